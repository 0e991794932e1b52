// Decode attention over a paged KV cache, for CPUs with AVX512-BF16: XLA FFI custom calls with
// the interface of `paged_decode_attention_xla` (pallas_kernels/xla_paged_attention.py), which
// is also their reference. A handler per pool element type (and a bf16-out one):
//
//   JaxbatchPagedDecode     q [B, H, D] bf16;  k_pages, v_pages [KVH, N, bs, D] uint16 (bf16
//                           bits, the CPU's bf16 pool)
//   JaxbatchPagedDecodeF32  q [B, H, D] f32;   k_pages, v_pages [KVH, N, bs, D] float32
//
//   both: item_slot [J], item_pages [J, PPI], item_first_pos [J] int32: a work list sorted by
//   row (padding items have item_slot >= B); lengths [B] int32; window [1] int32 (a key at
//   position p is seen by row r when lengths[r] - window <= p < lengths[r]); scale [1] f32.
//   -> out [B, H, D] float32; JaxbatchPagedDecodeBf16Out: as JaxbatchPagedDecode -> out bf16,
//   each float32 result rounded to nearest even (what the model's convert would do next).
//
// One unit of work is (row, kv head): its G = H / KVH query heads walk the row's items in
// order, 16 keys at a time, with an online softmax in float32 updated every 64 keys. q.K accumulates in float32
// (`vdpbf16ps` on bf16 pages, FMAs on float32 ones). p.V on bf16 pages is also `vdpbf16ps`,
// over the probabilities rounded to bf16 (as prefill's p.V does; the softmax's sum stays
// float32, so the result differs from the reference's float32 p.V by about a bf16 step) and
// values interleaved two keys at a time; on float32 pages it is float32 FMAs. A row's result
// depends on its own keys only, in a fixed order, whatever the batch. Units are claimed
// through an atomic counter by the calling thread and helpers on XLA's intra-op thread pool;
// while enough are left, each claims its next unit before it runs the current one, so that
// unit's first pages come from memory meanwhile.
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
#include "pool_dispatch.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxGroup = 16;
constexpr int kMaxHeadDim = 512;
using jaxbatch_simd::Exp;
using jaxbatch_simd::FirstLanes;
using jaxbatch_simd::Reduce16;

// A pool element type's loads: bf16 bits (uint16_t) or float.
template <typename T>
struct Elems;

