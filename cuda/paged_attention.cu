// Causal attention of a flat varlen batch (prefill chunks and decode rows) against the paged KV
// cache; the layouts and semantics of src/ops/paged_attention.rs.
//
// One block of ATTN_THREADS threads computes one (row, group of query heads, split): grid (rows,
// heads / heads_per_block, splits), the group's heads sharing one KV head (grouped-query
// attention), so the block reads each key and value once for all of them. It walks its keys in
// blocks of SOFTMAX_BLOCK positions aligned to absolute positions, with an online softmax per
// head; within a block 8 lanes per key reduce each head's dot product in a fixed butterfly, and
// every accumulation over keys is sequential in position order. So a (row, head)'s bits depend
// only on its own query, its keys and its split count: not on the batch, the paging, which
// other rows run, or which heads share its block.
//
#include "common.cuh"

constexpr int ATTN_THREADS = 128;
constexpr int SOFTMAX_BLOCK = 16;
constexpr int LANES_PER_KEY = ATTN_THREADS / SOFTMAX_BLOCK;  // 8
constexpr int MAX_DIM = 256;
constexpr int DIMS_PER_THREAD = MAX_DIM / ATTN_THREADS;     // 2
constexpr int MAX_GROUP = 8;  // query heads per block (the host picks a divisor of the group)

struct AttnArgs {
    const uint32_t* positions;   // [rows]
    const uint32_t* row_seq;     // [rows]
    const uint32_t* bt_offsets;  // [seqs + 1]: sequence s's pages are bt_pages[off[s]..off[s+1]]
    const uint32_t* bt_pages;
    const uint32_t* row_splits;  // [rows], >= 1
    int heads, kv_heads, dim, page_size, window, max_splits, heads_per_block;
    float scale;
    float softcap;  // Gemma 2's cap on the scaled scores, c tanh(s / c); 0: none
};

