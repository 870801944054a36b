//! Storage I/O for ubdirect: the io_uring read engine.
//!
//! [`Engine`] runs one or more io_uring rings, each on its own thread, and bridges them to async
//! callers. Reads go `(file, offset, len) → (lease, offset)` with `READ_FIXED` into UB pool blocks
//! registered once as fixed buffers, on registered files, with O_DIRECT where the file system
//! supports it. Unaligned ranges are widened to the direct-I/O alignment and the caller is told
//! where its bytes start (no copy). File systems without direct I/O fall back to buffered reads,
//! counted and logged once. Short reads are completed, `EINTR`/`EAGAIN` retried, and every error
//! carries the path, offset and length.

mod copier;
pub mod engine;
pub mod error;
pub mod extents;
pub mod passthru;
pub mod passthru_sys;
pub mod probe;
pub mod source;
mod sys;
mod worker;

pub use engine::{
    DirectMode, Engine, EngineConfig, EngineReport, EngineStats, FileHandle, ReadDone, pin_thread,
};
pub use error::IoError;
pub use passthru::{Controller, IdCtrl, IdNs, Namespace, NvmeError, NvmeStatus};
pub use source::FileSource;
pub use source::{NvmeOpener, NvmeSource, NvmeSourceError};

/// Whether every page of `off..off + len` of the open file `fd` is in the page cache now
/// (`cachestat(2)`: Linux ≥ 6.5, `ENOSYS` before; an empty range is `false`).
pub fn page_cache_resident(
    fd: &impl std::os::fd::AsRawFd,
    off: u64,
    len: u64,
) -> std::io::Result<bool> {
    sys::all_cached(fd, off, len)
}