template <>
struct Elems<uint16_t> {
  static constexpr int kAccWidth = 32;  // accumulator floats per block of D (see AccIndex)
  // dots[i] += q[h, c-th 32 of D] . k[i, same]
  template <int kN>
  static void Dots(const uint16_t* q, const uint16_t* k, int64_t D, int64_t n, __m512* dots) {
    jaxbatch_simd::Bf16Dots<kN>(q, k, D, n, dots);
  }
  // acc[h] += sum_i p[h][i] v[i], in key order two keys at a time: a pair's values interleaved
  // (v[i][d], v[i + 1][d]) meet the pair's bf16 probabilities in one `vdpbf16ps`. Lanes of keys
  // not seen are loaded as zeros (a pool's unused slots may hold anything, NaN included).
  // Accumulator float a of a block of 32 holds d = AccIndex(a) (the unpacks' lane order).
  template <int kG>
  static void AccumulatePV(const __m512* probs, int64_t G_, const uint16_t* v, int64_t D,
                           int64_t n, __mmask16 valid, float (*acc)[kMaxHeadDim]) {
    const int64_t G = kG ? kG : G_;
    alignas(64) uint32_t pairs[kMaxGroup][8];   // bf16 (p[2k], p[2k + 1]) per pair k
    for (int64_t h = 0; h < G; ++h)
      _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[h]),
                         (__m256i)_mm512_cvtneps_pbh(probs[h]));
    for (int64_t c = 0; c < D; c += 32) {
      const int64_t rem = std::min<int64_t>(32, D - c);
      const __mmask32 dm = rem == 32 ? ~0u : static_cast<__mmask32>((1u << rem) - 1);
      __m512 lo[kMaxGroup], hi[kMaxGroup];
      for (int64_t h = 0; h < G; ++h) {
        lo[h] = _mm512_load_ps(acc[h] + c);
        hi[h] = _mm512_load_ps(acc[h] + c + 16);
      }
      for (int64_t i = 0; i < n; i += 2) {
        const __mmask32 m0 = (valid >> i) & 1 ? dm : 0;
        const __mmask32 m1 = i + 1 < n && ((valid >> (i + 1)) & 1) ? dm : 0;
        if (!(m0 | m1)) continue;
        const __m512i v0 = _mm512_maskz_loadu_epi16(m0, v + i * D + c);
        const __m512i v1 = _mm512_maskz_loadu_epi16(m1, v + (i + 1) * D + c);
        const __m512bh vlo = (__m512bh)_mm512_unpacklo_epi16(v0, v1);
        const __m512bh vhi = (__m512bh)_mm512_unpackhi_epi16(v0, v1);
        for (int64_t h = 0; h < G; ++h) {
          const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[h][i / 2]));
          lo[h] = _mm512_dpbf16_ps(lo[h], vlo, pp);
          hi[h] = _mm512_dpbf16_ps(hi[h], vhi, pp);
        }
      }
      for (int64_t h = 0; h < G; ++h) {
        _mm512_store_ps(acc[h] + c, lo[h]);
        _mm512_store_ps(acc[h] + c + 16, hi[h]);
      }
    }
  }
  // Accumulator float a (of a block of 32) -> d: unpacklo/hi take quarters of each 128-bit lane.
  static int64_t AccIndex(int64_t a) {
    const int64_t block = a & ~int64_t{31}, half = (a >> 4) & 1, lane = a & 15;
    return block + 8 * (lane >> 2) + 4 * half + (lane & 3);
  }
};

template <>
struct Elems<float> {
  static constexpr int kAccWidth = 16;
  template <int kN>
  static void Dots(const float* q, const float* k, int64_t D, int64_t n_, __m512* dots) {
    const int64_t n = kN ? kN : n_;
    for (int64_t c = 0; c < D; c += 16) {
      const __mmask16 dm = FirstLanes(D - c);
      const __m512 qv = _mm512_maskz_loadu_ps(dm, q + c);
      for (int64_t i = 0; i < n; ++i)
        dots[i] = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(dm, k + i * D + c), dots[i]);
    }
  }
  // acc[h] += sum_i p[h][i] v[i], keys in order, the G accumulators in registers meanwhile.
  template <int kG>
  static void AccumulatePV(const __m512* probs, int64_t G_, const float* v, int64_t D, int64_t n,
                           __mmask16 valid, float (*acc)[kMaxHeadDim]) {
    const int64_t G = kG ? kG : G_;
    alignas(64) float pw[kMaxGroup][16];
    for (int64_t h = 0; h < G; ++h) _mm512_store_ps(pw[h], probs[h]);
    for (int64_t d = 0; d < D; d += 16) {
      const __mmask16 dm = FirstLanes(D - d);
      __m512 a[kMaxGroup];
      for (int64_t h = 0; h < G; ++h) a[h] = _mm512_load_ps(acc[h] + d);
      for (int64_t i = 0; i < n; ++i) {
        if (!((valid >> i) & 1)) continue;
        const __m512 vv = _mm512_maskz_loadu_ps(dm, v + i * D + d);
        for (int64_t h = 0; h < G; ++h)
          a[h] = _mm512_fmadd_ps(_mm512_set1_ps(pw[h][i]), vv, a[h]);
      }
      for (int64_t h = 0; h < G; ++h) _mm512_store_ps(acc[h] + d, a[h]);
    }
  }
  static int64_t AccIndex(int64_t a) { return a; }
};

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
  int64_t batch, heads, head_dim, kv_heads, num_pages, block_size, pages_per_item;
  std::vector<int64_t> first_item, item_count;  // per row
};