// Per-head arrays are MAX_GROUP long and every loop over them is unrolled with a `g < group`
// guard, so they stay in registers.
template <typename T>
__device__ void attention_split(const T* __restrict__ q, const T* __restrict__ k_cache,
                                const T* __restrict__ v_cache, T* __restrict__ out,
                                float* __restrict__ partial_acc, float* __restrict__ partial_ml,
                                const AttnArgs a) {
    const int row = blockIdx.x, split = blockIdx.z;
    const int splits = (int)a.row_splits[row];
    if (split >= splits) return;
    const int tid = threadIdx.x;
    const int group = a.heads_per_block;
    const int head0 = blockIdx.y * group;
    const int kvh = head0 / (a.heads / a.kv_heads);
    const int dim = a.dim;
    const uint32_t* bt = a.bt_pages + a.bt_offsets[a.row_seq[row]];

    const int pos = (int)a.positions[row];
    const int start = a.window > 0 ? max(0, pos + 1 - a.window) : 0;
    const int end = pos + 1;
    // This split's whole 16-key blocks, then clipped to [start, end).
    const int b0 = start / SOFTMAX_BLOCK, b1 = (end - 1) / SOFTMAX_BLOCK + 1;
    const int per_split = (b1 - b0 + splits - 1) / splits;
    const int lo = max(start, (b0 + split * per_split) * SOFTMAX_BLOCK);
    const int hi = min(end, (b0 + (split + 1) * per_split) * SOFTMAX_BLOCK);

    __shared__ float qs[MAX_GROUP][MAX_DIM];
    __shared__ float scores[MAX_GROUP][SOFTMAX_BLOCK];
    __shared__ float probs[MAX_GROUP][SOFTMAX_BLOCK];
    for (int g = 0; g < group; ++g) {
        const T* qrow = q + ((size_t)row * a.heads + head0 + g) * dim;
        for (int d = tid; d < dim; d += ATTN_THREADS) qs[g][d] = to_f32(qrow[d]);
    }
    __syncthreads();

    const int key = tid / LANES_PER_KEY, lane = tid % LANES_PER_KEY;
    float m[MAX_GROUP], l[MAX_GROUP], acc[MAX_GROUP][DIMS_PER_THREAD];
#pragma unroll
    for (int g = 0; g < MAX_GROUP; ++g) {
        m[g] = -INFINITY;
        l[g] = 0.f;
#pragma unroll
        for (int t = 0; t < DIMS_PER_THREAD; ++t) acc[g][t] = 0.f;
    }

    for (int j0 = lo; j0 < hi;) {
        const int j1 = min(hi, (j0 / SOFTMAX_BLOCK + 1) * SOFTMAX_BLOCK);
        const int n = j1 - j0;
        float dot[MAX_GROUP];
#pragma unroll
        for (int g = 0; g < MAX_GROUP; ++g) dot[g] = 0.f;
        if (key < n) {
            const int j = j0 + key;
            const size_t page = bt[j / a.page_size], in_page = j % a.page_size;
            const T* k = k_cache + (page * a.kv_heads + kvh) * dim * a.page_size + in_page;
            for (int d = lane; d < dim; d += LANES_PER_KEY) {
                const float kd = to_f32(k[(size_t)d * a.page_size]);
#pragma unroll
                for (int g = 0; g < MAX_GROUP; ++g) {
                    if (g < group) dot[g] += qs[g][d] * kd;
                }
            }
        }
        // Every lane of the warp takes part (absent keys with zeros); the butterfly gives all 8
        // lanes of a key the same sum (each step adds the same two values, in either order).
#pragma unroll
        for (int g = 0; g < MAX_GROUP; ++g) {
            if (g < group) {
                dot[g] += __shfl_xor_sync(0xffffffff, dot[g], 4);
                dot[g] += __shfl_xor_sync(0xffffffff, dot[g], 2);
                dot[g] += __shfl_xor_sync(0xffffffff, dot[g], 1);
                if (lane == 0 && key < n) {
                    const float s = dot[g] * a.scale;
                    scores[g][key] = a.softcap > 0.f ? tanhf(s / a.softcap) * a.softcap : s;
                }
            }
        }
        __syncthreads();
        float m_new[MAX_GROUP];
#pragma unroll
        for (int g = 0; g < MAX_GROUP; ++g) {
            m_new[g] = m[g];
            if (g < group) {
                for (int i = 0; i < n; ++i) m_new[g] = fmaxf(m_new[g], scores[g][i]);
                if (lane == 0 && key < n) probs[g][key] = expf(scores[g][key] - m_new[g]);
            }
        }
        __syncthreads();
        float alpha[MAX_GROUP];
#pragma unroll
        for (int g = 0; g < MAX_GROUP; ++g) {
            alpha[g] = 1.f;
            if (g < group) {
                alpha[g] = expf(m[g] - m_new[g]);
                float block_sum = 0.f;
                for (int i = 0; i < n; ++i) block_sum += probs[g][i];
                l[g] = l[g] * alpha[g] + block_sum;
            }
        }
#pragma unroll
        for (int t = 0; t < DIMS_PER_THREAD; ++t) {
            const int d = tid + t * ATTN_THREADS;
            if (d < dim) {
                float s[MAX_GROUP];
#pragma unroll
                for (int g = 0; g < MAX_GROUP; ++g) s[g] = 0.f;
#pragma unroll 4
                for (int i = 0; i < n; ++i) {
                    const int j = j0 + i;
                    const size_t page = bt[j / a.page_size], in_page = j % a.page_size;
                    const T* v = v_cache + ((page * a.page_size + in_page) * a.kv_heads + kvh) * dim;
                    const float vd = to_f32(v[d]);
#pragma unroll
                    for (int g = 0; g < MAX_GROUP; ++g) {
                        if (g < group) s[g] += probs[g][i] * vd;
                    }
                }
#pragma unroll
                for (int g = 0; g < MAX_GROUP; ++g) {
                    if (g < group) acc[g][t] = acc[g][t] * alpha[g] + s[g];
                }
            }
        }
#pragma unroll
        for (int g = 0; g < MAX_GROUP; ++g) m[g] = m_new[g];
        j0 = j1;
        __syncthreads();  // scores/probs are rewritten by the next block
    }

#pragma unroll
    for (int g = 0; g < MAX_GROUP; ++g) {
        if (g >= group) continue;
        const size_t head_row = (size_t)row * a.heads + head0 + g;
        if (splits == 1) {
            T* o = out + head_row * dim;
#pragma unroll
            for (int t = 0; t < DIMS_PER_THREAD; ++t) {
                const int d = tid + t * ATTN_THREADS;
                if (d < dim) o[d] = from_f32<T>(acc[g][t] / l[g]);
            }
            continue;
        }
        const size_t slot = head_row * a.max_splits + split;
#pragma unroll
        for (int t = 0; t < DIMS_PER_THREAD; ++t) {
            const int d = tid + t * ATTN_THREADS;
            if (d < dim) partial_acc[slot * dim + d] = acc[g][t];
        }
        if (tid == 0) {
            partial_ml[2 * slot] = m[g];
            partial_ml[2 * slot + 1] = l[g];
        }
    }
}

