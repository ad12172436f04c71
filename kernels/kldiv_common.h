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

template <typename T> KL_HD T kl_nan() { return std::numeric_limits<T>::quiet_NaN(); }
template <typename T> KL_HD bool kl_isfinite(T v) { return (v - v) == T(0); }  // inf - inf and NaN give NaN

// xlogy(t, t) as PyTorch defines it: 0 where t == 0 (also for t == -0), NaN where t is NaN.
template <typename T> KL_HD T xlogy_self(T t) { return t == T(0) ? T(0) : t * kl_log(t); }

// One element of the loss. x: the input (log-probability, or probability for FORM_PROBS); t: the target.
// LOWP: the inputs were 16-bit (see kl_log_p); it changes only the log's implementation in the hot case.
template <typename T, int FORM, bool LOG_TARGET, bool LOWP = false>
KL_HD T kl_point(T x, T t) {
  if (LOG_TARGET) {
    const T logp = FORM == FORM_PROBS ? kl_log(x) : x;
    return kl_exp(t) * (t - logp);
  }
  if (FORM == FORM_PROBS) {
    // t * (log t - log p) = t * log(t / p): one log instead of two, and no cancellation between two logs of
    // similar size. Valid whenever t > 0 and t / p is a normal finite number; every other case (t == 0,
    // p <= 0, infinities, NaN, a ratio that over/underflows) takes PyTorch's literal formula.
    const T r = t / x;
    if (t > T(0) && r >= std::numeric_limits<T>::min() && r <= std::numeric_limits<T>::max())
      return t * kl_log_p<LOWP>(r);
    return xlogy_self(t) - t * kl_log(x);
  }
  // t * (log t - x) for finite t > 0: the same value as xlogy(t, t) - t * x, rounded once instead of twice.
  if (t >= std::numeric_limits<T>::min() && t <= std::numeric_limits<T>::max())
    return t * (kl_log_p<LOWP>(t) - x);
  return xlogy_self(t) - t * x;
}

// d kl_point / d x.
template <typename T, int FORM, bool LOG_TARGET>
KL_HD T kl_grad_input(T x, T t) {
  const T w = LOG_TARGET ? kl_exp(t) : t;  // d loss / d logp = -w
  return FORM == FORM_PROBS ? -w / x : -w;
}

// kl_point and kl_grad_input together, sharing the ratio t / p of the probability form (the gradient
// -t / p is exactly the negated ratio): the fused training pass costs one multiply more than the loss.
template <typename T, int FORM, bool LOG_TARGET, bool LOWP = false>
KL_HD T kl_point_grad(T x, T t, T& dx) {
  if (FORM == FORM_PROBS && !LOG_TARGET) {
    const T r = t / x;
    dx = -r;
    if (t > T(0) && r >= std::numeric_limits<T>::min() && r <= std::numeric_limits<T>::max())
      return t * kl_log_p<LOWP>(r);
    return xlogy_self(t) - t * kl_log(x);
  }
  dx = kl_grad_input<T, FORM, LOG_TARGET>(x, t);
  return kl_point<T, FORM, LOG_TARGET, LOWP>(x, t);
}

// d kl_point / d t. For log_target = false autograd differentiates xlogy(t, t) = t * log(t) through both
// arguments: log(t) + t / t, which is NaN at t == 0 and at infinite t (pytorch#89558). We return the same.
template <typename T, int FORM, bool LOG_TARGET>
KL_HD T kl_grad_target(T x, T t) {
  const T logp = FORM == FORM_PROBS ? kl_log(x) : x;
  if (LOG_TARGET) return kl_exp(t) * (t - logp + T(1));
  if (t == T(0) || !kl_isfinite(t)) return kl_nan<T>();
  return kl_log(t) + T(1) - logp;
}

}  // namespace kldiv
