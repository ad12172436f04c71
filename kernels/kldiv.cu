// KL-divergence loss on CUDA: the kit's production kernels.
//
// Forward, reduced (sum / mean / batchmean): one pass over both inputs. Each thread accumulates in float
// lanes (double for float64 inputs) that it empties into a double every kFlush iterations: a float sum over
// thousands of terms loses about 1e-6 of the result. A warp-shuffle then shared-memory tree turns the
// block's sum into one double partial; a second, single-block kernel adds the partials in a fixed order and writes the
// 0-d result. No atomics, no host synchronisation: the same inputs give the same bits, inside CUDA graphs too. With
// `want_grad` the same pass also writes d loss / d input (already divided by the reduction's divisor), so training
// costs one write beyond the forward's reads; backward only rescales it when grad_output != 1.
//
// Forward, reduction='none': an elementwise kernel over the broadcast shape.
// Backward (reduction 'none', gradients w.r.t. the target, or a recompute): an elementwise kernel.
//
// Layout: contiguous operands of one shape take 16-byte vector loads (scalar loads when a pointer is not
// 16-byte aligned, and for the tail); anything else (strides, broadcasting) goes through `Geometry`.
// Indices are 64-bit throughout.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <mutex>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "kldiv_common.h"
#include "kldiv_plan.h"
#include "scale_span.cuh"

namespace kldiv {
namespace {

constexpr int kThreads = 512;  // threads per block of the streaming kernels
constexpr int kFinalThreads = 1024;
constexpr int kFlush = 8;  // vector iterations summed in float before moving into the double total

template <typename T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };

// 16 bytes of T, loaded and stored as one vector.
template <typename T>
struct alignas(16) Vec {
  static constexpr int N = 16 / sizeof(T);
  T v[N];
};

template <typename T>
__device__ __forceinline__ Vec<T> load_vec(const T* p) {
  Vec<T> out;
  *reinterpret_cast<uint4*>(&out) = __ldg(reinterpret_cast<const uint4*>(p));
  return out;
}

// The fused gradient is written once and read only by the optimizer later: a streaming store (evict-first)
// keeps it from displacing the inputs' lines in L2.
template <typename T>
__device__ __forceinline__ void store_vec_streaming(T* p, const Vec<T>& v) {
  __stcs(reinterpret_cast<uint4*>(p), *reinterpret_cast<const uint4*>(&v));
}

int sm_count() {
  static int counts[64] = {0};
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 64 && counts[dev]) return counts[dev];
  int n = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  if (dev < 64) counts[dev] = n;
  return n;
}

// Enough blocks to fill every SM at the kernel's occupancy, fewer when there is little work. The occupancy
// of each kernel is asked once (it depends only on the kernel and the architecture).
template <typename Kernel>
int64_t grid_for_kernel(Kernel kernel, int64_t work_items) {
  static std::mutex mu;
  static std::unordered_map<const void*, int> per_sm_of;
  int per_sm = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = per_sm_of.find(reinterpret_cast<const void*>(kernel));
    if (it != per_sm_of.end()) per_sm = it->second;
  }
  if (per_sm == 0) {
    int b = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, kernel, kThreads, 0));
    per_sm = b > 0 ? b : 1;
    std::lock_guard<std::mutex> lock(mu);
    per_sm_of[reinterpret_cast<const void*>(kernel)] = per_sm;
  }
  const int64_t want = (work_items + kThreads - 1) / kThreads;
  const int64_t full = static_cast<int64_t>(per_sm) * sm_count();
  return std::max<int64_t>(1, std::min(want, full));
}

