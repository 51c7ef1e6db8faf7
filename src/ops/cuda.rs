//! What the ops' `cuda_fwd` bodies share: the embedded PTX of `cuda/*.cu` (build.rs compiles it),
//! kernel lookup by dtype, launch shapes, and device copies of per-step metadata.
//!
//! Every kernel is launched on the device's one stream (see `config::device`), from whichever
//! host thread runs the op.

use std::sync::{Arc, Mutex, Weak};

use candle_core::cuda::cudarc::driver::{sys, CudaFunction, CudaSlice, CudaView, LaunchConfig};
use candle_core::cuda::CudaDType;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Device, Layout};

/// One `cuda/<name>.cu`, compiled to PTX; loaded once per device (candle caches it by name).
pub(super) struct Module {
    name: &'static str,
    ptx: &'static str,
}

macro_rules! module {
    ($ident:ident, $file:literal) => {
        pub(super) const $ident: Module = Module {
            name: concat!("detspec_", $file),
            ptx: include_str!(concat!(env!("OUT_DIR"), "/", $file, ".ptx")),
        };
    };
}
module!(RMS_NORM, "rms_norm");
module!(ROPE, "rope");
module!(CACHE_WRITE, "cache_write");
module!(PAGE_COPY, "page_copy");
module!(PAGED_ATTENTION, "paged_attention");

/// Runs `$body` with `$t` the Rust type of a float `$dtype` (f32, bf16, f16), or fails naming
/// `$what`.
macro_rules! with_float_type {
    ($dtype:expr, $what:expr, |$t:ident| $body:expr) => {
        match $dtype {
            candle_core::DType::F32 => {
                type $t = f32;
                $body
            }
            candle_core::DType::BF16 => {
                type $t = half::bf16;
                $body
            }
            candle_core::DType::F16 => {
                type $t = half::f16;
                $body
            }
            other => candle_core::bail!("{}: no CUDA kernel for dtype {other:?}", $what),
        }
    };
}
pub(super) use with_float_type;

/// `kernel` instantiated for `dtype` (`<kernel>_f32`, `_bf16`, `_f16`). Launch it with
/// `dev.cuda_stream().launch_builder(&f)`: the device's one stream.
pub(super) fn kernel(
    dev: &CudaDevice,
    module: &Module,
    kernel: &str,
    dtype: DType,
) -> candle_core::Result<CudaFunction> {
    let suffix = match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        other => bail!("{kernel}: no CUDA kernel for dtype {other:?} (f32, bf16, f16)"),
    };
    untyped_kernel(dev, module, &format!("{kernel}_{suffix}"))
}

/// `name` from `module`, whatever the dtype.
pub(super) fn untyped_kernel(
    dev: &CudaDevice,
    module: &Module,
    name: &str,
) -> candle_core::Result<CudaFunction> {
    Ok(dev
        .get_or_load_custom_func(name, module.name, module.ptx)?
        .into_cuda_function())
}

/// A grid-stride launch over `n` elements.
pub(super) fn grid_1d(n: usize) -> LaunchConfig {
    const THREADS: u32 = 256;
    // Enough blocks to fill any current GPU; the kernels stride over the rest.
    let blocks = n.div_ceil(THREADS as usize).clamp(1, 65_535) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The contiguous part of `s` that `l` addresses, as `T`.
pub(super) fn view<'a, T: CudaDType>(
    s: &'a CudaStorage,
    l: &Layout,
    what: &str,
) -> candle_core::Result<CudaView<'a, T>> {
    let Some((a, b)) = l.contiguous_offsets() else {
        bail!("{what}: expected a contiguous tensor");
    };
    Ok(s.as_cuda_slice::<T>()?.slice(a..b))
}

/// An `i32` kernel argument, or an error naming what overflowed.
pub(super) fn arg_i32(v: usize, what: &str) -> candle_core::Result<i32> {
    i32::try_from(v).or_else(|_| bail!("{what}: {v} does not fit a CUDA kernel's int argument"))
}

/// Streaming multiprocessors of `device` (the split-KV heuristic's unit of parallelism).
pub fn multiprocessors(device: &Device) -> usize {
    let Device::Cuda(cuda) = device else {
        return 1;
    };
    cuda.cuda_stream()
        .context()
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .ok()
        .and_then(|n| usize::try_from(n).ok())
        .filter(|&n| n > 0)
        .unwrap_or(132)
}

/// Device copies of host vectors that every layer of one forward uses (slots, attention
/// metadata): uploaded by the first layer, reused by the others. Keyed by the host value's `Arc`
/// (alive and the same allocation) and the device.
pub(super) struct UploadCache<K, V> {
    entry: Mutex<Option<Uploaded<K, V>>>,
}

/// The host value it came from, the device it lives on, the device copy.
type Uploaded<K, V> = (Weak<K>, candle_core::cuda::DeviceId, Arc<V>);

impl<K, V> UploadCache<K, V> {
    pub(super) const fn new() -> Self {
        Self {
            entry: Mutex::new(None),
        }
    }

    pub(super) fn get_or_upload(
        &self,
        key: &Arc<K>,
        dev: &CudaDevice,
        upload: impl FnOnce(&K) -> candle_core::Result<V>,
    ) -> candle_core::Result<Arc<V>> {
        let mut entry = self.entry.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((k, id, v)) = entry.as_ref() {
            if *id == dev.id() && k.upgrade().is_some_and(|k| Arc::ptr_eq(&k, key)) {
                return Ok(v.clone());
            }
        }
        let v = Arc::new(upload(key)?);
        *entry = Some((Arc::downgrade(key), dev.id(), v.clone()));
        Ok(v)
    }
}

/// Copies `values` to the device.
pub(super) fn upload_u32(dev: &CudaDevice, values: &[u32]) -> candle_core::Result<CudaSlice<u32>> {
    if values.is_empty() {
        // A zero-length allocation is not a valid pointer everywhere: keep one element.
        return dev.clone_htod(&[0u32][..]);
    }
    dev.clone_htod(values)
}
