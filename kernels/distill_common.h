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
// Accuracy: every KL is summed in its non-negative form, entry by entry,
//   KL(p || q) = sum_v [p log(p / q) - p + q] = sum_v q f(u),  u = log p - log q,  f(u) = u e^u - expm1(u) >= 0,
// (the added terms sum to 0 because p and q are normalised). No entry is negative, so a divergence is never
// below 0 however closely student and teacher agree, and f is evaluated by its series where |u| is small, where
// p log(p / q) alone would cancel. An error c in the row's normaliser moves the sum only by c * KL (f'(u) summed
// with weights q is the KL itself), so the logsumexp's rounding costs a relative, not an absolute, error.
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
// LOWP (16-bit logits) may use the device's hardware log: its ~2^-22 absolute error is far below the inputs' own
// resolution. exp stays accurate: the probabilities weigh every term.
DS_HD float d_exp(float v) { return expf(v); }
DS_HD double d_exp(double v) { return exp(v); }
DS_HD float d_log(float v) { return logf(v); }
DS_HD double d_log(double v) { return log(v); }
template <bool LOWP> DS_HD float d_log_p(float v) {
#if defined(__CUDA_ARCH__)
  if (LOWP) return __logf(v);
#endif
  return d_log(v);
}
template <bool LOWP> DS_HD double d_log_p(double v) { return d_log(v); }

// log(exp(x) + exp(y)) without overflow; -inf when both are -inf.
template <typename A> DS_HD A log_add_exp(A x, A y) {
  const A hi = x > y ? x : y, lo = x > y ? y : x;
  if (hi == ninf<A>()) return hi;
  return hi + d_log(A(1) + d_exp(lo - hi));
}

// Where |u| is below this, f(u) comes from its series (truncation below the type's rounding there).
template <typename A> DS_HD A series_limit() { return A(0.5); }

// f(u) / u^2 = sum_{k>=2} (k - 1) / k! u^(k-2), Horner form. float: terms to u^10 (truncation < 3e-8 of the
// value at |u| = 0.5); double: to u^16 (< 3e-17).
DS_HD float f_over_u2(float u) {
  float r = 1.0f / 403200.0f;  // 9/10!
  r = r * u + 1.0f / 45360.0f;  // 8/9!
  r = r * u + 1.0f / 5760.0f;   // 7/8!
  r = r * u + 1.0f / 840.0f;
  r = r * u + 1.0f / 144.0f;
  r = r * u + 1.0f / 30.0f;
  r = r * u + 1.0f / 8.0f;
  r = r * u + 1.0f / 3.0f;
  return r * u + 0.5f;
}
DS_HD double f_over_u2(double u) {
  // (k - 1) / k! for k = 16 .. 2
  double r = 15.0 / 20922789888000.0;
  r = r * u + 14.0 / 1307674368000.0;
  r = r * u + 13.0 / 87178291200.0;
  r = r * u + 12.0 / 6227020800.0;
  r = r * u + 11.0 / 479001600.0;
  r = r * u + 10.0 / 39916800.0;
  r = r * u + 9.0 / 3628800.0;
  r = r * u + 8.0 / 362880.0;
  r = r * u + 7.0 / 40320.0;
  r = r * u + 6.0 / 5040.0;
  r = r * u + 5.0 / 720.0;
  r = r * u + 4.0 / 120.0;
  r = r * u + 3.0 / 24.0;
  r = r * u + 2.0 / 6.0;
  return r * u + 0.5;
}

// The summand q f(u) = p log(p / q) - p + q of KL(p || q), u = log p - log q (given, computed accurately by the
// caller). p == 0 contributes q (the limit of p log p), q == 0 < p contributes +inf, p == q == 0 contributes 0.
template <typename A> DS_HD A kl_term(A p, A q, A u) {
  const A au = u < A(0) ? -u : u;
  if (au < series_limit<A>()) return q * (u * u) * f_over_u2(u);
  return (p > A(0) ? p * u : A(0)) - p + q;
}

// One entry (or bucket): log-probabilities and probabilities of student and teacher, and d = lt - ls computed
// without the rounding of the two normalisers' difference where the caller can (see the kernels).
template <typename A> struct Point {
  A ls, lt, ps, pt, d;
};

// Constants of a row that every entry needs: beta and the logs of the mixture weights (JSD only).
template <typename A> struct RowConst {
  A beta, log_1mb, log_b;
};

template <typename A> DS_HD RowConst<A> row_const(double beta) {
  RowConst<A> c;
  c.beta = static_cast<A>(beta);
  c.log_1mb = beta < 1.0 ? static_cast<A>(std::log1p(-beta)) : ninf<A>();
  c.log_b = beta > 0.0 ? static_cast<A>(std::log(beta)) : ninf<A>();
  return c;
}

// log m, m = (1 - beta) ps + beta pt; in log space when m is not a normal number (both probabilities underflow
// while their logs are finite: log m is then still finite and needed).
template <bool LOWP, typename A> DS_HD A log_mixture(const Point<A>& e, const RowConst<A>& c) {
  const A m = (A(1) - c.beta) * e.ps + c.beta * e.pt;
  if (m >= std::numeric_limits<A>::min()) return d_log_p<LOWP>(m);
  return log_add_exp(e.ls + c.log_1mb, e.lt + c.log_b);
}

DS_HD float d_expm1(float v) { return expm1f(v); }
DS_HD double d_expm1(double v) { return expm1(v); }
DS_HD float d_log1p(float v) { return log1pf(v); }
DS_HD double d_log1p(double v) { return log1p(v); }

