// Scaffolding shared by the variants v1..v3 of this folder, so that each variant file holds only its idea (its
// partial_kernel) and a diff against the one before shows just that: the includes, a block-wide double sum, the
// single-block kernel that adds the per-block partials in a fixed order and writes the 0-d loss, and the launcher
// that sizes the grid to fill the GPU once. v0, the seed, keeps its own float tree, atomicAdd and host round trip:
// those are its faults.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>

namespace {

// The sum of v over the block, in thread 0 (blockDim.x a multiple of 32): warp shuffles, then one warp over the
// warps' sums.
__device__ __forceinline__ double block_sum(double v) {
  __shared__ double warp_sums[32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = v;
  __syncthreads();
  v = threadIdx.x < blockDim.x / 32 ? warp_sums[threadIdx.x] : 0.0;
  if (threadIdx.x < 32)
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  return v;
}

// One block: the partials added in a fixed order (no atomics, so the same bits every run), divided by the batch.
__global__ void final_kernel(const double* __restrict__ partials, int count, double divisor, float* out) {
  double s = 0.0;
  for (int i = threadIdx.x; i < count; i += blockDim.x) s += partials[i];
  s = block_sum(s);
  if (threadIdx.x == 0) *out = static_cast<float>(s / divisor);
}

// A variant's kernel: the loss terms of p and t (n elements each), one double partial sum per block.
using PartialKernel = void (*)(const float*, const float*, int64_t, double*);

// F.kl_div(torch.log(predictions), targets, "batchmean") as a 0-d float32 tensor on the device, with no host
// synchronisation: partial_kernel over as many blocks of THREADS as fit on the GPU at once (fewer for small
// inputs), then final_kernel over their partials.
template <int THREADS>
at::Tensor launch_batchmean(PartialKernel partial_kernel, const at::Tensor& predictions, const at::Tensor& targets) {
  // On one GPU, and that GPU's stream and SM count: CPU tensors gave the kernels host pointers, and inputs on
  // another device than the current one ran on the current one's stream against the other's memory.
  TORCH_CHECK(predictions.is_cuda() && targets.device() == predictions.device(),
              "CUDA tensors on one device only, got ", predictions.device(), " and ", targets.device());
  const c10::cuda::CUDAGuard guard(predictions.device());
  TORCH_CHECK(predictions.scalar_type() == at::kFloat && targets.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(predictions.is_contiguous() && targets.is_contiguous() && predictions.sizes() == targets.sizes(),
              "contiguous inputs of one shape only");
  const int64_t n = predictions.numel();
  // batchmean's divisor, the batch (size 0); a 0-d input has none: its sum, as F.kl_div gives (read before any
  // launch: size(0) of a 0-d tensor threw after the first kernel was queued).
  const double batch = predictions.dim() > 0 ? static_cast<double>(predictions.size(0)) : 1.0;
  int dev = 0, sms = 0, per_sm = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, partial_kernel, THREADS, 0));
  const int blocks =
      static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((n + THREADS - 1) / THREADS, int64_t(per_sm) * sms)));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor partials = at::empty({blocks}, predictions.options().dtype(at::kDouble));
  at::Tensor out = at::empty({}, predictions.options());
  partial_kernel<<<blocks, THREADS, 0, stream>>>(predictions.data_ptr<float>(), targets.data_ptr<float>(), n,
                                                 partials.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  final_kernel<<<1, 1024, 0, stream>>>(partials.data_ptr<double>(), blocks, batch, out.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace
