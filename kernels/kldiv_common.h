// The KL-divergence arithmetic, one element at a time, shared by the CUDA kernels (kldiv.cu) and the CPU
// twin (kldiv_cpu.cpp) so that both compute the same function. Plain C++ with no torch headers.
//
// Semantics are PyTorch's (torch.nn.functional.kl_div, ATen's Loss.cpp), element by element:
//   log_target = false:  xlogy(t, t) - t * logp      (xlogy: 0 where t == 0, NaN where t is NaN)
//   log_target = true:   exp(t) * (t - logp)
// where logp is the input itself (FORM_LOGP, PyTorch's convention) or log(input) (FORM_PROBS, the fused
// form of F.kl_div(torch.log(p), t)). The gradients are those autograd derives from those expressions.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__CUDACC__)
#define KL_HD __host__ __device__ __forceinline__
#else
#define KL_HD inline
#endif

namespace kldiv {

enum Form : int { FORM_LOGP = 0, FORM_PROBS = 1 };

// Accurate (about 1 ulp) log and exp on both sides. The fast hardware log (__logf) has an absolute error
// near 2^-22 in log2 units that does not cancel over 2^28 elements: it would break the 1e-6 accuracy goal.
KL_HD float kl_log(float v) { return logf(v); }
KL_HD double kl_log(double v) { return log(v); }
KL_HD float kl_exp(float v) { return expf(v); }
KL_HD double kl_exp(double v) { return exp(v); }

// For 16-bit inputs (LOWP) the device uses the hardware log, __logf: its ~2^-22 absolute error is far below
// the inputs' own resolution, and it is several times cheaper than logf. The host keeps the accurate one.
template <bool LOWP> KL_HD float kl_log_p(float v) {
#if defined(__CUDA_ARCH__)
  if (LOWP) return __logf(v);
#endif
  return kl_log(v);
}
template <bool LOWP> KL_HD double kl_log_p(double v) { return kl_log(v); }

// The hot case's ratio t / p (FORM_PROBS). float on the GPU: the hardware reciprocal (rcp.approx) and one
// correction of the quotient, q + (t - p q) / p by two FMAs: within 1 ulp of t / p wherever the quotient is a
// normal number and no step over- or underflows; elsewhere (p = 0, subnormal or infinite, a quotient out of
// range) it comes out inf, 0 or NaN, which kl_is_hot sends to kl_literal like the exact quotient's. 4 instructions
// where IEEE division takes ~10 (its range check and slow-path branch are issued for every element): the
// probability form's forward sat at 1.07 x its floor on an H200 with it, bound by issue. Measured (one H200,
// tools/kl_trees.py, kernels/NOTES.md "Versions"): the float32 forward -4.5%, its training step -1.2%, the bf16
// log-probability forward unchanged. false compiles every kernel of kldiv.cu to the instructions it had.
constexpr bool kRatioApprox = true;
KL_HD float kl_ratio(float t, float p) {
#if defined(__CUDA_ARCH__)
  if (kRatioApprox) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(p));
    const float q = t * r;
    return fmaf(fmaf(-p, q, t), r, q);
  }
#endif
  return t / p;
}
KL_HD double kl_ratio(double t, double p) { return t / p; }

template <typename T> KL_HD T kl_nan() { return std::numeric_limits<T>::quiet_NaN(); }
template <typename T> KL_HD bool kl_isfinite(T v) { return (v - v) == T(0); }  // inf - inf and NaN give NaN

// xlogy(t, t) as PyTorch defines it: 0 where t == 0 (also for t == -0), NaN where t is NaN.
template <typename T> KL_HD T xlogy_self(T t) { return t == T(0) ? T(0) : t * kl_log(t); }

// The accurate log, or (LOWP on the device) the hardware one, as a function object for kl_hot.
template <bool LOWP> struct KlLog {
  template <typename T> KL_HD T operator()(T v) const { return kl_log_p<LOWP>(v); }
};

// Every path (both CUDA kernels' forms, the CPU twin's exact and vectorised loops) computes an element
// through the functions below; only the log's implementation differs between callers.
//
// The hot case without log_target, one log: t * log(t / p) (FORM_PROBS; no cancellation between two logs of
// similar size) or t * (log t - x) (FORM_LOGP; the value of xlogy(t, t) - t * x, rounded once instead of
// twice). It applies when t > 0 and the log's argument `arg` (t / p, or t) is a normal finite number; every
// other case (t == 0, p <= 0, infinities, NaN, a ratio that over/underflows) takes kl_literal.
template <typename T, int FORM>
KL_HD bool kl_is_hot(T t, T arg) {
  const bool normal = (arg >= std::numeric_limits<T>::min()) & (arg <= std::numeric_limits<T>::max());
  return FORM == FORM_PROBS ? (t > T(0)) & normal : normal;
}

