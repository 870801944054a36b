//! Devices: where batches end up. [`HostDevice`] keeps them in host memory; `CudaDevice` copies
//! them into GPU memory. Selection is `auto | cuda | host`, and what was chosen is reported.

use std::fmt;
use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::pool::Registration;
use crate::{DeviceError, Lease, MemoryKind};

#[cfg(feature = "cuda")]
pub mod cuda;
mod host;

pub use host::{HostCopyStream, HostDevice};

/// Which implementation a device is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    /// Host memory, zero copy.
    Host,
    /// An NVIDIA GPU through the CUDA driver API.
    Cuda,
}

impl fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DeviceKind::Host => "host",
            DeviceKind::Cuda => "cuda",
        })
    }
}

/// What a device is, for reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Implementation.
    pub kind: DeviceKind,
    /// Human-readable name (`NVIDIA H200`, `host`).
    pub name: String,
    /// CUDA ordinal.
    pub ordinal: Option<usize>,
    /// PCI address (`0000:3b:00.0`).
    pub pci_bus_id: Option<String>,
    /// NUMA node of the device's PCI root, from sysfs (`None` when unknown or single-node).
    pub numa_node: Option<i32>,
    /// Device memory in bytes.
    pub total_memory: Option<u64>,
}

/// A device allocation; freed on drop.
pub trait DeviceMemory: Send + Sync + fmt::Debug {
    /// Device address of the first byte.
    fn device_ptr(&self) -> u64;
    /// Bytes.
    fn len(&self) -> usize;
    /// Whether the allocation is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A device batches are delivered to. Every implementation passes the same conformance suite
/// (`ub/tests/device_conformance.rs`).
pub trait Device: Send + Sync + fmt::Debug {
    /// What this device is.
    fn info(&self) -> &DeviceInfo;
    /// Memory kind of the staging pool that storage reads land in (`Host` or `Pinned`).
    fn staging_kind(&self) -> MemoryKind;
    /// Memory kind of the pool batches are delivered in (`Host` for zero copy, `Device` for a GPU).
    fn batch_kind(&self) -> MemoryKind;
    /// Registers host memory with the device (page-locking it), for copies the device runs on
    /// its own (DMA).
    ///
    /// # Safety
    /// `ptr..ptr + len` must be one mapping of this process that stays mapped (not unmapped nor
    /// remapped) until the returned registration is dropped: the device reads and writes it
    /// without the CPU, and a driver may fault or corrupt another mapping placed there later.
    /// [`UbPool`](crate::UbPool) keeps this for its blocks.
    unsafe fn register_host(
        &self,
        ptr: *mut u8,
        len: usize,
    ) -> Result<Box<dyn Registration>, DeviceError>;
    /// Registers a read-only mapping (the page cache of a shard) with the device: CUDA pins it with
    /// `cuMemHostRegister(READ_ONLY | PORTABLE)`; the host device needs nothing.
    ///
    /// # Safety
    /// As [`Device::register_host`]: `ptr..ptr + len` stays mapped until the registration is
    /// dropped ([`MappedFile`](crate::MappedFile) keeps this: it drops its registration before
    /// its mapping). The device only reads it.
    unsafe fn register_host_readonly(
        &self,
        ptr: *mut u8,
        len: usize,
    ) -> Result<Box<dyn Registration>, DeviceError>;
    /// Copies `len` bytes at `src_offset` of a mapped file into `dst` at `dst_offset`,
    /// asynchronously. The mapping is kept alive and `dst` in flight until the copy completes.
    fn copy_mapped_to_device(
        &self,
        src: &Arc<crate::MappedFile>,
        src_offset: u64,
        len: usize,
        dst: &mut Lease,
        dst_offset: usize,
    ) -> Result<CopyCompletion, DeviceError>;
    /// Allocates `len` bytes of device memory.
    fn alloc_device(&self, len: usize) -> Result<Box<dyn DeviceMemory>, DeviceError>;
    /// Copies `src[src_range]` into `dst` at `dst_offset`, asynchronously. Both leases are
    /// `InFlight` until the copy completes; dropping them earlier orphans their slots until then.
    fn copy_to_device(
        &self,
        src: &mut Lease,
        src_range: Range<usize>,
        dst: &mut Lease,
        dst_offset: usize,
    ) -> Result<CopyCompletion, DeviceError>;
    /// Copies `src[src_range]` back into host memory, synchronously (verification, debugging).
    fn copy_to_host(
        &self,
        src: &Lease,
        src_range: Range<usize>,
        dst: &mut [u8],
    ) -> Result<(), DeviceError>;
    /// Waits until every copy submitted so far has completed.
    fn synchronize(&self) -> Result<(), DeviceError>;
    /// A copy stream of its own for serving device memory to the CPU in pieces (an SMC region in
    /// GPU memory): batched copies between a staging lease of kind [`Device::staging_kind`] and a
    /// device lease, completed by polling, never behind the device's other copies.
    fn copy_stream(&self) -> Result<Box<dyn CopyStream>, DeviceError>;
}

/// One piece of a batched copy: `len` bytes at `host` in the staging lease and at `device` in the
/// device lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyPart {
    /// Offset in the staging (host) lease.
    pub host: usize,
    /// Offset in the device lease.
    pub device: usize,
    /// Bytes.
    pub len: usize,
}

