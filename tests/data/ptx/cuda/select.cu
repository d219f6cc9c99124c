// Destination pointer chosen by a predicate (selp or a branch).
extern "C" __global__ void select_store(float* a, float* b, const float* x, int flag, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float* d = (flag > 0) ? a : b;
    d[i] = x[i];
}

extern "C" __global__ void select_load(const float* a, const float* b, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float* s = (i & 1) ? a : b;
    out[i] = s[i];
}
