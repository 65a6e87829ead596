// Causal paged attention for XLA:CPU through jax.ffi, one call per layer.
//
// The rule is pallas_kernels/reference.py's ragged paged attention. Each token's block-table
// row seq[t] and absolute position pos[t] come from the step's query_start / seq_lens /
// num_seqs as reference.token_metadata gives them (computed here: a cumsum per layer costs XLA
// more than the attention of one decode token). Token t (query heads q[t, Hq, D]) attends to
// positions max(0, pos - window + 1) .. pos of its row's pages ([Hkv, P, B, D], float32 or
// bfloat16: a bfloat16 element is read as the float32 with the same top 16 bits),
// query head h reading KV head h / (Hq / Hkv); scores are scaled by sm_scale, soft-capped
// (cap * tanh(s / cap)) when cap > 0, then softmaxed. A token with pos < 0 (padding) gets
// zeros. With a limit buffer of T entries (reference.py's kv_limit; an empty one: causal), token t
// sees up to max(pos, limit[t]) (inside its context; the window's start stays pos - window + 1).
// XLA's loop version of this (xla_attention.py) costs a few dozen small ops per trip
// and gathers whole chunks of pages; here each (token, KV head) reads only its own positions.
// With AVX-512 the q.k dots and the softmax's exp run 16 lanes wide (exp by a degree-6
// polynomial after range reduction, within 3 ulp of std::exp on [-87, 0]); the sums' order
// differs from the reference's, within float rounding.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
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

// A page element as float32: bfloat16 (stored as its 16 bits) is float32's top half.
inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t x) {
  const uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// float32 -> a page element: bfloat16 by round to nearest even (NaN stays a quiet NaN), as
// XLA's convert does.
inline void from_f32(float x, float& out) { out = x; }
inline void from_f32(float x, uint16_t& out) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    out = static_cast<uint16_t>((u >> 16) | 0x40);
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  out = static_cast<uint16_t>(u >> 16);
}

template <typename KT>
struct Args {
  const float* q;
  const KT *k, *v;
  const int32_t *tables, *seq, *pos, *hi;  // hi: last visible position (pos when causal)
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

#if JS_AVX512
// 16 page elements as float32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
#endif

// sum_e a[e] * b[e]
template <typename KT>
inline float dot(const float* a, const KT* b, int64_t d) {
  int64_t e = 0;
  float s = 0.f;
#if JS_AVX512
  __m512 acc = _mm512_setzero_ps();
  for (; e + 16 <= d; e += 16)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + e), load16(b + e), acc);
  s = _mm512_reduce_add_ps(acc);
#endif
  for (; e < d; ++e) s += a[e] * to_f32(b[e]);
  return s;
}

// o[e] += w * v[e]
template <typename KT>
inline void axpy(float w, const KT* v, float* o, int64_t d) {
  int64_t e = 0;
#if JS_AVX512
  const __m512 wv = _mm512_set1_ps(w);
  for (; e + 16 <= d; e += 16)
    _mm512_storeu_ps(o + e, _mm512_fmadd_ps(wv, load16(v + e), _mm512_loadu_ps(o + e)));
#endif
  for (; e < d; ++e) o[e] += w * to_f32(v[e]);
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

template <typename KT>
void attend_one(const Args<KT>& a, int64_t t, int64_t h, std::vector<float>& scores) {
  const int64_t g = a.hq / a.hkv, d = a.d;
  float* out = a.out + (t * a.hq + h * g) * d;
  const int32_t p = a.pos[t];
  if (p < 0) {
    std::fill(out, out + g * d, 0.f);
    return;
  }
  const int64_t lo = a.window > 0 ? std::max<int64_t>(0, p - a.window + 1) : 0;
  const int64_t n = a.hi[t] - lo + 1;
  const int32_t* table = a.tables + static_cast<int64_t>(a.seq[t]) * a.max_pages;
  const float* qh = a.q + (t * a.hq + h * g) * d;
  scores.resize(n * g);
  const int64_t head_off = h * a.pages * a.block * d;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t pp = lo + i;
    const KT* kr = a.k + head_off + (table[pp / a.block] * a.block + pp % a.block) * d;
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
    const KT* vr = a.v + head_off + (table[pp / a.block] * a.block + pp % a.block) * d;
    for (int64_t j = 0; j < g; ++j) axpy(scores[j * n + i], vr, out + j * d, d);
  }
}

