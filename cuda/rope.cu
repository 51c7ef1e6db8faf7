// Rotary embedding, "rotate half" (transformers' Llama): heads of `dim` values in T, cos/sin
// [tokens, dim/2] in f32 (gathered at each token's absolute position). Elementwise.
#include "common.cuh"

// One rotated pair (x[i], x[i + half]) of one head, as (first, second): every kernel here
// rotates through this function, so the fused ones give `rope`'s bits.
template <typename T>
__device__ __forceinline__ void rotated(const T* __restrict__ xh, size_t i, int half, float c,
                                        float s, T& first, T& second) {
    float x1 = to_f32(xh[i]), x2 = to_f32(xh[i + half]);
    first = from_f32<T>(x1 * c - x2 * s);
    second = from_f32<T>(x2 * c + x1 * s);
}

// The pair rotated into the same positions of `oh`.
template <typename T>
__device__ __forceinline__ void rotate_pair(const T* __restrict__ xh, T* __restrict__ oh,
                                            size_t i, int half, float c, float s) {
    rotated(xh, i, half, c, s, oh[i], oh[i + half]);
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

// rope_qkv with the KV cache write folded in: q rotated into `q_out` [tokens, q_heads, dim], k
// rotated and v copied straight into the paged caches at each token's slot (the layouts of
// cache_write.cu: K transposed per page [pages, kv_heads, dim, page_size], V rows [pages,
// page_size, kv_heads, dim]). One launch where rope_qkv and two cache writes were three (a
// decode step of an 8B model: 64 launches fewer), with their bits: the same `rotated`. Slots
// were bounds-checked on the host.
template <typename T>
__device__ void rope_qkv_cache(const T* __restrict__ qkv, const float* __restrict__ cos,
                               const float* __restrict__ sin, T* __restrict__ q_out,
                               T* __restrict__ k_cache, T* __restrict__ v_cache,
                               const uint32_t* __restrict__ slots, int tokens, int q_heads,
                               int kv_heads, int dim, int page_size) {
    int half = dim / 2;
    int heads = q_heads + 2 * kv_heads;
    size_t row = (size_t)kv_heads * dim;  // one slot's K or V values
    size_t n = (size_t)tokens * heads * half;
    for (size_t k = blockIdx.x * (size_t)blockDim.x + threadIdx.x; k < n;
         k += (size_t)gridDim.x * blockDim.x) {
        size_t i = k % half;
        size_t th = k / half;
        size_t t = th / heads;
        int h = (int)(th % heads);
        const T* src = qkv + th * dim;
        if (h < q_heads) {
            rotate_pair(src, q_out + (t * q_heads + h) * dim, i, half, cos[t * half + i],
                        sin[t * half + i]);
            continue;
        }
        size_t slot = slots[t];
        if (h < q_heads + kv_heads) {
            size_t page = slot / page_size, at = slot % page_size;
            size_t hd = (size_t)(h - q_heads) * dim + i;
            rotated(src, i, half, cos[t * half + i], sin[t * half + i],
                    k_cache[(page * row + hd) * page_size + at],
                    k_cache[(page * row + hd + half) * page_size + at]);
        } else {
            T* dst = v_cache + slot * row + (size_t)(h - q_heads - kv_heads) * dim;
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
    }                                                                                        \
    extern "C" __global__ void rope_qkv_cache_##NAME(                                        \
        const T* qkv, const float* cos, const float* sin, T* q_out, T* k_cache, T* v_cache,  \
        const uint32_t* slots, int tokens, int q_heads, int kv_heads, int dim,               \
        int page_size) {                                                                     \
        rope_qkv_cache<T>(qkv, cos, sin, q_out, k_cache, v_cache, slots, tokens, q_heads,    \
                          kv_heads, dim, page_size);                                         \
    }
DETSPEC_FOR_DTYPES(ROPE)
