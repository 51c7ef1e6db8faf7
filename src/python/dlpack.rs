//! DLPack both ways, by hand (a few `#[repr(C)]` structs and two capsule kinds), so the abi3
//! wheel needs nothing beyond pyo3's limited API.
//!
//! Out: [`PyTensor`] owns an engine buffer and implements `__dlpack__` / `__dlpack_device__`;
//! `torch.from_dlpack` wraps the buffer without a copy (versioned capsule when the consumer
//! asks for DLPack ≥ 1, the legacy one otherwise). The capsule keeps the buffer alive through
//! an `Arc`, so its deleter needs no GIL and may run on any thread.
//!
//! In: [`import`] takes any object with `__dlpack__` (a torch tensor) and copies its data once
//! into an engine buffer of the same dtype (never a conversion), honouring strides.
//!
//! Why not the `dlpark` crate: it is the only DLPack crate on pyo3 0.29 (0.8/0.9; 0.10 moved
//! to pyo3 0.30 with breaking renames three months after 0.8), and detspec needs five CPU
//! dtypes and one copy on import: about 300 lines here against a fast-moving pinned
//! dependency whose candle interop always copies on import anyway.

use std::ffi::{c_void, CStr};
use std::os::raw::c_char;
use std::sync::Arc;

use half::{bf16, f16};
use pyo3::exceptions::{PyBufferError, PyTypeError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::error::DetspecError;

use super::convert::to_pyerr;

const CPU: i32 = 1;

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

#[repr(C)]
struct DLPackVersion {
    major: u32,
    minor: u32,
}

#[repr(C)]
struct DLManagedTensorVersioned {
    version: DLPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DLTensor,
}

const LEGACY: &CStr = c"dltensor";
const VERSIONED: &CStr = c"dltensor_versioned";
const USED_LEGACY: &CStr = c"used_dltensor";
const USED_VERSIONED: &CStr = c"used_dltensor_versioned";

/// An engine buffer of one of the dtypes that cross the boundary.
#[derive(Clone)]
pub enum Buffer {
    F32(Vec<f32>),
    BF16(Vec<bf16>),
    F16(Vec<f16>),
    I64(Vec<i64>),
    I32(Vec<i32>),
}

impl Buffer {
    fn dtype(&self) -> (DLDataType, &'static str) {
        let t = |code, bits| DLDataType {
            code,
            bits,
            lanes: 1,
        };
        match self {
            Self::F32(_) => (t(2, 32), "float32"),
            Self::BF16(_) => (t(4, 16), "bfloat16"),
            Self::F16(_) => (t(2, 16), "float16"),
            Self::I64(_) => (t(0, 64), "int64"),
            Self::I32(_) => (t(0, 32), "int32"),
        }
    }

    fn as_ptr(&self) -> *const c_void {
        match self {
            Self::F32(v) => v.as_ptr().cast(),
            Self::BF16(v) => v.as_ptr().cast(),
            Self::F16(v) => v.as_ptr().cast(),
            Self::I64(v) => v.as_ptr().cast(),
            Self::I32(v) => v.as_ptr().cast(),
        }
    }

    fn len(&self) -> usize {
        match self {
            Self::F32(v) => v.len(),
            Self::BF16(v) => v.len(),
            Self::F16(v) => v.len(),
            Self::I64(v) => v.len(),
            Self::I32(v) => v.len(),
        }
    }
}

/// A buffer and its row-major shape. Rust never reads the buffer through a reference once it
/// is shared: consumers write through DLPack's raw pointer, as the protocol allows.
struct Storage {
    buf: Buffer,
    shape: Vec<usize>,
}

// SAFETY: the buffer is only reached through raw pointers after construction (see `Storage`);
// the Vec itself is never resized or moved while shared.
unsafe impl Sync for Storage {}

/// A tensor the engine produced, handed to Python without a copy through DLPack
/// (`torch.from_dlpack(t)`); `detspec.torch.to_torch` does that.
#[pyclass(name = "Tensor", module = "detspec._core", frozen)]
pub struct PyTensor {
    storage: Arc<Storage>,
}

impl PyTensor {
    /// Wraps `buf` (row-major `shape`) without copying it.
    pub fn new(buf: Buffer, shape: Vec<usize>) -> Result<Self, DetspecError> {
        let n: usize = shape.iter().product();
        if n != buf.len() {
            return Err(DetspecError::param(
                "shape",
                format!("{shape:?} holds {n} elements, the buffer {}", buf.len()),
            ));
        }
        Ok(Self {
            storage: Arc::new(Storage { buf, shape }),
        })
    }

    /// The buffer as a candle tensor (float dtypes only), for weights coming in: moved
    /// when this is its only owner (a fresh import), copied otherwise.
    pub fn into_candle(self, name: &str) -> Result<candle_core::Tensor, DetspecError> {
        let dev = candle_core::Device::Cpu;
        let Storage { buf, shape } = match Arc::try_unwrap(self.storage) {
            Ok(s) => s,
            Err(shared) => Storage {
                buf: shared.buf.clone(),
                shape: shared.shape.clone(),
            },
        };
        let t = match buf {
            Buffer::F32(v) => candle_core::Tensor::from_vec(v, shape, &dev),
            Buffer::BF16(v) => candle_core::Tensor::from_vec(v, shape, &dev),
            Buffer::F16(v) => candle_core::Tensor::from_vec(v, shape, &dev),
            other => {
                return Err(DetspecError::param(
                    "named_tensors",
                    format!(
                        "`{name}` has dtype {}; weights must be float32, bfloat16 or float16",
                        other.dtype().1
                    ),
                ))
            }
        };
        Ok(t?)
    }

    /// A leaked managed tensor (versioned or legacy) that owns its [`ExportCtx`]; the
    /// capsule's destructor or the consumer frees it through its deleter.
    fn export(&self, versioned: bool) -> *mut c_void {
        let (dtype, _) = self.storage.buf.dtype();
        let mut shape: Vec<i64> = self.storage.shape.iter().map(|&d| d as i64).collect();
        let mut strides = row_major_strides(&shape);
        // The Vecs' heap buffers do not move when the Vecs move into the context below.
        let dl_tensor = DLTensor {
            data: self.storage.buf.as_ptr().cast_mut(),
            device: DLDevice {
                device_type: CPU,
                device_id: 0,
            },
            ndim: shape.len() as i32,
            dtype,
            shape: shape.as_mut_ptr(),
            strides: strides.as_mut_ptr(),
            byte_offset: 0,
        };
        let null = std::ptr::null_mut();
        let managed = if versioned {
            Managed::Versioned(DLManagedTensorVersioned {
                version: DLPackVersion { major: 1, minor: 1 },
                manager_ctx: null,
                deleter: Some(delete_versioned),
                flags: 0,
                dl_tensor,
            })
        } else {
            Managed::Legacy(DLManagedTensor {
                dl_tensor,
                manager_ctx: null,
                deleter: Some(delete_legacy),
            })
        };
        let ctx = Box::leak(Box::new(ExportCtx {
            _keep: self.storage.clone(),
            _shape: shape,
            _strides: strides,
            managed,
        }));
        let ctx_ptr: *mut c_void = (ctx as *mut ExportCtx).cast();
        match &mut ctx.managed {
            Managed::Versioned(m) => {
                m.manager_ctx = ctx_ptr;
                (m as *mut DLManagedTensorVersioned).cast()
            }
            Managed::Legacy(m) => {
                m.manager_ctx = ctx_ptr;
                (m as *mut DLManagedTensor).cast()
            }
        }
    }
}

/// Strides (in elements) of a compact row-major array of `shape`.
fn row_major_strides(shape: &[i64]) -> Vec<i64> {
    let mut strides = vec![1i64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1].max(1);
    }
    strides
}

