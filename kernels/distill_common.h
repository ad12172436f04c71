// Divergences of two softmax distributions, one entry at a time: the arithmetic shared by the CUDA kernels
// (distill.cu) and the CPU twin (distill_cpu.cpp), so both compute the same function. Plain C++, no torch.
//
// A row holds one token's logits over the vocabulary. With a = student / T and b = teacher / T,
//   ls = a - logsumexp(a), lt = b - logsumexp(b)     (log-probabilities), ps = exp(ls), pt = exp(lt),
// and, per mode (TRL's generalized JSD convention):
//   FORWARD_KL (beta = 0): KL(pt || ps)          REVERSE_KL (beta = 1): KL(ps || pt)
//   JSD (0 < beta < 1):    beta KL(pt || m) + (1 - beta) KL(ps || m),  m = (1 - beta) ps + beta pt.
// A top-k teacher uses the same functions over k + 1 "buckets" (the k tokens and the tail) in place of entries.
//
// Accuracy. Every KL is summed in its non-negative form, entry by entry,
//   KL(p || q) = sum_v [p log(p / q) - p + q] = sum_v q f(u),  u = log p - log q,  f(u) = u e^u - expm1(u) >= 0,
// (the added terms sum to 0 because p and q are normalised; for the JSD they cancel within each entry, so its
// plain summand is already >= 0). No entry is negative, so a divergence is never below 0 however closely student
// and teacher agree, and where |u| is small, where p log(p / q) alone would cancel, f (and the JSD's summand)
// comes from its power series. d = lt - ls is formed from the logits' difference (make_point), so u keeps its
// digits. An error c in a row's normaliser moves the sum only by c * KL (f'(u) summed with weights q is the KL
// itself): the logsumexp's rounding costs a relative, not an absolute, error.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__CUDACC__)
#define DS_HD __host__ __device__ __forceinline__
#else
#define DS_HD inline
#endif

namespace distill {

enum Mode : int { FORWARD_KL = 0, REVERSE_KL = 1, JSD = 2 };
enum Reduction : int { RED_NONE = 0, RED_SUM = 1, RED_BATCHMEAN = 2 };

inline int mode_of(double beta) { return beta == 0.0 ? FORWARD_KL : (beta == 1.0 ? REVERSE_KL : JSD); }

template <typename A> DS_HD A ninf() { return -std::numeric_limits<A>::infinity(); }

// Accurate exp and log in the accumulation type (float lanes for 16-bit and float32 logits, double for float64).
DS_HD float d_exp(float v) { return expf(v); }
DS_HD double d_exp(double v) { return exp(v); }
DS_HD float d_log(float v) { return logf(v); }
DS_HD double d_log(double v) { return log(v); }

// Probabilities are formed in base 2: x log2(e) / T is one multiply per logit, and 2^x is one instruction on the
// GPU (ex2.approx: relative error near 2^-22, far below what the loss needs; results below 2^-126 flush to 0).
// The host keeps the accurate exp2. Normalisers are base-2 too; losses, u and d are natural.
constexpr double kLn2 = 0.693147180559945309417232121458176568;
constexpr double kLog2e = 1.442695040888963407359924681001892137;
DS_HD float d_exp2(float v) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(v));
  return y;
#else
  return exp2f(v);
#endif
}
DS_HD double d_exp2(double v) { return exp2(v); }
// The natural log of a normal (not subnormal) number where the per-entry loops need one: lg2.approx on the GPU
// (one instruction against ~20 for logf; CUDA's __log2f bound: an absolute 2^-22.6 in log2 on [0.5, 2], 2 ulp
// elsewhere, so accurate where the log is small), the accurate log on the host.
// d_log2_normal: its log2, which d_log_normal multiplies by ln 2 on the GPU (the JSD's plain chunks in fast_rows
// work in base 2, kJsdBase2Terms).
DS_HD float d_log2_normal(float v) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(v));
  return y;
#else
  return log2f(v);
#endif
}
DS_HD float d_log_normal(float v) {
#if defined(__CUDA_ARCH__)
  return d_log2_normal(v) * static_cast<float>(kLn2);
#else
  return logf(v);
#endif
}
DS_HD double d_log_normal(double v) { return log(v); }
DS_HD float d_log2(float v) { return log2f(v); }
DS_HD double d_log2(double v) { return log2(v); }

// Horner's rule: c[0] + c[1] x + ... + c[N-1] x^(N-1).
template <int N, typename A> DS_HD A horner(const A* c, A x) {
  A r = c[N - 1];
#pragma unroll
  for (int i = N - 2; i >= 0; --i) r = r * x + c[i];
  return r;
}
template <int N, typename A> DS_HD A horner(const A (&c)[N], A x) { return horner<N, A>(&c[0], x); }

// Where |u| (or |d|) is below this, the series are used.
constexpr double kSeriesLimit = 0.5;

