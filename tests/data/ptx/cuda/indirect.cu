// Pointers loaded from memory: the kernel is indirect.
extern "C" __global__ void scatter_ptrs(float** ptrs, const float* vals, const float* untouched, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) ptrs[i][0] = vals[i];
}

extern "C" __global__ void gather_rows(const float* const* rows, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = rows[i][threadIdx.y];
}
