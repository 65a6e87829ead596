// W8A8 matmul for XLA:CPU through jax.ffi: y[M, N] = x[M, K] @ (w[N, K] * scale[N]).T
//
// The rule is pallas_kernels/cpu_kernels.py's reference (int8_matmul_reference): each row of x is
// quantized in two int8 terms, x / a = hi + lo / 254 with a = max(max|x| / 127, 1e-12),
// hi = clip(round(x / a)), lo = clip(round((x / a - hi) * 254)) (round half to even); both
// terms are dotted with the int8 weight in int32, and y = (acc_hi + acc_lo * (1 / 254)) * a *
// scale[n]. The integer sums are exact, so the result differs from XLA's only by float
// rounding order.
//
// AVX-512 VNNI (vpdpbusd: u8 x s8 -> s32) takes the weight as unsigned (w + 128, a sign-bit
// flip as it is loaded) and each output subtracts 128 * sum_k x[k], once per activation row.
// Without VNNI the same loops are plain C++ for the compiler to vectorize. Work is split over
// output rows with the kernels' helper team (cpu_team.h) when a call is large enough to pay for
// the hand-off.
//
// One call takes every weight that shares the input (q/k/v, gate/up): the activation is
// quantized once and each weight is read once.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define JS_VNNI 1
#include <immintrin.h>
#else
#define JS_VNNI 0
#endif

#include "cpu_team.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Quantized activations: per row, hi and lo as int8 padded to kp bytes with zeros, their sums
// (the unsigned-weight correction) and the row's scale.
struct QuantX {
  int64_t m = 0, k = 0, kp = 0;
  std::vector<int8_t> hi, lo;
  std::vector<int32_t> hi_sum, lo_sum;
  std::vector<float> a;
};

void quantize_rows(const float* x, int64_t m, int64_t k, QuantX& q) {
  q.m = m;
  q.k = k;
  q.kp = (k + 63) / 64 * 64;
  q.hi.assign(m * q.kp, 0);
  q.lo.assign(m * q.kp, 0);
  q.hi_sum.assign(m, 0);
  q.lo_sum.assign(m, 0);
  q.a.resize(m);
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = x + r * k;
    float mx = 0.f;
    for (int64_t j = 0; j < k; ++j) mx = std::max(mx, std::fabs(xr[j]));
    const float a = std::max(mx / 127.0f, 1e-12f);
    q.a[r] = a;
    int8_t* hr = q.hi.data() + r * q.kp;
    int8_t* lr = q.lo.data() + r * q.kp;
    int32_t sh = 0, sl = 0;
    for (int64_t j = 0; j < k; ++j) {
      const float v = xr[j] / a;
      const float h = std::min(std::max(std::nearbyint(v), -127.0f), 127.0f);
      const float l = std::min(std::max(std::nearbyint((v - h) * 254.0f), -127.0f), 127.0f);
      hr[j] = static_cast<int8_t>(h);
      lr[j] = static_cast<int8_t>(l);
      sh += static_cast<int32_t>(h);
      sl += static_cast<int32_t>(l);
    }
    q.hi_sum[r] = sh;
    q.lo_sum[r] = sl;
  }
}

// acc_* = sum_k (w + 128) * x: the true sums are acc - 128 * sum(x).
inline float combine(const QuantX& q, int64_t r, int32_t acc_hi, int32_t acc_lo, float s) {
  const float fh = static_cast<float>(acc_hi - 128 * q.hi_sum[r]);
  const float fl = static_cast<float>(acc_lo - 128 * q.lo_sum[r]);
  return (fh + fl * (1.0f / 254.0f)) * q.a[r] * s;
}

#if JS_VNNI
// From this many activation rows on, weights are packed per block (see packed_rows); fewer
// rows (decode, a speculative verify step of up to 8 tokens) take single_rows or few_rows,
// which read each weight row once from memory for all of them. Measured on SmolLM2's projections (2-core
// AVX-512 VNNI): 4 rows cost 1.4x one row there against 2.2x packed, 8 rows 2.8x against
// 4.3x; from ~12 rows on the packed blocks are ahead (16 rows: 5.7x against 6.6x). Past ~2
// rows the dots, not the weight's bytes, are the cost: two vpdpbusd per 64 weight bytes for
// each activation row (the two-term rule), the same count in every layout.
constexpr int64_t kPackedMinRows = 9;

