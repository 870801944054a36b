//! The CUDA device, through cudarc's driver API with dynamic loading.
//!
//! This module is an FFI edge: the `unsafe` blocks here are the raw driver calls cudarc has no safe
//! wrapper for (host registration, copies between raw addresses, raw allocation).
//!
//! Completion: each copy records a blocking-sync event on the device's stream and hands
//! `(event, in-flight tokens, completion cell)` to a completion thread, which waits for the events in
//! stream order and only then drops the tokens — so a staging block goes back to `Free` exactly when
//! the DMA engine is done with it, never when the copy was merely enqueued.

use std::ffi::c_void;
use std::ops::Range;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, DriverError, result, sys};

use super::{
    Cell, CopyCompletion, CopyPart, CopyStream, Device, DeviceInfo, DeviceKind, DeviceMemory,
    Fence, FencePoll, check_copy, check_copy_back, check_parts,
};
use crate::pool::{InFlight, Registration};
use crate::{DeviceError, Lease, MappedFile, MemoryKind};

fn cuda_err(op: &'static str, e: DriverError) -> DeviceError {
    let name = e
        .error_name()
        .map(|c| c.to_string_lossy().into_owned())
        .unwrap_or_default();
    let text = e
        .error_string()
        .map(|c| c.to_string_lossy().into_owned())
        .unwrap_or_default();
    DeviceError::Cuda {
        op,
        message: format!("{name}: {text}"),
    }
}

struct Pending {
    event: CudaEvent,
    /// In-flight tokens of the blocks the copy touches, and what keeps a mapped source alive.
    tokens: (Vec<InFlight>, Option<Arc<MappedFile>>),
    cell: Arc<Cell>,
}

/// An NVIDIA GPU: pinned staging pools, device-memory batch pools, async H2D copies on one stream.
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    info: DeviceInfo,
    events: Arc<Mutex<Vec<CudaEvent>>>,
    completer: Mutex<Option<mpsc::Sender<Pending>>>,
    completer_thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("info", &self.info)
            .finish()
    }
}

/// Whether the CUDA driver library can be loaded on this machine (no cudarc call is made otherwise).
pub fn driver_present() -> bool {
    // SAFETY: only attempts to dlopen the driver library by its known names; loads nothing else.
    unsafe { sys::is_culib_present() }
}

impl CudaDevice {
    /// Opens GPU `ordinal`. On a machine without the NVIDIA driver or without GPUs this is a
    /// [`DeviceError::CudaUnavailable`], never a panic.
    pub fn new(ordinal: usize) -> Result<Self, DeviceError> {
        if !driver_present() {
            return Err(DeviceError::CudaUnavailable {
                reason: "libcuda.so (the NVIDIA driver library) was not found on this machine"
                    .into(),
            });
        }
        // cudarc panics where a driver symbol is missing; keep that a typed error too.
        match std::panic::catch_unwind(|| Self::open(ordinal)) {
            Ok(r) => r,
            Err(p) => Err(DeviceError::CudaUnavailable {
                reason: format!(
                    "the CUDA driver could not be used: {}",
                    p.downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_else(|| "panic in cudarc".into())
                ),
            }),
        }
    }

