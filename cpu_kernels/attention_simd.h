// SIMD pieces shared by the kernels here (attention, the GEMM's epilogues, the norm), for CPUs
// with AVX512-BF16. build.py hashes this header with each source that includes it.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace jaxbatch_simd {

// r lane a = the sum of the 16 lanes of acc[a]; the same tree for every a.
inline __m512 Reduce16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_unpacklo_ps(c[2 * i], c[2 * i + 1]),
                         _mm512_unpackhi_ps(c[2 * i], c[2 * i + 1]));
  __m512 r = _mm512_add_ps(
      _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(d[0]), _mm512_castps_pd(d[1]))),
      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(d[0]), _mm512_castps_pd(d[1]))));
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, r);
}

// e^x, relative error about 1e-7: 2^n e^r, |r| <= ln2 / 2. Below -87 it gives e^-87 (the
// softmax needs no less); past 88.7 it overflows to infinity, as expf does; NaN stays NaN
// (vmaxps returns its second operand where either is NaN: x, so a NaN score reaches the
// softmax's sum as the reference's exp carries it).
inline __m512 Exp(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// The first min(n, 16) lanes.
inline __mmask16 FirstLanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

// f rounded to bf16 (nearest even, as XLA's convert rounds), as float32.
inline __m512 RoundBf16(__m512 f) {
  const __m256i bits = (__m256i)_mm512_cvtneps_pbh(f);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// f as bf16 bits, rounded to nearest even (as XLA's convert rounds; NaN stays NaN).
inline uint16_t Bf16Bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// An attention kernel's output: float32, or bf16 bits for a bf16 model (rounded here rather
// than by an XLA convert of the float32 result, an op of its own over every output).
struct Out {
  float* f32 = nullptr;
  uint16_t* bf16 = nullptr;
  void Store(int64_t i, float value) const {
    if (bf16)
      bf16[i] = Bf16Bits(value);
    else
      f32[i] = value;
  }
};

}  // namespace jaxbatch_simd
