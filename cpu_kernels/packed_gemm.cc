// x @ W for CPUs with AVX512-BF16, over a weight packed once at load time: XLA FFI custom calls
// whose reference is `jnp.dot(x, w, preferred_element_type=float32)` (packed_gemm.py).
//
//   JaxbatchPackedGemm     x [M, K] bf16;  w [N / 16, K / 2, 32] uint16 (bf16 bits), element
//                          [b, p, 2 j + t] = W[2 p + t, 16 b + j]
//   JaxbatchPackedGemmF32  x [M, K] f32;   w [N / 16, K, 16] float32, element [b, k, j] =
//                          W[k, 16 b + j]
//   both -> y [M, N] float32.
//   JaxbatchPackedGemmBf16Out  as JaxbatchPackedGemm -> y [M, N] bf16, each float32 result
//                          rounded to nearest even (XLA's convert; a bf16 model's activations
//                          would take that convert next anyway, as an op of its own).
//   JaxbatchPackedGemmSiluMul  as JaxbatchPackedGemm over a fused [gate | up] weight (N = 2 I)
//                          -> y [M, I] bf16 = silu(gate) * up, computed as the model's jnp
//                          does it (`layers.activation`): gate and up rounded to bf16, then
//                          bf16(gate * sigmoid(gate)) * up rounded to bf16. The MLP's
//                          activation becomes the GEMM's epilogue: no [M, 2 I] result to
//                          write, read back and split, and no elementwise op of its own.
//
// A step of the inner loop reads one 64-byte line of each of a few column blocks and meets it
// with a broadcast of one (bf16: a pair of) x value(s) per row: `vdpbf16ps` on bf16, FMAs on
// float32, 8 rows by 3 blocks (48 columns) of float32 accumulators in registers. Every output
// element is one accumulator lane summed over k in order from zero, so a row's result does not
// depend on M, on its place in the batch, or on how the work is split. Units of work (3 column
// blocks, or for silu * up a gate block and its up block; every row) are claimed through an
// atomic counter by the calling thread and helpers on XLA's intra-op thread pool
// (pool_dispatch.h); each panel of the weight is read from memory once per call. A thread
// claims its next unit before it starts the current one and requests that unit's panel into
// L2 a line at a time while it computes the current one from L2, so memory streams all along,
// not in bursts at each panel's start (a thread's first unit, with nothing prefetched,
// streams its own panel). A lone row tile (up to 8 rows) requests the whole next panel, and
// keeps more lines in flight than it would waiting on its own; with several, all but the
// first share it, and the first, bound by arithmetic, requests the KV pages the next layer's
// decode attention will read, as decode attention published them (kv_prefetch.h):
// arithmetic here, memory there, at the same time (a thread's last unit, with no next
// panel, requests KV lines in every tile).
//
// Rows past `rows` (an operand: the call's padding, which a fixed-shape step carries after
// its real tokens) are not computed; their outputs are zero.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"
#include "attention_simd.h"
#include "kv_prefetch.h"
#include "checks.h"
#include "pool_dispatch.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxbatch_simd::RoundBf16;

constexpr int kRows = 8;     // rows of a register tile
constexpr int kBlocks = 3;   // 16-column blocks of a register tile (and of a unit of work)
constexpr int kPrefetchLines = 12;
constexpr int64_t kKvEvery = 2;         // steps of a tile per published KV line pair requested
constexpr int64_t kMaxKvLines = 1024;   // KV lines one tile requests at most
// A lone row tile computes from L2 and requests the next panel there only while both fit
// in half of a 1 MB L2 (smaller parts have 512 KB): past that, streaming its own panel is
// safer than losing its lines to the next one's.
constexpr int64_t kLonePanelBytes = int64_t{256} << 10;

// One step of k: bf16 consumes a pair of x values, float32 one.
template <typename T>
struct Step;

template <>
struct Step<uint16_t> {
  using Acc = __m512;
  static constexpr int64_t kPerStep = 2;
  static Acc Zero() { return _mm512_setzero_ps(); }
  static __m512 Broadcast(const uint16_t* x) {
    int32_t pair;
    std::memcpy(&pair, x, sizeof(pair));
    return _mm512_castsi512_ps(_mm512_set1_epi32(pair));
  }
  static __m512 Madd(__m512 acc, const uint16_t* w, __m512 x) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(w), (__m512bh)x);
  }
};

template <>
struct Step<float> {
  using Acc = __m512;
  static constexpr int64_t kPerStep = 1;
  static Acc Zero() { return _mm512_setzero_ps(); }
  static __m512 Broadcast(const float* x) { return _mm512_set1_ps(*x); }
  static __m512 Madd(__m512 acc, const float* w, __m512 x) {
    return _mm512_fmadd_ps(_mm512_loadu_ps(w), x, acc);
  }
};

// W8A8: x is the row quantized to int8 and offset by 128 (unsigned, what `vpdpbusd` takes),
// w int8; a step consumes four x values against four k values of 16 columns. The offset's
// share, 128 times the column's sum, is taken off in the epilogue (`Problem::comp`), so the
// int32 sum is exactly that of the signed products.
template <>
struct Step<uint8_t> {
  using Acc = __m512i;
  static constexpr int64_t kPerStep = 4;
  static Acc Zero() { return _mm512_setzero_si512(); }
  static __m512i Broadcast(const uint8_t* x) {
    int32_t quad;
    std::memcpy(&quad, x, sizeof(quad));
    return _mm512_set1_epi32(quad);
  }
  static __m512i Madd(__m512i acc, const uint8_t* w, __m512i x) {
    return _mm512_dpbusd_epi32(acc, x, _mm512_loadu_si512(w));
  }
};

