// The moment form: forward or reverse KL of a row without a gradient, from one read of the row and no normaliser
// known beforehand (the CUDA kernel moment_kernel, distill_moment.cuh, and the CPU twin share these functions).
// Plain C++, no torch; included after distill_common.h.
//
// Write P for the distribution that weights the divergence (the teacher for forward KL, the student for reverse)
// and Q for the other, xp and xq for their logits. With
//   e_v = 2^((xp_v - o) k2)              P's unnormalised probabilities at a scale o (a raw logit: see below),
//   d_v = (xp_v - xq_v) k2 - K           log2(p_v / q_v) up to a row constant (K: MomentRef, below),
//   c   = sum e d / sum e                the P-mean of d,  x_v = (d_v - c) ln 2,
// the divergence is KL(P || Q) = E_P[log(p / q)] = log E_P[e^-(x)] (the mean of x is 0), so
//   KL = log1p(B / Z),   Z = sum e,   B = sum e g(x),   g(x) = e^-x - 1 + x >= 0.
// Every term of B is non-negative, so B carries its relative digits however closely P and Q agree (g comes from
// its power series where |x| < 0.5, as distill_common.h's kl_term), and the loss is never below 0. Nothing needs
// the rows' logsumexps, so a row is read once, entry by entry, with two exponentials an entry (e, and e e^-x by
// one exponential of the difference of exponents), where the two-normaliser form reads a row twice (or keeps it on
// chip) and takes four.
//
// A part of a row (a group of entries, a thread's, a warp's) keeps (o, Z, c, B) at its own mean c. Two parts merge
// exactly at the new mean c = c1 + Z2 / (Z1 + Z2) (c2 - c1):
//   B = sum_i e^(y_i) B_i + Z_i phi(y_i),   y_i = (c - c_i) ln 2,   phi(y) = e^y - 1 - y >= 0,
// again a sum of non-negative terms: no step of the reduction cancels. A group's mean comes from its own entries
// (a second look at the registers that hold them), so the group's B never needs re-centring. An inexact centre
// (approximate divisions) costs only a relative error of its own size: the formula assumes sum e (d - c) = 0.
//
// Scales: e is taken against the part's largest raw logit o (xp - o is exact for 16-bit logits), so parts of one
// row differ only by exact powers 2^((o1 - o2) k2) up to one rounding; K, the row's reference for d, is a multiple
// of 1/256 (base 2), so subtracting it rounds nothing common to a group. The entries' q-mass enters B through e e^-x,
// formed as 2^((xp - o) k2 - (d - c)): exact where P has mass. Where xp = -inf (P has no mass but Q may) that form is
// NaN, and so is a NaN logit: a group whose sums come out NaN is taken again by the careful form (moment_group_careful:
// Q's mass from xq directly, selects around the infinities), so a padded vocabulary costs a few careful groups.
// Q's mass in parts with no P mass at all (o = -inf) is kept as its own (max, sum) pair and added at the end.
//
// What the moment form does not take on (the row's result is NaN, and the caller computes that row by the
// two-normaliser form instead, which gives the kit's usual answer): a student -inf where the teacher has mass (KL
// +inf), Q's mass beyond 2^127 of P's largest, a part whose scaled maximum lies beyond offset_limit (distill_common.h),
// an empty P. moment_loss returns NaN for those, and for a NaN logit.
#pragma once

