// Causal paged attention for XLA:CPU through jax.ffi, one call per layer.
//
// The rule is pallas_kernels/reference.py's ragged paged attention. Each token's block-table
// row seq[t] and absolute position pos[t] come from the step's query_start / seq_lens /
// num_seqs as reference.token_metadata gives them (computed here: a cumsum per layer costs XLA
// more than the attention of one decode token). Token t (query heads q[t, Hq, D]) attends to
// positions max(0, pos - window + 1) .. pos of its row's pages ([Hkv, P, B, D], float32),
// query head h reading KV head h / (Hq / Hkv); scores are scaled by sm_scale, soft-capped
// (cap * tanh(s / cap)) when cap > 0, then softmaxed. A token with pos < 0 (padding) gets
// zeros. XLA's loop version of this (xla_attention.py) costs a few dozen small ops per trip
// and gathers whole chunks of pages; here each (token, KV head) reads only its own positions.
// With AVX-512 the q.k dots and the softmax's exp run 16 lanes wide (exp by a degree-6
// polynomial after range reduction, within 3 ulp of std::exp on [-87, 0]); the sums' order
// differs from the reference's, within float rounding.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_team.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__)
#define JS_AVX512 1
#include <immintrin.h>
#else
#define JS_AVX512 0
#endif

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

#if JS_AVX512
// e^x for x <= 0 (scores minus their max): x = n ln2 + r, |r| <= ln2 / 2, e^r by its Taylor
// polynomial to degree 6, scaled by 2^n.
inline __m512 exp_neg(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
#endif

// sum_e a[e] * b[e]
inline float dot(const float* a, const float* b, int64_t d) {
  int64_t e = 0;
  float s = 0.f;
#if JS_AVX512
  __m512 acc = _mm512_setzero_ps();
  for (; e + 16 <= d; e += 16)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + e), _mm512_loadu_ps(b + e), acc);
  s = _mm512_reduce_add_ps(acc);
#endif
  for (; e < d; ++e) s += a[e] * b[e];
  return s;
}

// x[i] = e^(x[i] - mx) for i < n; returns their sum.
inline float exp_shifted(float* x, int64_t n, float mx) {
  int64_t i = 0;
  float l = 0.f;
#if JS_AVX512
  __m512 acc = _mm512_setzero_ps();
  const __m512 m = _mm512_set1_ps(mx);
  for (; i + 16 <= n; i += 16) {
    const __m512 v = exp_neg(_mm512_sub_ps(_mm512_loadu_ps(x + i), m));
    _mm512_storeu_ps(x + i, v);
    acc = _mm512_add_ps(acc, v);
  }
  l = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - mx);
    l += x[i];
  }
  return l;
}

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
      float s = dot(qh + j * d, kr, d) * a.sm_scale;
      if (a.cap > 0.f) s = a.cap * std::tanh(s / a.cap);
      scores[j * n + i] = s;
    }
  }
  for (int64_t j = 0; j < g; ++j) {
    float* sj = scores.data() + j * n;
    float mx = sj[0];
    for (int64_t i = 1; i < n; ++i) mx = std::max(mx, sj[i]);
    const float l = exp_shifted(sj, n, mx);
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
  std::atomic<int64_t> next{0};
  int64_t total = 0, chunk = 1;  // (token, KV head) tasks, and tasks per chunk
};

void run(void* p) {
  Shared& s = *static_cast<Shared*>(p);
  thread_local std::vector<float> scores;
  const int64_t chunks = (s.total + s.chunk - 1) / s.chunk;
  for (;;) {
    const int64_t c = s.next.fetch_add(1);
    if (c >= chunks) return;
    for (int64_t i = c * s.chunk; i < std::min(s.total, (c + 1) * s.chunk); ++i)
      attend_one(s.a, i / s.a.hkv, i % s.a.hkv, scores);
  }
}

// reference.token_metadata: each token's row (clamped to the last) and position, -1 where the
// token is padding (past the rows, past num_seqs, or in a row with no context).
void token_rows(const int32_t* qs, const int32_t* seq_lens, int64_t n_rows, int64_t num_seqs,
                int64_t n_tokens, std::vector<int32_t>& seq, std::vector<int32_t>& pos) {
  seq.resize(n_tokens);
  pos.resize(n_tokens);
  int64_t r = 0;
  for (int64_t t = 0; t < n_tokens; ++t) {
    while (r < n_rows && qs[r + 1] <= t) ++r;
    const int64_t c = std::min<int64_t>(r, n_rows - 1);
    const bool valid = r < n_rows && r < num_seqs && seq_lens[c] > 0;
    seq[t] = static_cast<int32_t>(c);
    pos[t] = valid ? seq_lens[c] - (qs[c + 1] - qs[c]) + static_cast<int32_t>(t - qs[c]) : -1;
  }
}