template <typename T>
struct Problem {
  const T* x;
  const T* w;
  float* y;          // float32 output, or
  uint16_t* y_bf16;  // bf16 output (bits), rounded to nearest even as XLA's convert rounds
  int64_t m, k, n_blocks;
  // Blocks a register tile's blocks lie apart: 1, or for silu * up the gate's block count, so
  // that a tile holds gate block b and up block b (silu_mul true; y has n_blocks / 2 blocks).
  int64_t jump = 1;
  bool silu_mul = false;
  // W8A8 only: each row's activation scale [M], each column's weight scale [N] and offset
  // share [N] (128 x the column's int8 sum).
  const float* x_scale = nullptr;
  const float* w_scale = nullptr;
  const int32_t* comp = nullptr;
  int64_t steps() const { return k / Step<T>::kPerStep; }
  // elements of one packed column block: steps lines of 64 bytes
  int64_t block_elems() const { return steps() * (64 / sizeof(T)); }
};

// Row `row`, column block `block` of the product as float32: the accumulator itself, or for
// W8A8 (the int32 sum less the offset's share) x (the row's scale x the columns' scales).
template <typename T>
inline __m512 ToFloat(const Problem<T>&, __m512 acc, int64_t, int64_t) { return acc; }

inline __m512 ToFloat(const Problem<uint8_t>& p, __m512i acc, int64_t row, int64_t block) {
  const __m512i exact = _mm512_sub_epi32(acc, _mm512_loadu_si512(p.comp + block * 16));
  const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(p.x_scale[row]),
                                     _mm512_loadu_ps(p.w_scale + block * 16));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(exact), scale);
}

// What a row tile requests while it computes, flags of its template (a tile's inner loop
// holds only the requests it makes: every one costs registers there): kOwn, its own panel's
// lines a few steps ahead into L1 (the first tile of a thread's first unit, which nothing
// prefetched); kNext, its share of the next unit's panel into L2 (`NextLines`); kKv,
// published KV lines (kv_prefetch.h), a key and a value line every kKvEvery steps.
constexpr int kOwn = 1, kNext = 2, kKv = 4;

// kNext's lines: the next panel's steps [first, first + count) of its `blocks` blocks, one
// step every `every` steps of the tile, from the first.
template <typename T>
struct NextLines {
  const T* panel = nullptr;
  int64_t first = 0, count = 0, every = 1, blocks = 0;
};

// 16 outputs of silu(gate) * up from float32 accumulators, as `layers.activation` and the
// multiply after it compute them on bf16 gate and up: g = bf16(gate), u = bf16(up),
// bf16(bf16(g * sigmoid(g)) * u) with sigmoid(g) = 1 / (1 + e^-g) in the same order (e^-g
// overflows to infinity below g = -88.7, and sigmoid to 0, as there).
inline void SiluMulStore(__m512 gate, __m512 up, uint16_t* y) {
  const __m512 g = RoundBf16(gate), u = RoundBf16(up), one = _mm512_set1_ps(1.0f);
  const __m512 e = jaxbatch_simd::Exp(_mm512_sub_ps(_mm512_setzero_ps(), g));
  const __m512 sigmoid = _mm512_div_ps(one, _mm512_add_ps(one, e));
  const __m512 a = RoundBf16(_mm512_mul_ps(g, sigmoid));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y),
                      (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(a, u)));
}

// y[r, 16 b .. 16 (b + NB)) for rows r0 .. r0 + MR, blocks b .. b + NB.
template <typename T, int MR, int NB, int kFlags>
void Tile(const Problem<T>& p, int64_t r0, int64_t b, const NextLines<T>& next,
          jaxbatch_prefetch::Feed& feed) {
  constexpr int64_t kLine = 64 / sizeof(T);
  const int64_t steps = p.steps(), stride = p.block_elems(), jump = p.jump * stride;
  const T* x = p.x + r0 * p.k;
  const T* w = p.w + b * stride;
  typename Step<T>::Acc acc[MR][NB];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = Step<T>::Zero();
  int64_t countdown = 1, q = next.first;
  const int64_t q_end = next.first + next.count;
  const char* kv_lines[kMaxKvLines];
  const int64_t kv_count = !(kFlags & kKv) ? 0 :
      feed.Fill(kv_lines, std::min<int64_t>(kMaxKvLines, 2 * (steps / kKvEvery)));
  int64_t kv_countdown = kKvEvery, kv_at = 0;
  for (int64_t s = 0; s < steps; ++s) {
    if ((kFlags & kKv) && --kv_countdown == 0) {
      kv_countdown = kKvEvery;
      if (kv_at < kv_count) {
        _mm_prefetch(kv_lines[kv_at], _MM_HINT_T2);
        _mm_prefetch(kv_lines[kv_at + 1], _MM_HINT_T2);
        kv_at += 2;
      }
    }
    if (kFlags & kOwn) {
      // its own lines ahead; past its end, when no kNext brings the next panel, that panel's
      // first lines (the next unit, from its first tile on, then starts warm)
      const int64_t ahead = s + kPrefetchLines;
      if (ahead < steps)
        for (int j = 0; j < NB; ++j)
          _mm_prefetch(reinterpret_cast<const char*>(w + j * jump + ahead * kLine),
                       _MM_HINT_T0);
      else if (!(kFlags & kNext) && next.panel != nullptr)
        for (int j = 0; j < NB; ++j)
          if (j < next.blocks)
            _mm_prefetch(reinterpret_cast<const char*>(next.panel + j * jump +
                                                       (ahead - steps) * kLine),
                         _MM_HINT_T0);
    }
    if ((kFlags & kNext) && --countdown == 0) {
      countdown = next.every;
      if (q < q_end)
        for (int j = 0; j < NB; ++j)
          if (j < next.blocks)
            _mm_prefetch(reinterpret_cast<const char*>(next.panel + j * jump + q * kLine),
                         _MM_HINT_T1);
      ++q;
    }
    for (int i = 0; i < MR; ++i) {
      const auto xb = Step<T>::Broadcast(x + i * p.k + s * Step<T>::kPerStep);
      for (int j = 0; j < NB; ++j)
        acc[i][j] = Step<T>::Madd(acc[i][j], w + j * jump + s * kLine, xb);
    }
  }
  if constexpr (NB == 2) {
    if (p.silu_mul) {
      for (int i = 0; i < MR; ++i)
        SiluMulStore(ToFloat(p, acc[i][0], r0 + i, b), ToFloat(p, acc[i][1], r0 + i, b + p.jump),
                     p.y_bf16 + (r0 + i) * p.jump * 16 + b * 16);
      return;
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j) {
      const int64_t at = (r0 + i) * p.n_blocks * 16 + (b + j) * 16;
      const __m512 y = ToFloat(p, acc[i][j], r0 + i, b + j);
      if (p.y_bf16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p.y_bf16 + at),
                            (__m256i)_mm512_cvtneps_pbh(y));
      else
        _mm512_storeu_ps(p.y + at, y);
    }
}

