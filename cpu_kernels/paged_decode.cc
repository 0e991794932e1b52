// Decode attention over a paged KV cache, for CPUs with AVX512-BF16: XLA FFI custom calls with
// the interface of `paged_decode_attention_xla` (pallas_kernels/xla_paged_attention.py), which
// is also their reference. A handler per pool element type (and a bf16-out one):
//
//   JaxbatchPagedDecode     q [B, H, D] bf16;  k_pages, v_pages [KVH, N, bs, D] uint16 (bf16
//                           bits, the CPU's bf16 pool; its keys grouped, see below)
//   JaxbatchPagedDecodeF32  q [B, H, D] f32;   k_pages, v_pages [KVH, N, bs, D] float32
//
//   both: item_slot [J], item_pages [J, PPI], item_first_pos [J] int32: a work list sorted by
//   row (padding items have item_slot >= B); lengths [B] int32; window [1] int32 (a key at
//   position p is seen by row r when lengths[r] - window <= p < lengths[r]); scale [1] f32.
//   -> out [B, H, D] float32; JaxbatchPagedDecodeBf16Out: as JaxbatchPagedDecode -> out bf16,
//   each float32 result rounded to nearest even (what the model's convert would do next).
//   JaxbatchPagedDecodeAmx, JaxbatchPagedDecodeBf16OutAmx: the bf16 handlers with q.K and p.V
//   on AMX tiles (decode_amx.h; pages of a multiple of 16 keys, a head dim of a multiple of
//   32, else an error), the softmax between them the same.
//
// One unit of work is (row, kv head): its G = H / KVH query heads walk the row's keys in
// order, a span of 16 at a time, with an online softmax in float32 updated every 64 keys.
// q.K accumulates in float32. A bf16 pool stores each page's keys in groups of 16, dim pair
// by dim pair (pallas_kernels/reference.py, KEY_GROUP), so one `vdpbf16ps` of a dim pair of
// 16 keys against a broadcast pair of q gives every key's lane its share, with no sum across
// lanes; float32 pages take FMAs and a sum of each key's lanes. p.V on bf16 pages is also
// `vdpbf16ps`, over the probabilities rounded to bf16 (as prefill's p.V does; the softmax's
// sum stays float32, so the result differs from the reference's float32 p.V by about a bf16
// step) and values interleaved two keys at a time; on float32 pages it is float32 FMAs. A
// row's result depends on its own keys only, in a fixed order, whatever the batch. Units are
// claimed through an atomic counter by the calling thread and helpers on XLA's intra-op
// thread pool; while enough are left, each claims its next unit before it runs the current
// one, and requests spans a few ahead of the one it computes, into the next unit's: a few
// lines at each step of a span's q.K (decode_elems.h, LineFeed). Before it starts, a call
// publishes the pages its rows will read at the next layer (attribute
// `next_layer_blocks`: how far on that layer's blocks lie in the folded pool), for the GEMMs
// in between to request into cache (kv_prefetch.h).
//
// Before any of that a call checks its operands (Check, checks.h): shapes, the work list's
// order and first positions, each row's coverage of its length, every page it reads within
// the pool; anything else is an InvalidArgument error, raised in Python, never a read of
// another row's pages or past the pool.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "attention_simd.h"
#include "checks.h"
#include "decode_amx.h"
#include "decode_elems.h"
#include "kv_prefetch.h"
#include "pool_dispatch.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxbatch_decode::Elems;
using jaxbatch_decode::kMaxGroup;
using jaxbatch_decode::kMaxHeadDim;
using jaxbatch_decode::Span;
using jaxbatch_simd::Exp;

template <typename T>
struct Problem {
  const T* q;
  const T* k;
  const T* v;
  const int32_t* item_slot;
  const int32_t* item_pages;
  const int32_t* item_first_pos;
  const int32_t* lengths;
  int32_t window;
  float scale;
  jaxbatch_simd::Out out;
  bool amx = false;   // q.K and p.V on AMX tiles (decode_amx.h): bf16 pages only
  int64_t batch, heads, head_dim, kv_heads, num_pages, block_size, pages_per_item;
  std::vector<int64_t> first_item, item_count;  // per row
};

