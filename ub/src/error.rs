//! Typed errors of pools and devices.

use std::time::Duration;

use crate::{MemoryKind, UbHandle};

/// Errors from pools and leases.
#[derive(Debug, thiserror::Error)]
pub enum UbError {
    /// The pool configuration cannot make a pool.
    #[error("pool {pool:?}: invalid configuration: {reason}")]
    InvalidConfig {
        /// Pool name.
        pool: String,
        /// What is wrong.
        reason: String,
    },
    /// Locking the pool's memory failed because RLIMIT_MEMLOCK is too low.
    #[error(
        "pool {pool:?}: cannot lock {requested} bytes of memory: RLIMIT_MEMLOCK is {limit} \
         (soft limit, bytes) and this process lacks CAP_IPC_LOCK. Fix: raise it, e.g. \
         `ulimit -l unlimited` in the shell, `LimitMEMLOCK=infinity` in a systemd unit, \
         `--ulimit memlock=-1` for docker, or a `memlock` line in /etc/security/limits.conf;          or make the pools smaller to fit it (`pool.staging_blocks` × `pool.staging_block_size`,          `pool.batch_blocks` × `pool.batch_block_size`, `pool.page_cache_budget`)"
    )]
    MemlockLimit {
        /// Pool name.
        pool: String,
        /// Bytes asked for.
        requested: usize,
        /// The soft limit in bytes (`u64::MAX` = unlimited).
        limit: u64,
    },
    /// An OS call failed while allocating or binding memory.
    #[error("pool {pool:?}: {op} failed")]
    Os {
        /// Pool name.
        pool: String,
        /// The call that failed.
        op: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The memory kind needs a device that can provide it.
    #[error(
        "pool {pool:?}: memory kind {kind} needs a CUDA device, but the pool's device is {device}"
    )]
    KindUnsupported {
        /// Pool name.
        pool: String,
        /// The kind asked for.
        kind: MemoryKind,
        /// The device given (or `none`).
        device: String,
    },
    /// A consumer refused to register the pool's memory.
    #[error("pool {pool:?}: registration with {consumer} failed: {source}")]
    Registration {
        /// Pool name.
        pool: String,
        /// Who refused (io_uring, cuda, …).
        consumer: String,
        /// The consumer's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// `acquire` waited until its deadline without a block coming free.
    #[error(
        "pool {pool:?}: no block came free within {waited:?} ({lent} lent, {in_flight} in flight, {orphaned} orphaned of {total})"
    )]
    AcquireTimeout {
        /// Pool name.
        pool: String,
        /// How long it waited.
        waited: Duration,
        /// Blocks lent at the time.
        lent: usize,
        /// Blocks with I/O in flight.
        in_flight: usize,
        /// Blocks orphaned (lease dropped, completion pending).
        orphaned: usize,
        /// Blocks in the pool.
        total: usize,
    },
    /// The pool was closed.
    #[error("pool {pool:?} is closed")]
    Closed {
        /// Pool name.
        pool: String,
    },
    /// A handle names a slot that was recycled since (old generation) or another pool.
    #[error(
        "stale or foreign handle {handle:?}: slot {slot} of pool {pool:?} is at generation {current}"
    )]
    StaleHandle {
        /// The handle presented.
        handle: UbHandle,
        /// Pool name.
        pool: String,
        /// Slot index.
        slot: u32,
        /// The slot's current generation.
        current: u64,
    },
    /// The block's memory is not addressable by the CPU (device memory).
    #[error("pool {pool:?}: {kind} memory is not host-visible")]
    NotHostVisible {
        /// Pool name.
        pool: String,
        /// The pool's kind.
        kind: MemoryKind,
    },
    /// The block has an I/O or copy in flight; its bytes cannot be touched until it completes.
    #[error(
        "pool {pool:?} slot {slot}: {in_flight} operation(s) in flight; wait for their completion"
    )]
    Busy {
        /// Pool name.
        pool: String,
        /// Slot index.
        slot: u32,
        /// Operations in flight.
        in_flight: u32,
    },
    /// A byte range does not fit in a block.
    #[error("pool {pool:?}: range {offset}+{len} exceeds block size {block_size}")]
    OutOfRange {
        /// Pool name.
        pool: String,
        /// Range start.
        offset: usize,
        /// Range length.
        len: usize,
        /// Block size.
        block_size: usize,
    },
    /// A device call failed while making the pool.
    #[error("pool {pool:?}: device error")]
    Device {
        /// Pool name.
        pool: String,
        /// The device error.
        #[source]
        source: Box<DeviceError>,
    },
}

/// Errors from devices.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// A mapped (page-cache) source could not be copied: changed file, range, budget.
    #[error(transparent)]
    Mapped(Box<crate::MapError>),
    /// CUDA was asked for but is not usable here.
    #[error("CUDA unavailable: {reason}")]
    CudaUnavailable {
        /// Why (library missing, no device, built without the `cuda` feature, …).
        reason: String,
    },
    /// A CUDA driver call failed.
    #[error("CUDA {op} failed: {message}")]
    Cuda {
        /// The call.
        op: &'static str,
        /// The driver's error name and string.
        message: String,
    },
    /// The operation needs memory of another kind.
    #[error("{op}: {what} is {got} memory, expected {expected}")]
    WrongKind {
        /// The operation.
        op: &'static str,
        /// Which operand.
        what: &'static str,
        /// The kind given.
        got: MemoryKind,
        /// The kind needed.
        expected: String,
    },
    /// A range or lease was refused by the pool.
    #[error(transparent)]
    Pool(#[from] UbError),
    /// Waiting for a copy's completion passed its deadline.
    #[error("{op}: no completion within {waited:?}")]
    Timeout {
        /// The operation.
        op: &'static str,
        /// How long it waited.
        waited: Duration,
    },
    /// The device is not supported by this operation.
    #[error("{0}")]
    Unsupported(String),
}