    fn open(ordinal: usize) -> Result<Self, DeviceError> {
        let unavailable = |e: DriverError| DeviceError::CudaUnavailable {
            reason: format!("{}", cuda_err("cuInit/cuDeviceGetCount", e)),
        };
        let count = CudaContext::device_count().map_err(unavailable)?;
        if count <= 0 {
            return Err(DeviceError::CudaUnavailable {
                reason: "the CUDA driver reports no GPUs".into(),
            });
        }
        if ordinal >= count as usize {
            return Err(DeviceError::CudaUnavailable {
                reason: format!("GPU ordinal {ordinal} requested, {count} present"),
            });
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| cuda_err("cuDevicePrimaryCtxRetain", e))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| cuda_err("cuStreamCreate", e))?;
        let name = ctx.name().unwrap_or_else(|_| format!("cuda:{ordinal}"));
        let attr = |a| ctx.attribute(a).ok();
        let pci_bus_id = match (
            attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID),
            attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID),
            attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID),
        ) {
            (Some(d), Some(b), Some(dev)) => Some(format!("{d:04x}:{b:02x}:{dev:02x}.0")),
            _ => None,
        };
        let numa_node = pci_bus_id.as_ref().and_then(|id| {
            std::fs::read_to_string(format!("/sys/bus/pci/devices/{id}/numa_node"))
                .ok()
                .and_then(|s| s.trim().parse::<i32>().ok())
                .filter(|n| *n >= 0)
        });
        let info = DeviceInfo {
            kind: DeviceKind::Cuda,
            name,
            ordinal: Some(ordinal),
            pci_bus_id,
            numa_node,
            total_memory: ctx.total_mem().ok().map(|m| m as u64),
        };
        let events: Arc<Mutex<Vec<CudaEvent>>> = Arc::default();
        let (tx, rx) = mpsc::channel::<Pending>();
        let free_events = events.clone();
        let completer_thread = std::thread::Builder::new()
            .name(format!("ubdirect-cuda{ordinal}-completions"))
            .spawn(move || {
                for p in rx {
                    // Events complete in stream order, so waiting on them in arrival order is exact.
                    let r = p
                        .event
                        .synchronize()
                        .map_err(|e| cuda_err("cuEventSynchronize", e));
                    if r.is_ok() {
                        // The DMA engine is done with both blocks: now they may be recycled.
                        drop(p.tokens);
                        free_events
                            .lock()
                            .unwrap_or_else(|x| x.into_inner())
                            .push(p.event);
                    } else {
                        // The stream failed: the hardware state of these blocks is unknown. Keep them
                        // out of circulation (leaked tokens keep the slots orphaned) and report.
                        std::mem::forget(p.tokens);
                    }
                    p.cell.complete(r);
                }
            })
            .map_err(|e| {
                DeviceError::Unsupported(format!("cannot spawn CUDA completion thread: {e}"))
            })?;
        Ok(Self {
            ctx,
            stream,
            info,
            events,
            completer: Mutex::new(Some(tx)),
            completer_thread: Some(completer_thread),
        })
    }

    /// The CUDA context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream copies are issued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn take_event(&self) -> Result<CudaEvent, DeviceError> {
        if let Some(e) = self.events.lock().unwrap_or_else(|p| p.into_inner()).pop() {
            return Ok(e);
        }
        self.ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC))
            .map_err(|e| cuda_err("cuEventCreate", e))
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        // Closing the channel ends the completion thread once every pending copy has completed.
        self.completer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(t) = self.completer_thread.take() {
            let _ = t.join();
        }
    }
}

#[derive(Debug)]
struct HostRegistration {
    ctx: Arc<CudaContext>,
    ptr: usize,
    len: usize,
}

impl Registration for HostRegistration {
    fn consumer(&self) -> String {
        format!("cuda:{} host registration", self.ctx.ordinal())
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_err() {
            return;
        }
        // SAFETY: ptr was registered by cuMemHostRegister in `register_host` and is still mapped (the
        // pool drops registrations before its memory).
        let r = unsafe { sys::cuMemHostUnregister(self.ptr as *mut c_void) }.result();
        if let Err(e) = r {
            tracing::warn!(
                ptr = self.ptr,
                len = self.len,
                "cuMemHostUnregister failed: {e}"
            );
        }
    }
}

#[derive(Debug)]
struct DeviceAlloc {
    ctx: Arc<CudaContext>,
    dptr: sys::CUdeviceptr,
    len: usize,
}

impl DeviceMemory for DeviceAlloc {
    fn device_ptr(&self) -> u64 {
        self.dptr
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_err() {
            return;
        }
        // SAFETY: dptr came from cuMemAlloc in `alloc_device`; the pool frees it only after every copy
        // touching it has completed.
        if let Err(e) = unsafe { result::free_sync(self.dptr) } {
            tracing::warn!(len = self.len, "cuMemFree failed: {e}");
        }
    }
}

impl Device for CudaDevice {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn staging_kind(&self) -> MemoryKind {
        MemoryKind::Pinned
    }

    fn batch_kind(&self) -> MemoryKind {
        MemoryKind::Device
    }