/// The managed tensor a capsule hands out, in the ABI the consumer asked for.
enum Managed {
    Legacy(DLManagedTensor),
    Versioned(DLManagedTensorVersioned),
}

/// What a capsule owns: the buffer's keep-alive, the shape/strides arrays the DLTensor
/// points into, and the managed struct itself (its `manager_ctx` points back here).
struct ExportCtx {
    _keep: Arc<Storage>,
    _shape: Vec<i64>,
    _strides: Vec<i64>,
    managed: Managed,
}

unsafe extern "C" fn delete_legacy(m: *mut DLManagedTensor) {
    if !m.is_null() {
        // SAFETY: `manager_ctx` is the leaked `Box<ExportCtx>` that owns `m`; DLPack calls the
        // deleter exactly once.
        drop(unsafe { Box::from_raw((*m).manager_ctx.cast::<ExportCtx>()) });
    }
}

unsafe extern "C" fn delete_versioned(m: *mut DLManagedTensorVersioned) {
    if !m.is_null() {
        // SAFETY: as in `delete_legacy`.
        drop(unsafe { Box::from_raw((*m).manager_ctx.cast::<ExportCtx>()) });
    }
}

/// Frees an unconsumed capsule's tensor (a consumer that took it renamed the capsule).
unsafe extern "C" fn capsule_destructor(capsule: *mut ffi::PyObject) {
    // SAFETY: called by Python with a valid capsule; the name tells which struct it holds.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, VERSIONED.as_ptr()) == 1 {
            let m = ffi::PyCapsule_GetPointer(capsule, VERSIONED.as_ptr())
                .cast::<DLManagedTensorVersioned>();
            if let Some(d) = m.as_ref().and_then(|m| m.deleter) {
                d(m);
            }
        } else if ffi::PyCapsule_IsValid(capsule, LEGACY.as_ptr()) == 1 {
            let m = ffi::PyCapsule_GetPointer(capsule, LEGACY.as_ptr()).cast::<DLManagedTensor>();
            if let Some(d) = m.as_ref().and_then(|m| m.deleter) {
                d(m);
            }
        }
        // Renamed to used_dltensor*: the consumer owns it; nothing to do.
        ffi::PyErr_Clear();
    }
}

