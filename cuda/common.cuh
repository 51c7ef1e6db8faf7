// Shared by every detspec kernel: dtype conversion to and from the f32 all arithmetic runs in.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }

// Instantiates `extern "C"` entry points NAME_f32, NAME_bf16, NAME_f16 of a template kernel.
#define DETSPEC_FOR_DTYPES(MACRO) \
    MACRO(f32, float)             \
    MACRO(bf16, __nv_bfloat16)    \
    MACRO(f16, __half)