template <typename KT>
struct Shared {
  Args<KT> a;
  std::atomic<int64_t> next{0};
  int64_t total = 0, chunk = 1;  // (token, KV head) tasks, and tasks per chunk
};

template <typename KT>
void run(void* p) {
  Shared<KT>& s = *static_cast<Shared<KT>*>(p);
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

// Attention over the pages in a (a.seq / a.pos / a.hi filled in here from the step's rows and
// the limit buffer).
template <typename KT>
ffi::Error attend(Args<KT> a, ffi::Buffer<ffi::S32> qs, ffi::Buffer<ffi::S32> seq_lens,
                  ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::S32> limit, int64_t threads) {
  const int64_t n_rows = seq_lens.dimensions()[0];
  if (qs.dimensions()[0] != n_rows + 1)
    return ffi::Error::InvalidArgument("query_start must be [S + 1] for seq_lens [S]");
  const int64_t n_limit = limit.element_count();
  if (n_limit != 0 && n_limit != a.t)
    return ffi::Error::InvalidArgument("kv_limit must be [T] or empty");
  thread_local std::vector<int32_t> seq, pos, hi;
  token_rows(qs.typed_data(), seq_lens.typed_data(), n_rows, num_seqs.typed_data()[0], a.t, seq,
             pos);
  a.seq = seq.data();
  a.pos = pos.data();
  if (n_limit) {
    const int32_t* lim = limit.typed_data();
    const int32_t* lens = seq_lens.typed_data();
    hi.resize(a.t);
    for (int64_t t = 0; t < a.t; ++t)
      hi[t] = pos[t] < 0 ? pos[t] : std::max(pos[t], std::min(lim[t], lens[seq[t]] - 1));
    a.hi = hi.data();
  } else {
    a.hi = a.pos;
  }
  Shared<KT> s;
  s.a = a;
  s.total = a.t * a.hkv;
  int64_t work = 0;  // positions x query heads to read
  for (int64_t t = 0; t < a.t; ++t) work += std::max<int32_t>(a.hi[t] + 1, 0);
  work *= a.hq;
  jaxserve::Team& team = jaxserve::team(static_cast<int>(threads) - 1);
  // Small chunks when there are few (token, KV head) tasks: one decode token has Hkv of them.
  s.chunk = std::clamp<int64_t>(s.total / (4 * (team.size() + 1)), 1, 8);
  const int64_t chunks = (s.total + s.chunk - 1) / s.chunk;
  const int64_t helpers = work < (1 << 11) ? 0 : std::min<int64_t>(team.size(), chunks - 1);
  team.run(static_cast<int>(helpers), run<KT>, &s);
  return ffi::Error::Success();
}

// The page element type of a float32 or bfloat16 pool (false: another type).
bool page_type(ffi::DataType t) { return t == ffi::DataType::F32 || t == ffi::DataType::BF16; }

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                          ffi::AnyBuffer v, ffi::Buffer<ffi::S32> tables,
                          ffi::Buffer<ffi::S32> qs, ffi::Buffer<ffi::S32> seq_lens,
                          ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::S32> limit,
                          ffi::ResultBuffer<ffi::F32> out, float sm_scale, float soft_cap,
                          int64_t window) {
  const auto qd = q.dimensions(), kd = k.dimensions(), td = tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2)
    return ffi::Error::InvalidArgument("q [T, Hq, D], pages [Hkv, P, B, D], tables [S, M]");
  if (!page_type(k.element_type()) || k.element_type() != v.element_type())
    return ffi::Error::InvalidArgument("pages must be float32 or bfloat16, K and V alike");
  if (k.element_type() == ffi::DataType::BF16)
    return attend(Args<uint16_t>{q.typed_data(), static_cast<const uint16_t*>(k.untyped_data()),
                                 static_cast<const uint16_t*>(v.untyped_data()),
                                 tables.typed_data(), nullptr, nullptr, nullptr,
                                 out->typed_data(), qd[0], qd[1], kd[0], qd[2], kd[1], kd[2],
                                 td[1], sm_scale, soft_cap, window},
                  qs, seq_lens, num_seqs, limit, pool.num_threads());
  return attend(Args<float>{q.typed_data(), static_cast<const float*>(k.untyped_data()),
                            static_cast<const float*>(v.untyped_data()), tables.typed_data(),
                            nullptr, nullptr, nullptr, out->typed_data(), qd[0], qd[1], kd[0],
                            qd[2], kd[1], kd[2], td[1], sm_scale, soft_cap, window},
                qs, seq_lens, num_seqs, limit, pool.num_threads());
}

