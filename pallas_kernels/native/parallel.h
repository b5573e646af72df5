// Work items spread over XLA's intra-op thread pool, shared by the native CPU kernels.
//
// parallel_for(pool, n, min_items_per_helper, fn) runs fn(item) once for every item in [0, n):
// the calling thread and up to pool.num_threads() - 1 helpers take items from one atomic counter.
// The shared state (counter, done count, a copy of fn) is heap-allocated and reference counted,
// so a helper that starts after the call returned touches only that state: it finds no item left
// and exits without calling fn. The caller waits only for items other threads have taken
// (running), never for a helper to start. Few items get fewer helpers (waking a thread costs more
// than a handful of items).

#ifndef PAXPAGE_NATIVE_PARALLEL_H_
#define PAXPAGE_NATIVE_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace paxpage_native {

struct ParallelState {
  std::function<void(int64_t)> fn;
  int64_t num_items = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

inline void drain(ParallelState& st) {
  for (;;) {
    const int64_t item = st.next.fetch_add(1, std::memory_order_relaxed);
    if (item >= st.num_items) return;
    st.fn(item);
    st.done.fetch_add(1, std::memory_order_release);
  }
}

template <typename Fn>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t num_items, int64_t min_items_per_helper, Fn fn) {
  auto st = std::make_shared<ParallelState>();
  st->fn = std::move(fn);
  st->num_items = num_items;
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, num_items / min_items_per_helper);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([st]() { drain(*st); });
  drain(*st);
  while (st->done.load(std::memory_order_acquire) < num_items) std::this_thread::yield();
}

}  // namespace paxpage_native

#endif  // PAXPAGE_NATIVE_PARALLEL_H_
