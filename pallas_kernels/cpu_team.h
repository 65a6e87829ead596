// A team of helper threads shared by the C++ CPU kernels (cpu_int8_matmul.cc, cpu_attention.cc).
//
// A decode step calls a kernel ~150 times, each for 10-100 us of work. Handing a share of each
// call to XLA's intra-op pool wakes a parked thread every time, which costs about as much as
// the share itself. The team's helpers instead keep polling for the next call for a short while
// after each one (JAXSERVE_CPU_SPIN_US, default 200 us; then they sleep on a condition
// variable), so back-to-back kernel calls in one step hand off in well under a microsecond.
//
// Team::run(n, fn, arg) runs fn(arg) on the calling thread and on up to n helpers, and returns
// once every helper that started fn has left it. fn must split its own work (a shared atomic
// chunk counter): a helper that starts late finds nothing left. A call made while another
// thread's call is in flight runs fn on its caller alone.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define JS_PAUSE() _mm_pause()
#else
#define JS_PAUSE() std::this_thread::yield()
#endif

namespace jaxserve {

class Team {
 public:
  explicit Team(int helpers) {
    const char* env = std::getenv("JAXSERVE_CPU_SPIN_US");
    spin_ = std::chrono::microseconds(env ? std::atoll(env) : 200);
    for (int i = 0; i < helpers; ++i) threads_.emplace_back([this] { loop(); });
  }
  int size() const { return static_cast<int>(threads_.size()); }

  void run(int n, void (*fn)(void*), void* arg) {
    if (n <= 0 || threads_.empty() || !busy_.try_lock()) {
      fn(arg);
      return;
    }
    fn_ = fn;
    arg_ = arg;
    want_.store(n);
    joined_.store(0);
    // Odd generation: open for helpers.
    const uint64_t g = gen_.load() + 1;
    gen_.store(g);
    if (sleeping_.load() > 0) {
      std::lock_guard<std::mutex> lk(mu_);
      cv_.notify_all();
    }
    fn(arg);
    gen_.store(g + 1);  // closed: a helper that registers from now on leaves at once
    while (inside_.load() > 0) JS_PAUSE();
    busy_.unlock();
  }

 private:
  void loop() {
    uint64_t seen = 0;
    for (;;) {
      uint64_t g = gen_.load();
      if (g == seen || (g & 1) == 0) {
        seen = g;
        wait_for_change(seen);
        continue;
      }
      seen = g;
      inside_.fetch_add(1);
      if (gen_.load() == g && joined_.fetch_add(1) < want_.load()) fn_(arg_);
      inside_.fetch_sub(1);
    }
  }

  // Poll for a new generation for spin_, then sleep until one comes.
  void wait_for_change(uint64_t seen) {
    const auto until = std::chrono::steady_clock::now() + spin_;
    for (int i = 0;; ++i) {
      if (gen_.load() != seen) return;
      JS_PAUSE();
      if ((i & 255) == 255 && std::chrono::steady_clock::now() > until) break;
    }
    std::unique_lock<std::mutex> lk(mu_);
    sleeping_.fetch_add(1);
    cv_.wait(lk, [&] { return gen_.load() != seen; });
    sleeping_.fetch_sub(1);
  }

  std::vector<std::thread> threads_;
  std::chrono::microseconds spin_;
  std::mutex busy_, mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> gen_{0};
  std::atomic<int> inside_{0}, joined_{0}, want_{0}, sleeping_{0};
  void (*fn_)(void*) = nullptr;
  void* arg_ = nullptr;
};

// The process's team, made on first use with `helpers` threads (XLA's intra-op pool size - 1).
// Never destroyed: its helpers wait on it until the process ends.
inline Team& team(int helpers) {
  static Team* t = new Team(helpers);
  return *t;
}

}  // namespace jaxserve