// The weight as unsigned bytes (w + 128, by flipping the sign bit; zeros past k), for
// vpdpbusd's unsigned operand.
inline __m512i load_w(const int8_t* p, int64_t left) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  if (left >= 64) return _mm512_xor_si512(flip, _mm512_loadu_si512(p));
  const __mmask64 mask = (~0ULL) >> (64 - left);
  return _mm512_maskz_mov_epi8(mask, _mm512_xor_si512(flip, _mm512_maskz_loadu_epi8(mask, p)));
}

// 16 weight rows, packed as [kp / 4][16][4] unsigned bytes (w + 128; zeros past k): one
// vector holds 4 inputs of each of the 16 rows, so an accumulator holds 16 outputs of one
// activation row and needs no horizontal sum.
// Whole 64-byte column blocks are a 16 x 16 transpose of 4-byte groups in registers (rows in,
// 4-byte columns out); the tail past the last whole block goes byte by byte.
void pack16(const int8_t* w, int64_t k, int64_t kp, uint8_t* out) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  int64_t j = 0;
  for (; j + 64 <= k; j += 64) {
    __m512i r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_xor_si512(flip, _mm512_loadu_si512(w + i * k + j));
    for (int i = 0; i < 16; i += 2) {
      t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
      t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
      r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
      r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
      r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
      r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int g = 0; g < 4; g += 2)
      for (int c = 0; c < 4; ++c) {
        t[4 * g + c] = _mm512_shuffle_i32x4(r[4 * g + c], r[4 * (g + 1) + c], 0x88);
        t[4 * (g + 1) + c] = _mm512_shuffle_i32x4(r[4 * g + c], r[4 * (g + 1) + c], 0xdd);
      }
    for (int c = 0; c < 4; ++c)
      for (int h = 0; h < 2; ++h) {
        r[c + 4 * h] = _mm512_shuffle_i32x4(t[4 * h + c], t[8 + 4 * h + c], 0x88);
        r[c + 4 * h + 8] = _mm512_shuffle_i32x4(t[4 * h + c], t[8 + 4 * h + c], 0xdd);
      }
    for (int c = 0; c < 16; ++c) _mm512_storeu_si512(out + (j / 4 + c) * 64, r[c]);
  }
  for (int64_t kk = j / 4; kk < kp / 4; ++kk)
    for (int64_t i = 0; i < 16; ++i)
      for (int64_t b = 0; b < 4; ++b) {
        const int64_t jj = 4 * kk + b;
        out[(kk * 16 + i) * 4 + b] =
            jj < k ? static_cast<uint8_t>(static_cast<int32_t>(w[i * k + jj]) + 128) : 128;
      }
}

// Activation rows r0 .. r0 + NT (tokens) against one packed block of 16 weight rows.
template <int NT>
void block16(const QuantX& q, const uint8_t* wp, const float* scale, float* y, int64_t n_out,
             int64_t n, int64_t r0) {
  const int64_t kp = q.kp;
  __m512i acc[2 * NT];
  for (auto& v : acc) v = _mm512_setzero_si512();
  const int8_t* H = q.hi.data() + r0 * kp;
  const int8_t* L = q.lo.data() + r0 * kp;
  for (int64_t kk = 0; kk < kp / 4; ++kk) {
    const __m512i wv = _mm512_loadu_si512(wp + kk * 64);
    for (int t = 0; t < NT; ++t) {
      int32_t hb, lb;
      std::memcpy(&hb, H + t * kp + 4 * kk, 4);
      std::memcpy(&lb, L + t * kp + 4 * kk, 4);
      acc[2 * t] = _mm512_dpbusd_epi32(acc[2 * t], wv, _mm512_set1_epi32(hb));
      acc[2 * t + 1] = _mm512_dpbusd_epi32(acc[2 * t + 1], wv, _mm512_set1_epi32(lb));
    }
  }
  const __m512 s = _mm512_loadu_ps(scale + n);
  const __m512 c = _mm512_set1_ps(1.0f / 254.0f);
  for (int t = 0; t < NT; ++t) {
    const int64_t r = r0 + t;
    const __m512 fh = _mm512_cvtepi32_ps(
        _mm512_sub_epi32(acc[2 * t], _mm512_set1_epi32(128 * q.hi_sum[r])));
    const __m512 fl = _mm512_cvtepi32_ps(
        _mm512_sub_epi32(acc[2 * t + 1], _mm512_set1_epi32(128 * q.lo_sum[r])));
    const __m512 v = _mm512_mul_ps(
        _mm512_mul_ps(_mm512_add_ps(fh, _mm512_mul_ps(fl, c)), _mm512_set1_ps(q.a[r])), s);
    _mm512_storeu_ps(y + r * n_out + n, v);
  }
}