#[pymethods]
impl PyTensor {
    /// DLPack export (array API): no copy; CPU only.
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__(
        &self,
        py: Python<'_>,
        stream: Option<Bound<'_, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        if stream.as_ref().is_some_and(|s| !s.is_none()) {
            return Err(PyBufferError::new_err(
                "stream must be None for a CPU tensor",
            ));
        }
        if let Some((t, id)) = dl_device {
            if (t, id) != (CPU, 0) {
                return Err(PyBufferError::new_err(format!(
                    "dl_device ({t}, {id}) is not this tensor's device (1, 0): CPU"
                )));
            }
        }
        if copy == Some(true) {
            return Err(PyBufferError::new_err(
                "copy=True is not supported: the export never copies (copy on the torch side)",
            ));
        }
        let versioned = max_version.is_some_and(|(major, _)| major >= 1);
        let ptr = self.export(versioned);
        let name = if versioned { VERSIONED } else { LEGACY };
        // SAFETY: `ptr` is a leaked managed tensor owned by the capsule from here on; the
        // name is static.
        let capsule = unsafe { ffi::PyCapsule_New(ptr, name.as_ptr(), Some(capsule_destructor)) };
        if capsule.is_null() {
            // SAFETY: the capsule was not created, so we still own the tensor.
            unsafe {
                if versioned {
                    delete_versioned(ptr.cast());
                } else {
                    delete_legacy(ptr.cast());
                }
            }
            return Err(PyErr::fetch(py));
        }
        // SAFETY: a new reference returned by PyCapsule_New.
        Ok(unsafe { Bound::from_owned_ptr(py, capsule) }.unbind())
    }

    fn __dlpack_device__(&self) -> (i32, i32) {
        (CPU, 0)
    }

    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.storage.shape)
    }

    /// `"float32"`, `"bfloat16"`, `"float16"`, `"int64"` or `"int32"`.
    #[getter]
    fn dtype(&self) -> &'static str {
        self.storage.buf.dtype().1
    }

    /// Address of the first element (what `torch.from_dlpack(t).data_ptr()` returns).
    #[getter]
    fn data_ptr(&self) -> usize {
        self.storage.buf.as_ptr() as usize
    }

    /// Copies any DLPack producer's CPU data once into a new engine tensor of the same dtype.
    #[staticmethod]
    fn from_dlpack(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<Self> {
        import(py, "tensor", "tensor", obj)
    }

    fn __repr__(&self) -> String {
        format!(
            "detspec._core.Tensor(shape={:?}, dtype={})",
            self.storage.shape,
            self.dtype()
        )
    }
}

