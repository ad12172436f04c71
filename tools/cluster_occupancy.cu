// How many thread-block clusters of each size a GPU keeps resident at once, for a block's threads and shared
// memory (cudaOccupancyMaxActiveClusters), against the blocks it would keep without clusters: the share of block
// slots a cluster size leaves empty (an SM's slots are only usable by a cluster whose blocks all fit in one GPC).
// The distillation kernels (kernels/distill.cu) take a row per cluster of 16; kernels/NOTES.md, version 30, has
// an H200's table. Standalone (no torch):
//   nvcc -O2 -arch=sm_90 -o /tmp/cluster_occupancy tools/cluster_occupancy.cu && /tmp/cluster_occupancy
// prints: threads, dynamic shared memory (bytes), cluster size, scheduling policy (0 spread, 1 load balancing),
// clusters resident, their blocks, blocks without clusters.
#include <cuda_runtime.h>

#include <cstdio>

__global__ void probe(float* p) {
  extern __shared__ float s[];
  if (p) p[threadIdx.x] = s[threadIdx.x];
}

#define CHECK(x)                                                                              \
  do {                                                                                        \
    cudaError_t e = (x);                                                                      \
    if (e != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
      return 1;                                                                               \
    }                                                                                         \
  } while (0)

int main() {
  cudaDeviceProp pr;
  CHECK(cudaGetDeviceProperties(&pr, 0));
  std::printf("# %s: %d SMs, %zu bytes of shared memory an SM, %zu a block at most\n", pr.name, pr.multiProcessorCount,
              pr.sharedMemPerMultiprocessor, pr.sharedMemPerBlockOptin);
  CHECK(cudaFuncSetAttribute(probe, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  CHECK(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, 220 * 1024));
  // 32064 bytes: fast_rows' bf16 slices of a 128256-entry row over 16 blocks (its static shared memory adds a few
  // hundred bytes, the driver 1 KB a block)
  const int threads[] = {128, 256, 512};
  // (and 36672 / 42752 / 51328: the same row over clusters of 14 / 12 / 10)
  const int smems[] = {24000, 28000, 32064, 32576, 36672, 42752, 43264, 51328, 64640, 128768};
  const int clusters[] = {1, 2, 4, 8, 10, 12, 14, 16};
  std::printf("threads smem cluster policy clusters_resident their_blocks blocks_without_clusters\n");
  for (int t : threads)
    for (int sm : smems)
      for (int c : clusters)
        for (int policy : {0, 1}) {
          cudaLaunchConfig_t cfg = {};
          cfg.gridDim = dim3(c * 4096);
          cfg.blockDim = dim3(t);
          cfg.dynamicSmemBytes = sm;
          cudaLaunchAttribute a[2];
          a[0].id = cudaLaunchAttributeClusterDimension;
          a[0].val.clusterDim.x = c;
          a[0].val.clusterDim.y = 1;
          a[0].val.clusterDim.z = 1;
          a[1].id = cudaLaunchAttributeClusterSchedulingPolicyPreference;
          a[1].val.clusterSchedulingPolicyPreference =
              policy ? cudaClusterSchedulingPolicyLoadBalancing : cudaClusterSchedulingPolicySpread;
          cfg.attrs = a;
          cfg.numAttrs = 2;
          int n = 0, b = 0;
          CHECK(cudaOccupancyMaxActiveClusters(&n, probe, &cfg));
          CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, probe, t, sm));
          std::printf("%d %d %d %d %d %d %d\n", t, sm, c, policy, n, n * c, b * pr.multiProcessorCount);
        }
  return 0;
}