// Many activation rows (prefill, batched decode): weight rows in packed blocks of 16 against
// tokens 6 at a time (12 accumulators). Returns the first row it did not do.
int64_t packed_rows(const QuantX& q, const int8_t* w, const float* scale, float* y,
                    int64_t n_out, int64_t n0, int64_t n1) {
  thread_local std::vector<uint8_t> wp;
  wp.resize(q.kp * 16);
  int64_t n = n0;
  for (; n + 16 <= n1; n += 16) {
    pack16(w + n * q.k, q.k, q.kp, wp.data());
    int64_t r = 0;
    for (; r + 6 <= q.m; r += 6) block16<6>(q, wp.data(), scale, y, n_out, n, r);
    switch (q.m - r) {
      case 5: block16<5>(q, wp.data(), scale, y, n_out, n, r); break;
      case 4: block16<4>(q, wp.data(), scale, y, n_out, n, r); break;
      case 3: block16<3>(q, wp.data(), scale, y, n_out, n, r); break;
      case 2: block16<2>(q, wp.data(), scale, y, n_out, n, r); break;
      case 1: block16<1>(q, wp.data(), scale, y, n_out, n, r); break;
      default: break;
    }
  }
  return n;
}

// Lane l of the result is the sum of v[f(l)]'s 16 lanes, f(l) = 4 * (l % 4) + l / 4: four
// levels of cross-lane adds (15 adds in all) instead of 16 separate horizontal sums.
inline __m512i sum16(const __m512i* v) {
  __m512i a[8], b[4], c[2];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)  // 256-bit halves: [v2i | v2i+1], 8 partial sums each
    a[i] = _mm512_add_epi32(_mm512_shuffle_i64x2(v[2 * i], v[2 * i + 1], 0x44),
                            _mm512_shuffle_i64x2(v[2 * i], v[2 * i + 1], 0xee));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)  // 128-bit lane j: v[4i + j], 4 partial sums
    b[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(a[2 * i], a[2 * i + 1], 0x88),
                            _mm512_shuffle_i32x4(a[2 * i], a[2 * i + 1], 0xdd));
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i)  // lane j: (v[8i + j], v[8i + 4 + j]), 2 partial sums each
    c[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(b[2 * i], b[2 * i + 1]),
                            _mm512_unpackhi_epi64(b[2 * i], b[2 * i + 1]));
  const __m512 c0 = _mm512_castsi512_ps(c[0]), c1 = _mm512_castsi512_ps(c[1]);
  return _mm512_add_epi32(_mm512_castps_si512(_mm512_shuffle_ps(c0, c1, 0x88)),
                          _mm512_castps_si512(_mm512_shuffle_ps(c0, c1, 0xdd)));
}

// Output rows [n0, n1) for up to kFewRowsMin - 1 activation rows (decode, a short verify step),
// one weight row at a time (a sequential read), each activation row in turn against it (from
// L1). Kept out of rows_kernel so its code does not depend on how the compiler treats the
// block paths (inlined there, this loop ran 20 % slower).
__attribute__((noinline)) void single_rows(const QuantX& q, const int8_t* w, const float* scale,
                                           float* y, int64_t n_out, int64_t n0, int64_t n1) {
  const int64_t k = q.k, kp = q.kp, m = q.m;
  const int8_t* H = q.hi.data();
  const int8_t* L = q.lo.data();
  int64_t n = n0;
  for (; n < n1; ++n) {
    const int8_t* wr = w + n * k;
    for (int64_t r = 0; r < m; ++r) {
      const int8_t* hp = H + r * kp;
      const int8_t* lp = L + r * kp;
      __m512i h0 = _mm512_setzero_si512(), h1 = h0, l0 = h0, l1 = h0;
      int64_t j = 0;
      for (; j + 128 <= kp; j += 128) {
        const __m512i a0 = load_w(wr + j, k - j), a1 = load_w(wr + j + 64, k - j - 64);
        h0 = _mm512_dpbusd_epi32(h0, a0, _mm512_loadu_si512(hp + j));
        h1 = _mm512_dpbusd_epi32(h1, a1, _mm512_loadu_si512(hp + j + 64));
        l0 = _mm512_dpbusd_epi32(l0, a0, _mm512_loadu_si512(lp + j));
        l1 = _mm512_dpbusd_epi32(l1, a1, _mm512_loadu_si512(lp + j + 64));
      }
      for (; j < kp; j += 64) {
        const __m512i a0 = load_w(wr + j, k - j);
        h0 = _mm512_dpbusd_epi32(h0, a0, _mm512_loadu_si512(hp + j));
        l0 = _mm512_dpbusd_epi32(l0, a0, _mm512_loadu_si512(lp + j));
      }
      y[r * n_out + n] = combine(q, r, _mm512_reduce_add_epi32(_mm512_add_epi32(h0, h1)),
                                 _mm512_reduce_add_epi32(_mm512_add_epi32(l0, l1)), scale[n]);
    }
  }
}