// Requests every cache line of span `s`, its keys' whole group (bf16 keys of a group are
// spread over all of it) and its values, into L2 (`_MM_HINT_T2`: requests for L1 stall the
// core once its few L1 miss buffers are taken). Key and value lines alternate: requesting all
// the keys first, then the values, ran slower.
template <typename T>
void PrefetchSpan(const Span<T>& s, int64_t D) {
  constexpr int64_t kPerLine = 64 / sizeof(T);
  for (int64_t b = 0; b < s.n * D; b += kPerLine) {
    _mm_prefetch(reinterpret_cast<const char*>(s.k + b), _MM_HINT_T2);
    _mm_prefetch(reinterpret_cast<const char*>(s.v + b), _MM_HINT_T2);
  }
}

// How many spans ahead of its use a span is requested. A row's pages are scattered over the
// pool, 2-4 KB at a time, too short for the hardware prefetcher; requesting a whole item
// (32 KB) at once stalled the core, and so, less, did a span's lines at once; a few spans
// ahead, a few lines per step of the arithmetic, keep memory and the core busy together.
constexpr int64_t kAhead = 6;

// Spans whose scores share one online-softmax update: the maximum, the correction and the
// rescaling of the accumulators happen once per kSpans * 16 keys, not once per 16 (that
// bookkeeping is a chain of dependent reductions, which dominated the time per key). A span
// list depends on the row's own keys only, so the batch does not change a row's result.
constexpr int kSpans = 4;

// The online softmax's update over `ns` spans' scores for each of the G query heads: the
// heads' maxima, sums and accumulators rescaled, and the spans' probabilities.
template <typename T, int kG>
void UpdateSoftmax(const Span<T>* spans, int ns, int64_t G_, int64_t width,
                   __m512 (*scores)[kMaxGroup], float* m, float* l, float (*acc)[kMaxHeadDim],
                   __m512 (*probs)[kMaxGroup]) {
  const int64_t G = kG ? kG : G_;
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t h = 0; h < G; ++h) {
    __m512 block_max = neg_inf;
    for (int s = 0; s < ns; ++s) block_max = _mm512_max_ps(block_max, scores[s][h]);
    const float new_m = std::max(m[h], _mm512_reduce_max_ps(block_max));
    const float correction = std::exp(m[h] - new_m);     // 0 for the first spans
    const __m512 shift = _mm512_set1_ps(new_m);
    __m512 sum = _mm512_setzero_ps();
    for (int s = 0; s < ns; ++s) {
      probs[s][h] = _mm512_maskz_mov_ps(spans[s].valid, Exp(_mm512_sub_ps(scores[s][h], shift)));
      sum = _mm512_add_ps(sum, probs[s][h]);
    }
    l[h] = l[h] * correction + _mm512_reduce_add_ps(sum);
    if (correction != 1.0f) {
      const __m512 cv = _mm512_set1_ps(correction);
      for (int64_t d = 0; d < width; d += 16)
        _mm512_store_ps(acc[h] + d, _mm512_mul_ps(_mm512_load_ps(acc[h] + d), cv));
    }
    m[h] = new_m;
  }
}

// A span's scores scaled, and -inf for the keys the row does not see.
inline __m512 Scaled(__m512 scores, float scale, __mmask16 valid) {
  return _mm512_mask_blend_ps(valid, _mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                              _mm512_mul_ps(scores, _mm512_set1_ps(scale)));
}

// The online softmax over `ns` spans for each of the G query heads, then p.V. ahead[s]: the
// span whose lines are requested during span s's q.K, or null.
template <typename T, int kG>
void SoftmaxSpans(const Problem<T>& p, const T* q, const Span<T>* spans, int ns, int64_t G_,
                  int64_t width, float* m, float* l, float (*acc)[kMaxHeadDim],
                  const Span<T>* const* ahead) {
  using E = Elems<T>;
  const int64_t D = p.head_dim, G = kG ? kG : G_;
  __m512 probs[kSpans][kMaxGroup];
  __m512 scores[kSpans][kMaxGroup];
  for (int s = 0; s < ns; ++s) {
    jaxbatch_decode::LineFeed feed;
    if (ahead[s]) feed.Start(*ahead[s], D);
    E::template Scores<kG>(q, spans[s], D, G, scores[s], feed);
    feed.Rest();
    for (int64_t h = 0; h < G; ++h) scores[s][h] = Scaled(scores[s][h], p.scale, spans[s].valid);
  }
  UpdateSoftmax<T, kG>(spans, ns, G, width, scores, m, l, acc, probs);
  for (int s = 0; s < ns; ++s)
    E::template AccumulatePV<kG>(probs[s], G, spans[s].v, D, spans[s].n, spans[s].valid, acc);
}

