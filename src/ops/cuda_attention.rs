//! The CUDA body of [`super::paged_attention`]: `cuda/paged_attention.cu`, split count per row
//! from the schedule (1 for the fixed schedule and for every row of a `fixed_seqs` sequence),
//! then a merge of the split rows.

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use candle_core::cuda::WrapErr;
use candle_core::{bail, CudaDevice, CudaStorage, Layout};

use super::attention_plan::{AttentionMetadata, AttentionSchedule, AttentionShape, SOFTMAX_BLOCK};
use super::cuda::{self, with_float_type, UploadCache};

/// Threads per (row, head group, split) block; `cuda/paged_attention.cu`'s `ATTN_THREADS`.
const ATTN_THREADS: u32 = 128;
/// Largest head_dim the kernel holds (`MAX_DIM`).
const MAX_DIM: usize = 256;
/// Most query heads one block attends for (`MAX_GROUP`).
const MAX_GROUP: usize = 8;

/// Query heads per block: the largest divisor of the heads sharing a KV head that the kernel
/// holds, so a block's heads share one KV head and every head is in exactly one block.
fn heads_per_block(heads: usize, kv_heads: usize) -> usize {
    let group = (heads / kv_heads.max(1)).max(1);
    (1..=group.min(MAX_GROUP))
        .rev()
        .find(|&g| group.is_multiple_of(g))
        .unwrap_or(1)
}

/// The metadata as the kernel reads it.
struct DeviceMetadata {
    positions: CudaSlice<u32>,
    row_seq: CudaSlice<u32>,
    bt_offsets: CudaSlice<u32>,
    bt_pages: CudaSlice<u32>,
    row_splits: CudaSlice<u32>,
    max_splits: usize,
}

/// Every layer of a forward attends with the same metadata: uploaded once.
static METADATA_ON_DEVICE: UploadCache<AttentionMetadata, DeviceMetadata> = UploadCache::new();

/// Splits of each row: 1 under the fixed schedule and for fixed sequences, else the schedule's
/// count, at most the row's number of 16-key blocks.
fn row_splits(meta: &AttentionMetadata) -> Vec<u32> {
    let splits = match meta.schedule {
        AttentionSchedule::Fixed => 1,
        AttentionSchedule::SplitKv { splits } => splits.max(1),
    };
    meta.positions
        .iter()
        .zip(&meta.row_seq)
        .map(|(&pos, &seq)| {
            let pos = pos as usize;
            let fixed = meta.fixed_seqs.get(seq as usize).copied().unwrap_or(false);
            if fixed || splits == 1 {
                return 1;
            }
            let start = meta
                .sliding_window
                .map_or(0, |w| (pos + 1).saturating_sub(w));
            let blocks = pos / SOFTMAX_BLOCK + 1 - start / SOFTMAX_BLOCK;
            splits.min(blocks) as u32
        })
        .collect()
}

fn upload(dev: &CudaDevice, meta: &AttentionMetadata) -> candle_core::Result<DeviceMetadata> {
    let mut offsets = Vec::with_capacity(meta.block_tables.len() + 1);
    let mut pages = Vec::new();
    offsets.push(0u32);
    for bt in &meta.block_tables {
        pages.extend_from_slice(bt);
        let Ok(end) = u32::try_from(pages.len()) else {
            bail!("paged_attention: block tables hold more than 2^32 pages");
        };
        offsets.push(end);
    }
    let splits = row_splits(meta);
    Ok(DeviceMetadata {
        positions: cuda::upload_u32(dev, &meta.positions)?,
        row_seq: cuda::upload_u32(dev, &meta.row_seq)?,
        bt_offsets: cuda::upload_u32(dev, &offsets)?,
        bt_pages: cuda::upload_u32(dev, &pages)?,
        max_splits: splits.iter().copied().max().unwrap_or(1) as usize,
        row_splits: cuda::upload_u32(dev, &splits)?,
    })
}

