//! Which device an engine runs on, as the user names it (`"cpu"`, `"cuda"`, `"cuda:N"`), and
//! opening it.

use std::fmt;
use std::str::FromStr;

use candle_core::Device;

use crate::error::{DetspecError, Result};

/// A device by name. Parsing never touches hardware; [`DeviceSpec::open`] does.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum DeviceSpec {
    #[default]
    Cpu,
    /// CUDA GPU by ordinal (`"cuda"` is `cuda:0`).
    Cuda(usize),
}

impl FromStr for DeviceSpec {
    type Err = DetspecError;

    fn from_str(s: &str) -> Result<Self> {
        let bad = || {
            DetspecError::param(
                "device",
                format!("unknown device `{s}` (cpu, cuda, cuda:N)"),
            )
        };
        match s {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            _ => {
                let ordinal = s.strip_prefix("cuda:").ok_or_else(bad)?;
                ordinal.parse().map(Self::Cuda).map_err(|_| bad())
            }
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl DeviceSpec {
    /// Opens the device, or says why it cannot be used (no CUDA in this build, no such GPU).
    pub fn open(self) -> Result<Device> {
        match self {
            Self::Cpu => Ok(Device::Cpu),
            Self::Cuda(ordinal) => open_cuda(self, ordinal),
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(spec: DeviceSpec, _ordinal: usize) -> Result<Device> {
    Err(DetspecError::param(
        "device",
        format!(
            "`{spec}` is not available: this build of detspec has no CUDA backend \
             (build the CUDA wheel with scripts/build-cuda-wheel.sh)"
        ),
    ))
}

/// One dedicated stream per engine device, whichever host thread issues the work (the loader,
/// the engine loop, sampling workers): everything the engine does on the GPU is ordered on it,
/// which is also cuBLAS's condition for run-to-run identical results. With one stream there is
/// nothing to synchronise between streams, so candle's per-tensor event tracking is switched off
/// (it costs an event record and wait per launch). cuBLAS may not reduce split-K partial sums in
/// bf16/f16: reductions stay in f32, as the verify path's accuracy argument assumes.
#[cfg(feature = "cuda")]
fn open_cuda(spec: DeviceSpec, ordinal: usize) -> Result<Device> {
    use candle_core::cuda::cudarc::cublas::sys as cublas;

    use candle_core::cuda::cudarc::driver::CudaContext;

    let count = CudaContext::device_count().map_err(|e| {
        DetspecError::param(
            "device",
            format!(
                "cannot open `{spec}`: the CUDA driver did not initialise ({e:?}); \
                 is there an NVIDIA GPU and driver?"
            ),
        )
    })?;
    if ordinal >= usize::try_from(count).unwrap_or(0) {
        return Err(DetspecError::param(
            "device",
            format!("`{spec}` does not exist: this machine has {count} CUDA GPU(s)"),
        ));
    }
    let device = Device::new_cuda_with_stream(ordinal).map_err(|e| {
        // candle appends a backtrace when RUST_BACKTRACE is set: keep the message.
        let msg = e.to_string();
        let first = msg.lines().next().unwrap_or_default().to_string();
        DetspecError::param("device", format!("cannot open `{spec}`: {first}"))
    })?;
    let Device::Cuda(cuda) = &device else {
        return Err(DetspecError::param(
            "device",
            format!("`{spec}` did not open as a CUDA device"),
        ));
    };
    // SAFETY: called before any tensor of this engine exists, and the engine only ever uses
    // this device's one stream (see above).
    unsafe { cuda.disable_event_tracking() };
    let handle = *cuda.cublas_handle().handle();
    let mode = cublas::cublasMath_t::CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION;
    // SAFETY: a live handle owned by the device; only the math mode changes.
    let status = unsafe { cublas::cublasSetMathMode(handle, mode) };
    if status != cublas::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        return Err(DetspecError::param(
            "device",
            format!("`{spec}`: cublasSetMathMode failed ({status:?})"),
        ));
    }
    Ok(device)
}

/// `(free, total)` bytes of `device`'s memory, as the driver reports them; `None` on the CPU or
/// where the driver cannot say.
pub fn device_memory(device: &Device) -> Option<(u64, u64)> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(cuda) => cuda
            .cuda_stream()
            .context()
            .mem_get_info()
            .ok()
            .map(|(free, total)| (free as u64, total as u64)),
        _ => None,
    }
}

/// CUDA GPUs this build can open: 0 without the `cuda` feature, without a driver or without a GPU.
pub fn cuda_device_count() -> usize {
    #[cfg(feature = "cuda")]
    {
        use candle_core::cuda::cudarc::driver::CudaContext;
        CudaContext::device_count()
            .ok()
            .and_then(|n| usize::try_from(n).ok())
            .unwrap_or(0)
    }
    #[cfg(not(feature = "cuda"))]
    0
}

/// The GPU for the fingerprint, or `cpu`: its name, multiprocessor count and cuBLAS version
/// (cuBLAS promises run-to-run identical bits only for one architecture, SM count and library
/// version), e.g. `nvidia_h200_sm132_cublas130100`.
pub fn device_label(device: &Device) -> String {
    match device {
        Device::Cpu => "cpu".to_string(),
        #[cfg(feature = "cuda")]
        Device::Cuda(cuda) => cuda_name(cuda),
        #[allow(unreachable_patterns)]
        _ => "gpu".to_string(),
    }
}

#[cfg(feature = "cuda")]
fn cuda_name(cuda: &candle_core::CudaDevice) -> String {
    let name = cuda
        .cuda_stream()
        .context()
        .name()
        .unwrap_or_else(|_| "cuda".to_string());
    // The fingerprint is a dash-separated identifier: "NVIDIA H100 80GB HBM3" → "nvidia_h100_80gb_hbm3".
    let name: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .collect();
    let sms = crate::ops::cuda_multiprocessors(&Device::Cuda(cuda.clone()));
    let mut version: std::ffi::c_int = 0;
    let handle = *cuda.cublas_handle().handle();
    // SAFETY: a live handle owned by the device; writes one int.
    let status = unsafe {
        candle_core::cuda::cudarc::cublas::sys::cublasGetVersion_v2(handle, &mut version)
    };
    if status != candle_core::cuda::cudarc::cublas::sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        version = 0;
    }
    format!("{name}_sm{sms}_cublas{version}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_names_users_write() {
        assert_eq!("cpu".parse::<DeviceSpec>().ok(), Some(DeviceSpec::Cpu));
        assert_eq!("cuda".parse::<DeviceSpec>().ok(), Some(DeviceSpec::Cuda(0)));
        assert_eq!(
            "cuda:3".parse::<DeviceSpec>().ok(),
            Some(DeviceSpec::Cuda(3))
        );
        for bad in ["gpu", "cuda:", "cuda:x", "cuda:-1", "CPU", ""] {
            let err = bad.parse::<DeviceSpec>().err().map(|e| e.to_string());
            assert!(
                err.as_deref().is_some_and(|m| m.contains("device")),
                "{bad:?}: {err:?}"
            );
        }
    }

    #[test]
    fn display_round_trips() {
        for spec in [DeviceSpec::Cpu, DeviceSpec::Cuda(0), DeviceSpec::Cuda(7)] {
            assert_eq!(spec.to_string().parse::<DeviceSpec>().ok(), Some(spec));
        }
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_in_a_cpu_build_names_the_device() {
        let msg = DeviceSpec::Cuda(1)
            .open()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            msg.contains("cuda:1") && msg.contains("no CUDA backend"),
            "{msg}"
        );
    }
}
