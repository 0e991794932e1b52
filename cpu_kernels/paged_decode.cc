// Decode attention over a paged KV cache of bf16 pages, for CPUs with AVX512-BF16: an XLA FFI
// custom call with the interface of `paged_decode_attention_xla`
// (pallas_kernels/xla_paged_attention.py), which is also its reference.
//
//   q [B, H, D] bf16; k_pages, v_pages [KVH, N, bs, D] uint16 (bf16 bits, the CPU pool);
//   item_slot [J], item_pages [J, PPI], item_first_pos [J] int32: a work list sorted by row
//   (padding items have item_slot >= B); lengths [B] int32; window [1] int32 (a key at
//   position p is seen by row r when lengths[r] - window <= p < lengths[r]); scale [1] f32.
//   -> out [B, H, D] float32.
//
// One unit of work is (row, kv head): its G = H / KVH query heads walk the row's items in
// order, 16 keys at a time, with an online softmax in float32; q.K is bf16 x bf16 with float32
// accumulation (`vdpbf16ps`), p.V float32. A row's result depends on its own keys only, in a
// fixed order, whatever the batch. Units are claimed through an atomic counter by the calling
// thread and helpers on XLA's intra-op thread pool.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxGroup = 16;
constexpr int kMaxHeadDim = 512;

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

// e^x for x <= 0 (softmax arguments), relative error about 1e-7: 2^n e^r, |r| <= ln2 / 2.
inline __m512 Exp(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
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

inline __m512 Bf16ToF32(const uint16_t* src, __mmask16 mask) {
  const __m256i bits = _mm256_maskz_loadu_epi16(mask, src);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

struct Problem {
  const uint16_t* q;
  const uint16_t* k;
  const uint16_t* v;
  const int32_t* item_slot;
  const int32_t* item_pages;
  const int32_t* item_first_pos;
  const int32_t* lengths;
  int32_t window;
  float scale;
  float* out;
  int64_t batch, heads, head_dim, kv_heads, num_pages, block_size, pages_per_item;
  std::vector<int64_t> first_item, item_count;  // per row
};

// Every cache line of item `it`'s pages (kv head g) that hold keys before `length`.
template <int Hint>
void PrefetchItem(const Problem& p, int64_t g, int64_t it, int64_t length) {
  const int64_t bs = p.block_size, D = p.head_dim;
  for (int64_t j = 0; j < p.pages_per_item; ++j) {
    const int64_t used = std::min<int64_t>(bs, length - (p.item_first_pos[it] + j * bs));
    if (used <= 0) break;
    const int64_t page = p.item_pages[it * p.pages_per_item + j];
    if (page < 0 || page >= p.num_pages) continue;
    const int64_t base = (g * p.num_pages + page) * bs * D;
    for (int64_t b = 0; b < used * D; b += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(p.k + base + b), static_cast<_mm_hint>(Hint));
      _mm_prefetch(reinterpret_cast<const char*>(p.v + base + b), static_cast<_mm_hint>(Hint));
    }
  }
}

// Row `row`, kv head `g`: out[row, g * G : (g + 1) * G, :].
void Unit(const Problem& p, int64_t row, int64_t g) {
  const int64_t D = p.head_dim, G = p.heads / p.kv_heads, bs = p.block_size;
  float* out = p.out + (row * p.heads + g * G) * D;
  const int64_t length = p.lengths[row];
  const int64_t lo = std::max<int64_t>(0, length - static_cast<int64_t>(p.window));
  float m[kMaxGroup], l[kMaxGroup];
  alignas(64) float acc[kMaxGroup][kMaxHeadDim];
  for (int64_t h = 0; h < G; ++h) {
    m[h] = -std::numeric_limits<float>::infinity();
    l[h] = 0.0f;
    std::fill(acc[h], acc[h] + D, 0.0f);
  }
  const uint16_t* q = p.q + (row * p.heads + g * G) * D;
  const int64_t dchunks = (D + 31) / 32;
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
      const uint16_t* kp = p.k + ((g * p.num_pages + page) * bs) * D;
      const uint16_t* vp = p.v + ((g * p.num_pages + page) * bs) * D;
      for (int64_t t0 = 0; t0 < bs; t0 += 16) {
        const int64_t n = std::min<int64_t>(16, bs - t0);
        __mmask16 valid = 0;
        for (int64_t i = 0; i < n; ++i) {
          const int64_t pos = page_pos + t0 + i;
          if (pos < length && pos >= lo) valid |= static_cast<__mmask16>(1u << i);
        }
        if (!valid) continue;
        __m512 probs[kMaxGroup];
        for (int64_t h = 0; h < G; ++h) {
          __m512 dots[16];
          for (int i = 0; i < 16; ++i) dots[i] = _mm512_setzero_ps();
          for (int64_t c = 0; c < dchunks; ++c) {
            const int64_t rem = std::min<int64_t>(32, D - 32 * c);
            const __mmask32 dm = rem == 32 ? ~0u : static_cast<__mmask32>((1u << rem) - 1);
            const __m512bh qv = (__m512bh)_mm512_maskz_loadu_epi16(dm, q + h * D + 32 * c);
            for (int64_t i = 0; i < n; ++i) {
              const __m512bh kv =
                  (__m512bh)_mm512_maskz_loadu_epi16(dm, kp + (t0 + i) * D + 32 * c);
              dots[i] = _mm512_dpbf16_ps(dots[i], qv, kv);
            }
          }
          const __m512 scores = _mm512_mask_blend_ps(
              valid, _mm512_set1_ps(-std::numeric_limits<float>::infinity()),
              _mm512_mul_ps(Reduce16(dots), _mm512_set1_ps(p.scale)));
          const float new_m = std::max(m[h], _mm512_reduce_max_ps(scores));
          const float correction = std::exp(m[h] - new_m);     // 0 for the first block
          const __m512 pr = _mm512_maskz_mov_ps(
              valid, Exp(_mm512_sub_ps(scores, _mm512_set1_ps(new_m))));
          l[h] = l[h] * correction + _mm512_reduce_add_ps(pr);
          if (correction != 1.0f) {
            const __m512 cv = _mm512_set1_ps(correction);
            for (int64_t d = 0; d < D; d += 16) {
              const __mmask16 dm = FirstLanes(D - d);
              _mm512_mask_storeu_ps(acc[h] + d, dm,
                                    _mm512_mul_ps(_mm512_maskz_loadu_ps(dm, acc[h] + d), cv));
            }
          }
          m[h] = new_m;
          probs[h] = pr;
        }
        alignas(64) float pw[kMaxGroup][16];
        for (int64_t h = 0; h < G; ++h) _mm512_store_ps(pw[h], probs[h]);
        // acc[h][d:d+16] += sum_i pw[h][i] * v[i][d:d+16], the G accumulators in registers
        // while the block's keys pass, in key order.
        for (int64_t d = 0; d < D; d += 16) {
          const __mmask16 dm = FirstLanes(D - d);
          __m512 a[kMaxGroup];
          for (int64_t h = 0; h < G; ++h) a[h] = _mm512_maskz_loadu_ps(dm, acc[h] + d);
          for (int64_t i = 0; i < n; ++i) {
            if (!(valid & (1u << i))) continue;
            const __m512 vv = Bf16ToF32(vp + (t0 + i) * D + d, dm);
            for (int64_t h = 0; h < G; ++h) a[h] = _mm512_fmadd_ps(_mm512_set1_ps(pw[h][i]), vv, a[h]);
          }
          for (int64_t h = 0; h < G; ++h) _mm512_mask_storeu_ps(acc[h] + d, dm, a[h]);
        }
      }
    }
  }
  for (int64_t h = 0; h < G; ++h) {
    const float inv = 1.0f / std::max(l[h], std::numeric_limits<float>::min());
    for (int64_t d = 0; d < D; ++d) out[h * D + d] = acc[h][d] * inv;
  }
}

