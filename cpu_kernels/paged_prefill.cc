// Prefill attention over a paged bf16 KV cache, for CPUs with AVX512-BF16: an XLA FFI custom
// call with the interface of `tiled_prefill_attention_xla` (pallas_kernels/
// xla_paged_attention.py), which is also its reference.
//
//   JaxbatchPagedPrefill  q [T, H, D] bf16; k_pages, v_pages [KVH, N, bs, D] uint16 (bf16 bits;
//                         the keys grouped, pallas_kernels/reference.py's KEY_GROUP);
//                         query_pos [T] int32 (a token's position, -1 for padding);
//                         tile_pages [T / tile, P] int32 (the block table of each tile's
//                         sequence); window [1] int32 (a key at p is seen by a query at q when
//                         q - window < p <= q); scale [1] f32.  -> out [T, H, D] float32.
//   JaxbatchPagedPrefillBf16Out  the same -> out bf16, each float32 result rounded to nearest
//                         even (what the model's convert would do next).
//
// One unit of work is (tile, kv head); its rows (the tile's tokens x the G query heads of the kv
// head, token-major) go through 16 at a time, one row per float lane, so that the softmax's
// bookkeeping is lane-wise and no dot needs a horizontal sum. A block of rows walks its keys
// 16 at a time: q.K is `vdpbf16ps` of the rows' query pairs (transposed once per block) against
// a broadcast pair of one key, each lane with its own causal (and window) mask; the online
// softmax in float32 is updated every 64 keys; p.V is `vdpbf16ps` of the rows' probability
// pairs, rounded to bf16 as the reference rounds them, against a broadcast pair of values.
// A row's result depends on its own keys and on the rows of its block (tokens of the same
// chunk, whatever else the call holds), so a request's result does not depend on the batch.
// Units are claimed through an atomic counter by the calling thread and helpers on XLA's
// intra-op thread pool, the last tiles (the longest contexts) first. A call first checks its
// operands (Check, checks.h): shapes, positions, every key a token sees inside its tile's
// table and every page of it inside the pool; anything else is an InvalidArgument error.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>

#include "attention_simd.h"
#include "checks.h"
#include "pool_dispatch.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxbatch_simd::Exp;

constexpr int kLanes = 16;        // rows of a block: one per float lane
constexpr int kMaxGroup = 16;     // query heads per kv head
constexpr int kMaxHeadDim = 512;
constexpr int kSpans = 4;         // spans of 16 keys per online-softmax update
constexpr int kGroupKeys = kSpans * 16;

struct Problem {
  const uint16_t* q;
  const uint16_t* k;
  const uint16_t* v;
  const int32_t* query_pos;
  const int32_t* tile_pages;
  int32_t window;
  float scale;
  jaxbatch_simd::Out out;
  int64_t tokens, heads, head_dim, kv_heads, num_pages, block_size, tiles, tile, table_pages;
};

// Up to 16 consecutive keys of one page.
struct Span {
  const uint16_t* k;
  const uint16_t* v;
  int64_t key0, n;
};

inline uint32_t Pair(const uint16_t* x) {
  uint32_t pair;
  std::memcpy(&pair, x, sizeof pair);
  return pair;
}

// One block of rows: their query pairs transposed, masks' bounds and softmax state.
struct Block {
  alignas(64) uint32_t qt[kMaxHeadDim / 2][kLanes];    // (q[r][2p], q[r][2p + 1]) at [p][r]
  __m512i lo, hi;                                      // lane r sees keys lo <= key <= hi
  __m512 m, l;
  alignas(64) float acc[kMaxHeadDim][kLanes];          // unnormalised output, [d][r]
  alignas(64) float scores[kGroupKeys][kLanes];
  alignas(64) uint32_t probs[kGroupKeys / 2][kLanes];  // bf16 (p[2i][r], p[2i + 1][r])
  alignas(64) uint32_t values[kGroupKeys / 2][kMaxHeadDim];  // bf16 (v[2i][d], v[2i + 1][d])
};

