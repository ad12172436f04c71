// KL-divergence loss on the CPU: the twin of kldiv.cu, with the same entry points and semantics
// (kldiv_common.h holds the shared per-element arithmetic).
//
// Work is cut into fixed chunks of kChunk elements, spread over OpenMP threads; each chunk's sum is kept
// apart and the chunk sums are added in order, so the result's bits do not depend on the thread count.
// Sums are accumulated in double: float sums over thousands of terms lose about 1e-6 of the result.
// Contiguous float32 inputs (the common case) take a vectorised fast path: a branch-free log that GCC turns
// into SIMD code, with any chunk that holds a special value (t <= 0, p <= 0, inf, NaN, subnormal, ...)
// recomputed by the exact scalar path. Other dtypes and layouts use the scalar path directly.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>

#include <cstring>
#include <type_traits>
#include <vector>

#include "kldiv_common.h"
#include "kldiv_plan.h"

namespace kldiv {
namespace {

constexpr int64_t kChunk = 1 << 14;
// Below this many elements one thread is faster than waking the OpenMP team (and steadier to time).
constexpr int64_t kParallelMin = 1 << 18;

template <typename T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };

// log(v) for a normal, positive, finite float; under 1 ulp (musl's logf reduction and polynomial). No
// branches and no table, so a loop calling it vectorises.
inline float log_normal_positive(float v) {
  const float ln2_hi = 6.9313812256e-01f, ln2_lo = 9.0580006145e-06f;
  const float Lg1 = 0.66666662693f, Lg2 = 0.40000972152f, Lg3 = 0.28498786688f, Lg4 = 0.24279078841f;
  uint32_t ix;
  std::memcpy(&ix, &v, 4);
  ix += 0x3f800000u - 0x3f3504f3u;  // reduce v = 2^k * m, m in [sqrt(2)/2, sqrt(2))
  const int k = static_cast<int>(ix >> 23) - 0x7f;
  ix = (ix & 0x007fffffu) + 0x3f3504f3u;
  float m;
  std::memcpy(&m, &ix, 4);
  const float f = m - 1.0f;
  const float s = f / (2.0f + f);
  const float z = s * s, w = z * z;
  const float R = z * (Lg1 + w * Lg3) + w * (Lg2 + w * Lg4);
  const float hfsq = 0.5f * f * f;
  const float dk = static_cast<float>(k);
  return s * (hfsq + R) + dk * ln2_lo - hfsq + f + dk * ln2_hi;
}

// kl_hot's log in the fast path. Other arguments give a meaningless number (no trap, no UB): kl_hot reports
// those elements as not hot, and their chunk is recomputed.
struct LogNormalPositive {
  float operator()(float v) const { return log_normal_positive(v); }
};

// Exact path: any dtype, any layout. Returns the chunk's sum; writes the fused gradient when grad != null.
template <typename T, int FORM, bool LOGT>
double chunk_exact(const T* x, const T* t, const Geometry& g, int64_t begin, int64_t end, T* grad, double inv_divisor) {
  using A = typename Acc<T>::type;
  const A gscale = static_cast<A>(inv_divisor);
  double acc = 0;
  for (int64_t i = begin; i < end; ++i) {
    int64_t ox = i, ot = i;
    if (!g.contiguous) offsets(g, i, ox, ot);
    const A xv = static_cast<A>(x[ox]), tv = static_cast<A>(t[ot]);
    if (grad) {
      A dx;
      acc += static_cast<double>(kl_point_grad<A, FORM, LOGT>(xv, tv, gscale, dx));
      grad[i] = static_cast<T>(dx);
    } else {
      acc += static_cast<double>(kl_point<A, FORM, LOGT>(xv, tv));
    }
  }
  return acc;
}

// Fast path for contiguous float32 with log_target = false: kl_hot (the math every path shares) with a
// log that GCC can vectorise. Sets `ok` false if any element is not the hot case (the caller then recomputes
// the chunk, gradient included, with the exact path). Written so that GCC vectorises it: bitwise & of the
// conditions, no early exits, the sum done in a second (scalar, double) loop, and the loader's
// -fno-trapping-math so that the selects around the division are not turned into branches.
template <int FORM, bool GRAD>
double chunk_fast_f32(const float* __restrict x, const float* __restrict t, int64_t begin, int64_t end,
                      float* __restrict grad, double inv_divisor, bool& ok) {
  float vals[kChunk];
  const float gscale = static_cast<float>(inv_divisor);
  const int64_t n = end - begin;
  x += begin;
  t += begin;
  int bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    float value, arg;
    const bool hot = kl_hot<float, FORM>(x[i], t[i], LogNormalPositive{}, value, arg);
    vals[i] = hot ? value : 0.0f;
    bad |= static_cast<int>(!hot);
    if constexpr (GRAD) grad[begin + i] = kl_hot_grad<float, FORM>(t[i], arg, gscale);
  }
  double a0 = 0.0, a1 = 0.0, a2 = 0.0, a3 = 0.0;  // four chains: the adds overlap
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    a0 += vals[i];
    a1 += vals[i + 1];
    a2 += vals[i + 2];
    a3 += vals[i + 3];
  }
  for (; i < n; ++i) a0 += vals[i];
  ok = bad == 0;
  return (a0 + a1) + (a2 + a3);
}

