// The CPU kernels' call log, compiled into an instrumented build only (this folder's
// call_log.py asks build.py for one: -DJAXBATCH_CALL_LOG and this folder on the include path;
// cpu_kernels/call_observer.h includes this file there, and is empty otherwise). XLA's profiler
// times every op too, but its tracing slows the step it times, the small calls most; a record
// here costs two clock reads and an atomic add, and nothing but a load while the log is unset.
//
// One log per process, handed to every kernel library as it loads (call_log.py, `wire`), as
// kv_prefetch.h's queue is. `Begin` takes the next record when the call is entered (on
// whichever thread XLA called it); `End` stamps it when the call's last unit is done: at the
// calling thread's return, or, for a call that returned a future (pool_dispatch.h), in the
// task that completes it. A full log records nothing more until call_log.py empties it.
#pragma once

#include <time.h>

#include <cstdint>

namespace jaxbatch_calls {

struct Record {
  int64_t kernel, a, b, c;
  int64_t entry_ns, end_ns;   // CLOCK_MONOTONIC; end 0 until the call is done
  int64_t tasks, threads;     // the pool tasks it scheduled, and the pool's threads
};

constexpr int64_t kMaxRecords = int64_t{1} << 17;   // call_log.CAPACITY

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

}  // namespace jaxbatch_calls

// Each kernel library defines these with this macro (call_log.py looks them up by name).
#define JAXBATCH_DEFINE_CALL_LOG_SETTER                                                     \
  extern "C" __attribute__((visibility("default"))) void JaxbatchSetCallLog(void* log) {    \
    __atomic_store_n(&jaxbatch_calls::Shared(), static_cast<jaxbatch_calls::Log*>(log),     \
                     __ATOMIC_RELEASE);                                                     \
  }                                                                                         \
  extern "C" __attribute__((visibility("default"))) int64_t JaxbatchCallLogCapacity() {     \
    return jaxbatch_calls::kMaxRecords;                                                     \
  }
