// Vector accesses: float4 / int2 loads and stores, read-only cache path.
extern "C" __global__ void copy_float4(const float4* __restrict__ in, float4* __restrict__ out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) { float4 v = __ldg(&in[i]); v.x += 1.f; out[i] = v; }
}

extern "C" __global__ void pack_int2(const int* a, int2* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = make_int2(a[2 * i], a[2 * i + 1]);
}
