// Loops: pointers advanced in loop-carried registers.
extern "C" __global__ void row_sum(const float* m, float* out, int rows, int cols) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float* p = m + (long long)r * cols;
    float acc = 0.f;
    for (int c = 0; c < cols; ++c) acc += *p++;
    out[r] = acc;
}

extern "C" __global__ void grid_stride_copy(const double* src, double* dst, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x)
        dst[i] = src[i];
}

extern "C" __global__ void swap_walk(float* a, float* b, int n) {
    float* p = a; float* q = b;
    for (int k = 0; k < n; ++k) { float* t = p; p = q; q = t; }
    p[threadIdx.x] = 1.f;
}
