// cp.async: global -> shared asynchronous copies (a global read).
#include <cuda_pipeline.h>
extern "C" __global__ void cp_async_copy(const float4* in, float4* out, int n) {
    __shared__ float4 tile[128];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) __pipeline_memcpy_async(&tile[threadIdx.x], &in[i], sizeof(float4));
    __pipeline_commit();
    __pipeline_wait_prior(0);
    __syncthreads();
    if (i < n) out[i] = tile[(threadIdx.x + 1) % blockDim.x];
}

extern "C" __global__ void bulk_store(float* out, const float* in) {
    __shared__ alignas(128) float tile[256];
    tile[threadIdx.x] = in[threadIdx.x];
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned s = (unsigned)__cvta_generic_to_shared(tile);
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], 1024;" :: "l"(out + blockIdx.x * 256), "r"(s) : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    }
}

extern "C" __global__ void prefetch_only(const float* hint, const float* x, float* y) {
    asm volatile("prefetch.global.L2 [%0];" :: "l"(hint + threadIdx.x));
    y[threadIdx.x] = x[threadIdx.x];
}
