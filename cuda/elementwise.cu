// The decoder's elementwise maps: residual add and SwiGLU, each one pass over its elements with
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

// silu(g) * u with silu(x) = x / (1 + exp(-x)), as candle-nn and transformers write it.
template <typename T>
__device__ void swiglu(const T* __restrict__ gate, const T* __restrict__ up, T* __restrict__ out,
                       size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const float g = to_f32(gate[i]);
        out[i] = from_f32<T>(g / (1.f + expf(-g)) * to_f32(up[i]));
    }
}

#define ELEMENTWISE(NAME, T)                                                                 \
    extern "C" __global__ void add_##NAME(const T* a, const T* b, T* out, size_t n) {        \
        add<T>(a, b, out, n);                                                                \
    }                                                                                        \
    extern "C" __global__ void swiglu_##NAME(const T* gate, const T* up, T* out, size_t n) { \
        swiglu<T>(gate, up, out, n);                                                         \
    }
DETSPEC_FOR_DTYPES(ELEMENTWISE)
