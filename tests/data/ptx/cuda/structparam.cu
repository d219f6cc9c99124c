// A struct passed by value whose fields are pointers.
struct Args { const float* x; float* y; int n; float* spare; };
extern "C" __global__ void struct_kernel(Args args, float alpha) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < args.n) args.y[i] = alpha * args.x[i];
}