template <typename T, int NB, int kFlags>
void RowTile(const Problem<T>& p, int64_t r0, int64_t rows, int64_t b, const NextLines<T>& next,
             jaxbatch_prefetch::Feed& feed) {
  switch (rows) {
    case 1: return Tile<T, 1, NB, kFlags>(p, r0, b, next, feed);
    case 2: return Tile<T, 2, NB, kFlags>(p, r0, b, next, feed);
    case 3: return Tile<T, 3, NB, kFlags>(p, r0, b, next, feed);
    case 4: return Tile<T, 4, NB, kFlags>(p, r0, b, next, feed);
    case 5: return Tile<T, 5, NB, kFlags>(p, r0, b, next, feed);
    case 6: return Tile<T, 6, NB, kFlags>(p, r0, b, next, feed);
    case 7: return Tile<T, 7, NB, kFlags>(p, r0, b, next, feed);
    default: return Tile<T, 8, NB, kFlags>(p, r0, b, next, feed);
  }
}

// Every row against blocks b .. b + NB, from L2 where the thread's previous unit prefetched
// the panel (`cold`, the thread's first unit: its first tile streams the panel, requesting
// its lines ahead). The panel of `next_b` (-1: none) is requested by a lone tile itself, or
// shared by every tile but the first, which requests KV lines instead (as every tile of a
// thread's last unit does). A lone tile whose two panels would crowd L2 streams its own.
template <typename T, int NB>
void Panel(const Problem<T>& p, int64_t b, int64_t next_b, bool cold,
           jaxbatch_prefetch::Feed& feed) {
  const int64_t tiles = (p.m + kRows - 1) / kRows, steps = p.steps();
  const int64_t first_next = tiles == 1 ? 0 : 1;
  const int64_t sharing = tiles - first_next, share = (steps + sharing - 1) / sharing;
  if (tiles == 1 && NB * steps * 64 > kLonePanelBytes) {
    NextLines<T> none;
    return RowTile<T, NB, kOwn>(p, 0, p.m, b, none, feed);
  }
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t r0 = t * kRows, rows = std::min<int64_t>(kRows, p.m - r0);
    const bool own = t == 0 && cold;
    NextLines<T> next;
    if (next_b >= 0) {
      next.panel = p.w + next_b * p.block_elems();
      // a silu * up unit's blocks are a gate and an up block; a plain one has fewer than NB
      // when it is the last
      next.blocks = p.silu_mul ? NB : std::min<int64_t>(NB, p.n_blocks - next_b);
    }
    if (next_b < 0 || t < first_next) {
      if (own)
        RowTile<T, NB, kOwn>(p, r0, rows, b, next, feed);
      else if (tiles > 1)
        RowTile<T, NB, kKv>(p, r0, rows, b, next, feed);
      else
        RowTile<T, NB, 0>(p, r0, rows, b, next, feed);
      continue;
    }
    next.first = std::min((t - first_next) * share, steps);
    next.count = std::min<int64_t>(share, steps - next.first);
    next.every = sharing;
    if (own)
      RowTile<T, NB, kOwn | kNext>(p, r0, rows, b, next, feed);
    else
      RowTile<T, NB, kNext>(p, r0, rows, b, next, feed);
  }
}

template <typename T>
void RunUnit(const Problem<T>& p, int64_t unit, int64_t next_unit, bool cold,
             jaxbatch_prefetch::Feed& feed) {
  // silu * up: a unit is a gate block and its up block
  if (p.silu_mul) return Panel<T, 2>(p, unit, next_unit, cold, feed);
  const int64_t b = unit * kBlocks;
  const int64_t next_b = next_unit < 0 ? -1 : next_unit * kBlocks;
  switch (std::min<int64_t>(kBlocks, p.n_blocks - b)) {
    case 1: return Panel<T, 1>(p, b, next_b, cold, feed);
    case 2: return Panel<T, 2>(p, b, next_b, cold, feed);
    default: return Panel<T, 3>(p, b, next_b, cold, feed);
  }
}

template <typename T>
struct Job : jaxbatch_pool::JobCounters {
  Problem<T> p;

  // A thread claims its next unit before it starts the current one, so that it can prefetch
  // the next panel while it computes.
  void Work() {
    jaxbatch_prefetch::Feed feed;
    int64_t u = next.fetch_add(1, std::memory_order_relaxed);
    for (bool cold = true; u < units; cold = false) {
      const int64_t after = next.fetch_add(1, std::memory_order_relaxed);
      RunUnit(p, u, after < units ? after : -1, cold, feed);
      UnitDone();
      u = after;
    }
  }
};

