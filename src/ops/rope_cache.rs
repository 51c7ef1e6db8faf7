//! [`rope_qkv`] and the KV cache write of its k and v as one step: on CUDA one kernel
//! (`rope_qkv_cache` in `cuda/rope.cu`) where three ran, since a batch-1 decode step is bound by
//! its launches as much as by its bytes (an 8B model: 64 launches a step fewer); elsewhere the
//! three ops themselves. Both give the three ops' bits (`tests/common/kernels.rs`).

use std::sync::Arc;

use candle_core::Tensor;

use super::{rope_qkv, write_k, write_kv};

/// Rotates the stacked projection's output `qkv` `[tokens, (q_heads + 2 kv_heads) · head_dim]`
/// as [`rope_qkv`] does, writes k into the transposed `k_cache` ([`write_k`]) and v into
/// `v_cache` ([`write_kv`]) at `slots`, and returns q `[tokens, q_heads, head_dim]`.
#[allow(clippy::too_many_arguments)]
pub fn rope_qkv_into_cache(
    qkv: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    q_heads: usize,
    kv_heads: usize,
    k_cache: &Tensor,
    v_cache: &Tensor,
    slots: Arc<Vec<u32>>,
) -> candle_core::Result<Tensor> {
    #[cfg(feature = "cuda")]
    if qkv.device().is_cuda() {
        let op = cuda::RopeQkvCache {
            rope: super::rope::RopeQkv { q_heads, kv_heads },
            k_cache: k_cache.clone(),
            v_cache: v_cache.clone(),
            slots,
        };
        let (t, d) = (qkv.dim(0)?, qkv.dim(1)? / (q_heads + 2 * kv_heads).max(1));
        return qkv
            .contiguous()?
            .apply_op3_no_bwd(cos, sin, &op)?
            .reshape((t, q_heads, d));
    }
    let (q, k, v) = rope_qkv(qkv, cos, sin, q_heads, kv_heads)?;
    write_k(k_cache, &k, slots.clone())?;
    write_kv(v_cache, &v, slots)?;
    Ok(q)
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::sync::Arc;

    use candle_core::{bail, CpuStorage, CudaStorage, CustomOp3, Layout, Shape, Tensor};

    use super::super::cache_write::{CacheWrite, PageLayout, SLOTS_ON_DEVICE};
    use super::super::cuda::{self as cu, with_float_type};
    use super::super::rope::RopeQkv;

    /// The fused op: q is its output; the caches it writes are held here, since a candle op has
    /// one output and writes in place into at most one tensor.
    pub(super) struct RopeQkvCache {
        pub(super) rope: RopeQkv,
        pub(super) k_cache: Tensor,
        pub(super) v_cache: Tensor,
        pub(super) slots: Arc<Vec<u32>>,
    }

    /// A cache's storage on the GPU and the contiguous range its layout addresses.
    fn cache_range<'a>(
        storage: &'a candle_core::Storage,
        layout: &Layout,
        what: &str,
    ) -> candle_core::Result<(&'a CudaStorage, usize, usize)> {
        let candle_core::Storage::Cuda(s) = storage else {
            bail!("rope_qkv_into_cache: {what} is not on the GPU");
        };
        let Some((start, end)) = layout.contiguous_offsets() else {
            bail!("rope_qkv_into_cache: {what} must be contiguous");
        };
        Ok((s, start, end))
    }

    impl CustomOp3 for RopeQkvCache {
        fn name(&self) -> &'static str {
            "detspec-rope-qkv-cache"
        }

        fn cpu_fwd(
            &self,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> candle_core::Result<(CpuStorage, Shape)> {
            bail!("rope_qkv_into_cache: the fused op runs on CUDA; the CPU runs the three ops")
        }

        fn cuda_fwd(
            &self,
            xs: &CudaStorage,
            xl: &Layout,
            cs: &CudaStorage,
            cl: &Layout,
            ss: &CudaStorage,
            sl: &Layout,
        ) -> candle_core::Result<(CudaStorage, Shape)> {
            use candle_core::backend::BackendStorage;
            use candle_core::cuda::cudarc::driver::PushKernelArg;
            use candle_core::cuda::WrapErr;

            let (t, d, half) = self.rope.dims(xl, cl, sl)?;
            super::super::rope::whole_heads(d, half)?;
            let (q_heads, kv_heads) = (self.rope.q_heads, self.rope.kv_heads);
            let k_write = CacheWrite {
                slots: self.slots.clone(),
                layout: PageLayout::Transposed,
            };
            let v_write = CacheWrite {
                slots: self.slots.clone(),
                layout: PageLayout::Rows,
            };
            let kv_len = t * kv_heads * d;
            let (page_size, _) = k_write.geometry(self.k_cache.dims(), kv_len)?;
            let (v_page_size, _) = v_write.geometry(self.v_cache.dims(), kv_len)?;
            if v_page_size != page_size {
                bail!(
                    "rope_qkv_into_cache: K pages of {page_size} slots, V pages of {v_page_size}"
                );
            }
            for (cache, what) in [(&self.k_cache, "K cache"), (&self.v_cache, "V cache")] {
                if cache.dtype() != xs.dtype() {
                    bail!(
                        "rope_qkv_into_cache: {what} {:?} and qkv {:?} dtypes differ",
                        cache.dtype(),
                        xs.dtype()
                    );
                }
            }
            let (k_guard, kl) = self.k_cache.storage_and_layout();
            let (v_guard, vl) = self.v_cache.storage_and_layout();
            let (k_storage, k_start, k_end) = cache_range(&k_guard, kl, "K cache")?;
            let (v_storage, v_start, v_end) = cache_range(&v_guard, vl, "V cache")?;

            let dev = xs.device().clone();
            let slots =
                SLOTS_ON_DEVICE.get_or_upload(&self.slots, &dev, |s| cu::upload_u32(&dev, s))?;
            let f = cu::kernel(&dev, &cu::ROPE, "rope_qkv_cache", xs.dtype())?;
            let cos = cu::view::<f32>(cs, cl, "rope_qkv_into_cache cos")?;
            let sin = cu::view::<f32>(ss, sl, "rope_qkv_into_cache sin")?;
            let args = [
                cu::arg_i32(t, "rope_qkv_into_cache tokens")?,
                cu::arg_i32(q_heads, "rope_qkv_into_cache q_heads")?,
                cu::arg_i32(kv_heads, "rope_qkv_into_cache kv_heads")?,
                cu::arg_i32(d, "rope_qkv_into_cache head_dim")?,
                cu::arg_i32(page_size, "rope_qkv_into_cache page_size")?,
            ];
            let q_len = t * q_heads * d;
            let pairs = t * (q_heads + 2 * kv_heads) * d / 2;
            with_float_type!(xs.dtype(), "rope_qkv_into_cache", |T| {
                let x = cu::view::<T>(xs, xl, "rope_qkv_into_cache qkv")?;
                let k = k_storage.as_cuda_slice::<T>()?.slice(k_start..k_end);
                let v = v_storage.as_cuda_slice::<T>()?.slice(v_start..v_end);
                // SAFETY: the kernel writes every element of q (both halves of every q head).
                let mut q = unsafe { dev.alloc::<T>(q_len.max(1))? };
                if pairs > 0 {
                    let stream = dev.cuda_stream();
                    let mut b = stream.launch_builder(&f);
                    b.arg(&x).arg(&cos).arg(&sin).arg(&mut q).arg(&k).arg(&v);
                    b.arg(slots.as_ref());
                    for a in &args {
                        b.arg(a);
                    }
                    // SAFETY: argument types and order match `rope_qkv_cache_*` in cuda/rope.cu;
                    // every slot was checked against both caches' sizes. The kernel writes the
                    // caches through views taken under their storages' read locks: the writes are
                    // device memory that no host reference covers, ordered on the device's one
                    // stream after every earlier reader and before every later one (candle's
                    // event tracking is off), as the cache-write op's own writes are.
                    unsafe { b.launch(cu::grid_1d(pairs)) }.w()?;
                }
                Ok((
                    CudaStorage::wrap_cuda_slice(q, dev.clone()),
                    Shape::from(q_len),
                ))
            })
        }
    }
}