/// Copies a DLPack producer's data into an engine tensor: one copy, the same dtype, strides
/// honoured. Tensors that require grad are detached first (a view, no copy). Errors name the
/// parameter and the tensor (`name`).
pub fn import(
    py: Python<'_>,
    param: &str,
    name: &str,
    obj: &Bound<'_, PyAny>,
) -> PyResult<PyTensor> {
    let bad = |msg: String| to_pyerr(py, DetspecError::param(param, format!("`{name}` {msg}")));
    if let Ok(t) = obj.cast::<PyTensor>() {
        let s = &t.get().storage;
        return Ok(PyTensor { storage: s.clone() });
    }
    if !obj.hasattr("__dlpack__")? {
        let ty = obj.get_type().name()?;
        return Err(bad(format!("is a {ty}, not a tensor (no __dlpack__)")));
    }
    let obj = if obj
        .getattr("requires_grad")
        .is_ok_and(|r| r.is_truthy().unwrap_or(false))
    {
        obj.call_method0("detach")?
    } else {
        obj.clone()
    };
    let device: (i32, i32) = obj.call_method0("__dlpack_device__")?.extract()?;
    if device.0 != CPU {
        return Err(bad(format!(
            "is on DLPack device {device:?}; only CPU tensors are accepted (call .cpu())"
        )));
    }
    let kwargs = pyo3::types::PyDict::new(py);
    kwargs.set_item("max_version", (1u32, 1u32))?;
    let capsule = match obj.call_method("__dlpack__", (), Some(&kwargs)) {
        Ok(c) => c,
        Err(e) if e.is_instance_of::<PyTypeError>(py) => obj.call_method0("__dlpack__")?,
        Err(e) => return Err(bad(format!("cannot be exported: {e}"))),
    };
    let cap = capsule.as_ptr();
    // SAFETY: `cap` is alive (held by `capsule`); the name check picks the struct type.
    unsafe {
        if ffi::PyCapsule_IsValid(cap, VERSIONED.as_ptr()) == 1 {
            let m = ffi::PyCapsule_GetPointer(cap, VERSIONED.as_ptr())
                .cast::<DLManagedTensorVersioned>();
            let r = match m.as_ref() {
                Some(mt) if mt.version.major == 1 => copy_out(&mt.dl_tensor).map_err(bad),
                Some(mt) => Err(bad(format!(
                    "uses DLPack {}.x; 1.x is supported",
                    mt.version.major
                ))),
                None => Err(PyErr::fetch(py)),
            };
            consume(cap, USED_VERSIONED, || {
                if let Some(d) = m.as_ref().and_then(|m| m.deleter) {
                    d(m);
                }
            });
            r
        } else if ffi::PyCapsule_IsValid(cap, LEGACY.as_ptr()) == 1 {
            let m = ffi::PyCapsule_GetPointer(cap, LEGACY.as_ptr()).cast::<DLManagedTensor>();
            let r = match m.as_ref() {
                Some(mt) => copy_out(&mt.dl_tensor).map_err(bad),
                None => Err(PyErr::fetch(py)),
            };
            consume(cap, USED_LEGACY, || {
                if let Some(d) = m.as_ref().and_then(|m| m.deleter) {
                    d(m);
                }
            });
            r
        } else {
            ffi::PyErr_Clear();
            Err(bad("returned something that is not a DLPack capsule".into()))
        }
    }
}