// Sum of `v` over the block, valid in thread 0. Fixed shuffle and tree order: deterministic.
template <int THREADS>
__device__ __forceinline__ double block_sum(double v) {
  __shared__ double warp_sums[THREADS / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  v = 0.0;
  if (warp == 0) {
    v = lane < THREADS / 32 ? warp_sums[lane] : 0.0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  }
  return v;
}

// ------------------------------------------------------------------------------------------- forward
// GRAD: also write d loss / d input (times 1 / divisor). A template argument, not a run-time test, so that
// the plain forward carries no trace of it (a run-time flag cost ~50% at 16384^2 on an H200).
template <typename T, int FORM, bool LOGT, bool CONTIG, bool GRAD>
__global__ void __launch_bounds__(kThreads)
reduce_kernel(const T* __restrict__ x, const T* __restrict__ t, const Geometry g, T* __restrict__ grad,
              const double inv_divisor, double* __restrict__ partials) {
  using A = typename Acc<T>::type;
  constexpr int V = Vec<T>::N;
  constexpr bool LOWP = sizeof(T) == 2;
  const int64_t n = g.n;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const A gscale = static_cast<A>(inv_divisor);
  A acc[V];
#pragma unroll
  for (int k = 0; k < V; ++k) acc[k] = A(0);
  double total = 0.0;
  int pending = 0;  // iterations held in acc
  // One vector of V elements: loss into acc[k], gradient into gv (GRAD only).
  auto step = [&](const Vec<T>& xv, const Vec<T>& tv, Vec<T>& gv) {
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const A xe = static_cast<A>(xv.v[k]), te = static_cast<A>(tv.v[k]);
      if (GRAD) {
        A dx;
        acc[k] += kl_point_grad<A, FORM, LOGT, LOWP>(xe, te, gscale, dx);
        gv.v[k] = static_cast<T>(dx);
      } else {
        acc[k] += kl_point<A, FORM, LOGT, LOWP>(xe, te);
      }
    }
  };
  int64_t scalar_from = 0;

  if (CONTIG) {
    const bool aligned =
        ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(t) | reinterpret_cast<uintptr_t>(grad)) & 15) ==
        0;
    const int64_t nvec = aligned ? n / V : 0;
    scalar_from = nvec * V;
    // Two vectors of each input in flight per iteration before any arithmetic.
    int64_t i = tid;
    for (; i + stride < nvec; i += 2 * stride) {
      const Vec<T> xa = load_vec(x + i * V), ta = load_vec(t + i * V);
      const Vec<T> xb = load_vec(x + (i + stride) * V), tb = load_vec(t + (i + stride) * V);
      Vec<T> ga, gb;
      step(xa, ta, ga);
      step(xb, tb, gb);
      if (GRAD) {
        store_vec_streaming(grad + i * V, ga);
        store_vec_streaming(grad + (i + stride) * V, gb);
      }
      if (++pending == kFlush) {
#pragma unroll
        for (int k = 0; k < V; ++k) {
          total += static_cast<double>(acc[k]);
          acc[k] = A(0);
        }
        pending = 0;
      }
    }
    for (; i < nvec; i += stride) {
      const Vec<T> xa = load_vec(x + i * V), ta = load_vec(t + i * V);
      Vec<T> ga;
      step(xa, ta, ga);
      if (GRAD) store_vec_streaming(grad + i * V, ga);
    }
  }
#pragma unroll
  for (int k = 0; k < V; ++k) total += static_cast<double>(acc[k]);
  for (int64_t i = scalar_from + tid; i < n; i += stride) {
    int64_t ox = i, ot = i;
    if (!CONTIG) offsets(g, i, ox, ot);
    const A xe = static_cast<A>(x[ox]), te = static_cast<A>(t[ot]);
    if (GRAD) {
      A dx;
      total += static_cast<double>(kl_point_grad<A, FORM, LOGT, LOWP>(xe, te, gscale, dx));
      grad[i] = static_cast<T>(dx);
    } else {
      total += static_cast<double>(kl_point<A, FORM, LOGT, LOWP>(xe, te));
    }
  }

  const double sum = block_sum<kThreads>(total);
  if (threadIdx.x == 0) partials[blockIdx.x] = sum;
}

// Adds the per-block partials in a fixed order and writes the 0-d result.
template <typename T>
__global__ void __launch_bounds__(kFinalThreads)
final_kernel(const double* __restrict__ partials, int64_t count, double divisor, T* __restrict__ out) {
  double s = 0.0;
  for (int64_t i = threadIdx.x; i < count; i += kFinalThreads) s += partials[i];
  s = block_sum<kFinalThreads>(s);
  if (threadIdx.x == 0) out[0] = static_cast<T>(s / divisor);
}