// Every cache line of item `it`'s pages (kv head g) that hold keys before `length`.
template <int Hint, typename T>
void PrefetchItem(const Problem<T>& p, int64_t g, int64_t it, int64_t length) {
  const int64_t bs = p.block_size, D = p.head_dim;
  constexpr int64_t kPerLine = 64 / sizeof(T);
  for (int64_t j = 0; j < p.pages_per_item; ++j) {
    const int64_t used = std::min<int64_t>(bs, length - (p.item_first_pos[it] + j * bs));
    if (used <= 0) break;
    const int64_t page = p.item_pages[it * p.pages_per_item + j];
    if (page < 0 || page >= p.num_pages) continue;
    const int64_t base = (g * p.num_pages + page) * bs * D;
    for (int64_t b = 0; b < used * D; b += kPerLine) {
      _mm_prefetch(reinterpret_cast<const char*>(p.k + base + b), static_cast<_mm_hint>(Hint));
      _mm_prefetch(reinterpret_cast<const char*>(p.v + base + b), static_cast<_mm_hint>(Hint));
    }
  }
}

// The first item of unit u (row u / KVH, kv head u % KVH), if the row has one.
template <int Hint, typename T>
void PrefetchUnit(const Problem<T>& p, int64_t u) {
  const int64_t row = u / p.kv_heads;
  if (p.item_count[row] > 0)
    PrefetchItem<Hint>(p, u % p.kv_heads, p.first_item[row], p.lengths[row]);
}

// Up to 16 consecutive keys of one page: the unit of q.K and p.V.
template <typename T>
struct Span {
  const T* k;
  const T* v;
  int64_t n;
  __mmask16 valid;
};

// Spans whose scores share one online-softmax update: the maximum, the correction and the
// rescaling of the accumulators happen once per kSpans * 16 keys, not once per 16 (that
// bookkeeping is a chain of dependent reductions, which dominated the time per key). A span
// list depends on the row's own keys only, so the batch does not change a row's result.
constexpr int kSpans = 4;