    unsafe fn register_host(
        &self,
        ptr: *mut u8,
        len: usize,
    ) -> Result<Box<dyn Registration>, DeviceError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("cuCtxSetCurrent", e))?;
        // SAFETY: this fn's contract: `ptr..ptr + len` is a live mapping that stays mapped until the
        // returned registration is dropped (the pool builder passes its own page-aligned blocks). PORTABLE makes the
        // registration visible to every context; the memory stays ordinary cached host memory.
        unsafe {
            sys::cuMemHostRegister_v2(ptr.cast(), len, sys::CU_MEMHOSTREGISTER_PORTABLE).result()
        }
        .map_err(|e| cuda_err("cuMemHostRegister", e))?;
        Ok(Box::new(HostRegistration {
            ctx: self.ctx.clone(),
            ptr: ptr as usize,
            len,
        }))
    }

    fn alloc_device(&self, len: usize) -> Result<Box<dyn DeviceMemory>, DeviceError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("cuCtxSetCurrent", e))?;
        // SAFETY: plain allocation; the pointer is owned by the returned value and freed in its Drop.
        let dptr = unsafe { result::malloc_sync(len) }.map_err(|e| cuda_err("cuMemAlloc", e))?;
        Ok(Box::new(DeviceAlloc {
            ctx: self.ctx.clone(),
            dptr,
            len,
        }))
    }

    fn copy_to_device(
        &self,
        src: &mut Lease,
        src_range: Range<usize>,
        dst: &mut Lease,
        dst_offset: usize,
    ) -> Result<CopyCompletion, DeviceError> {
        let len = check_copy(src, &src_range, dst, dst_offset)?;
        if src.kind() != MemoryKind::Pinned {
            return Err(DeviceError::WrongKind {
                op: "copy_to_device",
                what: "source",
                got: src.kind(),
                expected: "pinned (a pageable source would make the copy synchronous)".into(),
            });
        }
        let (Some(src_base), Some(dst_base)) = (src.host_ptr(), dst.device_ptr()) else {
            return Err(DeviceError::WrongKind {
                op: "copy_to_device",
                what: "destination",
                got: dst.kind(),
                expected: "device".into(),
            });
        };
        // SAFETY: both tokens go with the copy to `enqueue_h2d`, which drops them only when nothing
        // was enqueued or the stream was synchronized, else hands them to the completion thread,
        // which drops them after this copy's event completed (and leaks them if the stream failed).
        let tokens = unsafe { vec![src.begin_op(), dst.begin_op()] };
        // SAFETY: the source range was checked to lie inside its pinned block (page-locked pool).
        let src_ptr = unsafe { src_base.add(src_range.start) } as *const u8;
        self.enqueue_h2d(src_ptr, dst_base + dst_offset as u64, len, (tokens, None))
    }

    unsafe fn register_host_readonly(
        &self,
        ptr: *mut u8,
        len: usize,
    ) -> Result<Box<dyn Registration>, DeviceError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("cuCtxSetCurrent", e))?;
        // SAFETY: this fn's contract: `ptr..ptr + len` stays mapped until the returned registration
        // is dropped (MappedFile passes its own page-aligned, read-only shared file mapping and drops
        // the registration first, by field order). READ_ONLY is required for PROT_READ memory; PORTABLE makes it visible to every
        // context. The driver populates and pins the pages.
        unsafe {
            sys::cuMemHostRegister_v2(
                ptr.cast(),
                len,
                sys::CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_READ_ONLY,
            )
            .result()
        }
        .map_err(|e| cuda_err("cuMemHostRegister(READ_ONLY)", e))?;
        Ok(Box::new(HostRegistration {
            ctx: self.ctx.clone(),
            ptr: ptr as usize,
            len,
        }))
    }

    fn copy_mapped_to_device(
        &self,
        src: &Arc<MappedFile>,
        src_offset: u64,
        len: usize,
        dst: &mut Lease,
        dst_offset: usize,
    ) -> Result<CopyCompletion, DeviceError> {
        dst.check_range(dst_offset, len)?;
        let Some(dst_base) = dst.device_ptr() else {
            return Err(DeviceError::WrongKind {
                op: "copy_mapped_to_device",
                what: "destination",
                got: dst.kind(),
                expected: "device".into(),
            });
        };
        if !src.is_registered() {
            // Pageable memory: the copy engine may not read it asynchronously.
            return Err(DeviceError::Unsupported(format!(
                "copy_mapped_to_device: {} is mapped for CPU copies only, not registered",
                src.path().display()
            )));
        }
        let src_ptr = src
            .addr(src_offset, len)
            .map_err(|e| DeviceError::Mapped(Box::new(e)))?;
        // SAFETY: the token goes with the copy to `enqueue_h2d`, which drops it only when nothing
        // was enqueued or the stream was synchronized, else hands it to the completion thread,
        // which drops it after this copy's event completed (and leaks it if the stream failed).
        let tokens = unsafe { vec![dst.begin_op()] };
        self.enqueue_h2d(
            src_ptr,
            dst_base + dst_offset as u64,
            len,
            (tokens, Some(src.clone())),
        )
    }

    fn copy_to_host(
        &self,
        src: &Lease,
        src_range: Range<usize>,
        dst: &mut [u8],
    ) -> Result<(), DeviceError> {
        let len = check_copy_back(src, &src_range, dst.len())?;
        let Some(base) = src.device_ptr() else {
            return Err(DeviceError::WrongKind {
                op: "copy_to_host",
                what: "source",
                got: src.kind(),
                expected: "device".into(),
            });
        };
        self.stream
            .synchronize()
            .map_err(|e| cuda_err("cuStreamSynchronize", e))?;
        // SAFETY: the source range lies inside the block's device allocation (checked), the stream is
        // idle, and `dst` is a live mutable slice of exactly `len` bytes.
        unsafe {
            sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), base + src_range.start as u64, len)
                .result()
        }
        .map_err(|e| cuda_err("cuMemcpyDtoH", e))
    }

    fn synchronize(&self) -> Result<(), DeviceError> {
        self.stream
            .synchronize()
            .map_err(|e| cuda_err("cuStreamSynchronize", e))
    }

    fn copy_stream(&self) -> Result<Box<dyn CopyStream>, DeviceError> {
        let stream = self
            .ctx
            .new_stream()
            .map_err(|e| cuda_err("cuStreamCreate", e))?;
        Ok(Box::new(CudaCopyStream {
            ctx: self.ctx.clone(),
            stream,
            events: Arc::default(),
        }))
    }
}