// dots[j] (lane r) += q[r] . k[j] for j < n (kN: n fixed at compile time, else n_), the keys
// of a group of `group` stored dim-pair-major (pallas_kernels/reference.py's KEY_GROUP): key
// j's pair q at (q * group + j) * 2.
template <int kN>
inline void SpanDots(const Block& b, const uint16_t* k, int64_t D, int64_t group, int64_t n_,
                     __m512* dots) {
  const int64_t n = kN ? kN : n_;
  for (int64_t q = 0; q < D / 2; ++q) {
    const __m512bh qv = (__m512bh)_mm512_load_si512(b.qt[q]);
    const uint16_t* pairs = k + 2 * q * group;
    for (int64_t j = 0; j < n; ++j)
      dots[j] = _mm512_dpbf16_ps(
          dots[j], qv, (__m512bh)_mm512_set1_epi32(static_cast<int>(Pair(pairs + 2 * j))));
  }
}

// scores[key][r] for the span's keys, masked per lane (-inf where lane r does not see it);
// returns their lane-wise maximum.
inline __m512 SpanScores(const Problem& p, const Block& b, const Span& s, float* scores_out) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 dots[16];
  for (int j = 0; j < 16; ++j) dots[j] = _mm512_setzero_ps();
  const int64_t group = std::min<int64_t>(16, p.block_size);
  if (s.n == 16)
    SpanDots<16>(b, s.k, p.head_dim, group, 16, dots);
  else
    SpanDots<0>(b, s.k, p.head_dim, group, s.n, dots);
  __m512 best = neg_inf;
  const __m512 scale = _mm512_set1_ps(p.scale);
  for (int64_t j = 0; j < 16; ++j) {
    const __m512i key = _mm512_set1_epi32(static_cast<int>(s.key0 + j));
    const __mmask16 seen = j < s.n ? _mm512_cmple_epi32_mask(b.lo, key) &
                                         _mm512_cmple_epi32_mask(key, b.hi)
                                   : 0;
    const __m512 x = _mm512_mask_mul_ps(neg_inf, seen, dots[j], scale);
    _mm512_store_ps(scores_out + j * kLanes, x);
    best = _mm512_max_ps(best, x);
  }
  return best;
}

// acc[d0 + d] = acc[d0 + d] * correction + sum_i probs[i] values[i][d0 + d], d < nd (kD: nd
// fixed at compile time, else nd_).
template <int kD>
inline void AccumulatePV(Block& b, int64_t d0, int64_t nd_, int64_t pairs, __m512 correction) {
  const int64_t nd = kD ? kD : nd_;
  __m512 acc[16];
  for (int64_t d = 0; d < nd; ++d)
    acc[d] = _mm512_mul_ps(_mm512_load_ps(b.acc[d0 + d]), correction);
  for (int64_t i = 0; i < pairs; ++i) {
    const __m512bh pp = (__m512bh)_mm512_load_si512(b.probs[i]);
    for (int64_t d = 0; d < nd; ++d)
      acc[d] = _mm512_dpbf16_ps(acc[d], pp,
                                (__m512bh)_mm512_set1_epi32(static_cast<int>(b.values[i][d0 + d])));
  }
  for (int64_t d = 0; d < nd; ++d) _mm512_store_ps(b.acc[d0 + d], acc[d]);
}