// The online softmax over `ns` spans for each of the G query heads, then p.V.
template <typename T, int kG>
void SoftmaxSpans(const Problem<T>& p, const T* q, const Span<T>* spans, int ns, int64_t G_,
                  int64_t width, float* m, float* l, float (*acc)[kMaxHeadDim]) {
  using E = Elems<T>;
  const int64_t D = p.head_dim, G = kG ? kG : G_;
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 probs[kSpans][kMaxGroup];
  for (int64_t h = 0; h < G; ++h) {
    __m512 scores[kSpans];
    __m512 block_max = neg_inf;
    for (int s = 0; s < ns; ++s) {
      __m512 dots[16];
      for (int i = 0; i < 16; ++i) dots[i] = _mm512_setzero_ps();
      if (spans[s].valid == 0xFFFF)      // a full block of 16 keys: the loop over keys unrolled
        E::template Dots<16>(q + h * D, spans[s].k, D, 16, dots);
      else
        E::template Dots<0>(q + h * D, spans[s].k, D, spans[s].n, dots);
      scores[s] = _mm512_mask_blend_ps(spans[s].valid, neg_inf,
                                       _mm512_mul_ps(Reduce16(dots), _mm512_set1_ps(p.scale)));
      block_max = _mm512_max_ps(block_max, scores[s]);
    }
    const float new_m = std::max(m[h], _mm512_reduce_max_ps(block_max));
    const float correction = std::exp(m[h] - new_m);     // 0 for the first spans
    const __m512 shift = _mm512_set1_ps(new_m);
    __m512 sum = _mm512_setzero_ps();
    for (int s = 0; s < ns; ++s) {
      probs[s][h] = _mm512_maskz_mov_ps(spans[s].valid, Exp(_mm512_sub_ps(scores[s], shift)));
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
  for (int s = 0; s < ns; ++s)
    E::template AccumulatePV<kG>(probs[s], G, spans[s].v, D, spans[s].n, spans[s].valid, acc);
}

// Row `row`, kv head `g`: out[row, g * G : (g + 1) * G, :]. kG: G known at compile time (its
// loops unrolled, the per-head registers kept in registers), or 0 for any G.
template <typename T, int kG>
void Unit(const Problem<T>& p, int64_t row, int64_t g) {
  using E = Elems<T>;
  const int64_t D = p.head_dim, G = kG ? kG : p.heads / p.kv_heads, bs = p.block_size;
  const int64_t width = (D + E::kAccWidth - 1) / E::kAccWidth * E::kAccWidth;
  const int64_t out0 = (row * p.heads + g * G) * D;
  const int64_t length = p.lengths[row];
  const int64_t lo = std::max<int64_t>(0, length - static_cast<int64_t>(p.window));
  float m[kMaxGroup], l[kMaxGroup];
  alignas(64) float acc[kMaxGroup][kMaxHeadDim];
  for (int64_t h = 0; h < G; ++h) {
    m[h] = -std::numeric_limits<float>::infinity();
    l[h] = 0.0f;
    std::fill(acc[h], acc[h] + width, 0.0f);
  }
  const T* q = p.q + (row * p.heads + g * G) * D;
  Span<T> spans[kSpans];
  int ns = 0;
  const int64_t end_item = p.first_item[row] + p.item_count[row];
  if (p.item_count[row] > 0) PrefetchItem<_MM_HINT_T0>(p, g, p.first_item[row], length);
  for (int64_t it = p.first_item[row]; it < end_item; ++it) {
    // The next item's pages come from memory while this one's are used: rows' pages are
    // scattered over the pool, 2-4 KB at a time, too short for the hardware prefetcher.
    if (it + 1 < end_item) PrefetchItem<_MM_HINT_T1>(p, g, it + 1, length);
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
        if (!valid) continue;
        spans[ns++] = Span<T>{kp + t0 * D, vp + t0 * D, n, valid};
        if (ns == kSpans) {
          SoftmaxSpans<T, kG>(p, q, spans, ns, G, width, m, l, acc);
          ns = 0;
        }
      }
    }
  }
  if (ns) SoftmaxSpans<T, kG>(p, q, spans, ns, G, width, m, l, acc);
  for (int64_t h = 0; h < G; ++h) {
    const float inv = 1.0f / std::max(l[h], std::numeric_limits<float>::min());
    for (int64_t a = 0; a < width; ++a) {
      const int64_t d = E::AccIndex(a);
      if (d < D) p.out.Store(out0 + h * D + d, acc[h][a] * inv);
    }
  }
}

// Unit with G fixed at compile time for the common query groups.
template <typename T>
void RunUnit(const Problem<T>& p, int64_t row, int64_t g) {
  switch (p.heads / p.kv_heads) {
    case 1: return Unit<T, 1>(p, row, g);
    case 2: return Unit<T, 2>(p, row, g);
    case 3: return Unit<T, 3>(p, row, g);
    case 4: return Unit<T, 4>(p, row, g);
    case 8: return Unit<T, 8>(p, row, g);
    default: return Unit<T, 0>(p, row, g);
  }
}

template <typename T>
struct Job {
  Problem<T> p;
  int64_t units;
  int64_t workers;  // the calling thread and its helpers
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  ffi::CountDownPromise finished;   // pool_dispatch.h

  void Work() {
    int64_t u = next.fetch_add(1, std::memory_order_relaxed);
    while (u < units) {
      // The next unit is claimed now, its pages prefetched while this one runs, only while
      // every worker still has units ahead: near the end a unit held ahead would wait while
      // another thread found nothing left.
      int64_t after = -1;
      if (next.load(std::memory_order_relaxed) + workers <= units) {
        after = next.fetch_add(1, std::memory_order_relaxed);
        if (after < units) PrefetchUnit<_MM_HINT_T1>(p, after);
      }
      RunUnit(p, u / p.kv_heads, u % p.kv_heads);
      done.fetch_add(1, std::memory_order_release);
      u = after >= 0 ? after : next.fetch_add(1, std::memory_order_relaxed);
    }
  }
};

