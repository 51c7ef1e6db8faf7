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
module!(ELEMENTWISE, "elementwise");

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

/// A page-locked host buffer that device→host copies of logits land in, grown on demand and
/// kept (allocating pinned memory costs milliseconds). Pageable copies run through the driver's
/// staging buffer at a fraction of the link's speed, and a forward's logits are megabytes (64 rows
/// × 128k vocabulary), a verify pass's hundreds of megabytes.
struct Staging {
    device: candle_core::cuda::DeviceId,
    buf: candle_core::cuda::cudarc::driver::PinnedHostSlice<u16>,
}

static STAGING: Mutex<Option<Staging>> = Mutex::new(None);

/// A CUDA tensor's values as f32 on the host, row-major; `None` for a tensor on another
/// device. bf16 and f16 are copied as they are (half the bytes of f32) through a pinned buffer
/// and widened on the host, which is exact, so the values are those a device-side cast would
/// give.
pub fn to_host_f32(t: &candle_core::Tensor) -> candle_core::Result<Option<Vec<f32>>> {
    use candle_core::cuda::WrapErr;
    use rayon::prelude::*;

    let Device::Cuda(dev) = t.device() else {
        return Ok(None);
    };
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cuda(cs) = &*storage else {
        return Ok(None);
    };
    let Some((a, b)) = layout.contiguous_offsets() else {
        bail!("to_host_f32: expected a contiguous tensor");
    };
    // Half-precision values as their bits (bf16 and f16 are u16-sized), with the widening.
    let (widen, bits): (fn(u16) -> f32, _) = match t.dtype() {
        DType::BF16 => {
            let s = cs.as_cuda_slice::<half::bf16>()?;
            // SAFETY: bf16 has u16's size and alignment; the bits are only copied.
            let bits = unsafe { s.transmute::<u16>(s.len()) };
            (
                (|x| half::bf16::from_bits(x).to_f32()) as fn(u16) -> f32,
                bits,
            )
        }
        DType::F16 => {
            let s = cs.as_cuda_slice::<half::f16>()?;
            // SAFETY: as above, for f16.
            let bits = unsafe { s.transmute::<u16>(s.len()) };
            (
                (|x| half::f16::from_bits(x).to_f32()) as fn(u16) -> f32,
                bits,
            )
        }
        _ => {
            return Ok(Some(
                dev.cuda_stream()
                    .clone_dtoh(&cs.as_cuda_slice::<f32>()?.slice(a..b))
                    .w()?,
            ))
        }
    };
    let Some(bits) = bits else {
        bail!("to_host_f32: cannot view half-precision values as bits");
    };
    let n = b - a;
    let mut staging = STAGING.lock().unwrap_or_else(|e| e.into_inner());
    let fits = |s: &Staging| s.device == dev.id() && s.buf.len() >= n;
    if !staging.as_ref().is_some_and(fits) {
        *staging = None; // free the old buffer before taking a larger one
        let len = n.max(1 << 20).next_power_of_two();
        // SAFETY: the buffer is only read after a copy has written the part that is read.
        // Flags 0: cached host memory (write-combined memory is slow to read from the CPU).
        let buf = unsafe {
            dev.cuda_stream()
                .context()
                .alloc_pinned_with_flags::<u16>(len, 0)
        }
        .w()?;
        *staging = Some(Staging {
            device: dev.id(),
            buf,
        });
    }
    let Some(s) = staging.as_mut() else {
        bail!("to_host_f32: no staging buffer");
    };
    // Exactly `n` elements: the driver copies the destination slice's length.
    let Some(dst) = s.buf.as_mut_slice().w()?.get_mut(..n) else {
        bail!("to_host_f32: staging buffer under {n} elements");
    };
    let stream = dev.cuda_stream();
    stream.memcpy_dtoh(&bits.slice(a..b), dst).w()?;
    // A copy into pinned memory is asynchronous.
    stream.synchronize().w()?;
    let mut out = Vec::with_capacity(n);
    out.par_extend(dst.par_iter().with_min_len(1 << 14).map(|&x| widen(x)));
    Ok(Some(out))
}