#if JAXBATCH_HAVE_AMX
// ---- AMX: the same packed weights, met 16 rows at a time by the tile unit ------------------
//
// Sixteen consecutive packed lines of one column block, [16 k pairs][16 columns][2] bf16 or
// [16 k quads][16 columns][4] int8, are exactly a B tile of `tdpbf16ps` / `tdpbusd` (1 KB, a
// 64-byte stride), so the tile unit reads the weights as they are packed for AVX512, with no
// second copy. An A tile is 16 rows of x by 64 bytes (32 bf16 or 64 int8 k values), a C tile
// 16 rows by 16 columns of float32 (int32) sums. A row's sums are taken in the same k order
// whatever M, its place in the batch or the split of the work, as in the AVX512 tile above
// (the unit's order, not `vdpbf16ps`'s: for bf16 the two kernels agree to float32 rounding,
// for int8 exactly).
//
//   decode (M <= 16): tmm0..5 accumulate 6 column blocks (silu * up: 3 gate blocks and their
//     up blocks), tmm6 holds x's rows, tmm7 the block being read; a unit is those 6 blocks, its
//     panel streamed from memory once.
//   prefill (M > 16): tmm0..3 accumulate 2 row groups by a pair of blocks, tmm4..5 the
//     groups' rows, tmm6..7 the pair's blocks; a unit is 16 blocks (silu * up: 8 gate blocks
//     and their up blocks), taken k chunk by k chunk (`Prefill`).
using jaxbatch_amx::TileConfig;

constexpr int kTileRows = 16;
constexpr int kDecodeBlocks = 6;
constexpr int kPrefillBlocks = 16;
// Tile steps of a prefill k chunk: bf16 16 (512 k values); int8 32 (2048 k values: a K of
// 2048, the common one, then keeps its sums in the tiles from first k to last, never taking
// them out to `acc` and back).
template <typename T>
constexpr int64_t kChunkSteps = sizeof(T) == 1 ? 32 : 16;

// The tile instructions take their registers as literals: these switch over them.
#define JAXBATCH_TILE_CASES(op) \
  switch (t) { case 0: op(0); break; case 1: op(1); break; case 2: op(2); break; \
    case 3: op(3); break; case 4: op(4); break; case 5: op(5); break; \
    case 6: op(6); break; default: op(7); break; }

JAXBATCH_AMX inline void TileZero(int t) {
#define JAXBATCH_OP(n) _tile_zero(n)
  JAXBATCH_TILE_CASES(JAXBATCH_OP)
#undef JAXBATCH_OP
}

JAXBATCH_AMX inline void TileLoad(int t, const void* at, int64_t stride) {
#define JAXBATCH_OP(n) _tile_loadd(n, at, stride)
  JAXBATCH_TILE_CASES(JAXBATCH_OP)
#undef JAXBATCH_OP
}

JAXBATCH_AMX inline void TileStore(int t, void* at, int64_t stride = 64) {
#define JAXBATCH_OP(n) _tile_stored(n, at, stride)
  JAXBATCH_TILE_CASES(JAXBATCH_OP)
#undef JAXBATCH_OP
}

// C tile c += A tile a x B tile b.
template <typename T>
JAXBATCH_AMX inline void TileDot(int c, int a, int b) {
  const int t = c * 64 + a * 8 + b;
#define JAXBATCH_DOT(cc, aa, bb) case (cc) * 64 + (aa) * 8 + (bb): \
    if constexpr (std::is_same_v<T, uint16_t>) _tile_dpbf16ps(cc, aa, bb); \
    else _tile_dpbusd(cc, aa, bb); break;
  switch (t) {
    JAXBATCH_DOT(0, 6, 7) JAXBATCH_DOT(1, 6, 7) JAXBATCH_DOT(2, 6, 7)
    JAXBATCH_DOT(3, 6, 7) JAXBATCH_DOT(4, 6, 7) JAXBATCH_DOT(5, 6, 7)
    JAXBATCH_DOT(0, 4, 6) JAXBATCH_DOT(1, 4, 7) JAXBATCH_DOT(2, 5, 6) JAXBATCH_DOT(3, 5, 7)
  }
#undef JAXBATCH_DOT
}
#undef JAXBATCH_TILE_CASES

// One C tile's rows [0, rows) of row group r0, block `block` (or, for silu * up, a gate C
// tile and its up C tile), through the AVX512 tile's epilogue.
template <typename T>
void StoreTile(const Problem<T>& p, const void* c, int64_t ldc, int64_t r0, int64_t rows,
               int64_t block) {
  for (int64_t i = 0; i < rows; ++i) {
    const char* line = static_cast<const char*>(c) + i * ldc;
    typename Step<T>::Acc acc;
    std::memcpy(&acc, line, 64);
    const __m512 y = ToFloat(p, acc, r0 + i, block);
    const int64_t at = (r0 + i) * p.n_blocks * 16 + block * 16;
    if (p.y_bf16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p.y_bf16 + at),
                          (__m256i)_mm512_cvtneps_pbh(y));
    else
      _mm512_storeu_ps(p.y + at, y);
  }
}

template <typename T>
void StoreSiluMul(const Problem<T>& p, const void* gate, const void* up, int64_t ldc,
                  int64_t r0, int64_t rows, int64_t block) {
  for (int64_t i = 0; i < rows; ++i) {
    typename Step<T>::Acc g, u;
    std::memcpy(&g, static_cast<const char*>(gate) + i * ldc, 64);
    std::memcpy(&u, static_cast<const char*>(up) + i * ldc, 64);
    SiluMulStore(ToFloat(p, g, r0 + i, block), ToFloat(p, u, r0 + i, block + p.jump),
                 p.y_bf16 + (r0 + i) * p.jump * 16 + block * 16);
  }
}

template <typename T>
struct AmxJob : jaxbatch_pool::JobCounters {
  Problem<T> p;
  bool decode = true;          // M <= 16: the decode layout, else prefill's
  int64_t unit_blocks = 0;     // column blocks of a unit (silu * up: gate blocks)

  int64_t tile_steps() const { return p.steps() / kTileRows; }
  const T* block_at(int64_t block, int64_t s) const {
    return p.w + block * p.block_elems() + s * kTileRows * (64 / sizeof(T));
  }
  const T* rows_at(int64_t row, int64_t s) const {
    return p.x + row * p.k + s * (64 / sizeof(T));
  }

