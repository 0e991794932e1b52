// The gated MLP's activation product for CPUs with AVX512-BF16: an XLA FFI custom call whose
// reference is `jaxbatch.model.layers.activation(gate, "silu") * up` on bf16 activations.
//
//   JaxbatchSiluMul  gate_up [T, 2 I] bf16 (gate in the first I columns, up in the last I:
//                    the fused gate/up matmul's output) -> out [T, I] bf16, where
//                    out = bf16(bf16(g * 1 / (1 + e^-g)) * u), each step in float32 as the
//                    reference computes it (its e^x differs by an ulp or so of float32).
//
// XLA:CPU ran this elementwise product as a fusion far slower than the bytes it moves; here
// rows are split over the calling thread and, for large calls, one helper per pool thread.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#include "attention_simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Below this many outputs the calling thread works alone: waking a helper costs more.
constexpr int64_t kMinParallel = int64_t{1} << 16;

inline __m512 Widen(__m256i bf16) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16), 16));
}

inline __m256i Narrow(__m512 f32) { return (__m256i)_mm512_cvtneps_pbh(f32); }

void Rows(const uint16_t* x, uint16_t* out, int64_t r0, int64_t r1, int64_t I) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t r = r0; r < r1; ++r) {
    const uint16_t* gate = x + r * 2 * I;
    const uint16_t* up = gate + I;
    uint16_t* y = out + r * I;
    for (int64_t i = 0; i < I; i += 16) {
      const __mmask16 m = jaxbatch_simd::FirstLanes(I - i);
      const __m512 g = Widen(_mm256_maskz_loadu_epi16(m, gate + i));
      const __m512 u = Widen(_mm256_maskz_loadu_epi16(m, up + i));
      const __m512 e = jaxbatch_simd::Exp(_mm512_sub_ps(_mm512_setzero_ps(), g));
      const __m512 act = _mm512_mul_ps(g, _mm512_div_ps(one, _mm512_add_ps(one, e)));
      const __m512 product = _mm512_mul_ps(Widen(Narrow(act)), u);
      _mm256_mask_storeu_epi16(y + i, m, Narrow(product));
    }
  }
}

struct Job {
  const uint16_t* x;
  uint16_t* out;
  int64_t rows, I, chunk, chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Work() {
    for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < chunks;
         c = next.fetch_add(1, std::memory_order_relaxed)) {
      Rows(x, out, c * chunk, std::min(rows, (c + 1) * chunk), I);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

using Bf16Matrix = ffi::Buffer<ffi::BF16, 2>;

ffi::Error SiluMulImpl(ffi::ThreadPool pool, Bf16Matrix x, ffi::Result<Bf16Matrix> out) {
  const auto xd = x.dimensions(), yd = out->dimensions();
  if (xd[1] % 2 || yd[0] != xd[0] || yd[1] * 2 != xd[1])
    return ffi::Error::InvalidArgument("silu_mul: gate_up [T, 2 I] -> out [T, I]");
  auto job = std::make_shared<Job>();
  job->x = reinterpret_cast<const uint16_t*>(x.typed_data());
  job->out = reinterpret_cast<uint16_t*>(out->typed_data());
  job->rows = xd[0];
  job->I = yd[1];
  if (job->rows == 0 || job->I == 0) return ffi::Error::Success();
  const int64_t workers =
      job->rows * job->I < kMinParallel ? 1 : std::min<int64_t>(pool.num_threads(), job->rows);
  job->chunk = (job->rows + 2 * workers - 1) / (2 * workers);   // two chunks a worker
  job->chunks = (job->rows + job->chunk - 1) / job->chunk;
  for (int64_t i = 0; i < workers - 1; ++i) pool.Schedule([job] { job->Work(); });
  job->Work();
  while (job->done.load(std::memory_order_acquire) < job->chunks) _mm_pause();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbatchSiluMul, SiluMulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Bf16Matrix>()
                                  .Ret<Bf16Matrix>());