#if JAXBATCH_HAVE_AMX
// The lines of the spans ahead, requested a few at a time while the values are unpacked.
struct SpanFeed {
  static constexpr int64_t kPerStep = 2;   // key and value line pairs a step of the unpacking
  jaxbatch_decode::LineFeed spans[kSpans];
  int n = 0, at = 0;
  void Request(int64_t pairs) {
    for (; at < n; ++at) {
      const int64_t left = spans[at].left / 64;
      spans[at].Request(pairs);
      pairs -= std::min(pairs, left);
      if (pairs == 0) return;
    }
  }
  void Rest() {
    for (int i = at; i < n; ++i) spans[i].Rest();
  }
};

static_assert(kSpans == jaxbatch_decode_amx::kSpans, "a softmax block is the C tiles' spans");

// SoftmaxSpans on AMX tiles (decode_amx.h): q.K and p.V by the tile unit, the softmax between
// them in AVX512 as above. The spans ahead are requested a few lines at a time while this
// block's values are unpacked (the tiles leave no other loop long enough to spread them over).
template <int kG>
void AmxSoftmaxSpans(const Problem<uint16_t>& p, const uint16_t* q, const Span<uint16_t>* spans,
                     int ns, int64_t G_, int64_t width, float* m, float* l,
                     float (*acc)[kMaxHeadDim], const Span<uint16_t>* const* ahead) {
  const int64_t D = p.head_dim, G = kG ? kG : G_;
  SpanFeed feed;
  for (int s = 0; s < ns; ++s)
    if (ahead[s]) feed.spans[feed.n++].Start(*ahead[s], D);
  alignas(64) float tile_scores[kSpans][16][16];
  jaxbatch_decode_amx::Scores(q, D, spans, ns, tile_scores);
  __m512 probs[kSpans][kMaxGroup];
  __m512 scores[kSpans][kMaxGroup];
  for (int s = 0; s < ns; ++s)
    for (int64_t h = 0; h < G; ++h)
      scores[s][h] = Scaled(_mm512_load_ps(tile_scores[s][h]), p.scale, spans[s].valid);
  UpdateSoftmax<uint16_t, kG>(spans, ns, G, width, scores, m, l, acc, probs);
  alignas(64) uint16_t pairs[2][16][32];   // A tiles: spans 2t, 2t + 1's probabilities, bf16
  for (int t = 0; 2 * t < ns; ++t)
    for (int64_t h = 0; h < G; ++h) {
      const __m512 odd = 2 * t + 1 < ns ? probs[2 * t + 1][h] : _mm512_setzero_ps();
      _mm512_store_si512(pairs[t][h], (__m512i)_mm512_cvtne2ps_pbh(odd, probs[2 * t][h]));
    }
  jaxbatch_decode_amx::AccumulatePV(pairs, spans, ns, G, D, acc, feed);
  feed.Rest();
}
#endif  // JAXBATCH_HAVE_AMX

// Unit (row, kv head g)'s spans, in key order: its items' pages 16 keys at a time, those the
// row sees (its length, its window).
template <typename T>
void CollectSpans(const Problem<T>& p, int64_t row, int64_t g, std::vector<Span<T>>& spans) {
  spans.clear();
  const int64_t D = p.head_dim, bs = p.block_size, length = p.lengths[row];
  const int64_t lo = std::max<int64_t>(0, length - static_cast<int64_t>(p.window));
  const int64_t end_item = p.first_item[row] + p.item_count[row];
  for (int64_t it = p.first_item[row]; it < end_item; ++it) {
    for (int64_t j = 0; j < p.pages_per_item; ++j) {
      const int64_t page = p.item_pages[it * p.pages_per_item + j];
      const int64_t page_pos = p.item_first_pos[it] + j * bs;
      if (page_pos >= length) break;
      if (page < 0 || page >= p.num_pages) continue;     // never from the engine: no stray read
      if (page_pos + bs <= lo) continue;
      const T* kp = p.k + ((g * p.num_pages + page) * bs) * D;
      const T* vp = p.v + ((g * p.num_pages + page) * bs) * D;
      for (int64_t t0 = 0; t0 < bs; t0 += 16) {
        const int64_t n = std::min<int64_t>(16, bs - t0);
        __mmask16 valid = 0;
        for (int64_t i = 0; i < n; ++i) {
          const int64_t pos = page_pos + t0 + i;
          if (pos < length && pos >= lo) valid |= static_cast<__mmask16>(1u << i);
        }
        if (valid) spans.push_back(Span<T>{kp + t0 * D, vp + t0 * D, n, valid});
      }
    }
  }
}

