// Causal paged attention for XLA:CPU through jax.ffi, one call per layer.
//
// The rule is pallas_kernels/reference.py's ragged paged attention, given per token: token t
// (query heads q[t, Hq, D]) of block-table row seq[t] at absolute position pos[t] attends to
// positions max(0, pos - window + 1) .. pos of its row's pages ([Hkv, P, B, D], float32),
// query head h reading KV head h / (Hq / Hkv); scores are scaled by sm_scale, soft-capped
// (cap * tanh(s / cap)) when cap > 0, then softmaxed. A token with pos < 0 (padding) gets
// zeros. XLA's loop version of this (xla_attention.py) costs a few dozen small ops per trip
// and gathers whole chunks of pages; here each (token, KV head) reads only its own positions.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Args {
  const float *q, *k, *v;
  const int32_t *tables, *seq, *pos;
  float* out;
  int64_t t, hq, hkv, d, pages, block, max_pages;
  float sm_scale, cap;
  int64_t window;
};

void attend_one(const Args& a, int64_t t, int64_t h, std::vector<float>& scores) {
  const int64_t g = a.hq / a.hkv, d = a.d;
  float* out = a.out + (t * a.hq + h * g) * d;
  const int32_t p = a.pos[t];
  if (p < 0) {
    std::fill(out, out + g * d, 0.f);
    return;
  }
  const int64_t lo = a.window > 0 ? std::max<int64_t>(0, p - a.window + 1) : 0;
  const int64_t n = p - lo + 1;
  const int32_t* table = a.tables + static_cast<int64_t>(a.seq[t]) * a.max_pages;
  const float* qh = a.q + (t * a.hq + h * g) * d;
  scores.resize(n * g);
  const int64_t head_off = h * a.pages * a.block * d;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t pp = lo + i;
    const float* kr = a.k + head_off + (table[pp / a.block] * a.block + pp % a.block) * d;
    for (int64_t j = 0; j < g; ++j) {
      const float* qj = qh + j * d;
      float s = 0.f;
      for (int64_t e = 0; e < d; ++e) s += qj[e] * kr[e];
      s *= a.sm_scale;
      if (a.cap > 0.f) s = a.cap * std::tanh(s / a.cap);
      scores[j * n + i] = s;
    }
  }
  for (int64_t j = 0; j < g; ++j) {
    float* sj = scores.data() + j * n;
    float mx = sj[0];
    for (int64_t i = 1; i < n; ++i) mx = std::max(mx, sj[i]);
    float l = 0.f;
    for (int64_t i = 0; i < n; ++i) {
      sj[i] = std::exp(sj[i] - mx);
      l += sj[i];
    }
    const float inv = 1.f / l;
    for (int64_t i = 0; i < n; ++i) sj[i] *= inv;
    std::fill(out + j * d, out + (j + 1) * d, 0.f);
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t pp = lo + i;
    const float* vr = a.v + head_off + (table[pp / a.block] * a.block + pp % a.block) * d;
    for (int64_t j = 0; j < g; ++j) {
      const float w = scores[j * n + i];
      float* oj = out + j * d;
      for (int64_t e = 0; e < d; ++e) oj[e] += w * vr[e];
    }
  }
}

struct Shared {
  Args a;
  std::atomic<int64_t> next{0}, done{0};
  int64_t total = 0;
};

constexpr int64_t kTasksPerChunk = 8;

void run(Shared& s) {
  std::vector<float> scores;
  const int64_t chunks = (s.total + kTasksPerChunk - 1) / kTasksPerChunk;
  for (;;) {
    const int64_t c = s.next.fetch_add(1);
    if (c >= chunks) return;
    for (int64_t i = c * kTasksPerChunk; i < std::min(s.total, (c + 1) * kTasksPerChunk); ++i)
      attend_one(s.a, i / s.a.hkv, i % s.a.hkv, scores);
    s.done.fetch_add(1, std::memory_order_release);
  }
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                          ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                          ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> seq,
                          ffi::Buffer<ffi::S32> pos, ffi::ResultBuffer<ffi::F32> out,
                          float sm_scale, float soft_cap, int64_t window) {
  const auto qd = q.dimensions(), kd = k.dimensions(), td = tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2)
    return ffi::Error::InvalidArgument("q [T, Hq, D], pages [Hkv, P, B, D], tables [S, M]");
  auto s = std::make_shared<Shared>();
  s->a = Args{q.typed_data(), k.typed_data(), v.typed_data(), tables.typed_data(),
              seq.typed_data(), pos.typed_data(), out->typed_data(), qd[0], qd[1], kd[0],
              qd[2], kd[1], kd[2], td[1], sm_scale, soft_cap, window};
  s->total = qd[0] * kd[0];
  int64_t work = 0;  // positions x query heads to read
  for (int64_t t = 0; t < qd[0]; ++t) work += std::max<int32_t>(pos.typed_data()[t] + 1, 0);
  work *= qd[1];
  const int64_t chunks = (s->total + kTasksPerChunk - 1) / kTasksPerChunk;
  const int64_t helpers =
      work < (1 << 14) ? 0 : std::min<int64_t>(pool.num_threads() - 1, chunks - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([s] { run(*s); });
  run(*s);
  while (s->done.load(std::memory_order_acquire) < chunks) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxserve_paged_attention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("window"));