// ----------------------------------------------------------------------------------- reduction='none'
template <typename T, int FORM, bool LOGT, bool CONTIG>
__global__ void __launch_bounds__(kThreads)
pointwise_kernel(const T* __restrict__ x, const T* __restrict__ t, const Geometry g, T* __restrict__ out) {
  using A = typename Acc<T>::type;
  constexpr int V = Vec<T>::N;
  const int64_t n = g.n;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  int64_t scalar_from = 0;
  if (CONTIG) {
    const bool aligned =
        ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(t) | reinterpret_cast<uintptr_t>(out)) & 15) ==
        0;
    const int64_t nvec = aligned ? n / V : 0;
    scalar_from = nvec * V;
    for (int64_t i = tid; i < nvec; i += stride) {
      const Vec<T> xa = load_vec(x + i * V), ta = load_vec(t + i * V);
      Vec<T> o;
#pragma unroll
      for (int k = 0; k < V; ++k)
        o.v[k] =
            static_cast<T>(kl_point<A, FORM, LOGT, sizeof(T) == 2>(static_cast<A>(xa.v[k]), static_cast<A>(ta.v[k])));
      *reinterpret_cast<Vec<T>*>(out + i * V) = o;
    }
  }
  for (int64_t i = scalar_from + tid; i < n; i += stride) {
    int64_t ox = i, ot = i;
    if (!CONTIG) offsets(g, i, ox, ot);
    out[i] = static_cast<T>(kl_point<A, FORM, LOGT, sizeof(T) == 2>(static_cast<A>(x[ox]), static_cast<A>(t[ot])));
  }
}

// ------------------------------------------------------------------------------------------ backward
// grad_out is either one value (reductions; `go_stride` 0) or one per element of the broadcast shape,
// contiguous (`go_stride` 1). Outputs are contiguous over the broadcast shape; either may be null.
template <typename T, int FORM, bool LOGT>
__global__ void __launch_bounds__(kThreads)
backward_kernel(const T* __restrict__ x, const T* __restrict__ t, const Geometry g, const T* __restrict__ grad_out,
                int64_t go_stride, double inv_divisor, T* __restrict__ grad_x, T* __restrict__ grad_t) {
  using A = typename Acc<T>::type;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const A scale = static_cast<A>(inv_divisor);
  for (int64_t i = tid; i < g.n; i += stride) {
    int64_t ox = i, ot = i;
    if (!g.contiguous) offsets(g, i, ox, ot);
    const A xv = static_cast<A>(x[ox]), tv = static_cast<A>(t[ot]);
    const A go = static_cast<A>(grad_out[i * go_stride]) * scale;
    if (grad_x) grad_x[i] = static_cast<T>(kl_grad_input<A, FORM, LOGT>(xv, tv, go));
    if (grad_t) grad_t[i] = static_cast<T>(kl_grad_target<A, FORM, LOGT>(xv, tv, go));
  }
}

// grad *= grad_out, read on the device: when grad_out == 1 (loss.backward()) every block returns at once;
// otherwise a pass over the gradient in 16-byte vectors (scale_span.cuh), the blocks looping over its chunks.
constexpr int kScaleUnroll = 4;
template <typename T>
__global__ void __launch_bounds__(kThreads)
scale_kernel(T* __restrict__ grad, int64_t n, const T* __restrict__ grad_out, int64_t chunks) {
  using A = typename Acc<T>::type;
  const A go = static_cast<A>(grad_out[0]);
  if (go == A(1)) return;
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) scale_span_chunk<kThreads, kScaleUnroll>(grad, n, go, c);
}

// -------------------------------------------------------------------------------------------- checks
// The backend's own check; everything else is kldiv_plan.h's prepare().
void check_device(const at::Tensor& input) {
  TORCH_CHECK(input.is_cuda(), "kldiv (cuda backend): expected CUDA tensors, got ", input.device());
}

}  // namespace
}  // namespace kldiv

using namespace kldiv;

const char* kl_backend() { return "cuda"; }

