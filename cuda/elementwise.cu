// The decoder's elementwise maps: residual add and the MLP's gated activation (SwiGLU, GeGLU),
// each one pass over its elements with
// the arithmetic in f32 and one rounding to the output dtype. Per element, so trivially batch-
// and position-invariant.
#include "common.cuh"

template <typename T>
__device__ void add(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out,
                    size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        out[i] = from_f32<T>(to_f32(a[i]) + to_f32(b[i]));
    }
}

// silu(g) * u with silu(x) = x / (1 + exp(-x)), as candle-nn and transformers write it. Both
// SwiGLU kernels go through this function, so they give the same bits.
template <typename T>
__device__ __forceinline__ T swiglu_one(T gate, T up) {
    const float g = to_f32(gate);
    return from_f32<T>(g / (1.f + expf(-g)) * to_f32(up));
}

// gelu_tanh(g) * u, GELU's tanh form 0.5 g (1 + tanh(u)) written as g / (1 + exp(-2u)) (the
// same function, and no cancellation against -1 in the negative tail), as the CPU computes it.
template <typename T>
__device__ __forceinline__ T geglu_one(T gate, T up) {
    const float g = to_f32(gate);
    const float two_u = 1.5957692f * (g + 0.044715f * (g * g * g));
    return from_f32<T>(g / (1.f + expf(-two_u)) * to_f32(up));
}

// out = ONE(gate, up) per element (swiglu_one or geglu_one).
template <typename T, T (*ONE)(T, T)>
__device__ void gated(const T* __restrict__ gate, const T* __restrict__ up, T* __restrict__ out,
                      size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        out[i] = ONE(gate[i], up[i]);
    }
}

// The stacked gate/up projection's output gu [rows, 2 width] (per row: gate, then up) -> out
// [rows, width]. A 2-D grid (columns x rows): no 64-bit division per element.
template <typename T, T (*ONE)(T, T)>
__device__ void gated_halves(const T* __restrict__ gu, T* __restrict__ out, int rows, int width) {
    for (int r = blockIdx.y; r < rows; r += gridDim.y) {
        const T* row = gu + (size_t)r * 2 * width;
        T* orow = out + (size_t)r * width;
        for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < width;
             c += gridDim.x * blockDim.x) {
            orow[c] = ONE(row[c], row[width + c]);
        }
    }
}

// tanh(x / cap) * cap: Gemma 2's soft cap on the logits.
template <typename T>
__device__ void softcap(const T* __restrict__ x, T* __restrict__ out, size_t n, float cap) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        out[i] = from_f32<T>(tanhf(to_f32(x[i]) / cap) * cap);
    }
}

#define ELEMENTWISE(NAME, T)                                                                 \
    extern "C" __global__ void add_##NAME(const T* a, const T* b, T* out, size_t n) {        \
        add<T>(a, b, out, n);                                                                \
    }                                                                                        \
    extern "C" __global__ void swiglu_##NAME(const T* gate, const T* up, T* out, size_t n) { \
        gated<T, swiglu_one<T>>(gate, up, out, n);                                           \
    }                                                                                        \
    extern "C" __global__ void swiglu_halves_##NAME(const T* gu, T* out, int rows,           \
                                                    int width) {                             \
        gated_halves<T, swiglu_one<T>>(gu, out, rows, width);                                \
    }                                                                                        \
    extern "C" __global__ void geglu_##NAME(const T* gate, const T* up, T* out, size_t n) {  \
        gated<T, geglu_one<T>>(gate, up, out, n);                                            \
    }                                                                                        \
    extern "C" __global__ void geglu_halves_##NAME(const T* gu, T* out, int rows,            \
                                                   int width) {                              \
        gated_halves<T, geglu_one<T>>(gu, out, rows, width);                                 \
    }                                                                                        \
    extern "C" __global__ void softcap_##NAME(const T* x, T* out, size_t n, float cap) {     \
        softcap<T>(x, out, n, cap);                                                          \
    }
DETSPEC_FOR_DTYPES(ELEMENTWISE)
