//! What a ring runs: the submission entry kinds, the operations (reads and NVMe commands), the
//! commands callers send, and why an operation failed.

use super::*;

/// A submission entry type the worker can run: 16-byte entries for reads, 128-byte entries for
/// passthrough commands (which also take the 16-byte ones).
pub(crate) trait Sqe: squeue::EntryMarker + From<squeue::Entry> {
    /// Whether the ring takes 128-byte commands.
    const CMD: bool;
    /// The entry as this ring's type, if the ring takes 128-byte commands.
    fn from_cmd(e: squeue::Entry128) -> Option<Self>;
}

impl Sqe for squeue::Entry {
    const CMD: bool = false;
    fn from_cmd(_: squeue::Entry128) -> Option<Self> {
        None
    }
}

impl Sqe for squeue::Entry128 {
    const CMD: bool = true;
    fn from_cmd(e: squeue::Entry128) -> Option<Self> {
        Some(e)
    }
}

pub(super) const WAKE: u64 = u64::MAX;
pub(super) const CANCEL: u64 = u64::MAX - 1;

pub(crate) struct ReadOp {
    pub(crate) op_id: u64,
    pub(crate) file: Arc<FileInner>,
    /// The destination's fixed buffer; `None`: a pool not registered with the engine (pageable
    /// memory under a low RLIMIT_MEMLOCK), read by address.
    pub(crate) buf_index: Option<u16>,
    /// Address of the first byte of the (widened) destination.
    pub(crate) buf: usize,
    pub(crate) file_offset: u64,
    /// Bytes to read (widened).
    pub(crate) total: usize,
    /// Bytes that must arrive (up to the end of the requested range).
    pub(crate) required: usize,
    pub(crate) done: usize,
    pub(crate) retries: u32,
    /// Keeps the destination block in flight until this op is dropped, after its last CQE.
    #[expect(
        dead_code,
        reason = "held for its Drop, which is the block's completion"
    )]
    pub(crate) token: InFlight,
    pub(crate) reply: Option<tokio::sync::oneshot::Sender<Result<usize, IoError>>>,
    pub(crate) req_offset: u64,
    pub(crate) req_len: usize,
}

pub(super) const NVME_READ: &str = "NVMe read (uring_cmd)";

/// One NVMe read command (at most the namespace's max transfer) into a fixed buffer.
pub(crate) struct NvmeOp {
    pub(crate) op_id: u64,
    pub(crate) ns: Arc<Namespace>,
    pub(crate) slba: u64,
    pub(crate) nlb: u32,
    pub(crate) buf_index: u16,
    /// Address of the destination, inside fixed buffer `buf_index`.
    pub(crate) buf: usize,
    pub(crate) len: u32,
    /// 4 KiB pages from the destination's first page to the end of its fixed buffer: what kernels
    /// before the fix of 2025 count as the command's segments (see `Worker::fixed_tail_limit`).
    pub(crate) tail_pages: u32,
    /// Issued with the fixed buffer (`IORING_URING_CMD_FIXED`); false once it was refused.
    pub(crate) fixed: bool,
    /// Re-issued with the plain address after the fixed buffer was refused.
    pub(crate) refused_fixed: bool,
    pub(crate) retries: u32,
    /// Keeps the destination block in flight until this op is dropped, after its CQE.
    #[expect(
        dead_code,
        reason = "held for its Drop, which is the block's completion"
    )]
    pub(crate) token: InFlight,
    pub(crate) reply: Option<tokio::sync::oneshot::Sender<Result<(), NvmeError>>>,
}

impl NvmeOp {
    pub(super) fn status(&self, res: i32) -> NvmeError {
        if res > 0 {
            let (status, dnr) = NvmeStatus::from_word(res as u32);
            NvmeError::Status {
                op: NVME_READ,
                path: self.ns.path().to_path_buf(),
                slba: self.slba,
                nlb: self.nlb,
                status,
                dnr,
            }
        } else if res == -libc::ECANCELED {
            self.cancelled()
        } else {
            NvmeError::Os {
                op: NVME_READ,
                path: self.ns.path().to_path_buf(),
                slba: self.slba,
                nlb: self.nlb,
                source: std::io::Error::from_raw_os_error(-res),
            }
        }
    }

    pub(super) fn cancelled(&self) -> NvmeError {
        NvmeError::Cancelled {
            op: NVME_READ,
            path: self.ns.path().to_path_buf(),
            slba: self.slba,
            nlb: self.nlb,
        }
    }
}

/// An operation of either kind.
pub(crate) enum Op {
    Read(Box<ReadOp>),
    Nvme(Box<NvmeOp>),
}

impl Op {
    pub(super) fn op_id(&self) -> u64 {
        match self {
            Op::Read(o) => o.op_id,
            Op::Nvme(o) => o.op_id,
        }
    }

    /// Answers the caller that the op was cancelled before submission (its token drops with it).
    pub(super) fn cancel(self) {
        match self {
            Op::Read(mut op) => {
                let e = IoError::Cancelled {
                    path: op.file.path.clone(),
                    offset: op.req_offset,
                    len: op.req_len,
                };
                if let Some(r) = op.reply.take() {
                    drop(op);
                    let _ = r.send(Err(e));
                }
            }
            Op::Nvme(mut op) => {
                let e = op.cancelled();
                if let Some(r) = op.reply.take() {
                    drop(op);
                    let _ = r.send(Err(e));
                }
            }
        }
    }
}

pub(crate) enum Cmd {
    Read(Box<ReadOp>),
    Nvme(Box<NvmeOp>),
    Cancel {
        op_id: u64,
    },
    RegisterFile {
        slot: u32,
        fd: RawFd,
        reply: std::sync::mpsc::Sender<std::io::Result<()>>,
    },
    UnregisterFile {
        slot: u32,
    },
    RegisterBuffers {
        base: u32,
        iovecs: Arc<Vec<(usize, usize)>>,
        reply: std::sync::mpsc::Sender<std::io::Result<()>>,
    },
    UnregisterBuffers {
        base: u32,
        count: u32,
    },
    /// Panics the ring thread (tests of what its unwinding leaves behind).
    #[cfg(test)]
    Panic,
}

/// Why an op ended without success, before it is turned into its kind's error.
pub(super) enum Failure {
    Io(IoError),
    Nvme(NvmeError),
    Closed,
}
