// The first maximum of each row of float32 logits, NaN counted as +inf, for CPUs with AVX-512:
// an XLA FFI custom call whose reference is `jaxbatch.worker.argmax.two_level_argmax`.
//
//   JaxbatchFirstArgmax   x [N, V] f32 -> [N] s32
//
// XLA:CPU runs the jnp form (a two-level search over chunks of the row) as a few reductions,
// each its own pass over [N, V / 128, 128] on one thread. Here a row is one pass for its
// maximum (NaN as +inf) and one up to the
// first lane equal to it, 16 lanes at a time; the rows are split over XLA's intra-op threads
// (pool_dispatch.h). The result is exact: the jnp form's, whatever the batch.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>

#include "attention_simd.h"
#include "checks.h"
#include "pool_dispatch.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxbatch_simd::FirstLanes;

// Below this many logits a call runs on the calling thread alone: waking a helper costs more.
constexpr int64_t kMinParallelElements = int64_t{1} << 16;

// 16 logits from `at` (the first `lanes` of them; the others -inf), NaN as +inf.
inline __m512 Load(const float* at, __mmask16 lanes) {
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 x = _mm512_mask_loadu_ps(minus_inf, lanes, at);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_blend_ps(nan, x, _mm512_set1_ps(std::numeric_limits<float>::infinity()));
}

int32_t RowArgmax(const float* row, int64_t v) {
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t c = 0; c < v; c += 16)
    best = _mm512_max_ps(best, Load(row + c, FirstLanes(v - c)));
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best));
  for (int64_t c = 0; c < v; c += 16) {
    const __mmask16 lanes = FirstLanes(v - c);
    const __mmask16 hit = _mm512_mask_cmp_ps_mask(lanes, Load(row + c, lanes), top, _CMP_EQ_OQ);
    if (hit) return static_cast<int32_t>(c + __builtin_ctz(hit));
  }
  return 0;   // v == 0
}

struct Job : jaxbatch_pool::JobCounters {
  const float* x = nullptr;
  int32_t* out = nullptr;
  int64_t v = 0;

  void Work() {
    for (int64_t r = next.fetch_add(1, std::memory_order_relaxed); r < units;
         r = next.fetch_add(1, std::memory_order_relaxed)) {
      out[r] = RowArgmax(x + r * v, v);
      UnitDone();
    }
  }
};

using Logits = ffi::Buffer<ffi::F32, 2>;
using Tokens = ffi::Buffer<ffi::S32, 1>;

ffi::Future FirstArgmaxImpl(ffi::ThreadPool pool, Logits x, ffi::Result<Tokens> out) {
  const auto xd = x.dimensions();
  if (out->dimensions()[0] != xd[0] || (xd[0] > 0 && xd[1] == 0))
    return jaxbatch_pool::Ready(jaxbatch_checks::Invalid(
        "first_argmax", "x [N, V] with V > 0 and out [N] expected, got x ",
        jaxbatch_checks::Shape(xd), ", out ", jaxbatch_checks::Shape(out->dimensions())));
  auto job = std::make_shared<Job>();
  job->x = x.typed_data();
  job->out = out->typed_data();
  job->v = xd[1];
  job->units = xd[0];
  if (job->units == 0) return jaxbatch_pool::Ready();
  const int64_t helpers =
      xd[0] * xd[1] < kMinParallelElements ? 0 : jaxbatch_pool::Helpers(pool, job->units);
  return jaxbatch_pool::Run(pool, job, helpers, {jaxbatch_calls::kArgmax, xd[0], xd[1], 0});
}

}  // namespace

JAXBATCH_DEFINE_CALL_LOG_SETTER

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbatchFirstArgmax, FirstArgmaxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Logits>()
                                  .Ret<Tokens>());