// Merges the splits of rows with more than one, in split order.
template <typename T>
__device__ void attention_merge(T* __restrict__ out, const float* __restrict__ partial_acc,
                                const float* __restrict__ partial_ml, const AttnArgs a) {
    const int row = blockIdx.x, head = blockIdx.y;
    const int splits = (int)a.row_splits[row];
    if (splits == 1) return;
    const size_t first = ((size_t)row * a.heads + head) * a.max_splits;
    float m = -INFINITY;
    for (int s = 0; s < splits; ++s) m = fmaxf(m, partial_ml[2 * (first + s)]);
    float l = 0.f;
    for (int s = 0; s < splits; ++s) {
        const float ms = partial_ml[2 * (first + s)];
        if (ms > -INFINITY) l += partial_ml[2 * (first + s) + 1] * expf(ms - m);
    }
    T* o = out + ((size_t)row * a.heads + head) * a.dim;
    for (int d = threadIdx.x; d < a.dim; d += blockDim.x) {
        float s = 0.f;
        for (int k = 0; k < splits; ++k) {
            const float ms = partial_ml[2 * (first + k)];
            if (ms > -INFINITY) s += partial_acc[(first + k) * a.dim + d] * expf(ms - m);
        }
        o[d] = from_f32<T>(s / l);
    }
}

// Entry points take plain arguments (no struct), so the host passes each as a kernel parameter.
#define ATTN_PARAMS                                                                          \
    const uint32_t *positions, const uint32_t *row_seq, const uint32_t *bt_offsets,          \
        const uint32_t *bt_pages, const uint32_t *row_splits, int heads, int kv_heads,       \
        int dim, int page_size, int window, int max_splits, int heads_per_block, float scale, \
        float softcap
#define ATTN_ARGS                                                                            \
    AttnArgs{positions, row_seq, bt_offsets, bt_pages, row_splits, heads, kv_heads, dim,     \
             page_size, window, max_splits, heads_per_block, scale, softcap}

#define ATTENTION(NAME, T)                                                                   \
    extern "C" __global__ void __launch_bounds__(ATTN_THREADS) paged_attention_##NAME(      \
        const T* q, const T* k_cache, const T* v_cache, T* out, float* partial_acc,          \
        float* partial_ml, ATTN_PARAMS) {                                                    \
        attention_split<T>(q, k_cache, v_cache, out, partial_acc, partial_ml, ATTN_ARGS);    \
    }                                                                                        \
    extern "C" __global__ void attention_merge_##NAME(T* out, const float* partial_acc,     \
                                                      const float* partial_ml, ATTN_PARAMS) { \
        attention_merge<T>(out, partial_acc, partial_ml, ATTN_ARGS);                         \
    }
DETSPEC_FOR_DTYPES(ATTENTION)