// f(u) / u^2 = sum_{k>=2} (k - 1) / k! u^(k-2) on |u| < 0.5. float: a degree-6 Chebyshev fit (relative error
// 8.8e-8 in float arithmetic, the Horner rounding itself; the Taylor series needs degree 8 for that); double: the
// Taylor series to u^16 (truncation below 3e-17).
DS_HD float f_over_u2(float u) {
  constexpr float c[7] = {0.5f,
                          0.33333337119711653f,
                          0.12500000425576246f,
                          0.03333212212184884f,
                          0.006944308299484956f,
                          0.0012001555757105312f,
                          0.00017469932608297052f};
  return horner(c, u);
}
DS_HD double f_over_u2(double u) {
  constexpr double c[15] = {1.0 / 2,
                            2.0 / 6,
                            3.0 / 24,
                            4.0 / 120,
                            5.0 / 720,
                            6.0 / 5040,
                            7.0 / 40320,
                            8.0 / 362880,
                            9.0 / 3628800,
                            10.0 / 39916800,
                            11.0 / 479001600,
                            12.0 / 6227020800,
                            13.0 / 87178291200,
                            14.0 / 1307674368000,
                            15.0 / 20922789888000};
  return horner(c, u);
}

// a b + c: one rounding on the GPU (fma), two on the host (the CPU twin has no fused multiply-add to rely on).
DS_HD float d_fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return fmaf(a, b, c);
#else
  return a * b + c;
#endif
}
DS_HD double d_fma(double a, double b, double c) { return a * b + c; }

// The summand q f(u) = p log(p / q) - p + q of KL(p || q), u = log p - log q. p == 0 contributes q (the limit of
// p log p), q == 0 < p contributes +inf, p == q == 0 contributes 0; a NaN p or u gives NaN.
// Both forms are evaluated and one selected: no divergent branch in the entries' loops. Written for few
// instructions per entry (the forward KL's kernel is bound by them): the direct form as p u + (q - p), whose
// q - p is the forward KL's gradient (ps - pt) too, so the compiler forms it once; the region test on u^2, which
// the series needs anyway (one comparison; NaN and +-inf fail it).
template <typename A> DS_HD A kl_term(A p, A q, A u) {
  const A uu = u * u;
  const A series = q * uu * f_over_u2(u);
  const A direct = p <= A(0) ? q : d_fma(p, u, q - p);
  return uu < A(kSeriesLimit * kSeriesLimit) ? series : direct;
}

// The same summand without its series (the direct form alone, 2 instructions against ~13): where |u| is small
// it cancels to an absolute error of ~(p + q) 2^-21 (the two exponentials' rounding). The fast kernel sums it
// over a thread's entries with their mass (p + q) and keeps the sum only where it is at least kDirectMin of the
// mass (so that error is at most ~1e-5 of the sum, as the series' region leaves a single entry at |u| = 0.5, and
// typically ~1e-7); elsewhere (student and teacher close, a NaN) the thread sums its entries again with kl_term.
constexpr double kDirectMin = 1.0 / 16;
// A switch for measuring (false compiles fast_rows as before versions 20 and 21, kernels/NOTES.md); its tests on a GPU:
// `pytest -m gpu tests/test_distill.py -k "in_place or fast_kernel or nearly or forward_alone"` and
// tests/test_fused_linear.py, and `tools/distill_probe.py` against the kernels without it.
constexpr bool kDirectTerms = true;
template <typename A> DS_HD A kl_term_direct(A p, A q, A u) { return p <= A(0) ? q : d_fma(p, u, q - p); }

// ------------------------------------------------------------------------------------------ the JSD's series
// With d = lt - ls, the JSD's per-entry quantities are functions of d alone, times ps:
//   u_s = ls - log m = -log(1 - beta + beta e^d),   u_t = lt - log m = d + u_s,
//   summand / ps = beta e^d u_t + (1 - beta) u_s       (>= 0, ~ beta (1 - beta) d^2 / 2 near 0).
// Near d = 0 both cancel; their Taylor coefficients depend on beta only, so they are computed once per call
// (jsd_series, in double) and evaluated by Horner's rule where |d| < kSeriesLimit. The nearest singularity of
// u_s is at |d| >= pi, so at |d| = 0.5 the terms shrink like (0.5 / pi)^k: kJsdTerms terms leave < 1e-15.
constexpr int kJsdTerms = 20;
// Terms evaluated: float needs 10 (truncation < 1e-8 at |d| = 0.5), double all.
template <typename A> constexpr int jsd_terms() { return sizeof(A) == 4 ? 10 : kJsdTerms; }

