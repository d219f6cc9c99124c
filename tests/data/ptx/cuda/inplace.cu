// In-place updates: the same pointer is read and written.
extern "C" __global__ void relu_inplace(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n && x[i] < 0.f) x[i] = 0.f;
}

extern "C" __global__ void saxpy(float a, const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}

extern "C" __global__ void volatile_flag(volatile int* flag, int* out) {
    if (threadIdx.x == 0) { out[blockIdx.x] = flag[0]; flag[1] = 1; }
}
