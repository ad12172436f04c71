// Host-side planning shared by both backends: broadcasting, dimension coalescing, argument checks and
// the dispatch of run-time flags to kernel templates.
// The kernels iterate over the linear index of the broadcast shape (row-major); `Geometry` maps that index
// to element offsets in each operand. Adjacent dimensions that are contiguous in both operands are merged,
// so the common cases (same-shape contiguous, a broadcast row, a transposed view) stay cheap to index.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ExpandUtils.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#include "kldiv_common.h"

namespace kldiv {

constexpr int kMaxDims = 8;

struct Geometry {
  int64_t n;                   // elements of the broadcast shape
  int ndim;                    // dimensions after coalescing (0 for a single element)
  bool contiguous;             // both operands are dense and in row-major order: offset == linear index
  int64_t sizes[kMaxDims];     // innermost dimension last
  int64_t stride_x[kMaxDims];  // element strides (0 where broadcast)
  int64_t stride_t[kMaxDims];
};

// Checks shared by every entry point; the Python layer checks first with friendlier messages.
inline void check_operands(const at::Tensor& x, const at::Tensor& t) {
  TORCH_CHECK(x.defined() && t.defined(), "kldiv: undefined tensor");
  TORCH_CHECK(x.scalar_type() == t.scalar_type(), "kldiv: input and target must have the same dtype, got ",
              x.scalar_type(), " and ", t.scalar_type());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "kldiv: expected a floating-point dtype, got ", x.scalar_type());
  TORCH_CHECK(x.device() == t.device(), "kldiv: input and target are on different devices (", x.device(), " and ",
              t.device(), ")");
}

inline std::vector<int64_t> broadcast_shape(const at::Tensor& x, const at::Tensor& t) {
  return at::infer_size(x.sizes(), t.sizes());  // throws a clear error when not broadcastable
}

// Builds the iteration geometry over `shape` (the broadcast shape) for x and t. Returns false when more than
// kMaxDims dimensions remain after coalescing; the caller then passes contiguous copies.
inline bool make_geometry(const at::Tensor& x, const at::Tensor& t, const std::vector<int64_t>& shape, Geometry& g) {
  const int nd = static_cast<int>(shape.size());
  g.n = 1;
  for (auto s : shape) g.n *= s;
  // Nothing to visit, whatever the rank: an empty result, a zero sum. Planning must not depend on an empty
  // tensor's strides: they need not coalesce, and its dense copy is itself.
  if (g.n == 0) {
    g.ndim = 0;
    g.contiguous = true;
    return true;
  }
  // Strides of each operand expanded to the broadcast shape (0 on broadcast dimensions).
  auto expanded_strides = [&](const at::Tensor& a) {
    std::vector<int64_t> st(nd, 0);
    const int off = nd - static_cast<int>(a.dim());
    for (int d = 0; d < a.dim(); ++d) st[off + d] = a.size(d) == 1 ? 0 : a.stride(d);
    return st;
  };
  std::vector<int64_t> sx = expanded_strides(x), stt = expanded_strides(t);
  // Coalesce from the innermost dimension outwards, dropping size-1 dimensions.
  std::vector<int64_t> cs, cx, ct;  // innermost first while building
  for (int d = nd - 1; d >= 0; --d) {
    if (shape[d] == 1) continue;
    if (!cs.empty() && sx[d] == cx.back() * cs.back() && stt[d] == ct.back() * cs.back()) {
      cs.back() *= shape[d];
      continue;
    }
    cs.push_back(shape[d]);
    cx.push_back(sx[d]);
    ct.push_back(stt[d]);
  }
  g.ndim = static_cast<int>(cs.size());
  g.contiguous = g.ndim == 0 || (g.ndim == 1 && cx[0] == 1 && ct[0] == 1);
  if (g.ndim > kMaxDims) return false;
  for (int i = 0; i < g.ndim; ++i) {  // store outermost first
    g.sizes[i] = cs[g.ndim - 1 - i];
    g.stride_x[i] = cx[g.ndim - 1 - i];
    g.stride_t[i] = ct[g.ndim - 1 - i];
  }
  return true;
}

// Operand offsets of linear index i (row-major over the broadcast shape).
#if defined(__CUDACC__)
__host__ __device__ __forceinline__
#else
inline
#endif
    void offsets(const Geometry& g, int64_t i, int64_t& ox, int64_t& ot) {
  ox = 0;
  ot = 0;
  for (int d = g.ndim - 1; d >= 0; --d) {
    const int64_t s = g.sizes[d];
    const int64_t q = i / s;
    const int64_t r = i - q * s;
    ox += r * g.stride_x[d];
    ot += r * g.stride_t[d];
    i = q;
  }
}

// Calls f(form, logt) with the run-time flags turned into std::integral_constant arguments, so that a
// generic lambda can read them as compile-time constants: `constexpr int FORM = decltype(form)::value;`.
template <typename F>
void dispatch_form(bool from_probs, bool log_target, F&& f) {
  using Probs = std::integral_constant<int, FORM_PROBS>;
  using LogP = std::integral_constant<int, FORM_LOGP>;
  if (from_probs) {
    if (log_target) f(Probs{}, std::true_type{});
    else f(Probs{}, std::false_type{});
  } else {
    if (log_target) f(LogP{}, std::true_type{});
    else f(LogP{}, std::false_type{});
  }
}

// Both operands with their iteration geometry over the broadcast shape.
struct Prepared {
  at::Tensor x, t;
  std::vector<int64_t> shape;
  Geometry g;
};

// Checks the operands (the caller checks the device type) and plans the iteration.
inline Prepared prepare(const at::Tensor& input, const at::Tensor& target) {
  check_operands(input, target);
  Prepared p{input, target, broadcast_shape(input, target), {}};
  if (!make_geometry(p.x, p.t, p.shape, p.g)) {  // too many dimensions to index: dense copies
    p.x = input.expand(p.shape).contiguous();
    p.t = target.expand(p.shape).contiguous();
    TORCH_CHECK(make_geometry(p.x, p.t, p.shape, p.g), "kldiv: internal error planning the iteration");
  }
  return p;
}

// grad_output as the backward kernels read it: one value (reduce) or the broadcast shape, contiguous.
inline at::Tensor prepare_grad_out(const at::Tensor& grad_out, const at::Tensor& input, bool reduce,
                                   const std::vector<int64_t>& shape) {
  TORCH_CHECK(grad_out.scalar_type() == input.scalar_type() && grad_out.device() == input.device(),
              "kldiv: grad_output must match the input's dtype and device");
  if (reduce) {
    TORCH_CHECK(grad_out.numel() == 1, "kldiv: a reduced loss takes a single grad_output value");
    return grad_out.reshape({1});
  }
  TORCH_CHECK(grad_out.sizes().vec() == shape, "kldiv: grad_output must have the broadcast shape");
  return grad_out.contiguous();
}

}  // namespace kldiv