  // The unit's blocks: `b` .. plain, or gate blocks and their up blocks.
  int64_t Blocks(int64_t unit, int64_t* blocks) const {
    const int64_t first = unit * unit_blocks;
    const int64_t out = p.silu_mul ? p.jump : p.n_blocks;
    const int64_t n = std::min(unit_blocks, out - first);
    for (int64_t j = 0; j < n; ++j) {
      blocks[j] = first + j;
      if (p.silu_mul) blocks[n + j] = first + j + p.jump;
    }
    return p.silu_mul ? 2 * n : n;
  }

  JAXBATCH_AMX void Configure(TileConfig& now, const TileConfig& want) {
    if (!(now == want)) {
      _tile_loadconfig(&want);
      now = want;
    }
  }

  JAXBATCH_AMX void Decode(int64_t unit, TileConfig& config) {
    int64_t blocks[kDecodeBlocks];
    const int64_t nb = Blocks(unit, blocks), rows = p.m, stride = p.k * sizeof(T);
    TileConfig want;
    for (int t = 0; t < 8; ++t) {
      want.colsb[t] = 64;
      want.rows[t] = t == 7 ? kTileRows : rows;
    }
    Configure(config, want);
    for (int j = 0; j < nb; ++j) TileZero(j);
    for (int64_t s = 0, steps = tile_steps(); s < steps; ++s) {
      TileLoad(6, rows_at(0, s), stride);
      for (int j = 0; j < nb; ++j) {
        TileLoad(7, block_at(blocks[j], s), 64);
        TileDot<T>(j, 6, 7);
      }
    }
    alignas(64) char c[kDecodeBlocks][kTileRows * 64];
    for (int j = 0; j < nb; ++j) TileStore(j, c[j]);
    const int64_t half = nb / 2;
    for (int j = 0; j < (p.silu_mul ? half : nb); ++j) {
      if (p.silu_mul)
        StoreSiluMul(p, c[j], c[j + half], 64, 0, rows, blocks[j]);
      else
        StoreTile(p, c[j], 64, 0, rows, blocks[j]);
    }
  }

  // x's rows in passes of 2 row groups against the unit's blocks, a column pair at a time,
  // k in chunks: a chunk of a pair's weights is read from memory once and met by every pass
  // from L1, a chunk of x by every pair from L2; the sums wait in `acc` (the C tiles go out
  // and come back exactly, so each sum is still taken in k order from zero).
  JAXBATCH_AMX void Prefill(int64_t unit, TileConfig& config, std::vector<char>& acc_buffer) {
    int64_t blocks[kPrefillBlocks];
    const int64_t nb = Blocks(unit, blocks), stride = p.k * sizeof(T);
    const int64_t ldc = kPrefillBlocks * 64;                     // bytes of an acc row
    acc_buffer.resize(p.m * ldc + 64);
    char* acc = acc_buffer.data() + (64 - reinterpret_cast<uintptr_t>(acc_buffer.data()) % 64) % 64;
    const int64_t steps = tile_steps();
    for (int64_t k0 = 0; k0 < steps; k0 += kChunkSteps<T>) {
      const int64_t k1 = std::min(steps, k0 + kChunkSteps<T>);
      for (int64_t pair = 0; pair < nb; pair += 2) {
        const bool two = pair + 1 < nb;
        for (int64_t r0 = 0; r0 < p.m; r0 += 2 * kTileRows) {
          const int64_t rows0 = std::min<int64_t>(kTileRows, p.m - r0);
          const int64_t rows1 = std::clamp<int64_t>(p.m - r0 - kTileRows, 0, kTileRows);
          TileConfig want;
          // C tiles 0, 1: group 0 by the pair's blocks; 2, 3: group 1; A 4, 5; B 6, 7
          const int64_t tile_rows[8] = {rows0, two ? rows0 : 0, rows1, two ? rows1 : 0,
                                        rows0, rows1, kTileRows, two ? kTileRows : 0};
          for (int t = 0; t < 8; ++t) {
            want.rows[t] = tile_rows[t];
            want.colsb[t] = tile_rows[t] ? 64 : 0;
          }
          Configure(config, want);
          for (int t = 0; t < 4; ++t) {
            if (!tile_rows[t]) continue;
            if (k0 == 0)
              TileZero(t);
            else
              TileLoad(t, acc + (r0 + (t / 2) * kTileRows) * ldc + (pair + t % 2) * 64, ldc);
          }
          for (int64_t s = k0; s < k1; ++s) {
            TileLoad(6, block_at(blocks[pair], s), 64);
            if (two) TileLoad(7, block_at(blocks[pair + 1], s), 64);
            TileLoad(4, rows_at(r0, s), stride);
            TileDot<T>(0, 4, 6);
            if (two) TileDot<T>(1, 4, 7);
            if (rows1) {
              TileLoad(5, rows_at(r0 + kTileRows, s), stride);
              TileDot<T>(2, 5, 6);
              if (two) TileDot<T>(3, 5, 7);
            }
          }
          for (int t = 0; t < 4; ++t)
            if (tile_rows[t])
              TileStore(t, acc + (r0 + (t / 2) * kTileRows) * ldc + (pair + t % 2) * 64, ldc);
        }
      }
    }
    const int64_t half = nb / 2;
    for (int64_t r0 = 0; r0 < p.m; r0 += kTileRows) {
      const int64_t rows = std::min<int64_t>(kTileRows, p.m - r0);
      const char* c = acc + r0 * ldc;
      for (int j = 0; j < (p.silu_mul ? half : nb); ++j) {
        if (p.silu_mul)
          StoreSiluMul(p, c + j * 64, c + (j + half) * 64, ldc, r0, rows, blocks[j]);
        else
          StoreTile(p, c + j * 64, ldc, r0, rows, blocks[j]);
      }
    }
  }