// Power series of u_s(d) / d (us[]) and summand(d) / (ps d^2) (g[]), to kJsdTerms terms each.
inline void jsd_series(double beta, double (&us)[kJsdTerms], double (&g)[kJsdTerms]) {
  constexpr int N = kJsdTerms + 2;  // coefficients of d^0 .. d^(N-1)
  double e[N], w[N], log1p_w[N], pw[N], nxt[N];
  double fact = 1.0;
  for (int k = 0; k < N; ++k) {
    if (k > 0) fact *= k;
    e[k] = 1.0 / fact;                  // e^d
    w[k] = k == 0 ? 0.0 : beta / fact;  // beta (e^d - 1), no constant term
    log1p_w[k] = 0.0;
    pw[k] = w[k];
  }
  // log(1 + w) = w - w^2/2 + w^3/3 - ...; w has no constant term, so w^j starts at d^j.
  for (int j = 1; j < N; ++j) {
    for (int k = 0; k < N; ++k) log1p_w[k] += ((j % 2) ? 1.0 : -1.0) * pw[k] / j;
    for (int k = 0; k < N; ++k) {  // pw <- pw * w
      double acc = 0.0;
      for (int i = 0; i <= k; ++i) acc += pw[i] * w[k - i];
      nxt[k] = acc;
    }
    for (int k = 0; k < N; ++k) pw[k] = nxt[k];
  }
  double u_s[N], u_t[N], sum[N];
  for (int k = 0; k < N; ++k) {
    u_s[k] = -log1p_w[k];
    u_t[k] = u_s[k] + (k == 1 ? 1.0 : 0.0);
  }
  for (int k = 0; k < N; ++k) {  // beta e^d u_t + (1 - beta) u_s
    double acc = 0.0;
    for (int i = 0; i <= k; ++i) acc += e[i] * u_t[k - i];
    sum[k] = beta * acc + (1.0 - beta) * u_s[k];
  }
  for (int k = 0; k < kJsdTerms; ++k) {
    us[k] = u_s[k + 1];  // u_s(0) = 0
    g[k] = sum[k + 2];   // the summand starts at d^2
  }
}

// ------------------------------------------------------------------------------------- entries and rows
// One entry (or bucket): log-probabilities and probabilities of student and teacher, and d = lt - ls.
template <typename A> struct Point { A ls, lt, ps, pt, d; };

// Constants of a row that every entry needs: beta, the logs of the mixture weights and the JSD's series.
template <typename A> struct RowConst {
  A beta, log_b;
  A us[kJsdTerms], g[kJsdTerms];
};

// Double lanes (float64 logits) keep the JSD's relative digits at either end of beta. The float forms below form
// log z = log(1 - beta + beta e^d) to an ulp of 1 and u_t = d - log z, so where beta (or 1 - beta) is small u_s
// (or u_t) is lost to rounding and the loss's relative error grows as ~eps / min(beta, 1 - beta): in double 1e-11
// at beta = 1e-6, 1e-5 at 1e-12, 6-15% from 1e-16 on (a teacher part left negative and clamped); the series'
// coefficients likewise cancel to ~eps / (1 - beta) as beta nears 1. So in double lanes: u_s and u_t each from
// log1p of its own small argument (mixture_u_exact), and for beta > 1/2 the series of the exchanged problem
// (student and teacher, beta and 1 - beta, d and -d exchanged: the same divergence, whose series are those of
// 1 - beta < 1/2). Float lanes keep the fast forms and their documented limit.
template <typename A> constexpr bool exact_ends() { return sizeof(A) == 8; }
template <typename A> DS_HD bool exchanged_series(const RowConst<A>& c) { return exact_ends<A>() && c.beta > A(0.5); }

template <typename A> inline RowConst<A> row_const(double beta) {
  RowConst<A> c;
  c.beta = static_cast<A>(beta);
  c.log_b = beta > 0.0 ? static_cast<A>(std::log(beta)) : ninf<A>();
  double us[kJsdTerms], g[kJsdTerms];
  jsd_series(exchanged_series(c) ? 1.0 - beta : beta, us, g);  // (1 - beta exact where beta > 1/2)
  for (int k = 0; k < kJsdTerms; ++k) {
    c.us[k] = static_cast<A>(us[k]);
    c.g[k] = static_cast<A>(g[k]);
  }
  return c;
}

