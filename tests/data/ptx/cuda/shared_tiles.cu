// Shared-memory tiled transpose, plus local-memory scratch: neither is global.
extern "C" __global__ void transpose32(const float* in, float* out, int n) {
    __shared__ float tile[32][33];
    int x = blockIdx.x * 32 + threadIdx.x, y = blockIdx.y * 32 + threadIdx.y;
    if (x < n && y < n) tile[threadIdx.y][threadIdx.x] = in[y * n + x];
    __syncthreads();
    x = blockIdx.y * 32 + threadIdx.x; y = blockIdx.x * 32 + threadIdx.y;
    if (x < n && y < n) out[y * n + x] = tile[threadIdx.x][threadIdx.y];
}

extern "C" __global__ void local_scratch(const int* idx, float* out, int n) {
    float buf[16];
    for (int k = 0; k < 16; ++k) buf[k] = k * 0.5f;
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = buf[idx[i] & 15];
}