/// A stream of its own (non-blocking: it never waits for the device's loader stream), copies
/// between a pinned staging lease and a device lease, one timing-free event per batch, polled with
/// `cuEventQuery` (no completion thread, no wake-up: the waiter polls).
struct CudaCopyStream {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// Events of completed batches, reused.
    events: Arc<Mutex<Vec<CudaEvent>>>,
}

impl std::fmt::Debug for CudaCopyStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaCopyStream")
            .field("ordinal", &self.ctx.ordinal())
            .finish()
    }
}

/// A batch's event and the in-flight tokens of its two leases.
struct CudaFence {
    event: Option<CudaEvent>,
    tokens: Vec<InFlight>,
    events: Arc<Mutex<Vec<CudaEvent>>>,
}

impl CudaFence {
    fn finish(
        &mut self,
        r: Result<bool, DriverError>,
        op: &'static str,
    ) -> Result<bool, DeviceError> {
        match r {
            Ok(false) => Ok(false),
            Ok(true) => {
                // The DMA engine is done with both blocks.
                self.tokens.clear();
                if let Some(ev) = self.event.take() {
                    self.events
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(ev);
                }
                Ok(true)
            }
            Err(e) => {
                // The stream failed: the blocks' hardware state is unknown; keep them out of
                // circulation (their slots stay orphaned) and report.
                std::mem::forget(std::mem::take(&mut self.tokens));
                self.event = None;
                Err(cuda_err(op, e))
            }
        }
    }
}

impl FencePoll for CudaFence {
    fn poll(&mut self) -> Result<bool, DeviceError> {
        let Some(ev) = self.event.as_ref() else {
            return Ok(true);
        };
        let r = ev
            .context()
            .bind_to_thread()
            .and_then(|_| ev.try_is_complete());
        self.finish(r, "cuEventQuery")
    }

    fn wait(&mut self) -> Result<(), DeviceError> {
        let Some(ev) = self.event.as_ref() else {
            return Ok(());
        };
        let r = ev.synchronize().map(|_| true);
        self.finish(r, "cuEventSynchronize").map(|_| ())
    }
}

impl CudaCopyStream {
    fn event(&self) -> Result<CudaEvent, DeviceError> {
        if let Some(e) = self.events.lock().unwrap_or_else(|p| p.into_inner()).pop() {
            return Ok(e);
        }
        // No flags: timing disabled, no blocking sync (the waiter polls).
        self.ctx
            .new_event(None)
            .map_err(|e| cuda_err("cuEventCreate", e))
    }