  JAXBATCH_AMX void Work() {
    TileConfig config;
    config.palette = 0;   // none loaded yet on this thread
    std::vector<char> acc;
    for (int64_t u; (u = next.fetch_add(1, std::memory_order_relaxed)) < units;) {
      if (decode)
        Decode(u, config);
      else
        Prefill(u, config, acc);
      UnitDone();
    }
    _tile_release();
  }
};

// The AMX job for a problem the AVX512 path was handed (its rows, blocks, epilogue), or
// nullptr where the tiles cannot take it: k not a whole number of tile steps.
template <typename J, typename T>
std::shared_ptr<J> AmxJobFor(const Problem<T>& p) {
  if (p.k % (kTileRows * Step<T>::kPerStep) != 0) return nullptr;
  auto job = std::make_shared<J>();
  job->p = p;
  job->decode = p.m <= kTileRows;
  const int64_t per_unit = job->decode ? kDecodeBlocks : kPrefillBlocks;
  job->unit_blocks = p.silu_mul ? per_unit / 2 : per_unit;
  const int64_t out = p.silu_mul ? p.jump : p.n_blocks;
  job->units = (out + job->unit_blocks - 1) / job->unit_blocks;
  return job;
}

#endif  // JAXBATCH_HAVE_AMX

// Below this many multiply-adds a call runs on the calling thread alone: waking a helper
// costs more than it saves.
constexpr int64_t kMinParallelMacs = int64_t{1} << 18;

// y [M, N]: float32, or bf16 (its bits as uint16) for the bf16 handler of a bf16 model;
// kSiluMul: y [M, N / 2] bf16, silu(gate) * up. rows [1]: rows of x past rows[0] are padding.
template <typename T, typename X, typename W, typename Y, bool kSiluMul = false,
          bool kAmx = false>
ffi::Future PackedGemmImpl(ffi::ThreadPool pool, X x, W w, ffi::Buffer<ffi::S32, 1> rows,
                           ffi::Result<Y> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  constexpr int64_t kLine = 64 / sizeof(T);
  constexpr bool kBf16Out = std::is_same_v<Y, ffi::Buffer<ffi::BF16, 2>>;
  auto job = std::make_shared<Job<T>>();
  float* y32 = nullptr;
  uint16_t* y16 = nullptr;
  if constexpr (kBf16Out)
    y16 = reinterpret_cast<uint16_t*>(y->typed_data());
  else
    y32 = y->typed_data();
  job->p = Problem<T>{reinterpret_cast<const T*>(x.typed_data()),
                      reinterpret_cast<const T*>(w.typed_data()), y32, y16,
                      xd[0], xd[1], wd[0]};
  const int64_t out_blocks = kSiluMul ? wd[0] / 2 : wd[0];
  if (wd[2] != kLine || xd[1] % Step<T>::kPerStep != 0 || wd[1] != xd[1] / Step<T>::kPerStep ||
      yd[0] != xd[0] || yd[1] != out_blocks * 16 || (kSiluMul && wd[0] % 2 != 0) ||
      rows.element_count() != 1)
    return jaxbatch_pool::Ready(jaxbatch_checks::Invalid(
        "packed_gemm", "x [M, K] and w packed for K, rows [1], y [M, N] expected, got x ",
        jaxbatch_checks::Shape(xd), ", w ", jaxbatch_checks::Shape(wd), ", rows ",
        jaxbatch_checks::Shape(rows.dimensions()), ", y ", jaxbatch_checks::Shape(yd)));
  // Padding rows: zero, whatever x holds there (a padding row's input may be anything).
  job->p.m = std::clamp<int64_t>(rows.typed_data()[0], 0, xd[0]);
  const int64_t padding = (xd[0] - job->p.m) * yd[1];
  if (padding > 0) {
    if constexpr (kBf16Out)
      std::memset(y16 + job->p.m * yd[1], 0, padding * sizeof(uint16_t));
    else
      std::memset(y32 + job->p.m * yd[1], 0, padding * sizeof(float));
  }
  if (job->p.m == 0 || job->p.n_blocks == 0) return jaxbatch_pool::Ready();
  job->units = (job->p.n_blocks + kBlocks - 1) / kBlocks;
  if constexpr (kSiluMul) {
    job->p.jump = out_blocks;
    job->p.silu_mul = true;
    job->units = out_blocks;
  }
  const int64_t macs = job->p.m * job->p.k * job->p.n_blocks * 16;
  const jaxbatch_calls::Label label{jaxbatch_calls::kGemm, job->p.m, job->p.k, out_blocks * 16};
  if constexpr (kAmx) {
#if JAXBATCH_HAVE_AMX
    if (!jaxbatch_amx::Permitted())
      return jaxbatch_pool::Ready(jaxbatch_checks::Invalid(
          "packed_gemm", "the AMX variant called where Linux grants no tile registers"));
    if (auto amx = AmxJobFor<AmxJob<T>>(job->p))
      return jaxbatch_pool::Run(pool, amx, jaxbatch_pool::Helpers(pool, amx->units), label);
#else
    return jaxbatch_pool::Ready(jaxbatch_checks::Invalid(
        "packed_gemm", "the AMX variant of a library built without AMX intrinsics"));
#endif
  }
  // The caller works too: num_threads - 1 helpers make one thread per pool thread (per core).
  const int64_t helpers = macs < kMinParallelMacs ? 0 : jaxbatch_pool::Helpers(pool, job->units);
  return jaxbatch_pool::Run(pool, job, helpers, label);
}

// ---- W8A8: activations quantized per row here, int8 weights packed at load time --------