// Row `row`, kv head `g`: out[row, g * G : (g + 1) * G, :]. kG: G known at compile time (its
// loops unrolled, the per-head registers kept in registers), or 0 for any G.
template <typename T, int kG>
void Unit(const Problem<T>& p, int64_t row, int64_t g, const std::vector<Span<T>>& spans,
          const std::vector<Span<T>>* next, bool first) {
  using E = Elems<T>;
  const int64_t D = p.head_dim, G = kG ? kG : p.heads / p.kv_heads;
  const int64_t width = (D + E::kAccWidth - 1) / E::kAccWidth * E::kAccWidth;
  const int64_t out0 = (row * p.heads + g * G) * D;
  float m[kMaxGroup], l[kMaxGroup];
  alignas(64) float acc[kMaxGroup][kMaxHeadDim];
  for (int64_t h = 0; h < G; ++h) {
    m[h] = -std::numeric_limits<float>::infinity();
    l[h] = 0.0f;
    std::fill(acc[h], acc[h] + width, 0.0f);
  }
  const T* q = p.q + (row * p.heads + g * G) * D;
  // Spans are requested along this unit's list, then the next unit's: span i + kAhead during
  // span i's q.K, so a unit's first kAhead were requested before it starts (by the unit
  // before it, or here at once for a thread's first unit; a unit shorter than kAhead requests
  // the rest).
  const int64_t total = static_cast<int64_t>(spans.size());
  const auto span_at = [&](int64_t i) -> const Span<T>* {
    if (i < total) return &spans[i];
    if (next && i - total < static_cast<int64_t>(next->size())) return &(*next)[i - total];
    return nullptr;
  };
  for (int64_t i = first ? 0 : total; i < kAhead; ++i)
    if (const Span<T>* s = span_at(i)) PrefetchSpan(*s, D);
  for (int64_t i0 = 0; i0 < total; i0 += kSpans) {
    const int ns = static_cast<int>(std::min<int64_t>(kSpans, total - i0));
    const Span<T>* ahead[kSpans];
    for (int s = 0; s < ns; ++s) ahead[s] = span_at(i0 + kAhead + s);
#if JAXBATCH_HAVE_AMX
    if constexpr (std::is_same_v<T, uint16_t>) {
      if (p.amx) {
        AmxSoftmaxSpans<kG>(p, q, spans.data() + i0, ns, G, width, m, l, acc, ahead);
        continue;
      }
    }
#endif
    SoftmaxSpans<T, kG>(p, q, spans.data() + i0, ns, G, width, m, l, acc, ahead);
  }
  for (int64_t h = 0; h < G; ++h) {
    const float inv = 1.0f / std::max(l[h], std::numeric_limits<float>::min());
    for (int64_t a = 0; a < width; ++a) {
      const int64_t d = E::AccIndex(a);
      if (d < D) p.out.Store(out0 + h * D + d, acc[h][a] * inv);
    }
  }
}

// Unit with G fixed at compile time for the common query groups.
template <typename T, typename... Args>
void RunUnit(const Problem<T>& p, Args&&... args) {
  switch (p.heads / p.kv_heads) {
    case 1: return Unit<T, 1>(p, args...);
    case 2: return Unit<T, 2>(p, args...);
    case 3: return Unit<T, 3>(p, args...);
    case 4: return Unit<T, 4>(p, args...);
    case 8: return Unit<T, 8>(p, args...);
    default: return Unit<T, 0>(p, args...);
  }
}

template <typename T>
struct Job : jaxbatch_pool::JobCounters {
  Problem<T> p;
  int64_t workers;  // the calling thread and its helpers

  void Work() {
#if JAXBATCH_HAVE_AMX
    if (p.amx) jaxbatch_decode_amx::Begin(p.heads / p.kv_heads);
#endif
    Units();
#if JAXBATCH_HAVE_AMX
    if (p.amx) jaxbatch_decode_amx::End();
#endif
  }

