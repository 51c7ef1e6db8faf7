// Writes new K/V rows into the paged cache at their slots (layouts as src/ops/cache_write.rs):
// V rows [pages, page_size, kv_heads, head_dim]; K transposed per page
// [pages, kv_heads, head_dim, page_size]. `row` = kv_heads * head_dim. Slots were bounds-checked
// on the host.
#include "common.cuh"

template <typename T>
__device__ void cache_write(T* __restrict__ cache, const T* __restrict__ src,
                            const uint32_t* __restrict__ slots, int n, int row, int page_size,
                            int transposed) {
    size_t total = (size_t)n * row;
    for (size_t k = blockIdx.x * (size_t)blockDim.x + threadIdx.x; k < total;
         k += (size_t)gridDim.x * blockDim.x) {
        size_t i = k / row, hd = k % row;
        size_t slot = slots[i];
        size_t dst;
        if (transposed) {
            size_t page = slot / page_size, t = slot % page_size;
            dst = (page * row + hd) * page_size + t;
        } else {
            dst = slot * row + hd;
        }
        cache[dst] = src[k];
    }
}

#define CACHE_WRITE(NAME, T)                                                                 \
    extern "C" __global__ void cache_write_##NAME(T* cache, const T* src, const uint32_t* slots, \
                                                  int n, int row, int page_size, int transposed) { \
        cache_write<T>(cache, src, slots, n, row, page_size, transposed);                    \
    }
DETSPEC_FOR_DTYPES(CACHE_WRITE)