// u_s and u_t of the JSD (see above): from the series near d = 0, else from the mixture relative to the student,
//   z = m / p_s = 1 - beta + beta e^d,  u_s = -log z,  u_t = d - log z,
// a function of d alone: z lies near [1 - beta, 1 + beta e^d], where lg2.approx on the GPU is accurate to an
// absolute 2^-22.6 (__log2f's bound on [0.5, 2], 2 ulp elsewhere) and e^d by ex2.approx to 2 ulp, so u_s is good
// to ~3.5e-7 absolute. (The log of m itself, ~-12 for a typical entry, cost an accurate logf, ~20 instructions,
// and its rounding at that magnitude, ~5e-7; lg2.approx on m was 2 ulp of ~17 and put the loss's error from 3e-7
// to 2e-6.) Where e^d would overflow (d >= kJsdLogSpace) the teacher holds the mixture alone: log z = d + log beta
// (a student probability of 0, d = +inf, included). Branches, not selects: evaluating all three and selecting
// one ran 4% slower on an H200 (kernels/NOTES.md, version 11).
constexpr double kJsdLogSpace = 64.0;
template <typename A> DS_HD bool jsd_series_region(A d) { return d > A(-kSeriesLimit) && d < A(kSeriesLimit); }
template <typename A> DS_HD void mixture_u_series(const Point<A>& e, const RowConst<A>& c, A& us, A& ut) {
  if (exchanged_series(c)) {  // u_t is the exchanged problem's u_s at -d
    ut = -e.d * horner<jsd_terms<A>()>(&c.us[0], -e.d);
    us = ut - e.d;
    return;
  }
  us = e.d * horner<jsd_terms<A>()>(&c.us[0], e.d);
  ut = e.d + us;
}
// log z = log(1 - beta + beta e^d), for d below kJsdLogSpace; mixture_log_z_of takes e^d.
template <typename A> DS_HD A mixture_log_z_of(A ed, const RowConst<A>& c) {
  return d_log_normal(d_fma(c.beta, ed, A(1) - c.beta));
}
template <typename A> DS_HD A mixture_log_z(A d, const RowConst<A>& c) {
  return mixture_log_z_of(d_exp2(d * A(kLog2e)), c);
}
// Double lanes' u_s and u_t (exact_ends): with w_s = beta expm1(d) and w_t = (1 - beta) expm1(-d), z = 1 + w_s and
// z e^-d = 1 + w_t, so u_s = -log1p(w_s) and u_t = -log1p(w_t), each taken where its argument is small (|w| < 1/2:
// relative digits however small u is), the other then from u_t - u_s = d (|u| >= log 1.5 there, no cancellation
// to speak of); where neither is small, from z or z e^-d as a sum of two positive terms (d >= 0: e^-d cannot
// overflow). d = +-inf and NaN come out as the float forms have them (u_s = -inf, u_t = -log beta at +inf).
template <typename A> DS_HD void mixture_u_exact(A d, const RowConst<A>& c, A& us, A& ut) {
  const A ws = c.beta * expm1(d), wt = (A(1) - c.beta) * expm1(-d);
  const bool s_small = fabs(ws) < A(0.5), t_small = fabs(wt) < A(0.5);
  if (s_small) us = -log1p(ws);
  if (t_small) ut = -log1p(wt);
  if (s_small && !t_small) {
    ut = d + us;
  } else if (t_small && !s_small) {
    us = ut - d;
  } else if (!s_small && !t_small) {
    if (d >= A(0)) {
      ut = -log(d_fma(A(1) - c.beta, exp(-d), c.beta));
      us = ut - d;
    } else {
      us = -log(d_fma(c.beta, exp(d), A(1) - c.beta));
      ut = d + us;
    }
  }
}
template <typename A> DS_HD void mixture_u_direct(const Point<A>& e, const RowConst<A>& c, A& us, A& ut) {
  if constexpr (exact_ends<A>()) {
    mixture_u_exact(e.d, c, us, ut);
    return;
  }
  if (e.d >= A(kJsdLogSpace)) {
    us = -(e.d + c.log_b);
    ut = -c.log_b;
    return;
  }
  const A lz = mixture_log_z(e.d, c);
  us = -lz;
  ut = e.d - lz;
}
template <typename A> DS_HD void mixture_u(const Point<A>& e, const RowConst<A>& c, A& us, A& ut) {
  if (jsd_series_region(e.d)) mixture_u_series(e, c, us, ut);
  else mixture_u_direct(e, c, us, ut);
}

// u_t where the teacher's side needs its digits: kt = sum pt u_t and the teacher's gradient beta pt (u_t - kt).
// Where the teacher outweighs the student (d > 0 beyond the series) the float form's u_t = d - log z is the
// difference of two numbers near d, rounded at d's ulp (~2e-6 at d ~ 30), while u_t itself lies in (0, -log beta]
// and a row whose teacher holds its mass where the student has little has u_t - kt ~ 1e-5 at its top entries:
// such float32 teacher gradients were 4e-5 to 9e-4 off float64 where PyTorch's own float32 autograd was 2e-5 to
// 3e-4 (the CPU twin; the vocabulary split's phases alike, up to 1.5e-4 on an H200). From the teacher's side,
// z e^-d = beta + (1 - beta) e^-d lies in [beta, 1], and u_t = -log of it is good to an ulp of itself: the same
// draws 3e-6 to 3e-5. An accurate exponential and log more an entry where d > 0, so only where kt is summed for a
// teacher's gradient (point_terms' EXACT_KT) and in teacher_grad, which must take the same u_t as the kt it
// subtracts (one form in kt and the other in the gradient was worse than either). Given mixture_u's u_t: it stands
// where it is exact already (the series, d <= 0, the log-space end; double lanes' mixture_u_exact everywhere).
template <typename A> DS_HD A mixture_ut_exact(const Point<A>& e, const RowConst<A>& c, A ut) {
  if (exact_ends<A>() || !(e.d >= A(kSeriesLimit)) || e.d >= A(kJsdLogSpace)) return ut;
  return -d_log(d_fma(A(1) - c.beta, d_exp(-e.d), c.beta));
}

// u_s alone for a 16-bit gradient (the fast kernel's gradient pass; kernels/NOTES.md, version 12): the z form
// above is good to ~3.5e-7 absolute, far below a 16-bit gradient's rounding wherever |u_s| ~ beta |d| is more
// than ~1e-4, so the 10-term series is not needed there; below kJsdShortSeries a 4-term series (truncation
// ~(d / pi)^4 < 2e-7 relative) keeps u_s's relative digits (an exact d = 0, a row where student and teacher agree,
// still gives u_s = 0 and a zero gradient). All forms are evaluated and one selected: no divergent branch in the
// entries' loop, where mixture_u's branches cost a warp both sides whenever its entries straddle |d| = 0.5.
constexpr double kJsdShortSeries = 1.0 / 16;
template <typename A> DS_HD A mixture_us_short(const Point<A>& e, const RowConst<A>& c) {
  const A lz = mixture_log_z(e.d, c);  // (evaluated outside the select: the compiler then selects, not branches)
  const A us = e.d >= A(kJsdLogSpace) ? -(e.d + c.log_b) : -lz;
  return e.d * e.d < A(kJsdShortSeries * kJsdShortSeries) ? e.d * horner<4>(&c.us[0], e.d) : us;
}