  void Units() {
    std::vector<Span<T>> spans, after_spans;
    int64_t u = next.fetch_add(1, std::memory_order_relaxed);
    if (u < units) CollectSpans(p, u / p.kv_heads, u % p.kv_heads, spans);
    bool first = true;
    while (u < units) {
      // The next unit is claimed now, its first spans requested while this one ends, only
      // while every worker still has units ahead: near the end a unit held ahead would wait
      // while another thread found nothing left.
      int64_t after = -1;
      if (next.load(std::memory_order_relaxed) + workers <= units) {
        after = next.fetch_add(1, std::memory_order_relaxed);
        if (after < units) CollectSpans(p, after / p.kv_heads, after % p.kv_heads, after_spans);
      }
      const bool ahead = after >= 0 && after < units;
      RunUnit(p, u / p.kv_heads, u % p.kv_heads, spans, ahead ? &after_spans : nullptr, first);
      UnitDone();
      first = !ahead;
      if (ahead) {
        u = after;
        std::swap(spans, after_spans);
      } else {
        u = after >= 0 ? after : next.fetch_add(1, std::memory_order_relaxed);
        if (u < units) CollectSpans(p, u / p.kv_heads, u % p.kv_heads, spans);
      }
    }
  }
};

// The pages each row will read at the next layer, `next_layer_blocks` block ids further on in
// the folded pool, for the GEMMs in between to request (kv_prefetch.h). Past the last layer
// the ids leave the pool, and with next_layer_blocks 0 (not known) there is no next layer:
// then the queue is emptied, so that no GEMM requests what an earlier call published. The
// pages are those this layer's window sees: in a model mixing windows a global layer after
// a local one gets its recent pages requested only (the hint is partial, never wrong). At
// most kMaxBytes are published, the first rows' pages (units run in row order): requested
// further ahead than the caches hold, lines would be evicted before their use.
template <typename T>
void PublishNextLayer(const Problem<T>& p, int64_t next_layer_blocks) {
  const int64_t bs = p.block_size, D = p.head_dim, bytes = bs * D * sizeof(T);
  jaxbatch_prefetch::Publish([&](jaxbatch_prefetch::Range* ranges, int64_t max) {
    int64_t n = 0;
    if (next_layer_blocks <= 0) return n;
    const int64_t cap = std::min<int64_t>(max, jaxbatch_prefetch::kMaxBytes / (2 * bytes));
    for (int64_t row = 0; row < p.batch && n < cap; ++row) {
      const int64_t length = p.lengths[row], end_item = p.first_item[row] + p.item_count[row];
      const int64_t lo = std::max<int64_t>(0, length - static_cast<int64_t>(p.window));
      for (int64_t it = p.first_item[row]; it < end_item; ++it)
        for (int64_t j = 0; j < p.pages_per_item; ++j) {
          const int64_t page_pos = p.item_first_pos[it] + j * bs;
          if (page_pos >= length) break;
          const int64_t page = p.item_pages[it * p.pages_per_item + j] + next_layer_blocks;
          if (page < 0 || page >= p.num_pages || page_pos + bs <= lo) continue;
          for (int64_t g = 0; g < p.kv_heads && n < cap; ++g) {
            const int64_t at = (g * p.num_pages + page) * bs * D;
            jaxbatch_prefetch::Store(ranges[n++], reinterpret_cast<const char*>(p.k + at),
                                     reinterpret_cast<const char*>(p.v + at), bytes);
          }
        }
    }
    return n;
  });
}

using I32Vector = ffi::Buffer<ffi::S32, 1>;
using I32Matrix = ffi::Buffer<ffi::S32, 2>;
using F32Array3 = ffi::Buffer<ffi::F32, 3>;
using F32Vector = ffi::Buffer<ffi::F32, 1>;

