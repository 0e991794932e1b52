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
#pragma once

#include <immintrin.h>
#include <pthread.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>

#include "call_log.h"
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
// through `next`; `done` counts those finished; `finished` is Run's promise.
struct JobCounters {
  int64_t units = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  ffi::CountDownPromise finished;
  std::atomic<int64_t> pending_tasks{0};   // Run's tasks on the pool not yet through Work()
};

// Runs job->Work() until every one of job->units is done (job->done counts them), on the
// calling thread and `helpers` pool tasks, or on helpers + 1 pool tasks (see above). Job: a
// JobCounters with Work(). `label`: what the call log records of it (call_log.h).
template <typename Job>
ffi::Future Run(ffi::ThreadPool& pool, const std::shared_ptr<Job>& job, int64_t helpers,
                const jaxbatch_calls::Label& label) {
  jaxbatch_calls::Record* record = jaxbatch_calls::Begin(label);
  if (helpers > 0 && !OnPoolThread()) {
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
  while (job->done.load(std::memory_order_acquire) < job->units) _mm_pause();
  jaxbatch_calls::End(record);
  return Ready();
}

}  // namespace jaxbatch_pool
