// Reductions with atomics: atom/red are read-modify-write.
extern "C" __global__ void sum_atomic(const float* x, float* out, int n) {
    __shared__ float partial[256];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    partial[threadIdx.x] = i < n ? x[i] : 0.f;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) atomicAdd(out, partial[0]);
}

extern "C" __global__ void histogram(const int* keys, unsigned int* bins, unsigned int* overflow, int n, int nbins) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    int k = keys[i];
    if (k >= 0 && k < nbins) atomicAdd(&bins[k], 1u);
    else { unsigned old = atomicAdd(overflow, 1u); if (old == 0xffffffffu) bins[0] = 0; }
}

extern "C" __global__ void count_max(const int* x, int* best, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) atomicMax(best, x[i]);
}