// The rows' online softmax over `ns` spans, then p.V.
void SoftmaxSpans(const Problem& p, const Span* spans, int ns, Block& b) {
  const int64_t D = p.head_dim;
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 best = neg_inf;
  for (int s = 0; s < ns; ++s)
    best = _mm512_max_ps(best, SpanScores(p, b, spans[s], b.scores[s * 16]));
  const __m512 new_m = _mm512_max_ps(b.m, best);
  // lanes that have seen nothing yet: any shift (their probabilities are masked to zero)
  const __m512 shift = _mm512_mask_mov_ps(new_m, _mm512_cmpeq_ps_mask(new_m, neg_inf),
                                          _mm512_setzero_ps());
  const __m512 correction = Exp(_mm512_sub_ps(b.m, shift));  // ~0 where m was -inf: acc is 0
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < ns * 8; ++i) {
    __m512i pair = _mm512_setzero_si512();
    for (int64_t t = 0; t < 2; ++t) {
      const __m512 x = _mm512_load_ps(b.scores[2 * i + t]);
      const __m512 prob = _mm512_maskz_mov_ps(_mm512_cmpneq_ps_mask(x, neg_inf),
                                              Exp(_mm512_sub_ps(x, shift)));
      sum = _mm512_add_ps(sum, prob);
      const __m512i bits = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(prob));
      pair = _mm512_or_si512(pair, t ? _mm512_slli_epi32(bits, 16) : bits);
    }
    _mm512_store_si512(b.probs[i], pair);
  }
  b.l = _mm512_fmadd_ps(b.l, correction, sum);
  b.m = new_m;
  // values of a pair of keys interleaved per d; keys no lane sees (possibly NaN) read as zero
  for (int s = 0; s < ns; ++s) {
    const Span& sp = spans[s];
    for (int64_t i = 0; i < 8; ++i) {
      for (int64_t d = 0; d < D; d += 16) {
        const __mmask16 dm = jaxbatch_simd::FirstLanes(D - d);
        const __mmask16 m0 = 2 * i < sp.n ? dm : 0, m1 = 2 * i + 1 < sp.n ? dm : 0;
        const __m512i v0 =
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m0, sp.v + 2 * i * D + d));
        const __m512i v1 = _mm512_cvtepu16_epi32(
            _mm256_maskz_loadu_epi16(m1, sp.v + (2 * i + 1) * D + d));
        _mm512_store_si512(b.values[s * 8 + i] + d, _mm512_or_si512(v0, _mm512_slli_epi32(v1, 16)));
      }
    }
  }
  for (int64_t d0 = 0; d0 < D; d0 += 16) {
    if (D - d0 >= 16)
      AccumulatePV<16>(b, d0, 16, ns * 8, correction);
    else
      AccumulatePV<0>(b, d0, D - d0, ns * 8, correction);
  }
}

// Rows [r0, r0 + rows) of tile n (row = token * G + h), kv head g.
void RowBlock(const Problem& p, int64_t n, int64_t g, int64_t r0, int64_t rows, Block& b) {
  const int64_t D = p.head_dim, G = p.heads / p.kv_heads, bs = p.block_size;
  alignas(64) int32_t lo[kLanes], hi[kLanes];
  int64_t first = std::numeric_limits<int64_t>::max(), last = -1;
  for (int64_t r = 0; r < kLanes; ++r) {
    const int64_t t = n * p.tile + (r0 + r) / G, h = (r0 + r) % G;
    const int64_t pos = r < rows ? p.query_pos[t] : -1;
    lo[r] = std::numeric_limits<int32_t>::max();     // padding lanes see nothing
    hi[r] = -1;
    if (pos >= 0) {
      lo[r] = static_cast<int32_t>(std::max<int64_t>(0, pos - p.window + 1));
      hi[r] = static_cast<int32_t>(pos);
      first = std::min<int64_t>(first, lo[r]);
      last = std::max(last, pos);
    }
    const uint16_t* q = p.q + (t * p.heads + g * G + h) * D;
    for (int64_t i = 0; i < D / 2; ++i) b.qt[i][r] = pos >= 0 ? Pair(q + 2 * i) : 0;
  }
  b.lo = _mm512_load_si512(lo);
  b.hi = _mm512_load_si512(hi);
  b.m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  b.l = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) _mm512_store_ps(b.acc[d], _mm512_setzero_ps());
  const int32_t* table = p.tile_pages + n * p.table_pages;
  Span spans[kSpans];
  int ns = 0;
  for (int64_t j = first / bs; last >= 0 && j <= last / bs && j < p.table_pages; ++j) {
    const int64_t page = table[j];
    if (page < 0 || page >= p.num_pages) continue;        // never from the engine: no stray read
    const uint16_t* kp = p.k + ((g * p.num_pages + page) * bs) * D;
    const uint16_t* vp = p.v + ((g * p.num_pages + page) * bs) * D;
    for (int64_t k0 = 0; k0 < bs; k0 += 16) {
      const int64_t key0 = j * bs + k0, nk = std::min<int64_t>(16, bs - k0);
      if (key0 > last || key0 + nk <= first) continue;
      // keys past the last one any row sees may be unwritten: not read at all
      spans[ns++] = Span{kp + k0 * D, vp + k0 * D, key0, std::min<int64_t>(nk, last + 1 - key0)};
      if (ns == kSpans) {
        SoftmaxSpans(p, spans, ns, b);
        ns = 0;
      }
    }
  }
  if (ns) SoftmaxSpans(p, spans, ns, b);
  alignas(64) float inv[kLanes];
  _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f),
                                     _mm512_max_ps(b.l, _mm512_set1_ps(
                                                            std::numeric_limits<float>::min()))));
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = n * p.tile + (r0 + r) / G, h = (r0 + r) % G;
    const int64_t out0 = (t * p.heads + g * G + h) * D;
    for (int64_t d = 0; d < D; ++d) p.out.Store(out0 + d, b.acc[d][r] * inv[r]);  // padding: 0
  }
}

