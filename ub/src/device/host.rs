//! The host device: batches stay in host memory.

use std::ops::Range;
use std::sync::Arc;

use super::{
    CopyCompletion, CopyPart, CopyStream, Device, DeviceInfo, DeviceKind, DeviceMemory, Fence,
    check_copy, check_copy_back, check_parts,
};
use crate::pool::Registration;
use crate::{DeviceError, Lease, MappedFile, MemoryKind};

/// Host memory as the "device": for CPU training, machines without a GPU, and CI. Batches are
/// delivered in the staging leases themselves (zero copy); `copy_to_device` is a plain memcpy
/// between host leases for code that asks for a copy.
#[derive(Debug)]
pub struct HostDevice {
    info: DeviceInfo,
}

impl Default for HostDevice {
    fn default() -> Self {
        Self::new()
    }
}

impl HostDevice {
    /// The host device.
    pub fn new() -> Self {
        Self {
            info: DeviceInfo {
                kind: DeviceKind::Host,
                name: "host".into(),
                ordinal: None,
                pci_bus_id: None,
                numa_node: None,
                total_memory: None,
            },
        }
    }
}

impl Device for HostDevice {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn staging_kind(&self) -> MemoryKind {
        MemoryKind::Host
    }

    fn batch_kind(&self) -> MemoryKind {
        MemoryKind::Host
    }

    unsafe fn register_host(
        &self,
        _ptr: *mut u8,
        _len: usize,
    ) -> Result<Box<dyn Registration>, DeviceError> {
        Err(DeviceError::Unsupported(
            "the host device has no page-locked (pinned) memory to register: use kind = \"host\""
                .into(),
        ))
    }

    unsafe fn register_host_readonly(
        &self,
        _ptr: *mut u8,
        _len: usize,
    ) -> Result<Box<dyn Registration>, DeviceError> {
        // The CPU reads the page cache as it is: nothing to pin.
        Ok(Box::new(NoRegistration))
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
        let d = dst.as_mut_slice()?;
        src.copy_out(src_offset, &mut d[dst_offset..dst_offset + len])
            .map_err(|e| DeviceError::Mapped(Box::new(e)))?;
        Ok(CopyCompletion::ready(Ok(())))
    }

    fn alloc_device(&self, _len: usize) -> Result<Box<dyn DeviceMemory>, DeviceError> {
        Err(DeviceError::Unsupported(
            "the host device has no device memory: use kind = \"host\"".into(),
        ))
    }

    fn copy_to_device(
        &self,
        src: &mut Lease,
        src_range: Range<usize>,
        dst: &mut Lease,
        dst_offset: usize,
    ) -> Result<CopyCompletion, DeviceError> {
        let len = check_copy(src, &src_range, dst, dst_offset)?;
        let s = src.as_slice()?;
        let d = dst.as_mut_slice()?;
        d[dst_offset..dst_offset + len].copy_from_slice(&s[src_range]);
        Ok(CopyCompletion::ready(Ok(())))
    }

    fn copy_to_host(
        &self,
        src: &Lease,
        src_range: Range<usize>,
        dst: &mut [u8],
    ) -> Result<(), DeviceError> {
        check_copy_back(src, &src_range, dst.len())?;
        dst.copy_from_slice(&src.as_slice()?[src_range]);
        Ok(())
    }

    fn synchronize(&self) -> Result<(), DeviceError> {
        Ok(())
    }

    fn copy_stream(&self) -> Result<Box<dyn CopyStream>, DeviceError> {
        Ok(Box::new(HostCopyStream))
    }
}

/// The host device's copy stream: each part a `memcpy` between two host leases, done on return.
#[derive(Debug, Clone, Copy, Default)]
pub struct HostCopyStream;

impl CopyStream for HostCopyStream {
    fn to_device<'a>(
        &self,
        staging: &'a mut Lease,
        device: &'a mut Lease,
        parts: &[CopyPart],
    ) -> Result<Fence<'a>, DeviceError> {
        check_parts(staging, device, parts)?;
        let (s, d) = (staging.as_slice()?, device.as_mut_slice()?);
        for p in parts {
            d[p.device..p.device + p.len].copy_from_slice(&s[p.host..p.host + p.len]);
        }
        Ok(Fence::done())
    }

    fn to_host<'a>(
        &self,
        device: &'a mut Lease,
        staging: &'a mut Lease,
        parts: &[CopyPart],
    ) -> Result<Fence<'a>, DeviceError> {
        check_parts(staging, device, parts)?;
        let (d, s) = (device.as_slice()?, staging.as_mut_slice()?);
        for p in parts {
            s[p.host..p.host + p.len].copy_from_slice(&d[p.device..p.device + p.len]);
        }
        Ok(Fence::done())
    }
}

/// The host device's registration of a mapping: nothing held.
#[derive(Debug)]
struct NoRegistration;

impl Registration for NoRegistration {
    fn consumer(&self) -> String {
        "host (no registration needed)".into()
    }
}
