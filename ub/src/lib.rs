//! Register-once unified buffer (UB) pools and the devices batches land on.
//!
//! A [`UbPool`] is made once from a [`PoolConfig`]: its memory is allocated, locked and registered
//! with every consumer that must know it (the io_uring ring as fixed buffers, CUDA as page-locked
//! host memory) at creation, and never again. A [`Lease`] is an owned handle to one block. Slots move
//! `Free → Lent → InFlight → Free`; a lease dropped while an I/O or a copy still targets its block
//! leaves the slot [`SlotState::Orphaned`] until the completion arrives, so memory that hardware
//! may still write is never handed out again.
//!
//! [`Device`] is where batches end up: [`HostDevice`] (host memory, zero copy) or `CudaDevice`
//! (GPU memory, async H2D copies from pinned leases, completion by CUDA events).

pub mod config;
pub mod device;
pub mod error;
pub mod fallback;
pub mod invariant;
pub use invariant::broken_transitions;
pub mod mapped;
pub mod newfile;
pub mod pool;
pub mod probe;
pub mod source;
mod sys;
pub mod topology;

pub use config::{MemoryKind, PoolConfig};
#[cfg(feature = "cuda")]
pub use device::cuda::{CudaDevice, cufile_probe, driver_present as cuda_driver_present};
pub use device::{
    CopyCompletion, CopyPart, CopyStream, Device, DeviceInfo, DeviceKind, DeviceMemory,
    DeviceSelection, Fence, HostCopyStream, HostDevice, Selected, select_device,
};
pub use error::{DeviceError, UbError};
pub use mapped::{FileIdent, MapError, MappedFile, Piece, PinBudget};
pub use newfile::{NewFile, write_new};
pub use pool::{
    BlockView, HeldBack, InFlight, Lease, PoolDescriptor, PoolId, PoolStats, Registrar,
    Registration, SlotState, UbHandle, UbPool, UbPoolBuilder,
};
pub use probe::ProbeFile;
pub use source::{
    ChunkFiles, PlannedReads, ReadDone, ReadFuture, ReadPath, Source, SourceError, SourceErrorKind,
    SourceResult, check_request,
};

/// The page size every host block is aligned to.
pub const PAGE_SIZE: usize = 4096;

/// The soft `RLIMIT_MEMLOCK` in bytes (`u64::MAX` when unlimited): what a process without
/// `CAP_IPC_LOCK` may lock (pools, registered page cache).
pub fn memlock_limit() -> u64 {
    sys::memlock_limit()
}

/// The soft `RLIMIT_NOFILE` (`u64::MAX` when unlimited): the descriptors this process may hold.
pub fn open_files_limit() -> u64 {
    sys::open_files_limit()
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit (no privilege needed) and returns the soft
/// limit then in force: what a loader of many shards, two descriptors each, and an io_uring
/// registered-file table (at most the soft limit) need.
pub fn raise_open_files_limit() -> u64 {
    sys::raise_open_files_limit()
}

/// Makes room in this process's descriptor table for `n` descriptors at once (at most the soft
/// `RLIMIT_NOFILE`), so that a loader opening its shards and chunk files does not grow it doubling
/// by doubling: in a process of several threads every doubling waits for an RCU grace period,
/// which cost a warm object cache's first epoch tens of milliseconds for 512 chunk files (H200,
/// docs/decisions.md, "The descriptor table is grown once"). Costs at most one such wait, none
/// while the process has one thread; the table is pointers (8 bytes a descriptor).
pub fn reserve_descriptors(n: u64) -> std::io::Result<()> {
    let top = n.min(open_files_limit().saturating_sub(1));
    let Ok(top) = libc::c_int::try_from(top) else {
        return Ok(());
    };
    if top < 64 {
        return Ok(()); // the table's first size
    }
    let root = std::fs::File::open("/")?;
    sys::grow_fd_table(std::os::fd::AsFd::as_fd(&root), top)
}