    /// Enqueues `parts` in direction `h2d` (else D2H), then the batch's event.
    fn batch<'a>(
        &self,
        staging: &'a mut Lease,
        device: &'a mut Lease,
        parts: &[CopyPart],
        h2d: bool,
    ) -> Result<Fence<'a>, DeviceError> {
        check_parts(staging, device, parts)?;
        if staging.kind() != MemoryKind::Pinned {
            return Err(DeviceError::WrongKind {
                op: "copy stream",
                what: "staging",
                got: staging.kind(),
                expected: "pinned (a pageable block would make each copy synchronous)".into(),
            });
        }
        let (Some(host), Some(dev)) = (staging.host_ptr(), device.device_ptr()) else {
            return Err(DeviceError::WrongKind {
                op: "copy stream",
                what: "device",
                got: device.kind(),
                expected: "device".into(),
            });
        };
        if parts.is_empty() {
            return Ok(Fence::done());
        }
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("cuCtxSetCurrent", e))?;
        let event = self.event()?;
        // SAFETY: the tokens go into the batch's `CudaFence`, which drops them only once its event
        // completed or the stream was synchronized (`finish`), or when no copy was enqueued and no
        // event recorded; a failed stream leaks them. A fence dropped early waits for its event
        // first (`Fence`'s Drop).
        let tokens = unsafe { vec![staging.begin_op(), device.begin_op()] };
        let cu = self.stream.cu_stream();
        let mut enqueued = 0;
        let mut failed = None;
        for p in parts {
            // SAFETY: every part was checked to lie inside its block (`check_parts`); the staging
            // block is page-locked (a pinned pool); both leases are borrowed by the returned fence
            // and in flight (`tokens`) until its event completed, so neither is touched by the CPU,
            // reused or freed while the DMA runs. Host and device offsets stay inside the blocks.
            let r = unsafe {
                let h = host.add(p.host);
                let d = dev + p.device as u64;
                if h2d {
                    sys::cuMemcpyHtoDAsync_v2(d, h as *const c_void, p.len, cu)
                } else {
                    sys::cuMemcpyDtoHAsync_v2(h.cast(), d, p.len, cu)
                }
            }
            .result();
            match r {
                Ok(()) => enqueued += 1,
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        let op = if h2d {
            "cuMemcpyHtoDAsync"
        } else {
            "cuMemcpyDtoHAsync"
        };
        let recorded = event.record(&self.stream);
        let mut fence = CudaFence {
            event: Some(event),
            tokens,
            events: self.events.clone(),
        };
        match (failed, recorded) {
            (None, Ok(())) => Ok(Fence::pending(Box::new(fence))),
            (failed, recorded) => {
                // Some copies may be enqueued: wait for the stream before the leases go back.
                if enqueued > 0 || recorded.is_ok() {
                    let sync = self.stream.synchronize().map(|_| true);
                    fence.event = None;
                    let _ = fence.finish(sync, "cuStreamSynchronize");
                } else {
                    fence.tokens.clear();
                }
                Err(match (failed, recorded) {
                    (Some(e), _) => cuda_err(op, e),
                    (None, Err(e)) => cuda_err("cuEventRecord", e),
                    (None, Ok(())) => {
                        cuda_err(op, DriverError(sys::cudaError_enum::CUDA_ERROR_UNKNOWN))
                    }
                })
            }
        }
    }
}

impl CopyStream for CudaCopyStream {
    fn to_device<'a>(
        &self,
        staging: &'a mut Lease,
        device: &'a mut Lease,
        parts: &[CopyPart],
    ) -> Result<Fence<'a>, DeviceError> {
        self.batch(staging, device, parts, true)
    }

    fn to_host<'a>(
        &self,
        device: &'a mut Lease,
        staging: &'a mut Lease,
        parts: &[CopyPart],
    ) -> Result<Fence<'a>, DeviceError> {
        self.batch(staging, device, parts, false)
    }
}

/// Whether cuFile (GPUDirect Storage) can register a file under `dir`: `Ok(detail)` when it can,
/// `Err(reason)` when it cannot (library missing, driver refuses, file system unsupported). Never
/// panics: cudarc's loader panics are caught. The reason is a `CudaUnavailable` error.
pub fn cufile_probe(dir: &std::path::Path) -> Result<String, DeviceError> {
    cufile_probe_inner(dir).map_err(|reason| DeviceError::CudaUnavailable { reason })
}

