// RMSNorm over the last dimension: one block per row, so a row's reduction order depends only
// on the row length and the (fixed) block size, never on how many rows the batch has.
#include "common.cuh"

constexpr int RMS_THREADS = 256;

template <typename T>
__device__ void rms_norm(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ out,
                         int dim, float eps) {
    __shared__ float partial[RMS_THREADS];
    const T* row = x + (size_t)blockIdx.x * dim;
    T* orow = out + (size_t)blockIdx.x * dim;
    float sum = 0.f;
    for (int i = threadIdx.x; i < dim; i += RMS_THREADS) {
        float v = to_f32(row[i]);
        sum += v * v;
    }
    partial[threadIdx.x] = sum;
    __syncthreads();
    // Fixed tree over the block's partial sums.
    for (int s = RMS_THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
        __syncthreads();
    }
    float inv = 1.f / sqrtf(partial[0] / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += RMS_THREADS) {
        orow[i] = from_f32<T>(to_f32(w[i]) * (to_f32(row[i]) * inv));
    }
}

#define RMS_NORM(NAME, T)                                                                   \
    extern "C" __global__ void __launch_bounds__(RMS_THREADS) rms_norm_##NAME(             \
        const T* x, const T* w, T* out, int dim, float eps) {                               \
        rms_norm<T>(x, w, out, dim, eps);                                                   \
    }
DETSPEC_FOR_DTYPES(RMS_NORM)