template <typename T, int FORM, bool LOGT>
double reduce_sum(const T* x, const T* t, const Geometry& g, T* grad, double inv_divisor) {
  const int64_t nchunks = (g.n + kChunk - 1) / kChunk;
  std::vector<double> partial(nchunks);
#pragma omp parallel for schedule(static) if (g.n >= kParallelMin)
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t b = c * kChunk, e = std::min(g.n, b + kChunk);
    if constexpr (std::is_same_v<T, float> && !LOGT) {
      if (g.contiguous) {
        bool ok = true;
        partial[c] = grad ? chunk_fast_f32<FORM, true>(x, t, b, e, grad, inv_divisor, ok)
                          : chunk_fast_f32<FORM, false>(x, t, b, e, grad, inv_divisor, ok);
        if (ok) continue;
      }
    }
    partial[c] = chunk_exact<T, FORM, LOGT>(x, t, g, b, e, grad, inv_divisor);
  }
  double s = 0.0;
  for (double p : partial) s += p;
  return s;
}

// OpenMP pragmas cannot sit inside the AT_DISPATCH macros' arguments: the loops live here.
template <typename T, int FORM, bool LOGT>
void pointwise(const T* x, const T* t, const Geometry& g, T* out) {
  using A = typename Acc<T>::type;
#pragma omp parallel for schedule(static) if (g.n >= kParallelMin)
  for (int64_t i = 0; i < g.n; ++i) {
    int64_t ox = i, ot = i;
    if (!g.contiguous) offsets(g, i, ox, ot);
    out[i] = static_cast<T>(kl_point<A, FORM, LOGT>(static_cast<A>(x[ox]), static_cast<A>(t[ot])));
  }
}

template <typename T, int FORM, bool LOGT>
void backward(const T* x, const T* t, const Geometry& g, const T* grad_out, int64_t go_stride, double inv_divisor,
              T* gx, T* gt) {
  using A = typename Acc<T>::type;
  const A scale = static_cast<A>(inv_divisor);
#pragma omp parallel for schedule(static) if (g.n >= kParallelMin)
  for (int64_t i = 0; i < g.n; ++i) {
    int64_t ox = i, ot = i;
    if (!g.contiguous) offsets(g, i, ox, ot);
    const A xv = static_cast<A>(x[ox]), tv = static_cast<A>(t[ot]);
    const A go = static_cast<A>(grad_out[i * go_stride]) * scale;
    if (gx) gx[i] = static_cast<T>(kl_grad_input<A, FORM, LOGT>(xv, tv, go));
    if (gt) gt[i] = static_cast<T>(kl_grad_target<A, FORM, LOGT>(xv, tv, go));
  }
}

template <typename T>
void scale_in_place(T* grad, int64_t n, const T* grad_out) {
  using A = typename Acc<T>::type;
  const A go = static_cast<A>(grad_out[0]);
  if (go == A(1)) return;
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) grad[i] = static_cast<T>(static_cast<A>(grad[i]) * go);
}

