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

// silu(g) * u with silu(x) = x / (1 + exp(-x)), as candle-nn and transformers write it. Both
// SwiGLU kernels go through this function, so they give the same bits.
template <typename T>
__device__ __forceinline__ T swiglu_one(T gate, T up) {
    const float g = to_f32(gate);
    return from_f32<T>(g / (1.f + expf(-g)) * to_f32(up));
}

template <typename T>
__device__ void swiglu(const T* __restrict__ gate, const T* __restrict__ up, T* __restrict__ out,
                       size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        out[i] = swiglu_one(gate[i], up[i]);
    }
}

// The stacked gate/up projection's output gu [rows, 2 width] (per row: gate, then up) -> out
// [rows, width]. A 2-D grid (columns x rows): no 64-bit division per element.
template <typename T>
__device__ void swiglu_halves(const T* __restrict__ gu, T* __restrict__ out, int rows,
                              int width) {
    for (int r = blockIdx.y; r < rows; r += gridDim.y) {
        const T* row = gu + (size_t)r * 2 * width;
        T* orow = out + (size_t)r * width;
        for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < width;
             c += gridDim.x * blockDim.x) {
            orow[c] = swiglu_one(row[c], row[width + c]);
        }
    }
}

#define ELEMENTWISE(NAME, T)                                                                 \
    extern "C" __global__ void add_##NAME(const T* a, const T* b, T* out, size_t n) {        \
        add<T>(a, b, out, n);                                                                \
    }                                                                                        \
    extern "C" __global__ void swiglu_##NAME(const T* gate, const T* up, T* out, size_t n) { \
        swiglu<T>(gate, up, out, n);                                                         \
    }                                                                                        \
    extern "C" __global__ void swiglu_halves_##NAME(const T* gu, T* out, int rows,           \
                                                    int width) {                             \
        swiglu_halves<T>(gu, out, rows, width);                                              \
    }
DETSPEC_FOR_DTYPES(ELEMENTWISE)
