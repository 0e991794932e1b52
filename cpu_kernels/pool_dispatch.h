// How a kernel here runs its units of work on XLA's intra-op thread pool (packed_gemm.cc,
// paged_decode.cc, paged_prefill.cc). build.py hashes this header with each source.
//
// XLA:CPU runs an executable's ops on the thread that started it (jax's calling thread) until
// an op completes on a pool thread, and from then on that thread carries on. A kernel called on
// a pool thread works there beside `helpers` scheduled tasks and returns when every unit is
// done: two busy threads on a two-core machine. Called on any other thread, working there too
// would put a third thread beside the pool's (which spin a while after a task before they
// sleep), and every kernel of the step would share the cores three ways. So there the kernel
// only schedules its tasks and returns a future that the last of them completes: XLA continues
// the step on that pool thread, and the kernels after it find themselves on the pool.
//
// Either way a call never runs on more threads than the pool has (`Helpers`): on a pool
// thread the caller is one of them, and elsewhere it schedules helpers + 1 tasks. A caller
// that has run out of units and waits for its helpers' last ones spins briefly (the common
// case: they end within microseconds), then yields, then sleeps on a futex that the thread
// finishing the last unit wakes (`JobCounters::UnitDone`, `AwaitUnits`): a helper descheduled
// on a shared machine costs the waiting core nothing.
#pragma once

#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <cstring>
#include <memory>

#include "call_observer.h"
#include "xla/ffi/api/ffi.h"

namespace jaxbatch_pool {

namespace ffi = xla::ffi;

// Whether this thread is one of XLA's intra-op pool threads ("XLAEigen", named tf_XLAEigen by
// TSL). A thread misjudged either way still gets every unit done, only on other threads.
inline bool OnPoolThread() {
  thread_local int cached = -1;
  if (cached < 0) {
    char name[16] = {0};
    pthread_getname_np(pthread_self(), name, sizeof name);
    cached = std::strncmp(name, "tf_XLAEigen", 11) == 0;
  }
  return cached != 0;
}

// A future that is already complete: the kernel finished, or failed, on the calling thread.
inline ffi::Future Ready(ffi::Error error = ffi::Error::Success()) {
  ffi::Promise promise;
  if (error.success())
    promise.SetAvailable();
  else
    promise.SetError(std::move(error));
  return ffi::Future(promise);
}

// What every kernel's job carries besides its problem and Work(): `units` of work, claimed
// through `next`; `done` counts those finished (each through UnitDone); `finished` is Run's
// promise.
struct JobCounters {
  int64_t units = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  ffi::CountDownPromise finished;
  std::atomic<int64_t> pending_tasks{0};   // Run's tasks on the pool not yet through Work()
  std::atomic<int32_t> sleeping{0};        // 1 while a caller sleeps in AwaitUnits (a futex)

  // Counts a unit finished; the one that finishes the last wakes a caller asleep on them.
  void UnitDone() {
    if (done.fetch_add(1, std::memory_order_seq_cst) + 1 == units &&
        sleeping.load(std::memory_order_seq_cst) != 0) {
      sleeping.store(0, std::memory_order_seq_cst);
      syscall(SYS_futex, reinterpret_cast<int32_t*>(&sleeping), FUTEX_WAKE_PRIVATE, INT32_MAX,
              nullptr, nullptr, 0);
    }
  }
};

// Pauses spun, then yields, before a waiting caller sleeps: a few tens of microseconds of
// pauses cover helpers that end about when the caller does.
constexpr int kSpinPauses = 2048;
constexpr int kSpinYields = 64;

// Returns once every unit of `job` is done (the caller has claimed its last one already, so
// only helpers' units remain): spinning, then yielding, then asleep on `job.sleeping`, which
// UnitDone wakes (a 1 ms timeout besides, so that a lost wake costs a millisecond, not a
// hang).
inline void AwaitUnits(JobCounters& job) {
  for (int i = 0; job.done.load(std::memory_order_acquire) < job.units; ++i) {
    if (i < kSpinPauses) {
      _mm_pause();
    } else if (i < kSpinPauses + kSpinYields) {
      sched_yield();
    } else {
      job.sleeping.store(1, std::memory_order_seq_cst);
      if (job.done.load(std::memory_order_seq_cst) >= job.units) break;
      const timespec timeout{0, 1000000};
      syscall(SYS_futex, reinterpret_cast<int32_t*>(&job.sleeping), FUTEX_WAIT_PRIVATE, 1,
              &timeout, nullptr, 0);
    }
  }
}

// Helpers a call of `units` units schedules: one per pool thread besides the caller's (on a
// pool thread the caller is one; elsewhere Run schedules helpers + 1 tasks), none for one unit.
inline int64_t Helpers(int64_t pool_threads, int64_t units) {
  return std::max<int64_t>(0, std::min<int64_t>(pool_threads - 1, units - 1));
}
inline int64_t Helpers(ffi::ThreadPool& pool, int64_t units) {
  return Helpers(pool.num_threads(), units);
}

// Runs job->Work() until every one of job->units is done (job->done counts them), on the
// calling thread and `helpers` pool tasks, or on helpers + 1 pool tasks (see above). Job: a
// JobCounters with Work(). `label`: what the call says about itself (call_observer.h).
template <typename Job>
ffi::Future Run(ffi::ThreadPool& pool, const std::shared_ptr<Job>& job, int64_t helpers,
                const jaxbatch_calls::Label& label) {
  helpers = std::min<int64_t>(helpers, Helpers(pool, job->units));   // never past the pool
  const bool on_pool = OnPoolThread();
  jaxbatch_calls::Record* record =
      jaxbatch_calls::Begin(label, helpers > 0 && !on_pool ? helpers + 1 : helpers,
                            pool.num_threads());
  if (helpers > 0 && !on_pool) {
    job->finished = ffi::CountDownPromise(helpers + 1);
    job->pending_tasks.store(helpers + 1, std::memory_order_release);
    ffi::Future finished(job->finished);
    for (int64_t i = 0; i <= helpers; ++i)
      pool.Schedule([job, record] {
        job->Work();
        // the last task stamps the record just before it completes the future: after that,
        // XLA may already run the next op
        if (job->pending_tasks.fetch_sub(1, std::memory_order_acq_rel) == 1)
          jaxbatch_calls::End(record);
        job->finished.CountDown(1);
      });
    return finished;
  }
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { job->Work(); });
  job->Work();
  AwaitUnits(*job);
  jaxbatch_calls::End(record);
  return Ready();
}

}  // namespace jaxbatch_pool
