// v1: the seed's design fixed, not yet tuned. A grid sized to the SM count (grid-stride loop) instead of one
// block per row; 64-bit indices; xlogy semantics (a zero target contributes 0); float accumulation per
// thread; warp-shuffle block sums written as double partials; a single-block kernel adds them in a fixed
// order and writes the 0-d result on the device: deterministic, no atomics, no host sync. Still scalar
// 4-byte loads and two accurate logs per element. Contiguous float32 inputs, any number of dimensions.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

namespace {

constexpr int kThreads = 512;

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

__global__ void partial_kernel(const float* __restrict__ p, const float* __restrict__ t, int64_t n,
                               double* __restrict__ partials) {
  float acc = 0.0f;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const float tv = t[i], pv = p[i];
    acc += (tv == 0.0f ? 0.0f : tv * logf(tv)) - tv * logf(pv);
  }
  const double s = block_sum(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

__global__ void final_kernel(const double* __restrict__ partials, int count, double divisor, float* out) {
  double s = 0.0;
  for (int i = threadIdx.x; i < count; i += blockDim.x) s += partials[i];
  s = block_sum(s);
  if (threadIdx.x == 0) *out = static_cast<float>(s / divisor);
}

}  // namespace

at::Tensor kl_div_probs_batchmean(const at::Tensor& predictions, const at::Tensor& targets) {
  TORCH_CHECK(predictions.scalar_type() == at::kFloat && targets.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(predictions.is_contiguous() && targets.is_contiguous() && predictions.sizes() == targets.sizes(),
              "contiguous inputs of one shape only");
  const int64_t n = predictions.numel();
  int dev = 0, sms = 0, per_sm = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, partial_kernel, kThreads, 0));
  const int blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads,
                                                                             int64_t(per_sm) * sms)));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor partials = at::empty({blocks}, predictions.options().dtype(at::kDouble));
  at::Tensor out = at::empty({}, predictions.options());
  partial_kernel<<<blocks, kThreads, 0, stream>>>(predictions.data_ptr<float>(), targets.data_ptr<float>(), n,
                                                  partials.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  final_kernel<<<1, 1024, 0, stream>>>(partials.data_ptr<double>(), blocks,
                                       static_cast<double>(predictions.size(0)), out.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}