// Row r of x as int8 (offset by 128) and its scale: absmax = max |x|, q = x * (127 / absmax)
// rounded to nearest even, scale = absmax x float32(1 / 127) (q = 0 and scale 0 for a row of zeros): the
// same float32 operations, in the same order, as the reference (`packed_gemm.w8a8_reference`).
template <typename XT>
__m512 LoadAsFloat(const XT* x, __mmask16 lanes) {
  if constexpr (std::is_same_v<XT, float>) return _mm512_maskz_loadu_ps(lanes, x);
  const __m256i bits = _mm256_maskz_loadu_epi16(lanes, x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

template <typename XT>
void QuantizeRow(const XT* x, int64_t k, uint8_t* q, float* scale) {
  __m512 absmax = _mm512_setzero_ps();
  for (int64_t c = 0; c < k; c += 16) {
    const __mmask16 lanes = jaxbatch_simd::FirstLanes(k - c);
    absmax = _mm512_max_ps(absmax, _mm512_abs_ps(LoadAsFloat(x + c, lanes)));
  }
  const float m = _mm512_reduce_max_ps(absmax);
  const float inv = m > 0.0f ? 127.0f / m : 0.0f;
  *scale = m * (1.0f / 127.0f);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127),
                offset = _mm512_set1_epi32(128);
  for (int64_t c = 0; c < k; c += 16) {
    const __mmask16 lanes = jaxbatch_simd::FirstLanes(k - c);
    const __m512 v = _mm512_mul_ps(LoadAsFloat(x + c, lanes), _mm512_set1_ps(inv));
    __m512i r = _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(r, lo), hi), offset);
    _mm_mask_storeu_epi8(q + c, lanes, _mm512_cvtepi32_epi8(r));
  }
}

// A W8A8 call's job: its rows, quantized by every thread of the call (a few rows per claim)
// before any unit runs, since every unit reads every row; they live as long as the call.
template <typename J, typename XT>
struct WithQuantizedRows : J {
  static constexpr int64_t kRowsPerClaim = 4;
  const XT* x = nullptr;
  std::unique_ptr<uint8_t[]> xq;
  std::unique_ptr<float[]> x_scale;
  std::atomic<int64_t> next_row{0}, rows_done{0};

  void Work() {
    const int64_t m = this->p.m, k = this->p.k;
    for (int64_t r0; (r0 = next_row.fetch_add(kRowsPerClaim, std::memory_order_relaxed)) < m;) {
      const int64_t r1 = std::min(m, r0 + kRowsPerClaim);
      for (int64_t r = r0; r < r1; ++r)
        QuantizeRow(x + r * k, k, xq.get() + r * k, x_scale.get() + r);
      rows_done.fetch_add(r1 - r0, std::memory_order_release);
    }
    // others' last rows: a short spin, then yield (a descheduled thread holding them on a
    // shared machine must get the core; pool_dispatch.h's waits do the same)
    for (int spins = 0; rows_done.load(std::memory_order_acquire) < m; ++spins)
      if (spins < jaxbatch_pool::kSpinPauses)
        _mm_pause();
      else
        sched_yield();
    J::Work();
  }
};
template <typename XT>
using W8A8Job = WithQuantizedRows<Job<uint8_t>, XT>;
#if JAXBATCH_HAVE_AMX
template <typename XT>
using AmxW8A8Job = WithQuantizedRows<AmxJob<uint8_t>, XT>;
#endif

// x [M, K] bf16 or float32; w [N / 16, K / 4, 64] int8, element [b, p, 4 j + t] =
// W[4 p + t, 16 b + j]; w_scale [N] float32; comp [N] int32 = 128 x sum_k W[k, n]; rows [1]
// -> y [M, N] float32 or bf16, or (kSiluMul, W = [gate | up]) [M, N / 2] bf16 silu(gate) * up.
template <typename XT, typename X, typename Y, bool kSiluMul = false, bool kAmx = false>
ffi::Future W8A8GemmImpl(ffi::ThreadPool pool, X x, ffi::Buffer<ffi::S8, 3> w,
                         ffi::Buffer<ffi::F32, 1> w_scale, ffi::Buffer<ffi::S32, 1> comp,
                         ffi::Buffer<ffi::S32, 1> rows, ffi::Result<Y> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  constexpr bool kBf16Out = std::is_same_v<Y, ffi::Buffer<ffi::BF16, 2>>;
  const int64_t out_blocks = kSiluMul ? wd[0] / 2 : wd[0];
  if (wd[2] != 64 || xd[1] % 4 != 0 || wd[1] != xd[1] / 4 || yd[0] != xd[0] ||
      yd[1] != out_blocks * 16 || (kSiluMul && wd[0] % 2 != 0) ||
      w_scale.element_count() != wd[0] * 16 || comp.element_count() != wd[0] * 16 ||
      rows.element_count() != 1)
    return jaxbatch_pool::Ready(jaxbatch_checks::Invalid(
        "w8a8_gemm", "x [M, K], w packed for K, w_scale and comp [N], rows [1], y [M, N] "
        "expected, got x ", jaxbatch_checks::Shape(xd), ", w ", jaxbatch_checks::Shape(wd),
        ", w_scale ", jaxbatch_checks::Shape(w_scale.dimensions()), ", comp ",
        jaxbatch_checks::Shape(comp.dimensions()), ", rows ",
        jaxbatch_checks::Shape(rows.dimensions()), ", y ", jaxbatch_checks::Shape(yd)));
  auto job = std::make_shared<W8A8Job<XT>>();
  const int64_t m = std::clamp<int64_t>(rows.typed_data()[0], 0, xd[0]), k = xd[1];
  float* y32 = nullptr;
  uint16_t* y16 = nullptr;
  if constexpr (kBf16Out)
    y16 = reinterpret_cast<uint16_t*>(y->typed_data());
  else
    y32 = y->typed_data();
  const int64_t padding = (xd[0] - m) * yd[1];
  if (padding > 0) {
    if constexpr (kBf16Out)
      std::memset(y16 + m * yd[1], 0, padding * sizeof(uint16_t));
    else
      std::memset(y32 + m * yd[1], 0, padding * sizeof(float));
  }
  if (m == 0 || wd[0] == 0) return jaxbatch_pool::Ready();
  job->x = reinterpret_cast<const XT*>(x.typed_data());
  job->xq.reset(new uint8_t[m * k]);
  job->x_scale.reset(new float[m]);
  job->p = Problem<uint8_t>{job->xq.get(), reinterpret_cast<const uint8_t*>(w.typed_data()),
                            y32, y16, m, k, wd[0]};
  job->p.x_scale = job->x_scale.get();
  job->p.w_scale = w_scale.typed_data();
  job->p.comp = comp.typed_data();
  job->units = (wd[0] + kBlocks - 1) / kBlocks;
  if constexpr (kSiluMul) {
    job->p.jump = out_blocks;
    job->p.silu_mul = true;
    job->units = out_blocks;
  }
  const int64_t macs = m * k * wd[0] * 16;
  const jaxbatch_calls::Label label{jaxbatch_calls::kGemm, m, k, out_blocks * 16};
  if constexpr (kAmx) {
#if JAXBATCH_HAVE_AMX
    if (!jaxbatch_amx::Permitted())
      return jaxbatch_pool::Ready(jaxbatch_checks::Invalid(
          "w8a8_gemm", "the AMX variant called where Linux grants no tile registers"));
    if (auto amx = AmxJobFor<AmxW8A8Job<XT>>(job->p)) {
      amx->x = job->x;
      amx->xq = std::move(job->xq);
      amx->x_scale = std::move(job->x_scale);
      return jaxbatch_pool::Run(pool, amx, jaxbatch_pool::Helpers(pool, amx->units), label);
    }
#else
    return jaxbatch_pool::Ready(jaxbatch_checks::Invalid(
        "w8a8_gemm", "the AMX variant of a library built without AMX intrinsics"));
#endif
  }
  const int64_t helpers = macs < 2 * kMinParallelMacs ? 0 : jaxbatch_pool::Helpers(pool, job->units);
  return jaxbatch_pool::Run(pool, job, helpers, label);
}

