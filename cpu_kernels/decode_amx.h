// Decode attention's q.K and p.V on AMX tiles (paged_decode.cc's AMX handlers), for bf16 pages
// whose spans hold 16 keys (block size a multiple of 16) and a head dim a multiple of 32.
// build.py hashes this header with each source.
//
// A span's keys as the bf16 pool stores them ([D/2][16][2], reference.py's KEY_GROUP) are
// B tiles of `tdpbf16ps` as they lie: 32 dims of 16 keys, 1 KB at a 64-byte stride. The G query
// heads of a kv head are an A tile (G rows of 32 dims), so one `tdpbf16ps` gives every head's
// scores over 32 dims of a span's 16 keys, where AVX512 takes 16 `vdpbf16ps` per head. p.V
// meets the probabilities of two spans (an A tile: G rows of 32 keys, bf16, as the AVX512 path
// rounds them) with the spans' values interleaved a key pair per row (a B tile per 16 of the
// unpacked dims, built in L1 from the pages, which store values key by key). The unpacks take
// dims in the AVX512 path's lane order, so both paths keep their sums in the same accumulator
// layout (Elems<uint16_t>::AccIndex).
//
// Tiles: tmm0, 1 hold q's dims (q.K) or two span pairs' probabilities (p.V); tmm2, 3 the
// B tile being read, alternating; tmm4..7 the sums: up to 4 spans' scores, or 4 B tiles'
// (64 dims') share of p.V. Each call's sums start from zero, so a row's result depends on its
// own keys only, in a fixed order, whatever the batch.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "amx_tiles.h"
#include "decode_elems.h"

#if JAXBATCH_HAVE_AMX
namespace jaxbatch_decode_amx {

using jaxbatch_decode::kMaxGroup;
using jaxbatch_decode::kMaxHeadDim;
using jaxbatch_decode::Span;

constexpr int kSpans = 4;            // spans of one call: the C tiles tmm4..7
constexpr int64_t kKeys = 16;        // keys of a span
constexpr int64_t kPairBytes = 64;   // a tile row: 32 bf16 or 16 float32

// Whether the tiles cover a call: spans of 16 keys, dims in whole A tiles, G rows at most 16.
inline bool Covers(int64_t block_size, int64_t head_dim, int64_t group) {
  return block_size % kKeys == 0 && head_dim % 32 == 0 && group <= 16;
}

// Every tile 64 bytes a row; G rows for q, probabilities and sums, 16 for B tiles.
inline jaxbatch_amx::TileConfig Config(int64_t G) {
  jaxbatch_amx::TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = kPairBytes;
    config.rows[t] = (t == 2 || t == 3) ? kKeys : static_cast<uint8_t>(G);
  }
  return config;
}

// Loads the calling thread's tile configuration for G heads; End releases the tiles.
JAXBATCH_AMX inline void Begin(int64_t G) {
  const jaxbatch_amx::TileConfig config = Config(G);
  // GCC 12 sees `ldtilecfg` read the palette byte only, and drops the stores of the rows and
  // columns before it: this tells it the whole configuration is read.
  asm volatile("" : : "m"(config) : "memory");
  _tile_loadconfig(&config);
}
JAXBATCH_AMX inline void End() { _tile_release(); }

// scores[s][h][i] = q[h] . k_i over span s's 16 keys (G heads of q [G, D], D % 32 == 0).
JAXBATCH_AMX inline void Scores(const uint16_t* q, int64_t D, const Span<uint16_t>* spans,
                                int ns, float (*scores)[16][16]) {
  const int64_t chunks = D / 32, stride = 2 * D;
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (int64_t c = 0; c < chunks; c += 2) {
    const bool two = c + 1 < chunks;
    _tile_loadd(0, q + 32 * c, stride);
    if (two) _tile_loadd(1, q + 32 * (c + 1), stride);
    // span S's 32 dims from c: 16 dim pairs of 16 keys, 2 bf16 each
#define JAXBATCH_SPAN(S, C)                                                       \
  if (ns > S) {                                                                   \
    _tile_loadd(2, spans[S].k + 512 * c, kPairBytes);                             \
    _tile_dpbf16ps(C, 0, 2);                                                        \
    if (two) {                                                                    \
      _tile_loadd(3, spans[S].k + 512 * (c + 1), kPairBytes);                     \
      _tile_dpbf16ps(C, 1, 3);                                                      \
    }                                                                             \
  }
    JAXBATCH_SPAN(0, 4) JAXBATCH_SPAN(1, 5) JAXBATCH_SPAN(2, 6) JAXBATCH_SPAN(3, 7)
#undef JAXBATCH_SPAN
  }
  _tile_stored(4, scores[0], kPairBytes);
  if (ns > 1) _tile_stored(5, scores[1], kPairBytes);
  if (ns > 2) _tile_stored(6, scores[2], kPairBytes);
  if (ns > 3) _tile_stored(7, scores[3], kPairBytes);
}