// From this many activation rows, few_rows: against single_rows on SmolLM2's shapes (one
// thread, a step's weights cold; min of 12-25 runs, shared machine), 6-8 rows took 0.73-0.93x
// single_rows's time; 5 rows were no faster and 2-4 up to 1.4x slower (K = 1536).
constexpr int64_t kFewRowsMin = 6;

// Weight row n against the M (1-8) activation rows from r0, in one pass over the weight row:
// each 64-byte block is loaded once and dotted with every activation row's hi and lo terms
// (2 M accumulators in registers), and the 2 M sums come out of one sum16. Weight rows are
// taken one at a time, a sequential read: interleaving 2-8 weight rows per trip (fewer sums)
// measured 1.3-2x slower.
template <int M>
__attribute__((always_inline)) inline void row_dots(const QuantX& q, const int8_t* w, const float* scale, float* y,
                     int64_t n_out, int64_t n, int64_t r0) {
  static_assert(2 * M <= 16, "16 accumulators at most");
  const int64_t k = q.k, kp = q.kp;
  const int8_t* H = q.hi.data() + r0 * kp;
  const int8_t* L = q.lo.data() + r0 * kp;
  const int8_t* wr = w + n * k;
  __m512i acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_si512();
  for (int64_t j = 0; j < kp; j += 64) {
    const __m512i wv = load_w(wr + j, k - j);
#pragma GCC unroll 8
    for (int r = 0; r < M; ++r) {
      acc[2 * r] = _mm512_dpbusd_epi32(acc[2 * r], wv, _mm512_loadu_si512(H + r * kp + j));
      acc[2 * r + 1] =
          _mm512_dpbusd_epi32(acc[2 * r + 1], wv, _mm512_loadu_si512(L + r * kp + j));
    }
  }
  alignas(64) int32_t sums[16];
  _mm512_store_si512(sums, sum16(acc));
  for (int r = 0; r < M; ++r)  // accumulator a is in lane 4 * (a % 4) + a / 4
    y[(r0 + r) * n_out + n] = combine(q, r0 + r, sums[4 * (2 * r % 4) + r / 2],
                                      sums[4 * ((2 * r + 1) % 4) + r / 2], scale[n]);
}

template <int M>
__attribute__((noinline)) void few_rows(const QuantX& q, const int8_t* w, const float* scale,
                                        float* y, int64_t n_out, int64_t n0, int64_t n1,
                                        int64_t r0) {
  for (int64_t n = n0; n < n1; ++n) row_dots<M>(q, w, scale, y, n_out, n, r0);
}

// Output rows [n0, n1) of one weight, every activation row: up to 5 activation rows by
// single_rows, 6-8 (a longer speculative verify step) in one pass over the weight rows by
// few_rows; from kPackedMinRows on, packed blocks of 16 weight rows, the last (< 16) weight
// rows 8 activation rows at a time.
void rows_kernel(const QuantX& q, const int8_t* w, const float* scale, float* y, int64_t n_out,
                 int64_t n0, int64_t n1) {
  if (q.m < kFewRowsMin) return single_rows(q, w, scale, y, n_out, n0, n1);
  const int64_t n = q.m >= kPackedMinRows ? packed_rows(q, w, scale, y, n_out, n0, n1) : n0;
  if (n == n1) return;
  for (int64_t r0 = 0; r0 < q.m; r0 += 8) {
    switch (std::min<int64_t>(8, q.m - r0)) {
      case 1: few_rows<1>(q, w, scale, y, n_out, n, n1, r0); break;
      case 2: few_rows<2>(q, w, scale, y, n_out, n, n1, r0); break;
      case 3: few_rows<3>(q, w, scale, y, n_out, n, n1, r0); break;
      case 4: few_rows<4>(q, w, scale, y, n_out, n, n1, r0); break;
      case 5: few_rows<5>(q, w, scale, y, n_out, n, n1, r0); break;
      case 6: few_rows<6>(q, w, scale, y, n_out, n, n1, r0); break;
      case 7: few_rows<7>(q, w, scale, y, n_out, n, n1, r0); break;
      default: few_rows<8>(q, w, scale, y, n_out, n, n1, r0); break;
    }
  }
}
#else
void rows_kernel(const QuantX& q, const int8_t* w, const float* scale, float* y, int64_t n_out,
                 int64_t n0, int64_t n1) {
  const int64_t k = q.k, kp = q.kp, m = q.m;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wr = w + n * k;
    for (int64_t r = 0; r < m; ++r) {
      const int8_t* h = q.hi.data() + r * kp;
      const int8_t* l = q.lo.data() + r * kp;
      int32_t sh = 0, sl = 0;
      for (int64_t j = 0; j < k; ++j) {
        const int32_t wu = static_cast<int32_t>(wr[j]) + 128;
        sh += wu * h[j];
        sl += wu * l[j];
      }
      y[r * n_out + n] = combine(q, r, sh, sl, scale[n]);
    }
  }
}
#endif

