// Accesses inside non-inlined device functions reached through call.
__device__ __noinline__ void store_scaled(float* p, float v, float s) { *p = v * s; }
__device__ __noinline__ float load_at(const float* p, int i) { return p[i]; }

extern "C" __global__ void call_kernel(const float* x, float* y, float s, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) store_scaled(y + i, load_at(x, i), s);
}
