// Host-side planning shared by both backends: broadcasting, dimension coalescing and argument checks.
// The kernels iterate over the linear index of the broadcast shape (row-major); `Geometry` maps that index
// to element offsets in each operand. Adjacent dimensions that are contiguous in both operands are merged,
// so the common cases (same-shape contiguous, a broadcast row, a transposed view) stay cheap to index.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ExpandUtils.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <vector>

namespace kldiv {

constexpr int kMaxDims = 8;

struct Geometry {
  int64_t n;                  // elements of the broadcast shape
  int ndim;                   // dimensions after coalescing (0 for a single element)
  bool contiguous;            // both operands are dense and in row-major order: offset == linear index
  int64_t sizes[kMaxDims];    // innermost dimension last
  int64_t stride_x[kMaxDims];  // element strides (0 where broadcast)
  int64_t stride_t[kMaxDims];
};

// Checks shared by every entry point; the Python layer checks first with friendlier messages.
inline void check_operands(const at::Tensor& x, const at::Tensor& t) {
  TORCH_CHECK(x.defined() && t.defined(), "kldiv: undefined tensor");
  TORCH_CHECK(x.scalar_type() == t.scalar_type(), "kldiv: input and target must have the same dtype, got ",
              x.scalar_type(), " and ", t.scalar_type());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "kldiv: expected a floating-point dtype, got ",
              x.scalar_type());
  TORCH_CHECK(x.device() == t.device(), "kldiv: input and target are on different devices (", x.device(),
              " and ", t.device(), ")");
}

inline std::vector<int64_t> broadcast_shape(const at::Tensor& x, const at::Tensor& t) {
  return at::infer_size(x.sizes(), t.sizes());  // throws a clear error when not broadcastable
}

// Builds the iteration geometry over `shape` (the broadcast shape) for x and t. Returns false when more than
// kMaxDims dimensions remain after coalescing; the caller then passes contiguous copies.
inline bool make_geometry(const at::Tensor& x, const at::Tensor& t, const std::vector<int64_t>& shape,
                          Geometry& g) {
  const int nd = static_cast<int>(shape.size());
  g.n = 1;
  for (auto s : shape) g.n *= s;
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

}  // namespace kldiv