namespace distill {

// phi(y) / y^2 = sum_{j>=0} y^j / (j + 2)! on |y| < 0.5 (float: 7 terms, truncation below 5e-8 relative; double:
// 15, below 2e-19).
DS_HD float phi_over_y2(float y) {
  constexpr float c[7] = {1.f / 2, 1.f / 6, 1.f / 24, 1.f / 120, 1.f / 720, 1.f / 5040, 1.f / 40320};
  return horner(c, y);
}
DS_HD double phi_over_y2(double y) {
  constexpr double c[15] = {
      1.0 / 2,         1.0 / 6,          1.0 / 24,          1.0 / 120,           1.0 / 720,
      1.0 / 5040,      1.0 / 40320,      1.0 / 362880,      1.0 / 3628800,       1.0 / 39916800,
      1.0 / 479001600, 1.0 / 6227020800, 1.0 / 87178291200, 1.0 / 1307674368000, 1.0 / 20922789888000};
  return horner(c, y);
}
// phi(y) = e^y - 1 - y given ey = e^y: the series where |y| < 0.5, else directly.
template <typename A> DS_HD A phi(A y, A ey) {
  const A yy = y * y;
  return yy < A(kSeriesLimit * kSeriesLimit) ? yy * phi_over_y2(y) : (ey - A(1)) - y;
}
// A quotient whose rounding does not matter (a centre: see the top of this file).
DS_HD float div_approx(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdividef(a, b);
#else
  return a / b;
#endif
}
DS_HD double div_approx(double a, double b) { return a / b; }
#if defined(__CUDACC__)
#define DS_NOINLINE __host__ __device__ __noinline__
#else
#define DS_NOINLINE inline
#endif
DS_HD float d_log1p(float v) { return log1pf(v); }
DS_HD double d_log1p(double v) { return log1p(v); }

// A part of a row: P's largest raw logit o (-inf: no P mass yet), Z and B at scale o and centre c (base 2, relative
// to the row's reference), and Q's mass where P had none, (qo, qs): qo the largest raw Q logit there, qs = sum 2^((xq -
// qo) k2).
template <typename A> struct Moment { A o, z, c, b, qo, qs; };
template <typename A> DS_HD Moment<A> moment_empty() { return Moment<A>{ninf<A>(), A(0), A(0), A(0), ninf<A>(), A(0)}; }

// Adds a part (z, c, b) at m's scale to m, at the new mean (see the top of this file). A part with neither P nor Q
// mass adds nothing; a part with Q mass only (z = 0) is moved to m's centre.
template <typename A> DS_HD void moment_add(Moment<A>& m, A z, A c, A b) {
  if (z == A(0) && b == A(0)) return;
  if (m.z == A(0) && m.b == A(0)) {
    m.z = z;
    m.c = c;
    m.b = b;
    return;
  }
  const A zn = m.z + z;
  const A w = zn > A(0) ? div_approx(z, zn) : A(0);
  const A cn = d_fma(w, c - m.c, m.c);
  const A y1 = (cn - m.c) * A(kLn2), y2 = (cn - c) * A(kLn2);
  const A e1 = d_exp2(cn - m.c), e2 = d_exp2(cn - c);
  m.b = (e1 * m.b + m.z * phi(y1, e1)) + (e2 * b + z * phi(y2, e2));
  m.z = zn;
  m.c = cn;
}

// A part's (z, b) moved to the scale `to` >= m.o.
template <typename A> DS_HD void moment_rescale(Moment<A>& m, A to, A k2) {
  if (m.o == to) return;
  const A f = d_exp2((m.o - to) * k2);  // m.o = -inf: 0
  m.z *= f;
  m.b *= f;
  m.o = to;
}

// Q's (max, sum) pairs where P had no mass, combined (a pair with no mass adds nothing).
template <typename A> DS_HD void moment_q_add(Moment<A>& m, A qo, A qs, A k2) {
  if (!(qs > A(0))) {
    if (qs != qs) m.qs = qs;
    return;
  }
  if (!(m.qs > A(0)) && m.qs == m.qs) {
    m.qo = qo;
    m.qs = qs;
    return;
  }
  const A top = m.qo > qo ? m.qo : qo;
  m.qs = m.qs * d_exp2((m.qo - top) * k2) + qs * d_exp2((qo - top) * k2);
  m.qo = top;
}

// Merges part n into m (any scales).
template <typename A> DS_HD void moment_merge(Moment<A>& m, Moment<A> n, A k2) {
  const A top = m.o > n.o ? m.o : n.o;
  moment_rescale(m, top, k2);
  moment_rescale(n, top, k2);
  moment_add(m, n.z, n.c, n.b);
  moment_q_add(m, n.qo, n.qs, k2);
}

// The row's reference for d (see the top of this file): its first entry's logits where both are finite (else 0),
// and K = log2(p / q) there, rounded to a multiple of 1/256 (exact, and small d keeps its digits). Rows take d = (xp -
// xq) k2 - K (K keeps d and c near 0 whatever offset the two rows have): xp - xq is exact in float lanes for 16-bit
// logits, and for wider ones where the two rows are close (exact where xp and xq are within a factor 2 of each other,
// as where P and Q agree). float32 and float64 rows whose first logits differ by 32 or more (base 2, moment_shift) take
// d = ((xp - p0) - (xq - q0)) k2 (SHIFT) instead: at logits of +-1e4 xp - xq itself is rounded (2e-3), while the
// two shifts are exact near p0 and q0. Below that offset the plain difference rounds less than the two shifts,
// whose error grows with the row's spread around its first entry.
template <typename A> struct MomentRef { A p0, q0, K; };
template <typename A> DS_HD MomentRef<A> moment_reference(A xp0, A xq0, A k2) {
  const bool finite = xp0 - xp0 == A(0) && xq0 - xq0 == A(0);
  MomentRef<A> r{finite ? xp0 : A(0), finite ? xq0 : A(0), A(0)};
  const A d = (r.p0 - r.q0) * k2;
  r.K = d > A(-65536) && d < A(65536) ? A(static_cast<long long>(d * A(256) + (d < A(0) ? A(-0.5) : A(0.5)))) / A(256)
                                      : A(0);
  return r;
}
template <typename T, typename A> DS_HD bool moment_shift(const MomentRef<A>& r, A k2) {
  const A gap = (r.p0 - r.q0) * k2;
  return sizeof(T) > 2 && !(gap < A(32) && gap > A(-32));
}
template <bool SHIFT, typename A> DS_HD A moment_d(A xp, A xq, A k2, const MomentRef<A>& r) {
  return SHIFT ? ((xp - r.p0) - (xq - r.q0)) * k2 : d_fma(xp - xq, k2, -r.K);
}
// log2 of Q's mass at a logit xq against P's scale o, at centre c: the exponent of e e^-x where P has no mass.
template <bool SHIFT, typename A> DS_HD A moment_q_exponent(A xq, A o, A c, A k2, const MomentRef<A>& r) {
  return SHIFT ? d_fma(xq - r.q0, k2, d_fma(r.p0 - o, k2, c)) : d_fma(xq - o, k2, r.K) + c;
}

// One group of N entries' sums at P's scale o: Z, the group's centre c and B (xp, xq: raw logits in the
// accumulation type; entries past the row's end are -inf in both). FAST: the plain form, whose sums are NaN where
// xp = -inf or a logit is NaN (moment_group then takes the group again with FAST = false: the careful form).
// c_empty: the centre of a group without P mass (its Q mass is taken there).
template <bool FAST, bool SHIFT, int N, typename A>
DS_HD void moment_group_sums(const A (&xp)[N], const A (&xq)[N], A o, A c_empty, A k2, const MomentRef<A>& r, A& z,
                             A& c, A& b) {
  A e[N], a = A(0);
  z = A(0);
#pragma unroll
  for (int i = 0; i < N; ++i) {
    e[i] = d_exp2((xp[i] - o) * k2);
    const A d = moment_d<SHIFT>(xp[i], xq[i], k2, r);
    z += e[i];
    if (FAST) a = d_fma(e[i], d, a);
    else a = e[i] > A(0) ? d_fma(e[i], d, a) : a;  // no P mass here: d may be +-inf or NaN
  }
  c = z > A(0) ? div_approx(a, z) : c_empty;
  b = A(0);
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const A x2 = moment_d<SHIFT>(xp[i], xq[i], k2, r) - c;  // (d - c), base 2
    const A x = x2 * A(kLn2);
    // e e^-x: from P's exponent where P has mass; from Q's logit in the careful form where it has none
    const A eq =
        FAST || e[i] > A(0) ? d_exp2((xp[i] - o) * k2 - x2) : d_exp2(moment_q_exponent<SHIFT>(xq[i], o, c, k2, r));
    const A xx = x * x;
    const A series = e[i] * xx * phi_over_y2(-x);
    const A direct = FAST || e[i] > A(0) ? d_fma(e[i], x, eq - e[i]) : eq;
    b += xx < A(kSeriesLimit * kSeriesLimit) ? series : direct;
  }
}