// The hot case's value and log argument, and whether it applies. `value` and `arg` are written either way
// (`log` must accept any argument), so that a vectorising caller can select without branching.
template <typename T, int FORM, typename Log>
KL_HD bool kl_hot(T x, T t, Log log, T& value, T& arg) {
  arg = FORM == FORM_PROBS ? kl_ratio(t, x) : t;
  value = FORM == FORM_PROBS ? t * log(arg) : t * (log(arg) - x);
  return kl_is_hot<T, FORM>(t, arg);
}

// PyTorch's formula, literally: xlogy(t, t) - t * logp.
template <typename T, int FORM>
KL_HD T kl_literal(T x, T t) {
  return xlogy_self(t) - t * (FORM == FORM_PROBS ? kl_log(x) : x);
}

// One element of the loss. x: the input (log-probability, or probability for FORM_PROBS); t: the target.
// LOWP: the inputs were 16-bit (see kl_log_p); it changes only the log's implementation in the hot case.
template <typename T, int FORM, bool LOG_TARGET, bool LOWP = false>
KL_HD T kl_point(T x, T t) {
  if (LOG_TARGET) {
    const T logp = FORM == FORM_PROBS ? kl_log(x) : x;
    return kl_exp(t) * (t - logp);
  }
  T value, arg;
  if (kl_hot<T, FORM>(x, t, KlLog<LOWP>{}, value, arg)) return value;
  return kl_literal<T, FORM>(x, t);
}

// kl_grad_input in the hot case, from its log argument: -(t / p) * g reuses the ratio, which keeps the fused
// training pass at one division. The ratio is normal there and g (one over the divisor) is at most 1.
template <typename T, int FORM>
KL_HD T kl_hot_grad(T t, T arg, T g) {
  return FORM == FORM_PROBS ? -arg * g : -t * g;
}

// d kl_point / d x, times g (grad_output over the reduction's divisor). Outside the hot case, in the order
// autograd evaluates F.kl_div(torch.log(p), t): the weight times g, then divided by p. Dividing first (t / p,
// then times g) overflows where t / p exceeds the type's range (p subnormal, a softmax's saturated tail)
// while the gradient itself, smaller by the divisor, does not. In the hot case, kl_hot_grad: a gradient
// recomputed by backward has the bits of the fused pass's.
template <typename T, int FORM, bool LOG_TARGET>
KL_HD T kl_grad_input(T x, T t, T g) {
  if (FORM == FORM_PROBS && !LOG_TARGET) {
    const T r = kl_ratio(t, x);  // (kl_hot's: a recomputed gradient has the fused pass's bits)
    if (kl_is_hot<T, FORM>(t, r)) return kl_hot_grad<T, FORM>(t, r, g);
  }
  const T w = LOG_TARGET ? kl_exp(t) : t;  // d loss / d logp = -w
  return FORM == FORM_PROBS ? -(w * g) / x : -(w * g);
}

// kl_point and kl_grad_input (times g) together: the fused training pass.
template <typename T, int FORM, bool LOG_TARGET, bool LOWP = false>
KL_HD T kl_point_grad(T x, T t, T g, T& dx) {
  if (!LOG_TARGET) {
    T value, arg;
    if (kl_hot<T, FORM>(x, t, KlLog<LOWP>{}, value, arg)) {
      dx = kl_hot_grad<T, FORM>(t, arg, g);
      return value;
    }
    dx = kl_grad_input<T, FORM, false>(x, t, g);
    return kl_literal<T, FORM>(x, t);
  }
  dx = kl_grad_input<T, FORM, LOG_TARGET>(x, t, g);
  return kl_point<T, FORM, LOG_TARGET, LOWP>(x, t);
}

// d kl_point / d t, times g (grad_output over the reduction's divisor). For log_target = false autograd
// differentiates xlogy(t, t) = t * log(t) through both arguments: log(t) + t / t, which is NaN at t == 0 and at
// infinite t (pytorch#89558). We return the same. Each term takes g before the terms are added, as autograd's
// chain does (g (t - logp) e^t + g e^t; g log t + g - g logp): the sum first overflowed where it exceeds the
// type's range (t - logp near the largest float) while each term times g, smaller by the divisor, does not.
template <typename T, int FORM, bool LOG_TARGET>
KL_HD T kl_grad_target(T x, T t, T g) {
  const T logp = FORM == FORM_PROBS ? kl_log(x) : x;
  if (LOG_TARGET) {
    const T e = kl_exp(t);
    return (g * (t - logp)) * e + g * e;
  }
  if (t == T(0) || !kl_isfinite(t)) return kl_nan<T>();
  return (g * kl_log(t) + g) - g * logp;
}

}  // namespace kldiv