// The values of spans s0 and s0 + 1 (if `second`) as B tiles, a key pair a row: tile b holds
// 16 dims of 32 (b even: the unpacks' low quarters, odd: the high ones) for D / 16 tiles.
// Keys not seen load as zeros (a pool's unused slots may hold anything, NaN included).
template <typename Feed>
inline void ValueTiles(const Span<uint16_t>* spans, int64_t D, bool second,
                       uint16_t (*tiles)[16][32], Feed& feed) {
  for (int half = 0; half < 2; ++half) {
    const int64_t r0 = 8 * half;
    if (half == 1 && !second) {
      for (int64_t b = 0; b < D / 16; ++b)
        for (int64_t r = 8; r < 16; ++r) _mm512_store_si512(tiles[b][r], _mm512_setzero_si512());
      continue;
    }
    const Span<uint16_t>& s = spans[half];
    for (int64_t i = 0; i < kKeys; i += 2) {
      const __mmask32 m0 = (s.valid >> i) & 1 ? ~0u : 0u;
      const __mmask32 m1 = (s.valid >> (i + 1)) & 1 ? ~0u : 0u;
      for (int64_t c = 0; c < D; c += 32) {
        const __m512i v0 = _mm512_maskz_loadu_epi16(m0, s.v + i * D + c);
        const __m512i v1 = _mm512_maskz_loadu_epi16(m1, s.v + (i + 1) * D + c);
        _mm512_store_si512(tiles[c / 16][r0 + i / 2], _mm512_unpacklo_epi16(v0, v1));
        _mm512_store_si512(tiles[c / 16 + 1][r0 + i / 2], _mm512_unpackhi_epi16(v0, v1));
        feed.Request(Feed::kPerStep);
      }
    }
  }
}

// acc[h][16 b + j] += sum over the ns spans' keys of p[h][key] v[key][d(b, j)] (AccIndex's
// order). probs[t]: G rows of spans 2t and 2t + 1's probabilities, bf16, keys in order.
template <typename Feed>
JAXBATCH_AMX inline void AccumulatePV(const uint16_t (*probs)[16][32], const Span<uint16_t>* spans,
                                      int ns, int64_t G, int64_t D, float (*acc)[kMaxHeadDim],
                                      Feed& feed) {
  alignas(64) uint16_t values[2][kMaxHeadDim / 16][16][32];
  const int pairs = (ns + 1) / 2;
  for (int t = 0; t < pairs; ++t) ValueTiles(spans + 2 * t, D, 2 * t + 1 < ns, values[t], feed);
  _tile_loadd(0, probs[0], kPairBytes);
  if (pairs > 1) _tile_loadd(1, probs[1], kPairBytes);
  alignas(64) float sums[4][16][16];
  for (int64_t b0 = 0; b0 < D / 16; b0 += 4) {
    const int64_t nb = std::min<int64_t>(4, D / 16 - b0);   // D % 32 == 0: 2 or 4
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
#define JAXBATCH_PV(T, B, C, R)                                                   \
  if (nb > B) {                                                                   \
    _tile_loadd(R, values[T][b0 + B], kPairBytes);                                \
    _tile_dpbf16ps(C, T, R);                                                      \
  }
    JAXBATCH_PV(0, 0, 4, 2) JAXBATCH_PV(0, 1, 5, 3) JAXBATCH_PV(0, 2, 6, 2) JAXBATCH_PV(0, 3, 7, 3)
    if (pairs > 1) {
      JAXBATCH_PV(1, 0, 4, 2) JAXBATCH_PV(1, 1, 5, 3) JAXBATCH_PV(1, 2, 6, 2) JAXBATCH_PV(1, 3, 7, 3)
    }
#undef JAXBATCH_PV
    _tile_stored(4, sums[0], kPairBytes);
    _tile_stored(5, sums[1], kPairBytes);
    if (nb > 2) {
      _tile_stored(6, sums[2], kPairBytes);
      _tile_stored(7, sums[3], kPairBytes);
    }
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t h = 0; h < G; ++h) {
        float* a = acc[h] + 16 * (b0 + b);
        _mm512_store_ps(a, _mm512_add_ps(_mm512_load_ps(a), _mm512_load_ps(sums[b][h])));
      }
  }
}

}  // namespace jaxbatch_decode_amx
#endif  // JAXBATCH_HAVE_AMX
