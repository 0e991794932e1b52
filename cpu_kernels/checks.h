// What every handler here checks before it touches its operands: the sizes it reads by, and
// the work list's invariants, once per call (never in the loops that compute). A failed check
// is an ffi::Error with kInvalidArgument, which XLA raises in Python (a JaxRuntimeError naming
// the kernel and the operand), rather than a read of memory the call does not own, a division
// by zero, or a silently wrong result. build.py hashes this header with each source.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <string>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jaxbatch_checks {

namespace ffi = xla::ffi;

// An InvalidArgument error whose message is `kernel: ` and the parts, streamed.
template <typename... Parts>
ffi::Error Invalid(const char* kernel, Parts&&... parts) {
  std::ostringstream message;
  message << kernel << ": ";
  (message << ... << std::forward<Parts>(parts));
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, message.str());
}

// `dims` as "[a, b, c]".
template <typename Dims>
std::string Shape(const Dims& dims) {
  std::ostringstream s;
  s << '[';
  for (size_t i = 0; i < dims.size(); ++i) s << (i ? ", " : "") << dims[i];
  s << ']';
  return s.str();
}

// Whether two buffers' dimensions agree.
template <typename A, typename B>
bool SameDims(const A& a, const B& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return false;
  return true;
}

// The heads an attention kernel reads: q [rows, H, D] and out alike, k and v pages
// [KVH, N, bs, D] alike, KVH, bs and D positive, H a whole group of at most `max_group` per kv
// head, D at most `max_head_dim` (and even where `even_head_dim`: bf16 keys in dim pairs).
template <typename Q, typename K, typename V, typename O>
ffi::Error AttentionHeads(const char* kernel, const Q& qd, const K& kd, const V& vd,
                          const O& od, int64_t max_group, int64_t max_head_dim,
                          bool even_head_dim) {
  if (!SameDims(vd, kd))
    return Invalid(kernel, "v_pages ", Shape(vd), " differs from k_pages ", Shape(kd));
  if (!SameDims(od, qd))
    return Invalid(kernel, "out ", Shape(od), " differs from q ", Shape(qd));
  const int64_t H = qd[1], D = qd[2], KVH = kd[0], bs = kd[2];
  if (KVH < 1 || bs < 1 || D < 1)
    return Invalid(kernel, "k_pages ", Shape(kd), ": kv heads, block size and head dim must be "
                   "positive, q ", Shape(qd));
  if (kd[3] != D)
    return Invalid(kernel, "q ", Shape(qd), " and k_pages ", Shape(kd), " differ in head dim");
  if (H < KVH || H % KVH != 0 || H / KVH > max_group)
    return Invalid(kernel, H, " query heads over ", KVH, " kv heads: a whole group of at most ",
                   max_group, " expected");
  if (D > max_head_dim || (even_head_dim && D % 2))
    return Invalid(kernel, "head dim ", D, ": at most ", max_head_dim,
                   even_head_dim ? ", even for bf16 pages" : "");
  return ffi::Error::Success();
}

}  // namespace jaxbatch_checks
