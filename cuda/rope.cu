// Rotary embedding, "rotate half" (transformers' Llama): x [tokens, heads, dim] in T, cos/sin
// [tokens, dim/2] in f32 (gathered at each token's absolute position). Elementwise.
#include "common.cuh"

template <typename T>
__device__ void rope(const T* __restrict__ x, const float* __restrict__ cos,
                     const float* __restrict__ sin, T* __restrict__ out, int tokens, int heads,
                     int dim) {
    int half = dim / 2;
    size_t n = (size_t)tokens * heads * half;
    for (size_t k = blockIdx.x * (size_t)blockDim.x + threadIdx.x; k < n;
         k += (size_t)gridDim.x * blockDim.x) {
        size_t i = k % half;
        size_t th = k / half;  // token * heads + head
        size_t t = th / heads;
        const T* xh = x + th * dim;
        T* oh = out + th * dim;
        float x1 = to_f32(xh[i]), x2 = to_f32(xh[i + half]);
        float c = cos[t * half + i], s = sin[t * half + i];
        oh[i] = from_f32<T>(x1 * c - x2 * s);
        oh[i + half] = from_f32<T>(x2 * c + x1 * s);
    }
}

#define ROPE(NAME, T)                                                                        \
    extern "C" __global__ void rope_##NAME(const T* x, const float* cos, const float* sin,  \
                                           T* out, int tokens, int heads, int dim) {         \
        rope<T>(x, cos, sin, out, tokens, heads, dim);                                       \
    }
DETSPEC_FOR_DTYPES(ROPE)
