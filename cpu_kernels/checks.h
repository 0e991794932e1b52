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

}  // namespace jaxbatch_checks
