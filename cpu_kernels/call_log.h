// Kernel calls timed where they run, for `python -m benchmarks calls` (the lab's
// benchmarks/call_log.py owns the memory). XLA's profiler times every op too, but its tracing
// slows the step it times, the small calls most; a record here costs two clock reads and an
// atomic add, and nothing but a load while the log is unset.
//
// One log per process, handed to every kernel library as it loads (benchmarks/call_log.py,
// `wire`), as kv_prefetch.h's queue is. `Begin` takes the next record when the call is entered
// (on whichever thread XLA called it); `End` stamps it when the call's last unit is done: at the
// calling thread's return, or, for a call that returned a future (pool_dispatch.h), in the
// task that completes it. A full log records nothing more until call_log.py empties it.
//
// Compiled in only for an instrumented build (-DJAXBATCH_CALL_LOG, which
// benchmarks.call_log.instrument() asks build.py for, a library of its own in the cache):
// otherwise Begin and End are empty inline functions and a library defines no setter, so
// production calls carry no log code.
#pragma once

#include <time.h>

#include <cstdint>

namespace jaxbatch_calls {

// Which kernel a record is of (call_log.py, KERNELS).
enum Kernel : int64_t { kGemm = 1, kDecode = 2, kPrefill = 3, kNorm = 4, kArgmax = 5 };

// What a call says about itself: its kernel and three sizes, each kernel's own (call_log.py
// names them).
struct Label {
  int64_t kernel, a, b, c;
};

struct Record {
  int64_t kernel, a, b, c;
  int64_t entry_ns, end_ns;   // CLOCK_MONOTONIC; end 0 until the call is done
  int64_t tasks, threads;     // the pool tasks it scheduled, and the pool's threads
};

constexpr int64_t kMaxRecords = int64_t{1} << 17;   // call_log.CAPACITY

#ifdef JAXBATCH_CALL_LOG

struct Log {
  int64_t size;   // records taken (may pass kMaxRecords: those past it were not written)
  Record records[kMaxRecords];
};

// This library's log pointer: internal linkage, each library its own (kv_prefetch.h, Shared).
static inline Log*& Shared() {
  static Log* log = nullptr;
  return log;
}

inline int64_t NowNs() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return int64_t{t.tv_sec} * 1000000000 + t.tv_nsec;
}

// The record of a call now entered, or nullptr (no log, or a full one).
inline Record* Begin(const Label& label, int64_t tasks, int64_t threads) {
  Log* log = __atomic_load_n(&Shared(), __ATOMIC_ACQUIRE);
  if (log == nullptr) return nullptr;
  const int64_t at = __atomic_fetch_add(&log->size, 1, __ATOMIC_RELAXED);
  if (at >= kMaxRecords) return nullptr;
  Record* record = &log->records[at];
  record->kernel = label.kernel;
  record->a = label.a;
  record->b = label.b;
  record->c = label.c;
  record->tasks = tasks;
  record->threads = threads;
  record->entry_ns = NowNs();
  __atomic_store_n(&record->end_ns, int64_t{0}, __ATOMIC_RELEASE);
  return record;
}

inline void End(Record* record) {
  if (record != nullptr) __atomic_store_n(&record->end_ns, NowNs(), __ATOMIC_RELEASE);
}

#else   // a production build: nothing recorded, nothing to hand a log to

inline Record* Begin(const Label&, int64_t, int64_t) { return nullptr; }
inline void End(Record*) {}

#endif

}  // namespace jaxbatch_calls

#ifdef JAXBATCH_CALL_LOG

// Each kernel library defines these with this macro (call_log.py looks them up by name).
#define JAXBATCH_DEFINE_CALL_LOG_SETTER                                                     \
  extern "C" __attribute__((visibility("default"))) void JaxbatchSetCallLog(void* log) {    \
    __atomic_store_n(&jaxbatch_calls::Shared(), static_cast<jaxbatch_calls::Log*>(log),     \
                     __ATOMIC_RELEASE);                                                     \
  }                                                                                         \
  extern "C" __attribute__((visibility("default"))) int64_t JaxbatchCallLogCapacity() {     \
    return jaxbatch_calls::kMaxRecords;                                                     \
  }
#else
#define JAXBATCH_DEFINE_CALL_LOG_SETTER
#endif
