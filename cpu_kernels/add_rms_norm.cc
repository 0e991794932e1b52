// The residual add and the RMSNorm after it, for a bf16 model on CPUs with AVX512-BF16: an XLA
// FFI custom call whose reference is `layers.add_rms_norm`'s jnp form:
//
//   JaxbatchAddRmsNorm   x, h [T, d] bf16, w [d] f32; attributes eps, offset (f32)
//                        -> sum [T, d] bf16 = bf16(x + h),
//                           normed [T, d] bf16 = bf16(sum * (1 / sqrt(ms + eps)) * (w + offset)),
//                           ms = ordered_sum(sum^2) * (1 / d), every step in float32,
//                           rounded on its own (IEEE sqrt and division, no FMA)
//
// XLA:CPU runs the jnp form as a handful of loop fusions per norm, each reading the row again
// and recomputing the add and the squares (the fixed summation tree of
// pallas_kernels/ordered_sum.py ends its fusions at every pad), a scalar bf16 conversion per
// element: many times what one pass over a row costs here. The sum of squares takes the same
// tree as `ordered_sum`: 16 float32 lanes per chunk, chunks added in halves (a zero chunk
// appended to an odd count), then the lanes in halves, so the sums are the jnp path's, bit
// for bit. The square root and the division are IEEE's, where XLA:CPU takes approximations
// that differ between its versions and CPUs: a normed value may differ from the jnp path's
// by a bf16 step, never between batches. Rows are split over XLA's intra-op threads
// (pool_dispatch.h) when there are enough of them.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "attention_simd.h"
#include "checks.h"
#include "pool_dispatch.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// No multiply-add fused into an FMA: every step rounds on its own (a spec the tests check
// against numpy's float32, whichever compiler builds this).
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace {

using jaxbatch_simd::FirstLanes;
using jaxbatch_simd::RoundBf16;

constexpr int64_t kRowsPerUnit = 8;
constexpr int64_t kMinParallelRows = 64;

inline __m512 LoadBf16(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

inline void StoreBf16(uint16_t* p, __m512 f, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(f));
}

struct Problem {
  const uint16_t* x;
  const uint16_t* h;
  const float* w;
  uint16_t* sum;
  uint16_t* normed;
  int64_t rows, d;
  float eps, offset;
};

void Row(const Problem& p, int64_t r, std::vector<__m512>& chunks) {
  const int64_t d = p.d, n = (d + 15) / 16;
  const uint16_t* x = p.x + r * d;
  const uint16_t* h = p.h + r * d;
  uint16_t* sum = p.sum + r * d;
  chunks.resize(n + 1);
  for (int64_t c = 0; c < n; ++c) {
    const __mmask16 m = FirstLanes(d - c * 16);
    const __m512 s = RoundBf16(_mm512_add_ps(LoadBf16(x + c * 16, m), LoadBf16(h + c * 16, m)));
    StoreBf16(sum + c * 16, s, m);
    chunks[c] = _mm512_mul_ps(s, s);    // masked-off lanes load as 0: the tree's zero padding
  }
  // ordered_sum: chunks in halves, then lanes in halves
  int64_t count = n;
  while (count > 1) {
    if (count % 2) chunks[count++] = _mm512_setzero_ps();
    count /= 2;
    for (int64_t c = 0; c < count; ++c) chunks[c] = _mm512_add_ps(chunks[c], chunks[c + count]);
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, chunks[0]);
  for (int width = 8; width >= 1; width /= 2)
    for (int i = 0; i < width; ++i) lanes[i] = lanes[i] + lanes[i + width];
  // each step rounded on its own (see the pragma above)
  const float mean_square = lanes[0] * (1.0f / static_cast<float>(d));
  const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(mean_square + p.eps));
  const __m512 offset = _mm512_set1_ps(p.offset);
  uint16_t* out = p.normed + r * d;
  for (int64_t c = 0; c < n; ++c) {
    const __mmask16 m = FirstLanes(d - c * 16);
    const __m512 s = LoadBf16(sum + c * 16, m);
    const __m512 w = _mm512_add_ps(_mm512_maskz_loadu_ps(m, p.w + c * 16), offset);
    StoreBf16(out + c * 16, _mm512_mul_ps(_mm512_mul_ps(s, inv), w), m);
  }
}

struct Job : jaxbatch_pool::JobCounters {
  Problem p;

  void Work() {
    std::vector<__m512> chunks;
    for (int64_t u = next.fetch_add(1, std::memory_order_relaxed); u < units;
         u = next.fetch_add(1, std::memory_order_relaxed)) {
      const int64_t end = std::min(p.rows, (u + 1) * kRowsPerUnit);
      for (int64_t r = u * kRowsPerUnit; r < end; ++r) Row(p, r, chunks);
      UnitDone();
    }
  }
};

using Bf16Matrix = ffi::Buffer<ffi::BF16, 2>;
using F32Vector = ffi::Buffer<ffi::F32, 1>;

ffi::Future AddRmsNormImpl(ffi::ThreadPool pool, Bf16Matrix x, Bf16Matrix h, F32Vector w,
                           ffi::Result<Bf16Matrix> sum, ffi::Result<Bf16Matrix> normed,
                           float eps, float offset) {
  const auto xd = x.dimensions();
  const auto same = [&](auto dims) { return dims[0] == xd[0] && dims[1] == xd[1]; };
  if (!same(h.dimensions()) || !same(sum->dimensions()) || !same(normed->dimensions()) ||
      w.dimensions()[0] != xd[1])
    return jaxbatch_pool::Ready(jaxbatch_checks::Invalid(
        "add_rms_norm", "x, h, sum, normed [T, d] and w [d] expected, got x ",
        jaxbatch_checks::Shape(xd), ", h ", jaxbatch_checks::Shape(h.dimensions()), ", w ",
        jaxbatch_checks::Shape(w.dimensions()), ", sum ", jaxbatch_checks::Shape(sum->dimensions()),
        ", normed ", jaxbatch_checks::Shape(normed->dimensions())));
  auto job = std::make_shared<Job>();
  job->p = Problem{reinterpret_cast<const uint16_t*>(x.typed_data()),
                   reinterpret_cast<const uint16_t*>(h.typed_data()), w.typed_data(),
                   reinterpret_cast<uint16_t*>(sum->typed_data()),
                   reinterpret_cast<uint16_t*>(normed->typed_data()), xd[0], xd[1], eps, offset};
  if (job->p.rows == 0 || job->p.d == 0) return jaxbatch_pool::Ready();
  job->units = (job->p.rows + kRowsPerUnit - 1) / kRowsPerUnit;
  const int64_t helpers =
      job->p.rows < kMinParallelRows ? 0 : jaxbatch_pool::Helpers(pool, job->units);
  return jaxbatch_pool::Run(pool, job, helpers,
                            {jaxbatch_calls::kNorm, job->p.rows, job->p.d, 0});
}

}  // namespace

JAXBATCH_DEFINE_CALL_LOG_SETTER

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbatchAddRmsNorm, AddRmsNormImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Bf16Matrix>()
                                  .Arg<Bf16Matrix>()
                                  .Arg<F32Vector>()
                                  .Ret<Bf16Matrix>()
                                  .Ret<Bf16Matrix>()
                                  .Attr<float>("eps")
                                  .Attr<float>("offset"));