/// Copies between a staging lease and a device lease on a stream of their own ([`Device::copy_stream`]).
/// Each call enqueues every part, then one completion marker: the parts of a batch (adjacent dirty
/// pages, a fault's read-ahead) cost one wait, not one each.
pub trait CopyStream: Send + Sync + fmt::Debug {
    /// Enqueues `staging[p.host..] → device[p.device..]` for every part.
    fn to_device<'a>(
        &self,
        staging: &'a mut Lease,
        device: &'a mut Lease,
        parts: &[CopyPart],
    ) -> Result<Fence<'a>, DeviceError>;
    /// Enqueues `device[p.device..] → staging[p.host..]` for every part.
    fn to_host<'a>(
        &self,
        device: &'a mut Lease,
        staging: &'a mut Lease,
        parts: &[CopyPart],
    ) -> Result<Fence<'a>, DeviceError>;
}

/// What a [`Fence`] polls: the device's completion marker.
pub(crate) trait FencePoll: Send {
    /// `Ok(true)` once every copy enqueued before the marker has completed.
    fn poll(&mut self) -> Result<bool, DeviceError>;
    /// Blocks until then (a fence dropped before it completed).
    fn wait(&mut self) -> Result<(), DeviceError>;
}

/// The completion of a batch of copies, polled ([`Fence::poll`], [`Fence::wait`]). It borrows both
/// leases, so neither can be touched while the copies may run; dropping it before it completed
/// waits for the copies (they are short) — memory a copy still touches is never handed back.
pub struct Fence<'a> {
    inner: Option<Box<dyn FencePoll + 'a>>,
    _leases: std::marker::PhantomData<&'a mut Lease>,
}

impl fmt::Debug for Fence<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fence")
            .field("done", &self.inner.is_none())
            .finish()
    }
}

impl<'a> Fence<'a> {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn pending(inner: Box<dyn FencePoll + 'a>) -> Self {
        Self {
            inner: Some(inner),
            _leases: std::marker::PhantomData,
        }
    }

    pub(crate) fn done() -> Self {
        Self {
            inner: None,
            _leases: std::marker::PhantomData,
        }
    }

    /// Whether every copy of the batch has completed (an error: the stream failed).
    pub fn poll(&mut self) -> Result<bool, DeviceError> {
        let Some(f) = self.inner.as_mut() else {
            return Ok(true);
        };
        let done = f.poll();
        if !matches!(done, Ok(false)) {
            // Completed (or failed: the copies are over either way).
            self.inner = None;
        }
        done
    }

