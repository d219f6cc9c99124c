// Pointer arithmetic through 64-bit integers: pointers passed as integers and
// cast back after arithmetic, so accesses are generic (no cvta.to.global).
#include <stdint.h>
extern "C" __global__ void int_copy(unsigned long long src, unsigned long long dst, long long offset, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    uint64_t a = src + (uint64_t)(i + offset) * 4u;
    uint64_t b = (dst + (uint64_t)i * 4u) & ~(uint64_t)3;
    *(float*)b = *(const float*)a;
}

extern "C" __global__ void strided_gather(const float* base, float* out, long long stride, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const char* p = (const char*)base;
    p += (long long)i * stride;
    out[i] = *(const float*)(p - 0);
}
