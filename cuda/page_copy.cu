// Copies whole KV pages for copy-on-write: blockIdx.y picks the (src, dst) pair. The host
// launches pairs that depend on each other (one writes a page another reads or writes) in
// separate launches, so "applied in order" holds.
#include "common.cuh"

template <typename T>
__device__ void page_copy(T* data, const uint32_t* pairs, size_t page) {
    const uint32_t* p = pairs + 2 * blockIdx.y;
    const T* src = data + (size_t)p[0] * page;
    T* dst = data + (size_t)p[1] * page;
    for (size_t k = blockIdx.x * (size_t)blockDim.x + threadIdx.x; k < page;
         k += (size_t)gridDim.x * blockDim.x) {
        dst[k] = src[k];
    }
}

#define PAGE_COPY(NAME, T)                                                                   \
    extern "C" __global__ void page_copy_##NAME(T* data, const uint32_t* pairs, size_t page) { \
        page_copy<T>(data, pairs, page);                                                     \
    }
DETSPEC_FOR_DTYPES(PAGE_COPY)