using I32Vector = ffi::Buffer<ffi::S32, 1>;
using I32Matrix = ffi::Buffer<ffi::S32, 2>;
using F32Array3 = ffi::Buffer<ffi::F32, 3>;
using F32Vector = ffi::Buffer<ffi::F32, 1>;

// T: the pool's element type; Q, Pool, Y: the FFI buffers of q, of the pages and of out.
template <typename T, typename Q, typename Pool, typename Y>
ffi::Future PagedDecodeImpl(ffi::ThreadPool pool, Q q, Pool k, Pool v, I32Vector item_slot,
                           I32Matrix item_pages, I32Vector item_first_pos, I32Vector lengths,
                           I32Vector window, F32Vector scale, ffi::Result<Y> out) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  auto job = std::make_shared<Job<T>>();
  Problem<T>& p = job->p;
  p = Problem<T>{reinterpret_cast<const T*>(q.typed_data()),
                 reinterpret_cast<const T*>(k.typed_data()),
                 reinterpret_cast<const T*>(v.typed_data()), item_slot.typed_data(),
                 item_pages.typed_data(), item_first_pos.typed_data(), lengths.typed_data(),
                 window.typed_data()[0], scale.typed_data()[0], jaxbatch_simd::Out{},
                 qd[0], qd[1], qd[2], kd[0], kd[1], kd[2], item_pages.dimensions()[1], {}, {}};
  if (p.head_dim != kd[3] || p.heads % p.kv_heads != 0 || p.heads / p.kv_heads > kMaxGroup ||
      p.head_dim > kMaxHeadDim || lengths.dimensions()[0] != p.batch)
    return jaxbatch_pool::Ready(ffi::Error::InvalidArgument("paged_decode: unsupported shapes"));
  if constexpr (std::is_same_v<Y, F32Array3>)
    p.out.f32 = out->typed_data();
  else
    p.out.bf16 = reinterpret_cast<uint16_t*>(out->typed_data());
  p.first_item.assign(p.batch, 0);
  p.item_count.assign(p.batch, 0);
  const int64_t items = item_slot.dimensions()[0];
  for (int64_t i = items - 1; i >= 0; --i) {
    const int64_t row = p.item_slot[i];
    if (row >= 0 && row < p.batch) {
      p.first_item[row] = i;
      ++p.item_count[row];
    }
  }
  job->units = p.batch * p.kv_heads;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), job->units - 1);
  job->workers = std::max<int64_t>(helpers, 0) + 1;
  return jaxbatch_pool::Run(pool, job, helpers);
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
      .template Ret<Y>();
}

using Bf16Q = ffi::Buffer<ffi::BF16, 3>;
using Bf16Pool = ffi::Buffer<ffi::U16, 4>;
using F32Q = ffi::Buffer<ffi::F32, 3>;
using F32Pool = ffi::Buffer<ffi::F32, 4>;
using Bf16Array3 = ffi::Buffer<ffi::BF16, 3>;

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbatchPagedDecode,
                              (PagedDecodeImpl<uint16_t, Bf16Q, Bf16Pool, F32Array3>),
                              (Binding<Bf16Q, Bf16Pool, F32Array3>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbatchPagedDecodeBf16Out,
                              (PagedDecodeImpl<uint16_t, Bf16Q, Bf16Pool, Bf16Array3>),
                              (Binding<Bf16Q, Bf16Pool, Bf16Array3>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbatchPagedDecodeF32,
                              (PagedDecodeImpl<float, F32Q, F32Pool, F32Array3>),
                              (Binding<F32Q, F32Pool, F32Array3>()));
