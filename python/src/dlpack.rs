//! DLPack hand-over: the C structs of `dlpack.h` — the v0.8 ABI (`dltensor` capsule, every
//! framework accepts it) and, for a consumer that asks with `max_version >= (1, 0)`, the v1.0 one
//! (`dltensor_versioned`, with flags: not read-only, so NumPy's arrays are writable as torch's
//! tensors are; since 2026-12-07) — and the capsule that owns a batch until the consumer's deleter
//! runs. This module is an FFI edge; the structs are written out here because no maintained crate
//! tracks our pyo3 version.

use std::ffi::{CStr, c_void};
use std::sync::Arc;

use pyo3::ffi;
use pyo3::prelude::*;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct DLDevice {
    pub device_type: i32,
    pub device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct DLDataType {
    pub code: u8,
    pub bits: u8,
    pub lanes: u16,
}

#[repr(C)]
pub struct DLTensor {
    pub data: *mut c_void,
    pub device: DLDevice,
    pub ndim: i32,
    pub dtype: DLDataType,
    pub shape: *mut i64,
    pub strides: *mut i64,
    pub byte_offset: u64,
}

#[repr(C)]
pub struct DLManagedTensor {
    pub dl_tensor: DLTensor,
    pub manager_ctx: *mut c_void,
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// `DLPackVersion`.
#[repr(C)]
pub struct DLPackVersion {
    pub major: u32,
    pub minor: u32,
}

/// `DLManagedTensorVersioned` (DLPack 1.0).
#[repr(C)]
pub struct DLManagedTensorVersioned {
    pub version: DLPackVersion,
    pub manager_ctx: *mut c_void,
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    /// `DLPACK_FLAG_BITMASK_READ_ONLY` (1) and `_IS_COPIED` (2): neither here.
    pub flags: u64,
    pub dl_tensor: DLTensor,
}

/// `kDLCPU`.
pub const DL_CPU: i32 = 1;
/// `kDLCUDA`.
pub const DL_CUDA: i32 = 2;
const DL_UINT: u8 = 1;

const NAME: &CStr = c"dltensor";
const USED: &CStr = c"used_dltensor";
const NAME_V: &CStr = c"dltensor_versioned";

/// Whether the consumer's `max_version` (a `(major, minor)` tuple, or None) takes DLPack 1.0.
pub fn wants_versioned(py: Python<'_>, max_version: Option<PyObject>) -> PyResult<bool> {
    Ok(match max_version {
        Some(v) if !v.is_none(py) => v.extract::<(u32, u32)>(py)?.0 >= 1,
        _ => false,
    })
}

/// What the capsule keeps alive: the batch (and so its blocks) and the shape array.
struct Ctx {
    _owner: Arc<ubdirect_loader::Batch>,
    shape: [i64; 4],
}

const DL_INT: u8 = 0;
const DL_FLOAT: u8 = 2;
const DL_BFLOAT: u8 = 4;
/// `kDLBool`.
pub const DL_BOOL: u8 = 6;

/// The DLPack type of a token type.
pub fn dtype(d: ubdirect_loader::formats::Dtype) -> Option<DLDataType> {
    use ubdirect_loader::formats::Dtype as D;
    let (code, bits) = match d {
        D::U8 => (DL_UINT, 8),
        D::I8 => (DL_INT, 8),
        D::U16 => (DL_UINT, 16),
        D::I16 => (DL_INT, 16),
        D::U32 => (DL_UINT, 32),
        D::I32 => (DL_INT, 32),
        D::U64 => (DL_UINT, 64),
        D::I64 => (DL_INT, 64),
        D::F16 => (DL_FLOAT, 16),
        D::Bf16 => (DL_BFLOAT, 16),
        D::F32 => (DL_FLOAT, 32),
        D::F64 => (DL_FLOAT, 64),
    };
    Some(DLDataType {
        code,
        bits,
        lanes: 1,
    })
}

unsafe extern "C" fn deleter(t: *mut DLManagedTensor) {
    if t.is_null() {
        return;
    }
    // SAFETY: `t` and its manager_ctx were made by Box::into_raw in `capsule` and are freed only
    // here, once (DLPack: the consumer calls the deleter exactly once, or the capsule destructor does
    // when the capsule was never consumed).
    unsafe {
        let t = Box::from_raw(t);
        drop(Box::from_raw(t.manager_ctx.cast::<Ctx>()));
    }
}

unsafe extern "C" fn deleter_versioned(t: *mut DLManagedTensorVersioned) {
    if t.is_null() {
        return;
    }
    // SAFETY: as `deleter`, for the tensors made in `make` with `versioned`.
    unsafe {
        let t = Box::from_raw(t);
        drop(Box::from_raw(t.manager_ctx.cast::<Ctx>()));
    }
}

unsafe extern "C" fn capsule_destructor_versioned(capsule: *mut ffi::PyObject) {
    // SAFETY: as `capsule_destructor`, for capsules named "dltensor_versioned" until consumed.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, NAME_V.as_ptr()) == 1 {
            let p = ffi::PyCapsule_GetPointer(capsule, NAME_V.as_ptr())
                .cast::<DLManagedTensorVersioned>();
            if !p.is_null()
                && let Some(d) = (*p).deleter
            {
                d(p);
            }
        } else {
            ffi::PyErr_Clear();
        }
    }
}