// Attention over the pages in a (a.seq / a.pos filled in here from the step's rows).
ffi::Error attend(Args a, ffi::Buffer<ffi::S32> qs, ffi::Buffer<ffi::S32> seq_lens,
                  ffi::Buffer<ffi::S32> num_seqs, int64_t threads) {
  const int64_t n_rows = seq_lens.dimensions()[0];
  if (qs.dimensions()[0] != n_rows + 1)
    return ffi::Error::InvalidArgument("query_start must be [S + 1] for seq_lens [S]");
  thread_local std::vector<int32_t> seq, pos;
  token_rows(qs.typed_data(), seq_lens.typed_data(), n_rows, num_seqs.typed_data()[0], a.t, seq,
             pos);
  a.seq = seq.data();
  a.pos = pos.data();
  Shared s;
  s.a = a;
  s.total = a.t * a.hkv;
  int64_t work = 0;  // positions x query heads to read
  for (int64_t t = 0; t < a.t; ++t) work += std::max<int32_t>(a.pos[t] + 1, 0);
  work *= a.hq;
  jaxserve::Team& team = jaxserve::team(static_cast<int>(threads) - 1);
  // Small chunks when there are few (token, KV head) tasks: one decode token has Hkv of them.
  s.chunk = std::clamp<int64_t>(s.total / (4 * (team.size() + 1)), 1, 8);
  const int64_t chunks = (s.total + s.chunk - 1) / s.chunk;
  const int64_t helpers = work < (1 << 11) ? 0 : std::min<int64_t>(team.size(), chunks - 1);
  team.run(static_cast<int>(helpers), run, &s);
  return ffi::Error::Success();
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                          ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                          ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> qs,
                          ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> num_seqs,
                          ffi::ResultBuffer<ffi::F32> out, float sm_scale, float soft_cap,
                          int64_t window) {
  const auto qd = q.dimensions(), kd = k.dimensions(), td = tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2)
    return ffi::Error::InvalidArgument("q [T, Hq, D], pages [Hkv, P, B, D], tables [S, M]");
  return attend(Args{q.typed_data(), k.typed_data(), v.typed_data(), tables.typed_data(),
                     nullptr, nullptr, out->typed_data(), qd[0], qd[1], kd[0], qd[2], kd[1],
                     kd[2], td[1], sm_scale, soft_cap, window},
                qs, seq_lens, num_seqs, pool.num_threads());
}

// The step's new K/V ([T, Hkv, D]) written into their slots of the pages (the outputs, which
// alias the input pages), then the attention over them: reference.write_kv's rule (a negative
// slot counts from the end; one still out of range is dropped), then PagedAttention's.
ffi::Error PagedWriteAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                               ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new,
                               ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::F32>,
                               ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S32> tables,
                               ffi::Buffer<ffi::S32> qs, ffi::Buffer<ffi::S32> seq_lens,
                               ffi::Buffer<ffi::S32> num_seqs, ffi::ResultBuffer<ffi::F32> out,
                               ffi::ResultBuffer<ffi::F32> k_out,
                               ffi::ResultBuffer<ffi::F32> v_out, float sm_scale,
                               float soft_cap, int64_t window) {
  const auto qd = q.dimensions(), nd = k_new.dimensions(), td = tables.dimensions();
  const auto kd = k_out->dimensions();
  if (qd.size() != 3 || nd.size() != 3 || kd.size() != 4 || td.size() != 2 ||
      nd[1] != kd[0] || nd[2] != kd[3])
    return ffi::Error::InvalidArgument(
        "q [T, Hq, D], k/v [T, Hkv, D], pages [Hkv, P, B, D], tables [S, M]");
  const int64_t hkv = kd[0], d = kd[3], n_slots = kd[1] * kd[2];
  float* kp = k_out->typed_data();
  float* vp = v_out->typed_data();
  const float* kn = k_new.typed_data();
  const float* vn = v_new.typed_data();
  for (int64_t t = 0; t < nd[0]; ++t) {
    int64_t slot = slots.typed_data()[t];
    if (slot < 0) slot += n_slots;
    if (slot < 0 || slot >= n_slots) continue;
    for (int64_t h = 0; h < hkv; ++h) {
      std::copy(kn + (t * hkv + h) * d, kn + (t * hkv + h + 1) * d, kp + (h * n_slots + slot) * d);
      std::copy(vn + (t * hkv + h) * d, vn + (t * hkv + h + 1) * d, vp + (h * n_slots + slot) * d);
    }
  }
  return attend(Args{q.typed_data(), kp, vp, tables.typed_data(), nullptr, nullptr,
                     out->typed_data(), qd[0], qd[1], hkv, d, kd[1], kd[2], td[1], sm_scale,
                     soft_cap, window},
                qs, seq_lens, num_seqs, pool.num_threads());
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxserve_paged_attention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("window"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxserve_paged_write_attention, PagedWriteAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_new
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_new
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_pages (aliased to k_out)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_pages (aliased to v_out)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots
                                  .Arg<ffi::Buffer<ffi::S32>>()  // tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("window"));