// The careful form of a group, out of line: rare (padding at -inf, NaN logits), and inlined it took registers
// from the plain form's loop.
template <bool SHIFT, int N, typename A>
DS_NOINLINE void moment_group_careful(const A (&xp)[N], const A (&xq)[N], A o, A c_empty, A k2, const MomentRef<A>& r,
                                      A& z, A& c, A& b) {
  moment_group_sums<false, SHIFT>(xp, xq, o, c_empty, k2, r, z, c, b);
}

// A group of N entries added to m.
template <bool SHIFT, int N, typename A>
DS_HD void moment_group(Moment<A>& m, const A (&xp)[N], const A (&xq)[N], A k2, const MomentRef<A>& r) {
  A top = ninf<A>(), qtop = ninf<A>();
#pragma unroll
  for (int i = 0; i < N; ++i) top = xp[i] > top ? xp[i] : top;  // (a NaN logit shows in the sums below)
  if (top > m.o) moment_rescale(m, top, k2);
  if (m.o == ninf<A>()) {  // no P mass so far: Q's mass as its own pair
#pragma unroll
    for (int i = 0; i < N; ++i) qtop = xq[i] > qtop ? xq[i] : qtop;
    A qs = A(0);
    if (qtop != ninf<A>())
#pragma unroll
      for (int i = 0; i < N; ++i) qs += d_exp2((xq[i] - qtop) * k2);
#pragma unroll
    for (int i = 0; i < N; ++i) qs = xp[i] != xp[i] ? xp[i] : qs;  // a NaN P logit (top passed it over)
    moment_q_add(m, qtop, qs, k2);
    return;
  }
  A z, c, b;
  moment_group_sums<true, SHIFT>(xp, xq, m.o, m.c, k2, r, z, c, b);
  if (b != b || z != z || c != c) moment_group_careful<SHIFT>(xp, xq, m.o, m.c, k2, r, z, c, b);
  moment_add(m, z, c, b);
}

// The row's divergence from its whole Moment, or NaN where the moment form does not apply (see the top of this
// file): the caller then takes the row by the two-normaliser form.
template <bool SHIFT, typename A> DS_HD A moment_loss(Moment<A> m, A k2, const MomentRef<A>& r) {
  if (m.qs > A(0)) m.b += m.qs * d_exp2(moment_q_exponent<SHIFT>(m.qo, m.o, m.c, k2, r));  // Q's mass where P had none
  const A so = m.o * k2;
  const bool ok =
      m.z > A(0) && m.b - m.b == A(0) && m.c - m.c == A(0) && m.qs == m.qs && offset_ok(so) && so - so == A(0);
  if (!ok) return std::numeric_limits<A>::quiet_NaN();
  return d_log1p(m.b / m.z);
}

}  // namespace distill