// The JSD's summand from its teacher part a and student part b: a + b, >= 0 up to rounding (so clamped at 0), NaN kept.
template <typename A> DS_HD A jsd_summand(A a, A b) {
  A entry = a + b > A(0) ? a + b : A(0);
  if (a + b != a + b) entry = a + b;
  return entry;
}

// The JSD's summand beta pt u_t + (1 - beta) ps u_s from the z form (mixture_u_direct), >= 0 up to rounding,
// with u_s and u_t. Where d is small the two products cancel: the summand's absolute error is that of u_s, ~3.5e-7
// times the entry's mixture mass m, so over a whole row (whose m sums to 1) at most ~3.5e-7 (point_terms takes
// the series there; fast_rows' 16-bit training rows take this form everywhere and the series only for rows whose
// JSD is below kJsdDirectMin, where that bound could exceed ~6e-6 of the row's value; kernels/NOTES.md, version 21).
constexpr double kJsdDirectMin = 1.0 / 16;
// The JSD's terms p u (summand parts, ks, kt) are guarded `p <= 0 ? 0 : p u`: 0 where the probability p is 0 (u may
// then be infinite), NaN where p is NaN (its row's normaliser is NaN: a NaN or +inf logit, a row without mass, a
// maximum beyond the lanes' range). With `p > 0 ? p u : 0`, a row pair whose student and teacher were both such
// rows had every summand 0: a loss of 0 where the KLs give NaN, as float64 does. (Written out, not as a helper:
// a helper taking the product made nvcc reschedule the bf16 JSD kernel's loop; one form for all, so the compiler
// tests each p once.)
template <typename A> DS_HD A jsd_entry_direct(const Point<A>& e, const RowConst<A>& c, A& us, A& ut) {
  mixture_u_direct(e, c, us, ut);
  const A a = e.pt <= A(0) ? A(0) : c.beta * e.pt * ut;
  const A b = e.ps <= A(0) ? A(0) : (A(1) - c.beta) * e.ps * us;
  return jsd_summand(a, b);
}

// jsd_entry_direct for a point whose probabilities carry the mixture's weights, e.ps = (1 - beta) ps and e.pt =
// beta pt (fast_rows' kJsdWeightedPoints): the same summand with two multiplications fewer, and its student part
// (1 - beta) ps u_s in `b` (0 where the student has no mass), of which ks is the row's sum over 1 - beta.
template <typename A> DS_HD A jsd_entry_weighted(const Point<A>& e, const RowConst<A>& c, A& us, A& b) {
  A ut;
  mixture_u_direct(e, c, us, ut);
  const A a = e.pt <= A(0) ? A(0) : e.pt * ut;
  b = e.ps <= A(0) ? A(0) : e.ps * us;
  return jsd_summand(a, b);
}

// jsd_entry_weighted where |d| < kJsdLogSpace (fast_rows' kJsdPlainChunks): every value is finite there, so the z
// form needs no log-space branch and a probability of 0 no guard (0 times a finite u is 0), and the summand, finite,
// is clamped at 0 as jsd_summand does. jsd_plain_summand is the summand from the weighted probabilities and log z.
template <typename A> DS_HD A jsd_plain_summand(A ps, A pt, A d, A lz, A& us, A& b) {
  us = -lz;
  b = ps * us;
  const A sum = pt * (d - lz) + b;
  return sum > A(0) ? sum : A(0);
}
template <typename A> DS_HD A jsd_entry_plain(const Point<A>& e, const RowConst<A>& c, A& us, A& b) {
  return jsd_plain_summand(e.ps, e.pt, e.d, mixture_log_z(e.d, c), us, b);
}

// jsd_entry_plain with the teacher's weighted probability made from the student's, beta pt = (1 - beta) ps e^d
// beta / (1 - beta) (`pt_per_ps` is the last factor), where the z form needs e^d anyway: one exponential an entry
// fewer (fast_rows' kJsdPtFromPs). Only where (1 - beta) ps is a normal number: were it flushed to 0, beta pt
// (up to 2^-34 there, |d| < 64) would be too, where its own exponential keeps it.
template <typename A>
DS_HD A jsd_entry_plain_from_ps(A ps, A d, A pt_per_ps, const RowConst<A>& c, A& us, A& b) {
  const A ed = d_exp2(d * A(kLog2e));
  return jsd_plain_summand(ps, ps * (ed * pt_per_ps), d, mixture_log_z_of(ed, c), us, b);
}
// jsd_entry_plain_from_ps in base 2 (fast_rows' kJsdBase2Terms): d2 = d log2(e), and the summand, b and lz2 = log2 z
// are log2(e) times the natural ones (the caller multiplies its sums by ln 2 once): two multiplications an entry
// fewer (d log2(e) before the exponential, log2 z times ln 2 after the logarithm). The summand is clamped at 0 as
// jsd_plain_summand's.
template <typename A>
DS_HD A jsd_entry_plain_base2(A ps, A d2, A pt_per_ps, const RowConst<A>& c, A& lz2, A& b) {
  const A ed = d_exp2(d2);
  lz2 = d_log2_normal(d_fma(c.beta, ed, A(1) - c.beta));
  b = -(ps * lz2);
  const A sum = (ps * (ed * pt_per_ps)) * (d2 - lz2) + b;
  return sum > A(0) ? sum : A(0);
}