    /// Blocks until the batch completed (start-up work; the serving path polls with [`Fence::wait`]).
    pub fn wait_blocking(mut self) -> Result<(), DeviceError> {
        match self.inner.take() {
            Some(mut f) => f.wait(),
            None => Ok(()),
        }
    }

    /// Polls until the batch completed: spinning for `spin`, then yielding to the runtime between
    /// polls; past `deadline` a timeout (the fence then waits for the copies when dropped).
    pub async fn wait(mut self, spin: Duration, deadline: Duration) -> Result<(), DeviceError> {
        let start = Instant::now();
        loop {
            if self.poll()? {
                return Ok(());
            }
            let t = start.elapsed();
            if t >= deadline {
                return Err(DeviceError::Timeout {
                    op: "copy stream fence",
                    waited: t,
                });
            }
            if t < spin {
                std::hint::spin_loop();
            } else {
                tokio::task::yield_now().await;
            }
        }
    }
}

impl Drop for Fence<'_> {
    fn drop(&mut self) {
        if let Some(mut f) = self.inner.take()
            && let Err(e) = f.wait()
        {
            tracing::warn!("copy stream: waiting for an abandoned batch failed: {e}");
        }
    }
}

/// Checks a batch's parts against both leases.
pub(crate) fn check_parts(
    staging: &Lease,
    device: &Lease,
    parts: &[CopyPart],
) -> Result<(), DeviceError> {
    for p in parts {
        staging.check_range(p.host, p.len)?;
        device.check_range(p.device, p.len)?;
    }
    Ok(())
}

/// Device selection, as written in configs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceSelection {
    /// CUDA when a usable GPU is present, host otherwise (counted as the `no_gpu` fallback).
    #[default]
    Auto,
    /// CUDA or an error.
    Cuda,
    /// Host memory.
    Host,
}

impl std::str::FromStr for DeviceSelection {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Self::Auto),
            "cuda" => Ok(Self::Cuda),
            "host" => Ok(Self::Host),
            o => Err(format!("unknown device {o:?}: expected auto, cuda or host")),
        }
    }
}

/// The device chosen, and why.
#[derive(Debug, Clone)]
pub struct Selected {
    /// The device.
    pub device: Arc<dyn Device>,
    /// Why it was chosen (`selected by config`, or the reason CUDA was not usable).
    pub reason: String,
    /// Whether this was a fallback from `auto`'s first choice.
    pub fallback: bool,
}

/// Chooses a device. `auto` tries CUDA ordinal `ordinal` first and falls back to host, recording the
/// fallback; `cuda` fails with a clear error where CUDA is not usable.
pub fn select_device(selection: DeviceSelection, ordinal: usize) -> Result<Selected, DeviceError> {
    match selection {
        DeviceSelection::Host => Ok(Selected {
            device: Arc::new(HostDevice::new()),
            reason: "host selected by config".into(),
            fallback: false,
        }),
        DeviceSelection::Cuda => Ok(Selected {
            device: open_cuda(ordinal)?,
            reason: format!("cuda:{ordinal} selected by config"),
            fallback: false,
        }),
        DeviceSelection::Auto => match open_cuda(ordinal) {
            Ok(device) => Ok(Selected {
                device,
                reason: format!("auto: cuda:{ordinal} is usable"),
                fallback: false,
            }),
            Err(e) => {
                let reason = format!("auto: no usable GPU ({e}); batches stay in host memory");
                crate::fallback::record("no_gpu", reason.clone());
                Ok(Selected {
                    device: Arc::new(HostDevice::new()),
                    reason,
                    fallback: true,
                })
            }
        },
    }
}

