// RMSNorm over the last dimension, alone or after the residual add: one block per row, so a
// row's reduction order depends only on the row length and the (fixed) block size, never on
// how many rows the batch has.
#include "common.cuh"

constexpr int RMS_THREADS = 256;

// 1 / sqrt(mean(row²) + eps) of a row of `dim` values, each read through `value(i)`: every
// thread sums a strided slice in order, then a fixed tree over the block. Both kernels reduce
// through this one function, so the fused add + norm gives the unfused pair's bits.
template <typename F>
__device__ float inv_rms(F value, int dim, float eps) {
    __shared__ float partial[RMS_THREADS];
    float sum = 0.f;
    for (int i = threadIdx.x; i < dim; i += RMS_THREADS) {
        float v = value(i);
        sum += v * v;
    }
    partial[threadIdx.x] = sum;
    __syncthreads();
    for (int s = RMS_THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
        __syncthreads();
    }
    return 1.f / sqrtf(partial[0] / (float)dim + eps);
}

template <typename T>
__device__ void rms_norm(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ out,
                         int dim, float eps) {
    const T* row = x + (size_t)blockIdx.x * dim;
    T* orow = out + (size_t)blockIdx.x * dim;
    float inv = inv_rms([&](int i) { return to_f32(row[i]); }, dim, eps);
    for (int i = threadIdx.x; i < dim; i += RMS_THREADS) {
        orow[i] = from_f32<T>(to_f32(w[i]) * (to_f32(row[i]) * inv));
    }
}

// sum = x + delta (rounded to T, as `add`), then out = rms_norm(sum) (as `rms_norm`): the
// residual stream and the next sublayer's input in one pass. Each thread writes and later
// reads back only its own elements of `sum`.
template <typename T>
__device__ void add_rms_norm(const T* __restrict__ x, const T* __restrict__ delta,
                             const T* __restrict__ w, T* __restrict__ sum, T* __restrict__ out,
                             int dim, float eps) {
    size_t base = (size_t)blockIdx.x * dim;
    float inv = inv_rms(
        [&](int i) {
            T s = from_f32<T>(to_f32(x[base + i]) + to_f32(delta[base + i]));
            sum[base + i] = s;
            return to_f32(s);
        },
        dim, eps);
    for (int i = threadIdx.x; i < dim; i += RMS_THREADS) {
        out[base + i] = from_f32<T>(to_f32(w[i]) * (to_f32(sum[base + i]) * inv));
    }
}

#define RMS_NORM(NAME, T)                                                                   \
    extern "C" __global__ void __launch_bounds__(RMS_THREADS) rms_norm_##NAME(             \
        const T* x, const T* w, T* out, int dim, float eps) {                               \
        rms_norm<T>(x, w, out, dim, eps);                                                   \
    }                                                                                       \
    extern "C" __global__ void __launch_bounds__(RMS_THREADS) add_rms_norm_##NAME(         \
        const T* x, const T* delta, const T* w, T* sum, T* out, int dim, float eps) {       \
        add_rms_norm<T>(x, delta, w, sum, out, dim, eps);                                   \
    }
DETSPEC_FOR_DTYPES(RMS_NORM)