// Sums over a row (or the part of it held here): the loss, and what the gradients need beside it,
// ks = sum ps u_s and kt = sum pt u_t (the KL of student, teacher to what it is compared with, in the plain form
// p log(p / q); the gradient is p (u - K); a zero p contributes 0).
template <typename A> struct Terms { A loss, ks, kt; };

// The JSD's summand of one entry (>= 0) and u_s, u_t (mixture_u's: the same functions in the same regions).
template <typename A> DS_HD A jsd_point_entry(const Point<A>& e, const RowConst<A>& c, A& us, A& ut) {
  // (one branch for u_s, u_t and the summand: mixture_u's and the summand's regions are the same)
  if (jsd_series_region(e.d)) {
    mixture_u_series(e, c, us, ut);
    // (the exchanged problem's summand: its student's probability is pt, its d is -d)
    if (exchanged_series(c)) return e.pt * (e.d * e.d) * horner<jsd_terms<A>()>(&c.g[0], -e.d);
    return e.ps * (e.d * e.d) * horner<jsd_terms<A>()>(&c.g[0], e.d);
  }
  return jsd_entry_direct(e, c, us, ut);
}

// The loss of one entry (>= 0) and its parts of ks (KS) and kt (KT). EXACT_KT: the JSD's kt from
// mixture_ut_exact's u_t, as teacher_grad subtracts it from (false: mixture_u's, where no teacher's gradient
// follows from this kt, or it follows in 16 bits).
template <int MODE, bool KS, bool KT, typename A, bool EXACT_KT = KT>
DS_HD void point_terms(const Point<A>& e, const RowConst<A>& c, Terms<A>& acc) {
  if (MODE == FORWARD_KL) {  // KL(pt || ps): q = ps, u = lt - ls
    acc.loss += kl_term(e.pt, e.ps, e.d);
    if (KT) acc.kt += e.pt > A(0) ? e.pt * e.d : A(0);
  } else if (MODE == REVERSE_KL) {  // KL(ps || pt)
    acc.loss += kl_term(e.ps, e.pt, -e.d);
    if (KS) acc.ks += e.ps > A(0) ? -e.ps * e.d : A(0);
  } else {
    A us, ut;
    acc.loss += jsd_point_entry(e, c, us, ut);
    if (KS) acc.ks += e.ps <= A(0) ? A(0) : e.ps * us;
    if (KT) acc.kt += e.pt <= A(0) ? A(0) : e.pt * (EXACT_KT ? mixture_ut_exact(e, c, ut) : ut);
  }
}

// Which row sums a mode's gradients need: the student's gradient needs ks unless forward KL, the teacher's kt
// unless reverse KL.
template <int MODE> constexpr bool student_needs_k() { return MODE != FORWARD_KL; }
template <int MODE> constexpr bool teacher_needs_k() { return MODE != REVERSE_KL; }

// The JSD's student_grad from an entry's ps and u_s: (1 - beta) ps (u_s - ks); NaN stays NaN; no mass, no gradient.
template <typename A> DS_HD A jsd_student_grad(A ps, A us, const RowConst<A>& c, A ks) {
  if (!(ps > A(0))) return ps != ps ? ps : A(0);
  return (A(1) - c.beta) * ps * (us - ks);
}

// d loss / d a_v (a = student logits / T) of an entry whose own probability is e.ps, before the 1/T and the
// reduction's scale: ps - pt (forward), ps (u_s - ks) (reverse), (1 - beta) ps (u_s - ks) (JSD).
// SHORT: the JSD's u_s by mixture_us_short (for gradients stored in 16 bits).
template <int MODE, bool SHORT = false, typename A> DS_HD A student_grad(const Point<A>& e, const RowConst<A>& c,
                                                                         A ks) {
  if (MODE == FORWARD_KL) return e.ps - e.pt;
  if (!(e.ps > A(0))) return e.ps != e.ps ? e.ps : A(0);  // NaN stays NaN; no mass, no gradient
  if (MODE == REVERSE_KL) return e.ps * (-e.d - ks);
  A us, ut;
  if (SHORT) us = mixture_us_short(e, c);
  else mixture_u(e, c, us, ut);
  return jsd_student_grad(e.ps, us, c, ks);
}

// d loss / d b_v (b = teacher logits / T): pt (u_t - kt) (forward), pt - ps (reverse), beta pt (u_t - kt) (JSD,
// u_t by mixture_ut_exact: kt must come from point_terms with EXACT_KT).
template <int MODE, typename A> DS_HD A teacher_grad(const Point<A>& e, const RowConst<A>& c, A kt) {
  if (MODE == REVERSE_KL) return e.pt - e.ps;
  if (!(e.pt > A(0))) return e.pt != e.pt ? e.pt : A(0);
  if (MODE == FORWARD_KL) return e.pt * (e.d - kt);
  A us, ut;
  mixture_u(e, c, us, ut);
  return c.beta * e.pt * (mixture_ut_exact(e, c, ut) - kt);  // (kt by point_terms' EXACT_KT)
}

