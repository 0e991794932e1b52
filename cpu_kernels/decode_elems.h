// Decode attention's arithmetic per pool element type (paged_decode.cc): a span of keys, and
// for bf16 bits (uint16_t) and float32 pages the q.K scores and the p.V accumulation. build.py
// hashes this header with each source.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "attention_simd.h"

namespace jaxbatch_decode {

constexpr int kMaxGroup = 16;
constexpr int kMaxHeadDim = 512;
using jaxbatch_simd::FirstLanes;
using jaxbatch_simd::Reduce16;

// Up to 16 consecutive keys of one page, the unit of q.K and p.V: for bf16 pages one whole
// group of reference.py's KEY_GROUP, n = min(16, block size) (never shortened: the keys a row
// does not see are left out by `valid`, so n is also the group's stride for Scores).
template <typename T>
struct Span {
  const T* k;
  const T* v;
  int64_t n;
  __mmask16 valid;
};

// A span's cache lines, requested into L2 a few at a time (`Request`) between the arithmetic
// of another span: a whole span's lines requested at once stall the core until enough of its
// few miss buffers free up, where a few per step of the arithmetic keep memory and the core
// busy together. Key and value lines alternate.
struct LineFeed {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t left = 0;  // bytes of keys (and as many of values) not yet requested

  template <typename T>
  void Start(const Span<T>& s, int64_t D) {
    k = reinterpret_cast<const char*>(s.k);
    v = reinterpret_cast<const char*>(s.v);
    left = s.n * D * static_cast<int64_t>(sizeof(T));
  }
  // Up to `pairs` key lines and as many value lines.
  void Request(int64_t pairs) {
    for (; pairs > 0 && left > 0; --pairs, k += 64, v += 64, left -= 64) {
      _mm_prefetch(k, _MM_HINT_T2);
      _mm_prefetch(v, _MM_HINT_T2);
    }
  }
  void Rest() { Request(left / 64 + 1); }
};

// A pool element type's loads: bf16 bits (uint16_t) or float.
template <typename T>
struct Elems;

template <>
struct Elems<uint16_t> {
  static constexpr int kAccWidth = 32;  // accumulator floats per block of D (see AccIndex)
  // scores[h] lane i = q[h] . k[i] for the span's keys, a group stored dim-pair-major
  // ([D/2][n][2], pallas_kernels/reference.py's KEY_GROUP): one load holds a dim pair of every
  // key, one `vdpbf16ps` against q[h]'s broadcast pair adds it to all 16 lanes, and no sum
  // crosses lanes. Lanes past n read zeros. Even and odd pairs go to separate accumulators, so
  // that each head has two chains of dependent dots in flight, not one.
  // `feed`: another span's lines, requested a few per dim pair step.
  template <int kG>
  static void Scores(const uint16_t* q, const Span<uint16_t>& s, int64_t D, int64_t G_,
                     __m512* scores, LineFeed& feed) {
    const int64_t G = kG ? kG : G_, n = s.n;
    // the feed's lines spread over the D / 4 steps of the loop below
    const int64_t per_step = (feed.left / 64 + D / 4 - 1) / std::max<int64_t>(1, D / 4);
    const __mmask32 km = n >= 16 ? ~0u : static_cast<__mmask32>((1u << (2 * n)) - 1);
    __m512 odd[kMaxGroup];
    for (int64_t h = 0; h < G; ++h) scores[h] = odd[h] = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 2 <= D / 2; c += 2) {
      const __m512bh k0 = (__m512bh)_mm512_maskz_loadu_epi16(km, s.k + 2 * c * n);
      const __m512bh k1 = (__m512bh)_mm512_maskz_loadu_epi16(km, s.k + 2 * (c + 1) * n);
      feed.Request(per_step);
      for (int64_t h = 0; h < G; ++h) {
        scores[h] = _mm512_dpbf16_ps(scores[h], k0, QPair(q + h * D + 2 * c));
        odd[h] = _mm512_dpbf16_ps(odd[h], k1, QPair(q + h * D + 2 * c + 2));
      }
    }
    if (c < D / 2) {
      const __m512bh k0 = (__m512bh)_mm512_maskz_loadu_epi16(km, s.k + 2 * c * n);
      for (int64_t h = 0; h < G; ++h)
        scores[h] = _mm512_dpbf16_ps(scores[h], k0, QPair(q + h * D + 2 * c));
    }
    for (int64_t h = 0; h < G; ++h) scores[h] = _mm512_add_ps(scores[h], odd[h]);
  }
  // q[0], q[1] in every 32-bit lane
  static __m512bh QPair(const uint16_t* q) {
    uint32_t pair;
    std::memcpy(&pair, q, sizeof pair);
    return (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
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
  // scores[h] lane i = q[h] . k[i] for the span's keys ([n][D] as in the pool): one float32
  // accumulator per key, summed across its lanes by Reduce16.
  template <int kG>
  static void Scores(const float* q, const Span<float>& s, int64_t D, int64_t G_,
                     __m512* scores, LineFeed& feed) {
    const int64_t G = kG ? kG : G_;
    // the feed's lines spread over the G * D / 16 steps of Dots
    const int64_t steps = std::max<int64_t>(1, G * ((D + 15) / 16));
    const int64_t per_step = (feed.left / 64 + steps - 1) / steps;
    for (int64_t h = 0; h < G; ++h) {
      __m512 dots[16];
      for (int i = 0; i < 16; ++i) dots[i] = _mm512_setzero_ps();
      if (s.valid == 0xFFFF)      // a full block of 16 keys: the loop over keys unrolled
        Dots<16>(q + h * D, s.k, D, 16, dots, feed, per_step);
      else
        Dots<0>(q + h * D, s.k, D, s.n, dots, feed, per_step);
      scores[h] = Reduce16(dots);
    }
  }
  template <int kN>
  static void Dots(const float* q, const float* k, int64_t D, int64_t n_, __m512* dots,
                   LineFeed& feed, int64_t per_step) {
    const int64_t n = kN ? kN : n_;
    for (int64_t c = 0; c < D; c += 16) {
      feed.Request(per_step);
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

}  // namespace jaxbatch_decode