unsafe extern "C" fn capsule_destructor(capsule: *mut ffi::PyObject) {
    // SAFETY: called by Python with the capsule being destroyed. A capsule still named "dltensor" was
    // never consumed, so we own the tensor and run its deleter; a consumed one ("used_dltensor")
    // belongs to the consumer.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, NAME.as_ptr()) == 1 {
            let p = ffi::PyCapsule_GetPointer(capsule, NAME.as_ptr()).cast::<DLManagedTensor>();
            if !p.is_null()
                && let Some(d) = (*p).deleter
            {
                d(p);
            }
        } else {
            // Consumed (renamed) or invalid: nothing of ours to free; clear any error GetPointer set.
            let _ = USED;
            ffi::PyErr_Clear();
        }
    }
}

/// A 1-D uint8 DLPack capsule over `len` bytes at `addr` on `device`, owning a reference to `owner`.
pub fn capsule(
    py: Python<'_>,
    owner: Arc<ubdirect_loader::Batch>,
    addr: u64,
    len: usize,
    device: DLDevice,
    versioned: bool,
) -> PyResult<PyObject> {
    let u8 = DLDataType {
        code: DL_UINT,
        bits: 8,
        lanes: 1,
    };
    make(py, owner, addr, &[len as i64], u8, device, versioned)
}

/// A C-order DLPack capsule of `shape` (at most 4 dimensions) elements of `dtype` at `addr` (GPT
/// batches and their tensors).
pub fn capsule_nd(
    py: Python<'_>,
    owner: Arc<ubdirect_loader::Batch>,
    addr: u64,
    shape: &[i64],
    dtype: DLDataType,
    device: DLDevice,
    versioned: bool,
) -> PyResult<PyObject> {
    if shape.len() > 4 {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "DLPack tensors of ubdirect have at most 4 dimensions",
        ));
    }
    make(py, owner, addr, shape, dtype, device, versioned)
}

/// A DLPack type from its code and bits.
pub fn scalar(code: u8, bits: u8) -> DLDataType {
    DLDataType {
        code,
        bits,
        lanes: 1,
    }
}

/// `kDLInt`.
pub const INT: u8 = DL_INT;
/// `kDLFloat`.
pub const FLOAT: u8 = DL_FLOAT;

fn make(
    py: Python<'_>,
    owner: Arc<ubdirect_loader::Batch>,
    addr: u64,
    shape: &[i64],
    dtype: DLDataType,
    device: DLDevice,
    versioned: bool,
) -> PyResult<PyObject> {
    let mut dims = [0i64; 4];
    dims[..shape.len()].copy_from_slice(shape);
    let ctx = Box::into_raw(Box::new(Ctx {
        _owner: owner,
        shape: dims,
    }));
    let dl_tensor = DLTensor {
        data: addr as *mut c_void,
        device,
        ndim: shape.len() as i32,
        dtype,
        // SAFETY: ctx is a live Box until the deleter runs; the shape array lives inside it.
        shape: unsafe { (*ctx).shape.as_mut_ptr() },
        strides: std::ptr::null_mut(),
        byte_offset: 0,
    };
    let cap = if versioned {
        let t = Box::into_raw(Box::new(DLManagedTensorVersioned {
            version: DLPackVersion { major: 1, minor: 0 },
            manager_ctx: ctx.cast(),
            deleter: Some(deleter_versioned),
            flags: 0,
            dl_tensor,
        }));
        // SAFETY: `t` is a valid heap pointer; the name is a static C string; on failure we free it.
        let cap = unsafe {
            ffi::PyCapsule_New(
                t.cast(),
                NAME_V.as_ptr(),
                Some(capsule_destructor_versioned),
            )
        };
        if cap.is_null() {
            // SAFETY: the capsule was not created, so we still own `t`.
            unsafe { deleter_versioned(t) };
        }
        cap
    } else {
        let t = Box::into_raw(Box::new(DLManagedTensor {
            dl_tensor,
            manager_ctx: ctx.cast(),
            deleter: Some(deleter),
        }));
        // SAFETY: `t` is a valid heap pointer; the name is a static C string; on failure we free it.
        let cap = unsafe { ffi::PyCapsule_New(t.cast(), NAME.as_ptr(), Some(capsule_destructor)) };
        if cap.is_null() {
            // SAFETY: the capsule was not created, so we still own `t`.
            unsafe { deleter(t) };
        }
        cap
    };
    if cap.is_null() {
        return Err(PyErr::fetch(py));
    }
    // SAFETY: PyCapsule_New returned a new (owned) reference.
    Ok(unsafe { Bound::from_owned_ptr(py, cap) }.unbind())
}