// A row's softmax normaliser, in base 2: with a2 = x log2(e) / T, mx = max a2 and lz = log2 of the sum of
// 2^(a2 - mx). Log-probabilities are formed as (a2 - mx) - lz, exact near the maximum whatever the logits'
// offset (one combined logsumexp would be rounded at the offset: 1e-3 at logits of 1e4 in float32).
template <typename A> struct Norm { A mx, lz; };

// Logits beyond what the lanes resolve. Entries are shifted as x k2 - mx, mx = max(x) k2 rounded, in one fused
// multiply-add: the product is exact, so every entry of a row is off by the same rounding e of mx, which cancels
// in the normalisation while 2^e stays in range. From a scaled maximum of 2^24 on (2^53 in double lanes; beyond
// |x / T| ~ 1.2e7 in float lanes) that rounding is >= 1, and at ~1e10 2^e leaves the float range: a NaN or, worse,
// a wrong finite loss (a whole row at -1e12 gave a JSD of log(2) / 2) where PyTorch, which subtracts the maximum
// first, is exact. So:
//   - a row whose scaled maximum lies beyond the limit (or overflowed to -inf from a finite logit) is NaN, its loss
//     and its gradient (usable(), applied where a row's whole normaliser is formed: by the kernel that holds the
//     row, or by combine_row_norms for a split one; not in row_norms, which the split's terms kernel calls per
//     row: there it made ptxas spill);
//   - a part of a row (a thread's, warp's, block's or rank's entries) whose own maximum lies beyond the limit (a
//     stretch of padding at -1e10 or at the dtype's lowest value) adds a finite stand-in to the row's sum
//     (part_sum): such a part holds no mass unless the row's maximum is beyond the limit too, and then the row
//     is NaN anyway. Padding at -inf is exact as before.
template <typename A> DS_HD A offset_limit() { return sizeof(A) == 4 ? A(16777216.0) : A(9007199254740992.0); }
template <typename A> DS_HD bool offset_ok(A m) { return m < offset_limit<A>() && m > -offset_limit<A>(); }
// The scaled maximum of raw logits (k2 > 0); a finite raw maximum whose product overflows to -inf is the lowest
// finite value (beyond the limit), not -inf (which says: no mass).
template <typename A> DS_HD A scaled_max(A raw, A k2) {
  const A m = raw * k2;
  return m == ninf<A>() && raw != ninf<A>() ? std::numeric_limits<A>::lowest() : m;
}
// A part's sum of 2^(x k2 - o) taken at its own scaled maximum o (0 for a part without mass): a stand-in of 1 where
// o lies beyond the limit (NaN stays NaN).
template <typename A> DS_HD A part_sum(A l, A o) { return offset_ok(o) || l != l ? l : A(1); }
// A row's normaliser as its entries may use it: NaN where its maximum lies beyond the limit (-inf, a row without
// mass, is legal).
template <typename A> DS_HD Norm<A> usable(Norm<A> n) {
  if (offset_ok(n.mx) || n.mx == ninf<A>()) return n;
  return Norm<A>{std::numeric_limits<A>::quiet_NaN(), std::numeric_limits<A>::quiet_NaN()};
}

// Both rows' normalisers, with the differences every entry needs.
template <typename A> struct RowNorms {
  Norm<A> s, t;
  A dmx, dlz;  // t.mx - s.mx, t.lz - s.lz
  A dd;        // dmx + dlz: one rounding common to the whole row (a normaliser's error, see the top of this file)
  bool close;  // the maxima are within 1: d is formed from the logits' own difference (see make_point)
};

template <typename A> DS_HD RowNorms<A> row_norms(Norm<A> s, Norm<A> t) {
  RowNorms<A> r;
  r.s = s;
  r.t = t;
  r.dmx = t.mx - s.mx;
  r.dlz = t.lz - s.lz;
  r.dd = r.dmx + r.dlz;
  r.close = r.dmx > A(-1) && r.dmx < A(1);
  return r;
}

// log2 p of a logit x (not yet scaled; k2 = log2(e) / T) under a row's normaliser.
template <typename A> DS_HD A log2_prob(A x, A k2, const Norm<A>& n) { return (x * k2 - n.mx) - n.lz; }