// new K/V [T, Hkv, D] float32 into their slots of pages of KT (reference.write_kv's rule: a
// negative slot counts from the end; one still out of range is dropped).
template <typename KT>
void write_slots(const float* kn, const float* vn, KT* kp, KT* vp, const int32_t* slots,
                 int64_t t_new, int64_t hkv, int64_t d, int64_t n_slots) {
  for (int64_t t = 0; t < t_new; ++t) {
    int64_t slot = slots[t];
    if (slot < 0) slot += n_slots;
    if (slot < 0 || slot >= n_slots) continue;
    for (int64_t h = 0; h < hkv; ++h) {
      const float* ks = kn + (t * hkv + h) * d;
      const float* vs = vn + (t * hkv + h) * d;
      KT* kd = kp + (h * n_slots + slot) * d;
      KT* vd = vp + (h * n_slots + slot) * d;
      for (int64_t e = 0; e < d; ++e) {
        from_f32(ks[e], kd[e]);
        from_f32(vs[e], vd[e]);
      }
    }
  }
}

// The step's new K/V ([T, Hkv, D]) written into their slots of the pages (the outputs, which
// alias the input pages), then the attention over them: write_slots, then PagedAttention's.
ffi::Error PagedWriteAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                               ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new,
                               ffi::AnyBuffer, ffi::AnyBuffer, ffi::Buffer<ffi::S32> slots,
                               ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> qs,
                               ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> num_seqs,
                               ffi::Buffer<ffi::S32> limit, ffi::ResultBuffer<ffi::F32> out,
                               ffi::Result<ffi::AnyBuffer> k_out,
                               ffi::Result<ffi::AnyBuffer> v_out, float sm_scale,
                               float soft_cap, int64_t window) {
  const auto qd = q.dimensions(), nd = k_new.dimensions(), td = tables.dimensions();
  const auto kd = k_out->dimensions();
  if (qd.size() != 3 || nd.size() != 3 || kd.size() != 4 || td.size() != 2 ||
      nd[1] != kd[0] || nd[2] != kd[3])
    return ffi::Error::InvalidArgument(
        "q [T, Hq, D], k/v [T, Hkv, D], pages [Hkv, P, B, D], tables [S, M]");
  if (!page_type(k_out->element_type()) || k_out->element_type() != v_out->element_type())
    return ffi::Error::InvalidArgument("pages must be float32 or bfloat16, K and V alike");
  const int64_t hkv = kd[0], d = kd[3], n_slots = kd[1] * kd[2];
  if (k_out->element_type() == ffi::DataType::BF16) {
    auto* kp = static_cast<uint16_t*>(k_out->untyped_data());
    auto* vp = static_cast<uint16_t*>(v_out->untyped_data());
    write_slots(k_new.typed_data(), v_new.typed_data(), kp, vp, slots.typed_data(), nd[0], hkv,
                d, n_slots);
    return attend(Args<uint16_t>{q.typed_data(), kp, vp, tables.typed_data(), nullptr, nullptr,
                                 nullptr, out->typed_data(), qd[0], qd[1], hkv, d, kd[1], kd[2], td[1],
                                 sm_scale, soft_cap, window},
                  qs, seq_lens, num_seqs, limit, pool.num_threads());
  }
  auto* kp = static_cast<float*>(k_out->untyped_data());
  auto* vp = static_cast<float*>(v_out->untyped_data());
  write_slots(k_new.typed_data(), v_new.typed_data(), kp, vp, slots.typed_data(), nd[0], hkv, d,
              n_slots);
  return attend(Args<float>{q.typed_data(), kp, vp, tables.typed_data(), nullptr, nullptr,
                            nullptr, out->typed_data(), qd[0], qd[1], hkv, d, kd[1], kd[2], td[1],
                            sm_scale, soft_cap, window},
                qs, seq_lens, num_seqs, limit, pool.num_threads());
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxserve_paged_attention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k_pages
                                  .Arg<ffi::AnyBuffer>()  // v_pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_limit ([T] or [0])
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
                                  .Arg<ffi::AnyBuffer>()  // k_pages (aliased to k_out)
                                  .Arg<ffi::AnyBuffer>()  // v_pages (aliased to v_out)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots
                                  .Arg<ffi::Buffer<ffi::S32>>()  // tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_limit ([T] or [0])
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("window"));
