// A hint channel from decode attention to the GEMMs that run after it (kv_hints.py owns its
// memory). Decode attention of layer l is bound by how fast this CPU serves its scattered
// pages; the GEMMs between it and layer l + 1's attention (o, gate/up, down, qkv) are bound by
// arithmetic and leave memory idle. So decode attention publishes the pages its rows will read
// at layer l + 1 (the same block ids, one layer's blocks further on in the folded pool), and
// the GEMMs request their lines into L2 a few at a time while they compute: layer l + 1's
// attention then finds them in cache. A request is only a hint (a prefetch never faults, and
// changes no result), so a stale or foreign entry costs a wasted read, nothing else.
//
// One queue per process, shared by the libraries that publish or request hints (paged_decode,
// packed_gemm) through JaxbatchSetPrefetchQueue: kv_hints.py hands it to each as it loads,
// after checking that it was built for the same queue size (JaxbatchPrefetchQueueRanges);
// until then, or with the queue unset, nothing is published or requested. Within a model
// call the GEMMs between two layers' attention depend on the first one's output and feed the
// second, so a queue is published by one decode call and drained by the GEMMs after it.
// Entries are written and read with atomic accesses all the same: engines in other threads,
// or tensor-parallel shards, share the queue, and at worst aim a request at the wrong line.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace jaxbatch_prefetch {

struct Range {        // one page of one kv head: its key lines and its value lines
  const char* k;
  const char* v;
  int64_t bytes;
};

constexpr int64_t kMaxRanges = int64_t{1} << 15;   // kv_hints.QUEUE_RANGES
// Key and value bytes one publication names at most: about what L2 and this machine's share
// of L3 keep until the next layer's attention (at 64 rows of 256 tokens a layer reads 12 MB,
// and requesting all of it ran slower than requesting none).
constexpr int64_t kMaxBytes = int64_t{4} << 20;

struct Queue {
  int64_t size;   // ranges published
  int64_t next;   // ranges claimed by GEMM threads
  Range ranges[kMaxRanges];
};

// This library's queue pointer: internal linkage (`static`), so that each library holds its
// own. As an ordinary inline function's static it would be a GNU_UNIQUE symbol, one object
// for every library in the process, and a queue handed to one would reach all of them.
static inline Queue*& Shared() {
  static Queue* queue = nullptr;
  return queue;
}

// Publishes `n` ranges from `fill(ranges, max)` (which returns how many it wrote), replacing
// what was there.
template <typename Fill>
void Publish(Fill fill) {
  Queue* q = __atomic_load_n(&Shared(), __ATOMIC_ACQUIRE);
  if (q == nullptr) return;
  __atomic_store_n(&q->size, 0, __ATOMIC_RELEASE);
  const int64_t n = fill(q->ranges, kMaxRanges);
  __atomic_store_n(&q->next, 0, __ATOMIC_RELAXED);
  __atomic_store_n(&q->size, n, __ATOMIC_RELEASE);
}

inline void Store(Range& r, const char* k, const char* v, int64_t bytes) {
  __atomic_store_n(&r.k, k, __ATOMIC_RELAXED);
  __atomic_store_n(&r.v, v, __ATOMIC_RELAXED);
  __atomic_store_n(&r.bytes, bytes, __ATOMIC_RELAXED);
}

// A GEMM thread's cursor over the queue. Fill hands out line addresses a tile at a time, so
// that the tile's inner loop only reads them from an array: a call inside that loop would
// spill its accumulators (every zmm register is caller-saved).
struct Feed {
  Queue* q = __atomic_load_n(&Shared(), __ATOMIC_ACQUIRE);
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t off = 0, bytes = 0;

  // Up to `max` line addresses into `lines`, a key line then a value line; returns how many.
  __attribute__((noinline)) int64_t Fill(const char** lines, int64_t max) {
    int64_t n = 0;
    while (n + 2 <= max) {
      if (off >= bytes) {
        if (q == nullptr) break;
        const int64_t i = __atomic_fetch_add(&q->next, 1, __ATOMIC_RELAXED);
        if (i >= __atomic_load_n(&q->size, __ATOMIC_ACQUIRE) || i >= kMaxRanges) {
          q = nullptr;
          break;
        }
        const Range& r = q->ranges[i];
        k = __atomic_load_n(&r.k, __ATOMIC_RELAXED);
        v = __atomic_load_n(&r.v, __ATOMIC_RELAXED);
        bytes = __atomic_load_n(&r.bytes, __ATOMIC_RELAXED);
        off = 0;
      }
      lines[n++] = k + off;
      lines[n++] = v + off;
      off += 64;
    }
    return n;
  }
};

}  // namespace jaxbatch_prefetch

// Each library that publishes or requests hints defines these with this macro (kv_hints.py
// looks them up by name).
#define JAXBATCH_DEFINE_PREFETCH_SETTER                                                \
  extern "C" __attribute__((visibility("default"))) void JaxbatchSetPrefetchQueue(      \
      void* queue) {                                                                   \
    __atomic_store_n(&jaxbatch_prefetch::Shared(),                                     \
                     static_cast<jaxbatch_prefetch::Queue*>(queue), __ATOMIC_RELEASE); \
  }                                                                                    \
  extern "C" __attribute__((visibility("default"))) int64_t                            \
  JaxbatchPrefetchQueueRanges() {                                                      \
    return jaxbatch_prefetch::kMaxRanges;                                              \
  }