#[cfg(feature = "cuda")]
fn open_cuda(ordinal: usize) -> Result<Arc<dyn Device>, DeviceError> {
    Ok(Arc::new(cuda::CudaDevice::new(ordinal)?))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(_ordinal: usize) -> Result<Arc<dyn Device>, DeviceError> {
    Err(DeviceError::CudaUnavailable {
        reason: "this build has no CUDA support (built without the `cuda` feature)".into(),
    })
}

#[derive(Debug, Default)]
struct CellState {
    done: bool,
    result: Option<DeviceError>,
}

/// Shared completion cell: filled once by the completer, awaited by a blocking or async waiter.
#[derive(Debug, Default)]
pub(crate) struct Cell {
    state: Mutex<CellState>,
    cv: Condvar,
    notify: tokio::sync::Notify,
}

impl Cell {
    pub(crate) fn complete(&self, result: Result<(), DeviceError>) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.done = true;
        s.result = result.err();
        drop(s);
        self.cv.notify_all();
        self.notify.notify_waiters();
    }

    fn take(&self) -> Option<Result<(), DeviceError>> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if s.done {
            Some(s.result.take().map_or(Ok(()), Err))
        } else {
            None
        }
    }
}

/// The completion of an asynchronous copy. Dropping it does not cancel the copy: the leases stay
/// in flight until the device says it is done.
#[derive(Debug)]
pub struct CopyCompletion {
    cell: Arc<Cell>,
}

impl CopyCompletion {
    pub(crate) fn pending() -> (Self, Arc<Cell>) {
        let cell = Arc::new(Cell::default());
        (Self { cell: cell.clone() }, cell)
    }

    pub(crate) fn ready(result: Result<(), DeviceError>) -> Self {
        let (c, cell) = Self::pending();
        cell.complete(result);
        c
    }

    /// Whether the copy has completed (successfully or not).
    pub fn is_done(&self) -> bool {
        self.cell.state.lock().map(|s| s.done).unwrap_or(true)
    }

    /// Waits for the copy, at most `deadline`.
    pub async fn wait(self, deadline: Duration) -> Result<(), DeviceError> {
        let start = Instant::now();
        loop {
            let notified = self.cell.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(r) = self.cell.take() {
                return r;
            }
            let left = deadline.saturating_sub(start.elapsed());
            if left.is_zero() || tokio::time::timeout(left, notified).await.is_err() {
                return self.cell.take().unwrap_or(Err(DeviceError::Timeout {
                    op: "copy completion",
                    waited: start.elapsed(),
                }));
            }
        }
    }

    /// Blocks the thread until the copy completes, at most `deadline`.
    pub fn wait_blocking(self, deadline: Duration) -> Result<(), DeviceError> {
        let start = Instant::now();
        let mut s = self.cell.state.lock().unwrap_or_else(|p| p.into_inner());
        while !s.done {
            let left = deadline.saturating_sub(start.elapsed());
            if left.is_zero() {
                return Err(DeviceError::Timeout {
                    op: "copy completion",
                    waited: start.elapsed(),
                });
            }
            s = self
                .cell
                .cv
                .wait_timeout(s, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        s.result.take().map_or(Ok(()), Err)
    }
}

/// Checks a copy's operands: ranges inside their blocks.
pub(crate) fn check_copy(
    src: &Lease,
    src_range: &Range<usize>,
    dst: &Lease,
    dst_offset: usize,
) -> Result<usize, DeviceError> {
    let len = src_range.end.checked_sub(src_range.start).ok_or_else(|| {
        DeviceError::Unsupported(format!(
            "copy: empty or reversed source range {src_range:?}"
        ))
    })?;
    src.check_range(src_range.start, len)?;
    dst.check_range(dst_offset, len)?;
    Ok(len)
}

/// Checks a copy back to host memory: the range inside the block, the destination of its length.
pub(crate) fn check_copy_back(
    src: &Lease,
    src_range: &Range<usize>,
    dst_len: usize,
) -> Result<usize, DeviceError> {
    let len = src_range.end.saturating_sub(src_range.start);
    src.check_range(src_range.start, len)?;
    if dst_len != len {
        return Err(DeviceError::Unsupported(format!(
            "copy_to_host: destination holds {dst_len} bytes, range {src_range:?} has {len}"
        )));
    }
    Ok(len)
}