fn cufile_probe_inner(dir: &std::path::Path) -> Result<String, String> {
    // SAFETY: only attempts to dlopen libcufile by its known names.
    if !unsafe { cudarc::cufile::sys::is_culib_present() } {
        return Err("libcufile not found (GPUDirect Storage is not installed; set LD_LIBRARY_PATH to CUDA's lib directory if it is)".into());
    }
    if !driver_present() {
        return Err("no NVIDIA driver".into());
    }
    // Never through a planted name: an unnamed O_TMPFILE, or a new name made with O_EXCL|O_NOFOLLOW.
    let probe_file = crate::ProbeFile::create(dir, ".ubdirect-cufile-probe", 1 << 20)
        .map_err(|e| format!("probe file in {}: {e}", dir.display()))?;
    let probe = probe_file.path().to_path_buf();
    let r = std::panic::catch_unwind(|| -> Result<String, String> {
        let _dev = CudaDevice::new(0).map_err(|e| e.to_string())?;
        let cf =
            cudarc::cufile::safe::Cufile::new().map_err(|e| format!("cuFileDriverOpen: {e:?}"))?;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags_direct()
            .open(&probe)
            .map_err(|e| format!("open O_DIRECT: {e}"))?;
        let _h = cf
            .register(f)
            .map_err(|e| format!("cuFileHandleRegister: {e:?}"))?;
        Ok("cuFileHandleRegister succeeded".into())
    });
    drop(probe_file);
    match r {
        Ok(r) => r,
        Err(_) => Err("cuFile panicked while loading (incompatible libcufile)".into()),
    }
}

trait DirectFlag {
    fn custom_flags_direct(&mut self) -> &mut Self;
}

impl DirectFlag for std::fs::OpenOptions {
    fn custom_flags_direct(&mut self) -> &mut Self {
        std::os::unix::fs::OpenOptionsExt::custom_flags(self, libc::O_DIRECT)
    }
}

impl CudaDevice {
    /// Enqueues one H2D copy on the stream and hands its event, with what must stay alive and in
    /// flight until the DMA is done, to the completion thread.
    fn enqueue_h2d(
        &self,
        src: *const u8,
        dst: u64,
        len: usize,
        tokens: (Vec<InFlight>, Option<Arc<MappedFile>>),
    ) -> Result<CopyCompletion, DeviceError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("cuCtxSetCurrent", e))?;
        // SAFETY: the callers checked both ranges against their blocks (or mapping); the source is
        // page-locked (a pinned pool, or a mapping registered READ_ONLY) and everything the copy touches
        // is held by `tokens` (in-flight slots, the mapping's Arc) until the completion thread has seen
        // this copy's event, so nothing is reused, unmapped or freed while the DMA runs.
        let r = unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, src as *const c_void, len, self.stream.cu_stream())
        }
        .result();
        if let Err(e) = r {
            // Nothing was enqueued: releasing the blocks is safe.
            drop(tokens);
            return Err(cuda_err("cuMemcpyHtoDAsync", e));
        }
        let event = match self.take_event().and_then(|ev| {
            ev.record(&self.stream)
                .map(|_| ev)
                .map_err(|e| cuda_err("cuEventRecord", e))
        }) {
            Ok(ev) => ev,
            Err(e) => {
                // The copy is enqueued; wait for the stream before letting the blocks go.
                if self.stream.synchronize().is_ok() {
                    drop(tokens);
                } else {
                    std::mem::forget(tokens);
                }
                return Err(e);
            }
        };
        let (completion, cell) = CopyCompletion::pending();
        let pending = Pending {
            event,
            tokens,
            cell,
        };
        let guard = self.completer.lock().unwrap_or_else(|p| p.into_inner());
        match guard.as_ref().map(|tx| tx.send(pending)) {
            Some(Ok(())) => {}
            Some(Err(mpsc::SendError(p))) => {
                let r = p
                    .event
                    .synchronize()
                    .map_err(|e| cuda_err("cuEventSynchronize", e));
                drop(p.tokens);
                p.cell.complete(r);
            }
            None => unreachable!("completion channel is only taken in Drop"),
        }
        Ok(completion)
    }
}

/// `CU_MEMHOSTREGISTER_READ_ONLY` (CUDA 11.1+): the memory is read-only (a PROT_READ mapping).
const CU_MEMHOSTREGISTER_READ_ONLY: u32 = 0x08;