/// Attention of `q` against the caches; `shape` was checked against the operands and metadata.
pub(super) fn paged_attention(
    meta: &Arc<AttentionMetadata>,
    scale: f32,
    shape: &AttentionShape,
    (qs, ql): (&CudaStorage, &Layout),
    (ks, kl): (&CudaStorage, &Layout),
    (vs, vl): (&CudaStorage, &Layout),
) -> candle_core::Result<CudaStorage> {
    let dtype = qs.dtype();
    if ks.dtype() != dtype || vs.dtype() != dtype {
        bail!(
            "paged_attention: q {dtype:?}, k_cache {:?} and v_cache {:?} must share a dtype",
            ks.dtype(),
            vs.dtype()
        );
    }
    if shape.dim > MAX_DIM {
        bail!(
            "paged_attention: head_dim {} is above the CUDA kernel's {MAX_DIM}",
            shape.dim
        );
    }
    let dev = qs.device().clone();
    let n = shape.rows * shape.heads * shape.dim;
    let md = METADATA_ON_DEVICE.get_or_upload(meta, &dev, |m| upload(&dev, m))?;
    let split_rows = md.max_splits > 1;
    let partial = shape.rows * shape.heads * md.max_splits;
    // Workspaces only when some row is split (one element otherwise: never read). Not zeroed:
    // every (row, head, split) slot the merge reads is written by its split, empty or not.
    // SAFETY: see above; f32 has no invalid bit patterns.
    let partial_acc =
        unsafe { dev.alloc::<f32>(if split_rows { partial * shape.dim } else { 1 })? };
    // SAFETY: as above.
    let partial_ml = unsafe { dev.alloc::<f32>(if split_rows { partial * 2 } else { 1 })? };
    let per_block = heads_per_block(shape.heads, shape.kv_heads);
    let ints = [
        cuda::arg_i32(shape.heads, "paged_attention heads")?,
        cuda::arg_i32(shape.kv_heads, "paged_attention kv_heads")?,
        cuda::arg_i32(shape.dim, "paged_attention head_dim")?,
        cuda::arg_i32(shape.page_size, "paged_attention page_size")?,
        cuda::arg_i32(
            meta.sliding_window.unwrap_or(0),
            "paged_attention sliding_window",
        )?,
        cuda::arg_i32(md.max_splits, "paged_attention splits")?,
        cuda::arg_i32(per_block, "paged_attention heads_per_block")?,
    ];
    let (rows, heads) = (
        u32::try_from(shape.rows).or_else(|_| bail!("paged_attention: {} rows", shape.rows))?,
        u32::try_from(shape.heads).or_else(|_| bail!("paged_attention: {} heads", shape.heads))?,
    );
    let attention = cuda::kernel(&dev, &cuda::PAGED_ATTENTION, "paged_attention", dtype)?;
    let merge = cuda::kernel(&dev, &cuda::PAGED_ATTENTION, "attention_merge", dtype)?;
    // The score's scale and soft cap (0: none).
    let scores = [scale, meta.softcap.unwrap_or(0.0)];
    let stream = dev.cuda_stream();
    with_float_type!(dtype, "paged_attention", |T| {
        let q = cuda::view::<T>(qs, ql, "paged_attention q")?;
        let k = cuda::view::<T>(ks, kl, "paged_attention k_cache")?;
        let v = cuda::view::<T>(vs, vl, "paged_attention v_cache")?;
        // SAFETY: every (row, head) is written, by the attention kernel (one split) or the merge.
        let mut out = unsafe { dev.alloc::<T>(n.max(1))? };
        if n > 0 {
            let mut b = stream.launch_builder(&attention);
            b.arg(&q).arg(&k).arg(&v).arg(&mut out);
            b.arg(&partial_acc).arg(&partial_ml);
            push_metadata(&mut b, &md, &ints, &scores);
            let cfg = LaunchConfig {
                grid_dim: (rows, heads / per_block as u32, md.max_splits as u32),
                block_dim: (ATTN_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: argument types and order match `paged_attention_*` in
            // cuda/paged_attention.cu; every page lookup was checked on the host.
            unsafe { b.launch(cfg) }.w()?;
            if split_rows {
                let mut b = stream.launch_builder(&merge);
                b.arg(&mut out).arg(&partial_acc).arg(&partial_ml);
                push_metadata(&mut b, &md, &ints, &scores);
                let cfg = LaunchConfig {
                    grid_dim: (rows, heads, 1),
                    block_dim: (ATTN_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: as above, `attention_merge_*`.
                unsafe { b.launch(cfg) }.w()?;
            }
        }
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    })
}

/// The kernels' trailing `ATTN_PARAMS`, in order.
fn push_metadata<'a>(
    b: &mut candle_core::cuda::cudarc::driver::LaunchArgs<'a>,
    md: &'a DeviceMetadata,
    ints: &'a [i32; 7],
    scores: &'a [f32; 2],
) {
    b.arg(&md.positions)
        .arg(&md.row_seq)
        .arg(&md.bt_offsets)
        .arg(&md.bt_pages)
        .arg(&md.row_splits);
    for i in ints {
        b.arg(i);
    }
    for f in scores {
        b.arg(f);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(
        positions: Vec<u32>,
        schedule: AttentionSchedule,
        fixed: Vec<bool>,
    ) -> AttentionMetadata {
        AttentionMetadata {
            row_seq: (0..positions.len() as u32).collect(),
            block_tables: vec![vec![0; 64]; positions.len()],
            positions,
            schedule,
            fixed_seqs: fixed,
            ..Default::default()
        }
    }

    #[test]
    fn fixed_rows_never_split() {
        let m = meta(
            vec![500, 500],
            AttentionSchedule::SplitKv { splits: 4 },
            vec![true, false],
        );
        assert_eq!(row_splits(&m), [1, 4]);
        let m = meta(vec![500], AttentionSchedule::Fixed, vec![]);
        assert_eq!(row_splits(&m), [1]);
    }

    #[test]
    fn head_groups_divide_the_heads_sharing_a_kv_head() {
        assert_eq!(heads_per_block(32, 8), 4); // Llama-3-8B
        assert_eq!(heads_per_block(64, 8), 8); // Llama-3-70B
        assert_eq!(heads_per_block(28, 4), 7); // Qwen2-7B
        assert_eq!(heads_per_block(32, 2), 8); // 16 per KV head: two blocks
        assert_eq!(heads_per_block(40, 4), 5);
        assert_eq!(heads_per_block(36, 3), 6); // 12 per KV head
        assert_eq!(heads_per_block(32, 32), 1); // multi-head attention
    }

    #[test]
    fn splits_never_exceed_blocks() {
        // Position 20 spans blocks 0 and 1.
        let m = meta(
            vec![20, 3],
            AttentionSchedule::SplitKv { splits: 8 },
            vec![],
        );
        assert_eq!(row_splits(&m), [2, 1]);
    }
}
