// RMSNorm over the last dimension, alone or after the residual add: one block per row, so a
// row's reduction order depends only on the row length and the (fixed) block size, never on
// how many rows the batch has.
//
// Thread t sums the squares of elements t, t + 256, t + 512, ... in that order, then a fixed
// tree adds the 256 partial sums; both kernels reduce in exactly this order, so the fused add +
// norm gives the unfused pair's bits. The loops load UNROLL elements before using any (the
// loads overlap instead of waiting out one memory latency each: at batch 1 a row is one block,
// and the wait was most of its time).
#include "common.cuh"

constexpr int RMS_THREADS = 256;
constexpr int UNROLL = 8;

// The sum of every thread's `partial`, by a fixed tree over the block.
__device__ float block_sum(float partial) {
    __shared__ float sums[RMS_THREADS];
    sums[threadIdx.x] = partial;
    __syncthreads();
    for (int s = RMS_THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) sums[threadIdx.x] += sums[threadIdx.x + s];
        __syncthreads();
    }
    return sums[0];
}

// w[i] * (v[i] * inv) for this thread's elements of `row` (already rounded to T).
template <typename T>
__device__ void scale_row(const T* __restrict__ row, const T* __restrict__ w, T* __restrict__ out,
                          int dim, float inv) {
    for (int base = threadIdx.x; base < dim; base += RMS_THREADS * UNROLL) {
        float v[UNROLL], g[UNROLL];
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            const int i = base + k * RMS_THREADS;
            v[k] = i < dim ? to_f32(row[i]) : 0.f;
            g[k] = i < dim ? to_f32(w[i]) : 0.f;
        }
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            const int i = base + k * RMS_THREADS;
            if (i < dim) out[i] = from_f32<T>(g[k] * (v[k] * inv));
        }
    }
}

template <typename T>
__device__ void rms_norm(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ out,
                         int dim, float eps) {
    const T* row = x + (size_t)blockIdx.x * dim;
    float sum = 0.f;
    for (int base = threadIdx.x; base < dim; base += RMS_THREADS * UNROLL) {
        float v[UNROLL];
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            const int i = base + k * RMS_THREADS;
            v[k] = i < dim ? to_f32(row[i]) : 0.f;
        }
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            if (base + k * RMS_THREADS < dim) sum += v[k] * v[k];
        }
    }
    const float inv = 1.f / sqrtf(block_sum(sum) / (float)dim + eps);
    scale_row(row, w, out + (size_t)blockIdx.x * dim, dim, inv);
}

// sum = x + delta (rounded to T, as `add`), then out = rms_norm(sum) (as `rms_norm`): the
// residual stream and the next sublayer's input in one pass. Each thread reads back only the
// elements of `sum` it wrote.
template <typename T>
__device__ void add_rms_norm(const T* __restrict__ x, const T* __restrict__ delta,
                             const T* __restrict__ w, T* __restrict__ sum_out,
                             T* __restrict__ out, int dim, float eps) {
    const size_t at = (size_t)blockIdx.x * dim;
    float sum = 0.f;
    for (int base = threadIdx.x; base < dim; base += RMS_THREADS * UNROLL) {
        float a[UNROLL], b[UNROLL];
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            const int i = base + k * RMS_THREADS;
            a[k] = i < dim ? to_f32(x[at + i]) : 0.f;
            b[k] = i < dim ? to_f32(delta[at + i]) : 0.f;
        }
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            const int i = base + k * RMS_THREADS;
            if (i < dim) {
                const T s = from_f32<T>(a[k] + b[k]);
                sum_out[at + i] = s;
                const float v = to_f32(s);
                sum += v * v;
            }
        }
    }
    const float inv = 1.f / sqrtf(block_sum(sum) / (float)dim + eps);
    scale_row(sum_out + at, w, out + at, dim, inv);
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