template <typename X, typename Y>
constexpr auto W8A8Binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .template Arg<X>()
      .template Arg<ffi::Buffer<ffi::S8, 3>>()
      .template Arg<ffi::Buffer<ffi::F32, 1>>()
      .template Arg<ffi::Buffer<ffi::S32, 1>>()
      .template Arg<ffi::Buffer<ffi::S32, 1>>()
      .template Ret<Y>();
}

template <typename X, typename W, typename Y>
constexpr auto Binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .template Arg<X>()
      .template Arg<W>()
      .template Arg<ffi::Buffer<ffi::S32, 1>>()
      .template Ret<Y>();
}

using Bf16X = ffi::Buffer<ffi::BF16, 2>;
using Bf16W = ffi::Buffer<ffi::U16, 3>;
using F32X = ffi::Buffer<ffi::F32, 2>;
using F32W = ffi::Buffer<ffi::F32, 3>;
using F32Y = ffi::Buffer<ffi::F32, 2>;
using Bf16Y = ffi::Buffer<ffi::BF16, 2>;

}  // namespace

JAXBATCH_DEFINE_AMX_BUILT
JAXBATCH_DEFINE_PREFETCH_SETTER
JAXBATCH_DEFINE_CALL_LOG_SETTER

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbatchPackedGemm, (PackedGemmImpl<uint16_t, Bf16X, Bf16W, F32Y>),
                              (Binding<Bf16X, Bf16W, F32Y>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbatchPackedGemmBf16Out,
                              (PackedGemmImpl<uint16_t, Bf16X, Bf16W, Bf16Y>),
                              (Binding<Bf16X, Bf16W, Bf16Y>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbatchPackedGemmSiluMul,
                              (PackedGemmImpl<uint16_t, Bf16X, Bf16W, Bf16Y, true>),
                              (Binding<Bf16X, Bf16W, Bf16Y>()));
// The same over AMX tiles (bf16 `tdpbf16ps`, int8 `tdpbusd`), for CPUs that have them.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbatchPackedGemmAmx,
                              (PackedGemmImpl<uint16_t, Bf16X, Bf16W, F32Y, false, true>),
                              (Binding<Bf16X, Bf16W, F32Y>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbatchPackedGemmBf16OutAmx,
                              (PackedGemmImpl<uint16_t, Bf16X, Bf16W, Bf16Y, false, true>),
                              (Binding<Bf16X, Bf16W, Bf16Y>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbatchPackedGemmSiluMulAmx,
                              (PackedGemmImpl<uint16_t, Bf16X, Bf16W, Bf16Y, true, true>),
                              (Binding<Bf16X, Bf16W, Bf16Y>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbatchPackedGemmF32, (PackedGemmImpl<float, F32X, F32W, F32Y>),
                              (Binding<F32X, F32W, F32Y>()));

// W8A8: bf16 or float32 activations, quantized per row inside the call.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbatchW8A8Gemm, (W8A8GemmImpl<float, F32X, F32Y>),
                              (W8A8Binding<F32X, F32Y>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbatchW8A8GemmBf16, (W8A8GemmImpl<uint16_t, Bf16X, Bf16Y>),
                              (W8A8Binding<Bf16X, Bf16Y>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbatchW8A8GemmSiluMul,
                              (W8A8GemmImpl<uint16_t, Bf16X, Bf16Y, true>),
                              (W8A8Binding<Bf16X, Bf16Y>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbatchW8A8GemmAmx, (W8A8GemmImpl<float, F32X, F32Y, false, true>),
                              (W8A8Binding<F32X, F32Y>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbatchW8A8GemmBf16Amx,
                              (W8A8GemmImpl<uint16_t, Bf16X, Bf16Y, false, true>),
                              (W8A8Binding<Bf16X, Bf16Y>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbatchW8A8GemmSiluMulAmx,
                              (W8A8GemmImpl<uint16_t, Bf16X, Bf16Y, true, true>),
                              (W8A8Binding<Bf16X, Bf16Y>()));