/// Marks a capsule consumed (so its destructor leaves the tensor alone) and frees the
/// tensor: the data has been copied.
///
/// # Safety
/// `cap` is a live capsule whose tensor `free` deletes.
unsafe fn consume(cap: *mut ffi::PyObject, used: &'static CStr, free: impl FnOnce()) {
    // SAFETY: per the function contract.
    unsafe {
        ffi::PyCapsule_SetName(cap, used.as_ptr() as *const c_char);
    }
    free();
}

/// One copy of a DLTensor's elements into a row-major engine buffer.
///
/// # Safety
/// `t` describes valid memory (DLPack producer's guarantee while the capsule is alive).
unsafe fn copy_out(t: &DLTensor) -> Result<PyTensor, String> {
    if t.device.device_type != CPU {
        return Err(format!(
            "is on DLPack device type {}; only CPU",
            t.device.device_type
        ));
    }
    let ndim = usize::try_from(t.ndim).map_err(|_| format!("has ndim {}", t.ndim))?;
    // SAFETY: DLPack: `shape` has `ndim` entries; `strides` is NULL or has `ndim` entries.
    let shape: Vec<i64> = if ndim == 0 {
        Vec::new()
    } else {
        unsafe { std::slice::from_raw_parts(t.shape, ndim) }.to_vec()
    };
    if shape.iter().any(|&d| d < 0) {
        return Err(format!("has a negative dimension in shape {shape:?}"));
    }
    let dims: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
    let strides: Vec<i64> = if t.strides.is_null() || ndim == 0 {
        row_major_strides(&shape)
    } else {
        unsafe { std::slice::from_raw_parts(t.strides, ndim) }.to_vec()
    };
    let n: usize = dims.iter().product();
    let lanes_ok = t.dtype.lanes == 1;
    // SAFETY: element type matches the DLPack dtype checked in each arm.
    let base = unsafe { (t.data as *const u8).add(t.byte_offset as usize) };
    let buf = match (t.dtype.code, t.dtype.bits, lanes_ok) {
        (2, 32, true) => Buffer::F32(unsafe { gather::<f32>(base, &dims, &strides, n) }),
        (4, 16, true) => Buffer::BF16(unsafe { gather::<bf16>(base, &dims, &strides, n) }),
        (2, 16, true) => Buffer::F16(unsafe { gather::<f16>(base, &dims, &strides, n) }),
        (0, 64, true) => Buffer::I64(unsafe { gather::<i64>(base, &dims, &strides, n) }),
        (0, 32, true) => Buffer::I32(unsafe { gather::<i32>(base, &dims, &strides, n) }),
        (code, bits, _) => {
            return Err(format!(
                "has an unsupported dtype (DLPack code {code}, {bits} bits, {} lanes); \
                 supported: float32, bfloat16, float16, int64, int32",
                t.dtype.lanes
            ))
        }
    };
    PyTensor::new(buf, dims).map_err(|e| e.to_string())
}

/// Row-major copy of `n` elements at `base` laid out by `dims`/`strides` (in elements).
///
/// # Safety
/// Every index reached through `dims`/`strides` from `base` is a valid `T`.
unsafe fn gather<T: Copy>(base: *const u8, dims: &[usize], strides: &[i64], n: usize) -> Vec<T> {
    let base = base.cast::<T>();
    let mut out = Vec::with_capacity(n);
    if n == 0 {
        return out;
    }
    let contiguous = {
        let mut expect = 1i64;
        dims.iter().zip(strides).rev().all(|(&d, &s)| {
            let ok = d == 1 || s == expect;
            expect *= d as i64;
            ok
        })
    };
    if contiguous {
        // SAFETY: contiguous row-major: `n` consecutive elements.
        out.extend_from_slice(unsafe { std::slice::from_raw_parts(base, n) });
        return out;
    }
    let mut index = vec![0usize; dims.len()];
    for _ in 0..n {
        let off: i64 = index.iter().zip(strides).map(|(&i, &s)| i as i64 * s).sum();
        // SAFETY: per the function contract.
        out.push(unsafe { *base.offset(off as isize) });
        for d in (0..dims.len()).rev() {
            index[d] += 1;
            if index[d] < dims[d] {
                break;
            }
            index[d] = 0;
        }
    }
    out
}
