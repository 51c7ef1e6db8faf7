// Rotary embedding, "rotate half" (transformers' Llama): heads of `dim` values in T, cos/sin
// [tokens, dim/2] in f32 (gathered at each token's absolute position). Elementwise.
#include "common.cuh"

// One rotated pair (x[i], x[i + half]) of one head: both kernels rotate through this function,
// so the fused q/k/v split gives `rope`'s bits.
template <typename T>
__device__ __forceinline__ void rotate_pair(const T* __restrict__ xh, T* __restrict__ oh,
                                            size_t i, int half, float c, float s) {
    float x1 = to_f32(xh[i]), x2 = to_f32(xh[i + half]);
    oh[i] = from_f32<T>(x1 * c - x2 * s);
    oh[i + half] = from_f32<T>(x2 * c + x1 * s);
}

// x [tokens, heads, dim] -> out, same shape.
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
        rotate_pair(x + th * dim, out + th * dim, i, half, cos[t * half + i], sin[t * half + i]);
    }
}

// The stacked q/k/v projection's output qkv [tokens, q_heads + 2 kv_heads, dim] (per token: its
// q heads, k heads, v heads) -> out, three planes one after the other: q [tokens, q_heads, dim]
// and k [tokens, kv_heads, dim] rotated, v [tokens, kv_heads, dim] copied.
template <typename T>
__device__ void rope_qkv(const T* __restrict__ qkv, const float* __restrict__ cos,
                         const float* __restrict__ sin, T* __restrict__ out, int tokens,
                         int q_heads, int kv_heads, int dim) {
    int half = dim / 2;
    int heads = q_heads + 2 * kv_heads;
    size_t n = (size_t)tokens * heads * half;
    T* k_plane = out + (size_t)tokens * q_heads * dim;
    T* v_plane = k_plane + (size_t)tokens * kv_heads * dim;
    for (size_t k = blockIdx.x * (size_t)blockDim.x + threadIdx.x; k < n;
         k += (size_t)gridDim.x * blockDim.x) {
        size_t i = k % half;
        size_t th = k / half;
        size_t t = th / heads;
        int h = (int)(th % heads);
        const T* src = qkv + th * dim;
        if (h < q_heads) {
            T* dst = out + (t * q_heads + h) * dim;
            rotate_pair(src, dst, i, half, cos[t * half + i], sin[t * half + i]);
        } else if (h < q_heads + kv_heads) {
            T* dst = k_plane + (t * kv_heads + (h - q_heads)) * dim;
            rotate_pair(src, dst, i, half, cos[t * half + i], sin[t * half + i]);
        } else {
            T* dst = v_plane + (t * kv_heads + (h - q_heads - kv_heads)) * dim;
            dst[i] = src[i];
            dst[i + half] = src[i + half];
        }
    }
}

#define ROPE(NAME, T)                                                                        \
    extern "C" __global__ void rope_##NAME(const T* x, const float* cos, const float* sin,  \
                                           T* out, int tokens, int heads, int dim) {         \
        rope<T>(x, cos, sin, out, tokens, heads, dim);                                       \
    }                                                                                        \
    extern "C" __global__ void rope_qkv_##NAME(const T* qkv, const float* cos,              \
                                               const float* sin, T* out, int tokens,         \
                                               int q_heads, int kv_heads, int dim) {         \
        rope_qkv<T>(qkv, cos, sin, out, tokens, q_heads, kv_heads, dim);                     \
    }
DETSPEC_FOR_DTYPES(ROPE)