// Checks a call's operands and its work list, and fills p.first_item and p.item_count from it;
// any violation is an error naming it (checks.h). The work list is what
// `decode_work_items` (pallas_kernels/xla_paged_attention.py) builds: the used items first,
// sorted by row (so a row's items are contiguous), then padding (item_slot >= B); a row's k-th
// item starts at position k * PPI * bs, and its items cover the row's length; every page a
// row reads (those before its length) lies in the pool.
template <typename T, typename Q, typename Pool, typename Y>
ffi::Error Check(Problem<T>& p, const Q& q, const Pool& k, const Pool& v, const I32Vector& item_slot,
                 const I32Matrix& item_pages, const I32Vector& item_first_pos,
                 const I32Vector& lengths, const I32Vector& window, const F32Vector& scale,
                 ffi::Result<Y>& out) {
  using jaxbatch_checks::Invalid;
  using jaxbatch_checks::Shape;
  constexpr const char* kName = "paged_decode";
  const auto qd = q.dimensions(), kd = k.dimensions();
  if (auto error = jaxbatch_checks::AttentionHeads(kName, qd, kd, v.dimensions(),
                                                   out->dimensions(), kMaxGroup, kMaxHeadDim,
                                                   std::is_same_v<T, uint16_t>);
      error.failure())
    return error;
  const int64_t B = qd[0], H = qd[1], D = qd[2], KVH = kd[0], N = kd[1], bs = kd[2];
  if (lengths.dimensions()[0] != B)
    return Invalid(kName, "lengths ", Shape(lengths.dimensions()), " for ", B, " rows");
  if (window.element_count() != 1 || scale.element_count() != 1)
    return Invalid(kName, "window and scale hold one value each, got ",
                   Shape(window.dimensions()), " and ", Shape(scale.dimensions()));
  if (window.typed_data()[0] < 1) return Invalid(kName, "window ", window.typed_data()[0]);
  const int64_t J = item_slot.dimensions()[0], PPI = item_pages.dimensions()[1];
  if (item_pages.dimensions()[0] != J || item_first_pos.dimensions()[0] != J)
    return Invalid(kName, "item_slot ", Shape(item_slot.dimensions()), ", item_pages ",
                   Shape(item_pages.dimensions()), " and item_first_pos ",
                   Shape(item_first_pos.dimensions()), " differ in items");
  const int32_t* slot = item_slot.typed_data();
  const int32_t* pages = item_pages.typed_data();
  const int32_t* first_pos = item_first_pos.typed_data();
  const int32_t* length = lengths.typed_data();
  for (int64_t r = 0; r < B; ++r)
    if (length[r] < 0) return Invalid(kName, "row ", r, ": length ", length[r]);
  p.first_item.assign(B, 0);
  p.item_count.assign(B, 0);
  int64_t last_row = -1, padding_at = -1;
  for (int64_t i = 0; i < J; ++i) {
    const int64_t row = slot[i];
    if (row < 0) return Invalid(kName, "item ", i, ": slot ", row);
    if (row >= B) {                        // padding
      if (padding_at < 0) padding_at = i;
      continue;
    }
    if (padding_at >= 0)
      return Invalid(kName, "item ", i, " (row ", row, ") after padding item ", padding_at,
                     ": used items come first");
    if (row < last_row)
      return Invalid(kName, "item ", i, " (row ", row, ") after an item of row ", last_row,
                     ": items must be sorted by row");
    if (row != last_row) p.first_item[row] = i;
    last_row = row;
    const int64_t at = p.item_count[row]++ * PPI * bs;
    if (first_pos[i] != at)
      return Invalid(kName, "item ", i, " (row ", row, "): first position ", first_pos[i],
                     ", its place in the row's items says ", at);
    for (int64_t j = 0; j < PPI && at + j * bs < length[row]; ++j) {
      const int64_t page = pages[i * PPI + j];
      if (page < 0 || page >= N)
        return Invalid(kName, "item ", i, " (row ", row, ") page ", j, ": ", page,
                       " outside the pool's ", N, " pages");
    }
  }
  for (int64_t r = 0; r < B; ++r)
    if (p.item_count[r] * PPI * bs < length[r])
      return Invalid(kName, "row ", r, ": length ", length[r], " but its ", p.item_count[r],
                     " items cover ", p.item_count[r] * PPI * bs, " keys");
  return ffi::Error::Success();
}

