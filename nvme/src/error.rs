//! Typed I/O errors: every one names the file, offset and length it concerns.

use std::path::PathBuf;
use std::time::Duration;

/// Errors from the io_uring engine.
#[derive(Debug, thiserror::Error)]
pub enum IoError {
    /// Opening (or probing) a file failed.
    #[error("open {path}: {source}")]
    Open {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The requested range ends past the end of the file.
    #[error("read {path} at {offset}+{len}: past end of file (size {size})")]
    PastEof {
        /// The file.
        path: PathBuf,
        /// Requested offset.
        offset: u64,
        /// Requested length.
        len: usize,
        /// File size when opened.
        size: u64,
    },
    /// The file ended before the requested range was read (it shrank, or vanished, after open).
    #[error("read {path} at {offset}+{len}: unexpected end of file after {got} bytes")]
    UnexpectedEof {
        /// The file.
        path: PathBuf,
        /// Requested offset.
        offset: u64,
        /// Requested length.
        len: usize,
        /// Bytes received.
        got: usize,
    },
    /// The kernel returned an error for the read.
    #[error("read {path} at {offset}+{len}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Requested offset.
        offset: u64,
        /// Requested length.
        len: usize,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The lease's memory is not host memory.
    #[error("pool {pool:?} holds {kind} memory, which io_uring cannot read into")]
    NotHostVisible {
        /// Pool name.
        pool: String,
        /// Memory kind.
        kind: ubdirect_ub::MemoryKind,
    },
    /// The (widened) read does not fit in the lease.
    #[error(
        "read {path} at {offset}+{len}: needs {need} bytes at lease offset {lease_offset}, block holds {capacity}"
    )]
    BufferTooSmall {
        /// The file.
        path: PathBuf,
        /// Requested offset.
        offset: u64,
        /// Requested length.
        len: usize,
        /// Bytes the read needs in the block (after widening to the direct-I/O alignment).
        need: usize,
        /// Where in the block it was to land.
        lease_offset: usize,
        /// Block size.
        capacity: usize,
    },
    /// An O_DIRECT read's destination is not aligned as the file system requires.
    #[error(
        "read {path}: lease offset {lease_offset} is not a multiple of the direct-I/O memory alignment {align}"
    )]
    Misaligned {
        /// The file.
        path: PathBuf,
        /// The offending lease offset.
        lease_offset: usize,
        /// Required alignment.
        align: u32,
    },
    /// `direct = "on"` was asked for on a file system without direct I/O.
    #[error("{path}: O_DIRECT required by config but unsupported here: {reason}")]
    DirectUnsupported {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The read did not complete within the engine's deadline; it was cancelled.
    #[error(
        "read {path} at {offset}+{len}: no completion within {waited:?} (cancel requested; the block stays orphaned until the kernel completes it)"
    )]
    Timeout {
        /// The file.
        path: PathBuf,
        /// Requested offset.
        offset: u64,
        /// Requested length.
        len: usize,
        /// How long it waited.
        waited: Duration,
    },
    /// The read was cancelled.
    #[error("read {path} at {offset}+{len}: cancelled")]
    Cancelled {
        /// The file.
        path: PathBuf,
        /// Requested offset.
        offset: u64,
        /// Requested length.
        len: usize,
    },
    /// The engine is shut down or its thread died.
    #[error("io_uring engine is closed")]
    Closed,
    /// Setting up a ring, or registering with it, failed.
    #[error("io_uring {what}: {source}")]
    Setup {
        /// What was being set up.
        what: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The engine's configuration is invalid.
    #[error("engine config: {0}")]
    Config(String),
    /// A range of a mapping asked of [`crate::Engine::copy_mapped`] that it does not hold.
    #[error(transparent)]
    Mapped(#[from] ubdirect_ub::MapError),
}

impl IoError {
    /// Whether the read failed because the file is no longer what it was when opened or checked —
    /// cut short (before or after its open), or unreadable on a failing disk (`EIO`, `ESTALE`,
    /// `ENODATA`) — not because the engine, the lease or the deadline failed. What a copy kept
    /// elsewhere (an object cache's store) can make good.
    pub fn means_damaged_file(&self) -> bool {
        match self {
            IoError::UnexpectedEof { .. } | IoError::PastEof { .. } => true,
            IoError::Read { source, .. } => matches!(
                source.raw_os_error(),
                Some(libc::EIO | libc::ESTALE | libc::ENODATA)
            ),
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_or_failing_file_is_damage_and_the_engine_lease_or_deadline_is_not() {
        let p = PathBuf::from("c.chunk");
        let read = |errno| IoError::Read {
            path: p.clone(),
            offset: 0,
            len: 1,
            source: std::io::Error::from_raw_os_error(errno),
        };
        let short = IoError::UnexpectedEof {
            path: p.clone(),
            offset: 0,
            len: 2,
            got: 1,
        };
        assert!(short.means_damaged_file());
        assert!(read(libc::EIO).means_damaged_file());
        assert!(read(libc::ESTALE).means_damaged_file());
        assert!(!read(libc::EFAULT).means_damaged_file());
        assert!(!read(libc::EINVAL).means_damaged_file());
        assert!(!IoError::Closed.means_damaged_file());
        assert!(!IoError::Config("cpus".into()).means_damaged_file());
    }
}