struct Job {
  Problem p;
  int64_t units;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Work() {
    for (int64_t u; (u = next.fetch_add(1, std::memory_order_relaxed)) < units;) {
      Unit(p, u / p.kv_heads, u % p.kv_heads);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

using Bf16Array3 = ffi::Buffer<ffi::BF16, 3>;
using PoolArray = ffi::Buffer<ffi::U16, 4>;
using I32Vector = ffi::Buffer<ffi::S32, 1>;
using I32Matrix = ffi::Buffer<ffi::S32, 2>;
using F32Array3 = ffi::Buffer<ffi::F32, 3>;
using F32Vector = ffi::Buffer<ffi::F32, 1>;

ffi::Error PagedDecodeImpl(ffi::ThreadPool pool, Bf16Array3 q, PoolArray k, PoolArray v,
                           I32Vector item_slot, I32Matrix item_pages, I32Vector item_first_pos,
                           I32Vector lengths, I32Vector window, F32Vector scale,
                           ffi::Result<F32Array3> out) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  auto job = std::make_shared<Job>();
  Problem& p = job->p;
  p = Problem{reinterpret_cast<const uint16_t*>(q.typed_data()), k.typed_data(), v.typed_data(),
              item_slot.typed_data(), item_pages.typed_data(), item_first_pos.typed_data(),
              lengths.typed_data(), window.typed_data()[0], scale.typed_data()[0], out->typed_data(),
              qd[0], qd[1], qd[2], kd[0], kd[1], kd[2], item_pages.dimensions()[1], {}, {}};
  if (p.head_dim != kd[3] || p.heads % p.kv_heads != 0 || p.heads / p.kv_heads > kMaxGroup ||
      p.head_dim > kMaxHeadDim || lengths.dimensions()[0] != p.batch)
    return ffi::Error::InvalidArgument("paged_decode: unsupported shapes");
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
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { job->Work(); });
  job->Work();
  while (job->done.load(std::memory_order_acquire) < job->units) _mm_pause();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbatchPagedDecode, PagedDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Bf16Array3>()
                                  .Arg<PoolArray>()
                                  .Arg<PoolArray>()
                                  .Arg<I32Vector>()
                                  .Arg<I32Matrix>()
                                  .Arg<I32Vector>()
                                  .Arg<I32Vector>()
                                  .Arg<I32Vector>()
                                  .Arg<F32Vector>()
                                  .Ret<F32Array3>());