// See kldiv_bindings.cpp for the contract of each entry point.
std::vector<at::Tensor> kl_div_forward(const at::Tensor& input, const at::Tensor& target, bool reduce, double divisor,
                                       bool log_target, bool from_probs, bool want_grad, bool wide) {
  check_device(input);
  Prepared p = prepare(input, target);
  const c10::cuda::CUDAGuard guard(input.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto opts = input.options();
  at::Tensor grad;
  if (!reduce) {
    at::Tensor out = at::empty(p.shape, opts);
    if (p.g.n == 0) return {out, grad};
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "kl_div_none", [&] {
      using T = scalar_t;
      dispatch_form(from_probs, log_target, [&](auto form_c, auto logt_c) {
        constexpr int FORM = decltype(form_c)::value;
        constexpr bool LOGT = decltype(logt_c)::value;
        if (p.g.contiguous) {
          auto k = pointwise_kernel<T, FORM, LOGT, true>;
          k<<<grid_for_kernel(k, (p.g.n + Vec<T>::N - 1) / Vec<T>::N), kThreads, 0, stream>>>(
              p.x.data_ptr<T>(), p.t.data_ptr<T>(), p.g, out.data_ptr<T>());
        } else {
          auto k = pointwise_kernel<T, FORM, LOGT, false>;
          k<<<grid_for_kernel(k, p.g.n), kThreads, 0, stream>>>(p.x.data_ptr<T>(), p.t.data_ptr<T>(), p.g,
                                                                out.data_ptr<T>());
        }
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
    return {out, grad};
  }

  // The fused gradient is laid out like the broadcast shape: only possible when the input has that shape.
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
      T* gptr = want_grad ? grad.data_ptr<T>() : nullptr;
      const double inv = 1.0 / divisor;
      int64_t blocks = 1;
      at::Tensor partials;
      // The fused gradient is written only on the contiguous path; a strided input's gradient comes
      // from the backward kernel instead (the op asks for it only when the input is contiguous).
      TORCH_CHECK(!want_grad || p.g.contiguous, "kldiv: the fused gradient needs contiguous operands");
      auto launch = [&](auto kernel, int64_t work) {
        blocks = grid_for_kernel(kernel, work);
        partials = at::empty({blocks}, opts.dtype(at::kDouble));
        kernel<<<blocks, kThreads, 0, stream>>>(p.x.data_ptr<T>(), p.t.data_ptr<T>(), p.g, gptr, inv,
                                                partials.data_ptr<double>());
      };
      const int64_t vec_work = (p.g.n + Vec<T>::N - 1) / Vec<T>::N;
      if (want_grad) launch(reduce_kernel<T, FORM, LOGT, true, true>, vec_work);
      else if (p.g.contiguous) launch(reduce_kernel<T, FORM, LOGT, true, false>, vec_work);
      else launch(reduce_kernel<T, FORM, LOGT, false, false>, p.g.n);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      if (wide_out) {
        final_kernel<float>
            <<<1, kFinalThreads, 0, stream>>>(partials.data_ptr<double>(), blocks, divisor, out.data_ptr<float>());
      } else {
        final_kernel<T>
            <<<1, kFinalThreads, 0, stream>>>(partials.data_ptr<double>(), blocks, divisor, out.data_ptr<T>());
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return {out, grad};
}

std::vector<at::Tensor> kl_div_backward(const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& target,
                                        bool reduce, double divisor, bool log_target, bool from_probs, bool want_input,
                                        bool want_target) {
  check_device(input);
  Prepared p = prepare(input, target);
  const c10::cuda::CUDAGuard guard(input.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor go = prepare_grad_out(grad_out, input, reduce, p.shape);
  const auto opts = input.options();
  at::Tensor gx = want_input ? at::empty(p.shape, opts) : at::Tensor();
  at::Tensor gt = want_target ? at::empty(p.shape, opts) : at::Tensor();
  if (p.g.n == 0 || !(want_input || want_target)) return {gx, gt};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "kl_div_backward", [&] {
    using T = scalar_t;
    dispatch_form(from_probs, log_target, [&](auto form_c, auto logt_c) {
      constexpr int FORM = decltype(form_c)::value;
      constexpr bool LOGT = decltype(logt_c)::value;
      auto k = backward_kernel<T, FORM, LOGT>;
      k<<<grid_for_kernel(k, p.g.n), kThreads, 0, stream>>>(
          p.x.data_ptr<T>(), p.t.data_ptr<T>(), p.g, go.data_ptr<T>(), reduce ? 0 : 1, reduce ? 1.0 / divisor : 1.0,
          want_input ? gx.data_ptr<T>() : nullptr, want_target ? gt.data_ptr<T>() : nullptr);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return {gx, gt};
}

void kl_div_scale_grad_(at::Tensor grad, const at::Tensor& grad_out) {
  TORCH_CHECK(grad.is_cuda() && grad.is_contiguous(), "kldiv: scale_grad_ needs a contiguous CUDA tensor");
  TORCH_CHECK(
      grad_out.numel() == 1 && grad_out.scalar_type() == grad.scalar_type() && grad_out.device() == grad.device(),
      "kldiv: scale_grad_ takes one grad_output value of the gradient's dtype and device");
  if (grad.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(grad.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "kl_div_scale_grad", [&] {
    using T = scalar_t;
    auto k = scale_kernel<T>;
    const int64_t chunks = scale_span_chunks<kThreads, kScaleUnroll, T>(grad.numel());
    k<<<grid_for_kernel(k, chunks * kThreads), kThreads, 0, stream>>>(grad.data_ptr<T>(), grad.numel(),
                                                                      grad_out.data_ptr<T>(), chunks);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}