struct Job {
  const int8_t* w;
  const float* scale;
  float* y;
  int64_t n;
};

// Output rows in chunks of kChunk over all jobs; chunks are taken from a shared counter by the
// calling thread and by the team's helpers (a helper that starts late finds none left).
constexpr int64_t kChunk = 64;
// Below this many weight bytes x activation rows a call runs on the calling thread only.
constexpr int64_t kThreadMinWork = 1 << 16;

struct Shared {
  std::vector<Job> jobs;
  std::vector<std::pair<int, int64_t>> chunks;  // (job, first row)
  QuantX q;
  std::atomic<int64_t> next{0};
};

void run_chunks(void* p) {
  Shared& s = *static_cast<Shared*>(p);
  const int64_t total = static_cast<int64_t>(s.chunks.size());
  for (;;) {
    const int64_t c = s.next.fetch_add(1);
    if (c >= total) return;
    const auto [j, n0] = s.chunks[c];
    const Job& job = s.jobs[j];
    rows_kernel(s.q, job.w, job.scale, job.y, job.n, n0, std::min(n0 + kChunk, job.n));
  }
}

ffi::Error matmul_impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                       std::vector<std::tuple<ffi::Buffer<ffi::S8>, ffi::Buffer<ffi::F32>,
                                              ffi::ResultBuffer<ffi::F32>>> ws) {
  const auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("x must be [M, K]");
  const int64_t m = xd[0], k = xd[1];
  // One per calling thread, reused: a call's buffers are only touched until it returns.
  thread_local Shared shared;
  shared.jobs.clear();
  shared.chunks.clear();
  shared.next.store(0);
  quantize_rows(x.typed_data(), m, k, shared.q);
  int64_t work = 0;
  for (auto& [w, s, y] : ws) {
    const auto wd = w.dimensions();
    if (wd.size() != 2 || wd[1] != k) return ffi::Error::InvalidArgument("w must be [N, K]");
    const int64_t n = wd[0];
    const int j = static_cast<int>(shared.jobs.size());
    shared.jobs.push_back(Job{w.typed_data(), s.typed_data(), y->typed_data(), n});
    for (int64_t n0 = 0; n0 < n; n0 += kChunk) shared.chunks.emplace_back(j, n0);
    work += n * k * m;
  }
  const int64_t total = static_cast<int64_t>(shared.chunks.size());
  jaxserve::Team& team = jaxserve::team(static_cast<int>(pool.num_threads()) - 1);
  const int64_t helpers =
      work < kThreadMinWork ? 0 : std::min<int64_t>(team.size(), total - 1);
  team.run(static_cast<int>(helpers), run_chunks, &shared);
  return ffi::Error::Success();
}

// x [M, K] against the (weight [N, K] int8, scale [N] float32) pairs that follow it, one
// [M, N] float32 result per pair.
ffi::Error Int8Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs ws,
                      ffi::RemainingRets ys) {
  if (ws.size() != 2 * ys.size())
    return ffi::Error::InvalidArgument("one (weight, scale) pair per result");
  std::vector<std::tuple<ffi::Buffer<ffi::S8>, ffi::Buffer<ffi::F32>,
                         ffi::ResultBuffer<ffi::F32>>> jobs;
  for (size_t i = 0; i < ys.size(); ++i) {
    auto w = ws.get<ffi::Buffer<ffi::S8>>(2 * i);
    auto s = ws.get<ffi::Buffer<ffi::F32>>(2 * i + 1);
    auto y = ys.get<ffi::Buffer<ffi::F32>>(i);
    if (w.has_error() || s.has_error() || y.has_error())
      return ffi::Error::InvalidArgument("weights int8, scales and results float32");
    jobs.emplace_back(*w, *s, *y);
  }
  return matmul_impl(pool, x, std::move(jobs));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxserve_int8_matmul, Int8Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets());