// The point of an entry from its logits xs, xt (not yet scaled; k2 = log2(e) / T) and the rows' normalisers.
// d = lt - ls two ways (CLOSE is r.close, a row's constant, hoisted out of the entries' loop by the callers):
// where the rows share an offset, from the logits' difference first, ((xt - xs) k2 - (dmx + dlz)) ln 2 (one fused
// multiply-add with the row's constants k2 ln 2 and (dmx + dlz) ln 2, whose roundings are a normaliser's error):
// the difference is exact for 16-bit logits, so d keeps its digits where the distributions nearly agree; otherwise
// from each row's shifted logit,
// (b - mt) - (a - ms) - dlz: exact near each maximum, where the mass is.
template <bool CLOSE, typename A> DS_HD Point<A> make_point(A xs, A xt, A k2, const RowNorms<A>& r) {
  Point<A> e;
  const A as = xs * k2 - r.s.mx, at = xt * k2 - r.t.mx;  // shifted scaled logits, base 2
  const A ls2 = as - r.s.lz, lt2 = at - r.t.lz;
  e.ps = d_exp2(ls2);
  e.pt = d_exp2(lt2);
  e.ls = ls2 * A(kLn2);
  e.lt = lt2 * A(kLn2);
  // CLOSE: natural units straight from the logits' difference, one multiply-add per entry (the scale k2 ln 2 = 1/T
  // and dd ln 2 are the row's constants, hoisted out of the entries' loop).
  e.d = CLOSE ? d_fma(xt - xs, k2 * A(kLn2), -(r.dd * A(kLn2))) : ((at - as) - r.dlz) * A(kLn2);
  return e;
}
// make_point's d alone, by the same operations (the two must stay alike: a chunk's test on d, fast_rows'
// kJsdPlainChunks, vouches for the points made after it).
template <bool CLOSE, typename A> DS_HD A point_d(A xs, A xt, A k2, const RowNorms<A>& r) {
  return CLOSE ? d_fma(xt - xs, k2 * A(kLn2), -(r.dd * A(kLn2)))
               : (((xt * k2 - r.t.mx) - (xs * k2 - r.s.mx)) - r.dlz) * A(kLn2);
}
// point_d in base 2 (d log2(e): the same operations without the multiplication by ln 2).
template <bool CLOSE, typename A> DS_HD A point_d2(A xs, A xt, A k2, const RowNorms<A>& r) {
  return CLOSE ? d_fma(xt - xs, k2, -r.dd) : ((xt * k2 - r.t.mx) - (xs * k2 - r.s.mx)) - r.dlz;
}

// A vocabulary split across ranks: each rank's statistics of its slice of every row, gathered as parts
// [world, n, width] (rank r's at index r), are combined by every rank alike, in rank order, so all ranks get the
// same bits (distill_combine; a reduction kernel could pair the ranks otherwise).

// One distribution's normaliser over the whole row from its slices' (part[r * stride], part[r * stride + 1]) =
// (mx_r, lz_r), r < world: the largest max, and log2 sum_r 2^(lz_r + mx_r - max), in float64. A row without mass
// anywhere (every max -inf, a masked row) keeps (-inf, -inf); a NaN anywhere makes both NaN.
template <typename A> DS_HD Norm<A> combine_norm(const A* part, int64_t stride, int64_t world) {
  double top = ninf<double>();
  bool nan = false;
  for (int64_t r = 0; r < world; ++r) {
    const double m = static_cast<double>(part[r * stride]);
    nan = nan || m != m;
    top = m > top ? m : top;
  }
  if (nan) top = std::numeric_limits<double>::quiet_NaN();
  const double shift = top == ninf<double>() ? 0.0 : top;  // -inf - -inf would be NaN
  double total = 0.0;
  for (int64_t r = 0; r < world; ++r)
    total += d_exp2((static_cast<double>(part[r * stride + 1]) + static_cast<double>(part[r * stride])) - shift);
  return Norm<A>{static_cast<A>(top), static_cast<A>(d_log2(total))};
}

// Row i's two normalisers (student's, teacher's) from parts [world, n, 4], written to out[4 i .. 4 i + 3].
template <typename A> DS_HD void combine_row_norms(const A* parts, int64_t i, int64_t n, int64_t world, A* out) {
  const Norm<A> s = usable(combine_norm(parts + 4 * i, 4 * n, world));  // the whole row's (see usable)
  const Norm<A> t = usable(combine_norm(parts + 4 * i + 2, 4 * n, world));
  out[4 * i] = s.mx;
  out[4 * i + 1] = s.lz;
  out[4 * i + 2] = t.mx;
  out[4 * i + 3] = t.lz;
}

// A row's (loss, ks, kt) from its slices' partial sums (part[r * stride + 0..2], r < world), added in rank order in
// parts' type: float32 on CUDA, whose kernels sum each slice in float32 lanes; float64 from the CPU twin, whose
// rows' sums are double, so that its split's K sums are rounded once, as one process's are (kernels/NOTES.md,
// version 47).
template <typename A> DS_HD void combine_terms(const A* part, int64_t stride, int64_t world, A& loss, A& ks, A& kt) {
  loss = part[0];
  ks = part[1];
  kt = part[2];
  for (int64_t r = 1; r < world; ++r) {
    loss = loss + part[r * stride];
    ks = ks + part[r * stride + 1];
    kt = kt + part[r * stride + 2];
  }
}

// A bucket of a top-k row from probabilities and their logs (the teacher's log-probabilities are given).
template <typename A> DS_HD Point<A> bucket_point(A ps, A ls, A pt, A lt) {
  Point<A> e;
  e.ls = ls;
  e.lt = lt;
  e.ps = ps;
  e.pt = pt;
  e.d = lt - ls;
  return e;
}

}  // namespace distill