// Tile n, kv head g: out[tile tokens, g * G : (g + 1) * G, :].
void Unit(const Problem& p, int64_t n, int64_t g) {
  const int64_t rows = p.tile * (p.heads / p.kv_heads);
  static thread_local Block b;    // about 120 KB: not on a pool thread's stack
  for (int64_t r0 = 0; r0 < rows; r0 += kLanes)
    RowBlock(p, n, g, r0, std::min<int64_t>(kLanes, rows - r0), b);
}

struct Job : jaxbatch_pool::JobCounters {
  Problem p;

  void Work() {
    for (int64_t u = next.fetch_add(1, std::memory_order_relaxed); u < units;
         u = next.fetch_add(1, std::memory_order_relaxed)) {
      // the last tiles first: their tokens see the most keys
      Unit(p, p.tiles - 1 - u / p.kv_heads, u % p.kv_heads);
      UnitDone();
    }
  }
};

using I32Vector = ffi::Buffer<ffi::S32, 1>;
using I32Matrix = ffi::Buffer<ffi::S32, 2>;
using F32Vector = ffi::Buffer<ffi::F32, 1>;
using Bf16Q = ffi::Buffer<ffi::BF16, 3>;
using Bf16Pool = ffi::Buffer<ffi::U16, 4>;
using F32Out = ffi::Buffer<ffi::F32, 3>;
using Bf16Out = ffi::Buffer<ffi::BF16, 3>;

