// The observation point of a kernel call (pool_dispatch.h's Run): what the call says about
// itself (a Label: its kernel and three sizes, each kernel's own), and Begin / End around it.
// A production build records nothing: Begin and End are empty and a library exports no
// setter. An instrumented build (-DJAXBATCH_CALL_LOG and the include path of the instrument
// that asked for it, availability.instrument: the lab's benchmarks/call_log.h) takes the
// instrument's Begin, End and JAXBATCH_DEFINE_CALL_LOG_SETTER instead.
#pragma once

#include <cstdint>

namespace jaxbatch_calls {

enum Kernel : int64_t { kGemm = 1, kDecode = 2, kPrefill = 3, kNorm = 4, kArgmax = 5 };

struct Label {
  int64_t kernel, a, b, c;
};

struct Record;

}  // namespace jaxbatch_calls

#ifdef JAXBATCH_CALL_LOG
#include "call_log.h"
#else

namespace jaxbatch_calls {

inline Record* Begin(const Label&, int64_t, int64_t) { return nullptr; }
inline void End(Record*) {}

}  // namespace jaxbatch_calls

#define JAXBATCH_DEFINE_CALL_LOG_SETTER

#endif