// T: the pool's element type; Q, Pool, Y: the FFI buffers of q, of the pages and of out.
template <typename T, typename Q, typename Pool, typename Y, bool kAmx = false>
ffi::Future PagedDecodeImpl(ffi::ThreadPool pool, Q q, Pool k, Pool v, I32Vector item_slot,
                           I32Matrix item_pages, I32Vector item_first_pos, I32Vector lengths,
                           I32Vector window, F32Vector scale, ffi::Result<Y> out,
                           int64_t next_layer_blocks) {
  auto job = std::make_shared<Job<T>>();
  Problem<T>& p = job->p;
  ffi::Error error = Check(p, q, k, v, item_slot, item_pages, item_first_pos, lengths, window,
                           scale, out);
  if (!error.success()) return jaxbatch_pool::Ready(std::move(error));
  const auto qd = q.dimensions(), kd = k.dimensions();
  p.q = reinterpret_cast<const T*>(q.typed_data());
  p.k = reinterpret_cast<const T*>(k.typed_data());
  p.v = reinterpret_cast<const T*>(v.typed_data());
  p.item_slot = item_slot.typed_data();
  p.item_pages = item_pages.typed_data();
  p.item_first_pos = item_first_pos.typed_data();
  p.lengths = lengths.typed_data();
  p.window = window.typed_data()[0];
  p.scale = scale.typed_data()[0];
  p.batch = qd[0];
  p.heads = qd[1];
  p.head_dim = qd[2];
  p.kv_heads = kd[0];
  p.num_pages = kd[1];
  p.block_size = kd[2];
  p.pages_per_item = item_pages.dimensions()[1];
  if constexpr (std::is_same_v<Y, F32Array3>)
    p.out.f32 = out->typed_data();
  else
    p.out.bf16 = reinterpret_cast<uint16_t*>(out->typed_data());
  if constexpr (kAmx) {
#if JAXBATCH_HAVE_AMX
    if (!jaxbatch_amx::Permitted())
      return jaxbatch_pool::Ready(jaxbatch_checks::Invalid(
          "paged_decode", "the AMX variant called where Linux grants no tile registers"));
    if (!jaxbatch_decode_amx::Covers(p.block_size, p.head_dim, p.heads / p.kv_heads))
      return jaxbatch_pool::Ready(jaxbatch_checks::Invalid(
          "paged_decode", "the AMX variant takes pages of a multiple of 16 keys and a head dim "
          "a multiple of 32, got ", p.block_size, " and ", p.head_dim));
    p.amx = true;
#else
    return jaxbatch_pool::Ready(jaxbatch_checks::Invalid(
        "paged_decode", "the AMX variant of a library built without AMX intrinsics"));
#endif
  }
  PublishNextLayer(p, next_layer_blocks);
  job->units = p.batch * p.kv_heads;
  if (job->units == 0) return jaxbatch_pool::Ready();
  const int64_t helpers = jaxbatch_pool::Helpers(pool, job->units);
  job->workers = helpers + 1;
  return jaxbatch_pool::Run(pool, job, helpers,
                            {jaxbatch_calls::kDecode, p.batch, p.heads, p.head_dim});
}

template <typename Q, typename Pool, typename Y>
constexpr auto Binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .template Arg<Q>()
      .template Arg<Pool>()
      .template Arg<Pool>()
      .template Arg<I32Vector>()
      .template Arg<I32Matrix>()
      .template Arg<I32Vector>()
      .template Arg<I32Vector>()
      .template Arg<I32Vector>()
      .template Arg<F32Vector>()
      .template Ret<Y>()
      .template Attr<int64_t>("next_layer_blocks");
}

using Bf16Q = ffi::Buffer<ffi::BF16, 3>;
using Bf16Pool = ffi::Buffer<ffi::U16, 4>;
using F32Q = ffi::Buffer<ffi::F32, 3>;
using F32Pool = ffi::Buffer<ffi::F32, 4>;
using Bf16Array3 = ffi::Buffer<ffi::BF16, 3>;

}  // namespace

JAXBATCH_DEFINE_AMX_BUILT
JAXBATCH_DEFINE_PREFETCH_SETTER
JAXBATCH_DEFINE_CALL_LOG_SETTER

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbatchPagedDecode,
                              (PagedDecodeImpl<uint16_t, Bf16Q, Bf16Pool, F32Array3>),
                              (Binding<Bf16Q, Bf16Pool, F32Array3>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbatchPagedDecodeBf16Out,
                              (PagedDecodeImpl<uint16_t, Bf16Q, Bf16Pool, Bf16Array3>),
                              (Binding<Bf16Q, Bf16Pool, Bf16Array3>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbatchPagedDecodeF32,
                              (PagedDecodeImpl<float, F32Q, F32Pool, F32Array3>),
                              (Binding<F32Q, F32Pool, F32Array3>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbatchPagedDecodeAmx,
                              (PagedDecodeImpl<uint16_t, Bf16Q, Bf16Pool, F32Array3, true>),
                              (Binding<Bf16Q, Bf16Pool, F32Array3>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbatchPagedDecodeBf16OutAmx,
                              (PagedDecodeImpl<uint16_t, Bf16Q, Bf16Pool, Bf16Array3, true>),
                              (Binding<Bf16Q, Bf16Pool, Bf16Array3>()));