// The backend's own check; everything else is kldiv_plan.h's prepare().
void check_device(const at::Tensor& input) {
  TORCH_CHECK(input.device().is_cpu(), "kldiv (cpu backend): expected CPU tensors, got ", input.device());
}

}  // namespace
}  // namespace kldiv

using namespace kldiv;

const char* kl_backend() { return "cpu"; }

std::vector<at::Tensor> kl_div_forward(const at::Tensor& input, const at::Tensor& target, bool reduce, double divisor,
                                       bool log_target, bool from_probs, bool want_grad, bool wide) {
  check_device(input);
  Prepared p = prepare(input, target);
  const auto opts = input.options();
  at::Tensor grad;
  if (!reduce) {
    at::Tensor out = at::empty(p.shape, opts);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "kl_div_none", [&] {
      using T = scalar_t;
      dispatch_form(from_probs, log_target, [&](auto form_c, auto logt_c) {
        pointwise<T, decltype(form_c)::value, decltype(logt_c)::value>(p.x.data_ptr<T>(), p.t.data_ptr<T>(), p.g,
                                                                       out.data_ptr<T>());
      });
    });
    return {out, grad};
  }

  TORCH_CHECK(!want_grad || input.sizes().vec() == p.shape,
              "kldiv: the fused gradient needs the input to have the broadcast shape");
  const bool wide_out = wide && input.scalar_type() != at::kDouble;  // (float64's own dtype is its wide one)
  at::Tensor out = at::empty({}, wide_out ? opts.dtype(at::kFloat) : opts);
  if (want_grad) grad = at::empty(p.shape, opts);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "kl_div_reduce", [&] {
    using T = scalar_t;
    dispatch_form(from_probs, log_target, [&](auto form_c, auto logt_c) {
      constexpr int FORM = decltype(form_c)::value;
      constexpr bool LOGT = decltype(logt_c)::value;
      const double s = reduce_sum<T, FORM, LOGT>(p.x.data_ptr<T>(), p.t.data_ptr<T>(), p.g,
                                                 want_grad ? grad.data_ptr<T>() : nullptr, 1.0 / divisor);
      if (wide_out) {
        *out.data_ptr<float>() = static_cast<float>(s / divisor);
      } else {
        *out.data_ptr<T>() = static_cast<T>(s / divisor);
      }
    });
  });
  return {out, grad};
}

std::vector<at::Tensor> kl_div_backward(const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& target,
                                        bool reduce, double divisor, bool log_target, bool from_probs, bool want_input,
                                        bool want_target) {
  check_device(input);
  Prepared p = prepare(input, target);
  const at::Tensor go = prepare_grad_out(grad_out, input, reduce, p.shape);
  const auto opts = input.options();
  at::Tensor gx = want_input ? at::empty(p.shape, opts) : at::Tensor();
  at::Tensor gt = want_target ? at::empty(p.shape, opts) : at::Tensor();
  if (p.g.n == 0 || !(want_input || want_target)) return {gx, gt};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "kl_div_backward", [&] {
    using T = scalar_t;
    dispatch_form(from_probs, log_target, [&](auto form_c, auto logt_c) {
      backward<T, decltype(form_c)::value, decltype(logt_c)::value>(
          p.x.data_ptr<T>(), p.t.data_ptr<T>(), p.g, go.data_ptr<T>(), reduce ? 0 : 1, reduce ? 1.0 / divisor : 1.0,
          want_input ? gx.data_ptr<T>() : nullptr, want_target ? gt.data_ptr<T>() : nullptr);
    });
  });
  return {gx, gt};
}

void kl_div_scale_grad_(at::Tensor grad, const at::Tensor& grad_out) {
  TORCH_CHECK(grad.device().is_cpu() && grad.is_contiguous(), "kldiv: scale_grad_ needs a contiguous CPU tensor");
  TORCH_CHECK(
      grad_out.numel() == 1 && grad_out.scalar_type() == grad.scalar_type() && grad_out.device() == grad.device(),
      "kldiv: scale_grad_ takes one grad_output value of the gradient's dtype and device");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "kl_div_scale_grad", [&] {
    scale_in_place<scalar_t>(grad.data_ptr<scalar_t>(), grad.numel(), grad_out.data_ptr<scalar_t>());
  });
}