// u_s = ls - log m and u_t = lt - log m. Where the two distributions nearly agree (|d| small) from d alone:
// u_s = -log((1 - beta) + beta e^d) = -log1p(beta expm1(d)) and u_t = d + u_s, which keeps the digits that
// ls - log m cancels; elsewhere directly (there d + u_s could cancel two large numbers).
template <bool LOWP, typename A> DS_HD void mixture_u(const Point<A>& e, const RowConst<A>& c, A& us, A& ut) {
  if (e.d > A(-0.5) && e.d < A(0.5)) {
    us = -d_log1p(c.beta * d_expm1(e.d));
    ut = e.d + us;
  } else {
    const A lm = log_mixture<LOWP>(e, c);
    us = e.ls - lm;
    ut = e.lt - lm;
  }
}

// Sums over a row (or the part of it held here) that the gradients need, beside the loss itself:
// ks = sum ps * u_s and kt = sum pt * u_t, the KL of student (teacher) to the distribution it is compared with,
// in the plain form p log(p / q) (the gradient is p (u - K); a zero p contributes 0).
template <typename A> struct Terms {
  A loss, ks, kt;
};

// loss of one entry, and its parts of ks and kt. Non-negative (see the top of this file).
template <int MODE, bool LOWP, typename A> DS_HD void point_terms(const Point<A>& e, const RowConst<A>& c,
                                                                  Terms<A>& acc) {
  if (MODE == FORWARD_KL) {  // KL(pt || ps): q = ps, u = lt - ls
    acc.loss += kl_term(e.pt, e.ps, e.d);
    acc.kt += e.pt > A(0) ? e.pt * e.d : A(0);
  } else if (MODE == REVERSE_KL) {  // KL(ps || pt)
    acc.loss += kl_term(e.ps, e.pt, -e.d);
    acc.ks += e.ps > A(0) ? -e.ps * e.d : A(0);
  } else {
    const A m = (A(1) - c.beta) * e.ps + c.beta * e.pt;
    A us, ut;
    mixture_u<LOWP>(e, c, us, ut);
    acc.loss += c.beta * kl_term(e.pt, m, ut) + (A(1) - c.beta) * kl_term(e.ps, m, us);
    acc.ks += e.ps > A(0) ? e.ps * us : A(0);
    acc.kt += e.pt > A(0) ? e.pt * ut : A(0);
  }
}

// d loss / d a_v (a = student logits / T) of an entry whose own probability is e.ps, before the 1/T and the
// reduction's scale: ps - pt (forward), ps (u_s - ks) (reverse), (1 - beta) ps (u_s - ks) (JSD).
template <int MODE, bool LOWP, typename A> DS_HD A student_grad(const Point<A>& e, const RowConst<A>& c, A ks) {
  if (MODE == FORWARD_KL) return e.ps - e.pt;
  if (!(e.ps > A(0))) return e.ps != e.ps ? e.ps : A(0);  // NaN stays NaN; no mass, no gradient
  if (MODE == REVERSE_KL) return e.ps * (-e.d - ks);
  A us, ut;
  mixture_u<LOWP>(e, c, us, ut);
  return (A(1) - c.beta) * e.ps * (us - ks);
}

// d loss / d b_v (b = teacher logits / T): pt (u_t - kt) (forward), pt - ps (reverse), beta pt (u_t - kt) (JSD).
template <int MODE, bool LOWP, typename A> DS_HD A teacher_grad(const Point<A>& e, const RowConst<A>& c, A kt) {
  if (MODE == REVERSE_KL) return e.pt - e.ps;
  if (!(e.pt > A(0))) return e.pt != e.pt ? e.pt : A(0);
  if (MODE == FORWARD_KL) return e.pt * (e.d - kt);
  A us, ut;
  mixture_u<LOWP>(e, c, us, ut);
  return c.beta * e.pt * (ut - kt);
}

// A row's softmax normaliser of x / T, kept as (max, log of the sum of exp(x / T - max)): log-probabilities are
// formed as (x / T - max) - lz, exact near the maximum whatever the logits' offset (one combined logsumexp
// would be rounded at the offset: 1e-3 at logits of 1e4 in float32).
template <typename A> struct Norm {
  A mx, lz;
};

// Both rows' normalisers, with the differences every entry needs.
template <typename A> struct RowNorms {
  Norm<A> s, t;
  A dmx, dlz;  // t.mx - s.mx, t.lz - s.lz
  bool close;  // the maxima are within 1: d is formed from the logits' own difference (see make_point)
};

template <typename A> DS_HD RowNorms<A> row_norms(Norm<A> s, Norm<A> t) {
  RowNorms<A> r;
  r.s = s;
  r.t = t;
  r.dmx = t.mx - s.mx;
  r.dlz = t.lz - s.lz;
  r.close = r.dmx > A(-1) && r.dmx < A(1);
  return r;
}

// The point of an entry from its logits xs, xt (not yet divided by T) and the rows' normalisers.
// d = lt - ls two ways: where the rows share an offset (close maxima), from the logits' difference first,
// (xt - xs) / T - dmx - dlz: exact for 16-bit logits and keeping u's digits where the distributions nearly
// agree; otherwise from each row's shifted logit, (b - mt) - (a - ms) - dlz: exact near each maximum, where
// the mass is.
template <typename A> DS_HD Point<A> make_point(A xs, A xt, A inv_t, const RowNorms<A>& r) {
  Point<A> e;
  const A as = xs * inv_t - r.s.mx, at = xt * inv_t - r.t.mx;  // shifted scaled logits
  e.ls = as - r.s.lz;
  e.lt = at - r.t.lz;
  e.ps = d_exp(e.ls);
  e.pt = d_exp(e.lt);
  e.d = r.close ? ((xt - xs) * inv_t - r.dmx) - r.dlz : (at - as) - r.dlz;
  return e;
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