// Checks a call's operands (checks.h): the shapes it reads by, and that every key a token
// sees lies in its tile's block table and every page of it in the pool (a position is -1 for
// padding, else a key position at or past 0).
template <typename Y>
ffi::Error Check(const Bf16Q& q, const Bf16Pool& k, const Bf16Pool& v, const I32Vector& query_pos,
                 const I32Matrix& tile_pages, const I32Vector& window, const F32Vector& scale,
                 ffi::Result<Y>& out) {
  using jaxbatch_checks::Invalid;
  using jaxbatch_checks::Shape;
  constexpr const char* kName = "paged_prefill";
  const auto qd = q.dimensions(), kd = k.dimensions(), td = tile_pages.dimensions();
  if (auto error = jaxbatch_checks::AttentionHeads(kName, qd, kd, v.dimensions(),
                                                   out->dimensions(), kMaxGroup, kMaxHeadDim,
                                                   true);
      error.failure())
    return error;
  const int64_t T = qd[0], H = qd[1], D = qd[2], KVH = kd[0], N = kd[1], bs = kd[2];
  if (query_pos.dimensions()[0] != T)
    return Invalid(kName, "query_pos ", Shape(query_pos.dimensions()), " for ", T, " tokens");
  if (window.element_count() != 1 || scale.element_count() != 1)
    return Invalid(kName, "window and scale hold one value each, got ",
                   Shape(window.dimensions()), " and ", Shape(scale.dimensions()));
  const int64_t w = window.typed_data()[0];
  if (w < 1) return Invalid(kName, "window ", w);
  if (T == 0) return ffi::Error::Success();
  if (td[0] < 1 || T % td[0] != 0)
    return Invalid(kName, "tile_pages ", Shape(td), ": whole tiles of ", T, " tokens expected");
  const int64_t tiles = td[0], tile = T / tiles, P = td[1];
  const int32_t* pos = query_pos.typed_data();
  const int32_t* table = tile_pages.typed_data();
  for (int64_t n = 0; n < tiles; ++n) {
    int64_t first = std::numeric_limits<int64_t>::max(), last = -1;
    for (int64_t t = n * tile; t < (n + 1) * tile; ++t) {
      if (pos[t] < -1) return Invalid(kName, "token ", t, ": position ", pos[t]);
      if (pos[t] >= 0) {
        first = std::min<int64_t>(first, std::max<int64_t>(0, pos[t] - w + 1));
        last = std::max<int64_t>(last, pos[t]);
      }
    }
    if (last < 0) continue;                 // a tile of padding
    if (last / bs >= P)
      return Invalid(kName, "tile ", n, ": position ", last, " past its table's ", P,
                     " pages of ", bs);
    for (int64_t j = first / bs; j <= last / bs; ++j)
      if (table[n * P + j] < 0 || table[n * P + j] >= N)
        return Invalid(kName, "tile ", n, " page ", j, ": ", table[n * P + j],
                       " outside the pool's ", N, " pages");
  }
  return ffi::Error::Success();
}

// Y: the output buffer, float32 or bf16.
template <typename Y>
ffi::Future PagedPrefillImpl(ffi::ThreadPool pool, Bf16Q q, Bf16Pool k, Bf16Pool v,
                            I32Vector query_pos, I32Matrix tile_pages, I32Vector window,
                            F32Vector scale, ffi::Result<Y> out) {
  ffi::Error error = Check(q, k, v, query_pos, tile_pages, window, scale, out);
  if (!error.success()) return jaxbatch_pool::Ready(std::move(error));
  const auto qd = q.dimensions(), kd = k.dimensions(), td = tile_pages.dimensions();
  if (qd[0] == 0) return jaxbatch_pool::Ready();
  auto job = std::make_shared<Job>();
  Problem& p = job->p;
  p = Problem{reinterpret_cast<const uint16_t*>(q.typed_data()), k.typed_data(), v.typed_data(),
              query_pos.typed_data(), tile_pages.typed_data(), window.typed_data()[0],
              scale.typed_data()[0], jaxbatch_simd::Out{}, qd[0], qd[1], qd[2], kd[0], kd[1],
              kd[2], td[0], qd[0] / td[0], td[1]};
  if constexpr (std::is_same_v<Y, F32Out>)
    p.out.f32 = out->typed_data();
  else
    p.out.bf16 = reinterpret_cast<uint16_t*>(out->typed_data());
  job->units = p.tiles * p.kv_heads;
  return jaxbatch_pool::Run(pool, job, jaxbatch_pool::Helpers(pool, job->units),
                            {jaxbatch_calls::kPrefill, p.tokens, p.heads, p.head_dim});
}

template <typename Y>
constexpr auto Binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<Bf16Q>()
      .Arg<Bf16Pool>()
      .Arg<Bf16Pool>()
      .Arg<I32Vector>()
      .Arg<I32Matrix>()
      .Arg<I32Vector>()
      .Arg<F32Vector>()
      .template Ret<Y>();
}

}  // namespace

JAXBATCH_DEFINE_CALL_LOG_SETTER

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbatchPagedPrefill, PagedPrefillImpl<F32Out>,
                              Binding<F32Out>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbatchPagedPrefillBf16Out, PagedPrefillImpl<Bf16Out>,
                              Binding<Bf16Out>());
