//! NVMe passthrough: identify, and reads/writes straight into UB leases, by ioctl and by io_uring
//! `URING_CMD` on the generic char device (`/dev/ngXnY`, SQE128/CQE32). NVMe status codes are decoded
//! into named errors.

use std::fmt;
use std::fs::OpenOptions;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

use io_uring::{IoUring, cqueue, opcode, squeue, types};
use ubdirect_ub::{Lease, UbError};

use crate::passthru_sys as sys;

/// A decoded NVMe completion status (Status Code Type, Status Code).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NvmeStatus {
    /// Generic 0x01.
    InvalidOpcode,
    /// Generic 0x02.
    InvalidField,
    /// Generic 0x04.
    DataTransferError,
    /// Generic 0x06.
    InternalError,
    /// Generic 0x0B.
    InvalidNamespace,
    /// Generic 0x80.
    LbaOutOfRange,
    /// Generic 0x81.
    CapacityExceeded,
    /// Generic 0x82.
    NamespaceNotReady,
    /// Media 0x80.
    WriteFault,
    /// Media 0x81.
    UnrecoveredReadError,
    /// Media 0x86.
    AccessDenied,
    /// Anything else.
    Other {
        /// Status code type.
        sct: u8,
        /// Status code.
        sc: u8,
    },
}

impl NvmeStatus {
    /// Decodes the status word an NVMe ioctl returns (positive return value).
    pub fn from_word(w: u32) -> (Self, bool) {
        let sc = (w & 0xff) as u8;
        let sct = ((w >> 8) & 0x7) as u8;
        let dnr = w & 0x4000 != 0;
        let s = match (sct, sc) {
            (0, 0x01) => Self::InvalidOpcode,
            (0, 0x02) => Self::InvalidField,
            (0, 0x04) => Self::DataTransferError,
            (0, 0x06) => Self::InternalError,
            (0, 0x0B) => Self::InvalidNamespace,
            (0, 0x80) => Self::LbaOutOfRange,
            (0, 0x81) => Self::CapacityExceeded,
            (0, 0x82) => Self::NamespaceNotReady,
            (2, 0x80) => Self::WriteFault,
            (2, 0x81) => Self::UnrecoveredReadError,
            (2, 0x86) => Self::AccessDenied,
            (sct, sc) => Self::Other { sct, sc },
        };
        (s, dnr)
    }
}

impl fmt::Display for NvmeStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Other { sct, sc } => write!(f, "status type {sct:#x} code {sc:#04x}"),
            s => write!(f, "{s:?}"),
        }
    }
}

/// Errors of the passthrough path.
#[derive(Debug, thiserror::Error)]
pub enum NvmeError {
    /// The device could not be opened.
    #[error("open {path}: {source}")]
    Open {
        /// Path.
        path: PathBuf,
        /// OS error.
        #[source]
        source: std::io::Error,
    },
    /// The descriptor is not an NVMe device (the ioctl was refused with ENOTTY or EINVAL).
    #[error("{path} is not an NVMe controller or namespace: {op} refused ({source})")]
    NotNvme {
        /// Path.
        path: PathBuf,
        /// The operation.
        op: &'static str,
        /// OS error.
        #[source]
        source: std::io::Error,
    },
    /// The OS refused the command.
    #[error("{op} on {path} (LBA {slba}+{nlb}): {source}")]
    Os {
        /// The operation.
        op: &'static str,
        /// Path.
        path: PathBuf,
        /// First LBA.
        slba: u64,
        /// Blocks.
        nlb: u32,
        /// OS error.
        #[source]
        source: std::io::Error,
    },
    /// The controller completed the command with an error status.
    #[error("{op} on {path} (LBA {slba}+{nlb}): NVMe {status}{}", if *dnr { " (do not retry)" } else { "" })]
    Status {
        /// The operation.
        op: &'static str,
        /// Path.
        path: PathBuf,
        /// First LBA.
        slba: u64,
        /// Blocks.
        nlb: u32,
        /// Decoded status.
        status: NvmeStatus,
        /// Do-not-retry bit.
        dnr: bool,
    },
    /// The request does not fit (LBA range, lease, maximum transfer).
    #[error("{path}: {reason}")]
    Range {
        /// Path.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The lease refused access (in flight, device memory).
    #[error(transparent)]
    Lease(#[from] UbError),
    /// The lease's pool is not registered with the engine (no fixed buffer to read into).
    #[error(
        "pool {pool:?} is not registered with this engine: build it with `.register_with(engine.registrar())`"
    )]
    NotRegistered {
        /// Pool name.
        pool: String,
    },
    /// No completion within the deadline. The command stays in flight (and its block with it) until
    /// the controller or the kernel's own timeout completes it.
    #[error("{op} on {path} (LBA {slba}+{nlb}): no completion after {waited:?}")]
    Timeout {
        /// The operation.
        op: &'static str,
        /// Path.
        path: PathBuf,
        /// First LBA.
        slba: u64,
        /// Blocks.
        nlb: u32,
        /// How long it waited.
        waited: Duration,
    },
    /// Cancelled before the controller saw it.
    #[error("{op} on {path} (LBA {slba}+{nlb}): cancelled")]
    Cancelled {
        /// The operation.
        op: &'static str,
        /// Path.
        path: PathBuf,
        /// First LBA.
        slba: u64,
        /// Blocks.
        nlb: u32,
    },
    /// The engine's passthrough rings could not start (kernel without SQE128/CQE32 or URING_CMD).
    #[error("passthrough rings for {path}: {source}")]
    Rings {
        /// The namespace.
        path: PathBuf,
        /// Why.
        #[source]
        source: crate::IoError,
    },
    /// The engine is shut down.
    #[error("engine closed")]
    Closed,
}

fn open_rw(path: &Path) -> Result<OwnedFd, NvmeError> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map(OwnedFd::from)
        .map_err(|source| NvmeError::Open {
            path: path.to_path_buf(),
            source,
        })
}

fn trimmed(b: &[u8]) -> String {
    String::from_utf8_lossy(b)
        .trim_end_matches([' ', '\0'])
        .to_string()
}

/// Identify Controller fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdCtrl {
    /// PCI vendor id.
    pub vid: u16,
    /// Serial number.
    pub serial: String,
    /// Model number.
    pub model: String,
    /// Firmware revision.
    pub firmware: String,
    /// Maximum data transfer size exponent (0 = no limit).
    pub mdts: u8,
    /// Namespaces.
    pub namespaces: u32,
}

impl IdCtrl {
    /// The maximum transfer in bytes, assuming the minimum memory page size (4 KiB).
    pub fn max_transfer(&self) -> Option<u64> {
        (self.mdts > 0).then(|| 4096u64 << self.mdts)
    }
}

/// Identify Namespace fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdNs {
    /// Size in logical blocks.
    pub nsze: u64,
    /// Capacity in logical blocks.
    pub ncap: u64,
    /// Logical block size in bytes.
    pub lba_size: u32,
}

fn admin(
    fd: &OwnedFd,
    path: &Path,
    cmd: &mut sys::nvme_passthru_cmd,
    op: &'static str,
) -> Result<(), NvmeError> {
    // SAFETY: `cmd` is a valid nvme_passthru_cmd whose addr/data_len describe a live buffer of the caller.
    let r = unsafe { sys::nvme_ioctl_admin_cmd(fd.as_raw_fd(), cmd) };
    status(r, path, op, 0, 0)
}

fn status(
    r: nix::Result<i32>,
    path: &Path,
    op: &'static str,
    slba: u64,
    nlb: u32,
) -> Result<(), NvmeError> {
    match r {
        Ok(0) => Ok(()),
        Ok(w) => {
            let (status, dnr) = NvmeStatus::from_word(w as u32);
            Err(NvmeError::Status {
                op,
                path: path.to_path_buf(),
                slba,
                nlb,
                status,
                dnr,
            })
        }
        Err(e @ (nix::Error::ENOTTY | nix::Error::EINVAL))
            if op.starts_with("identify") || op == "NVME_IOCTL_ID" =>
        {
            Err(NvmeError::NotNvme {
                path: path.to_path_buf(),
                op,
                source: e.into(),
            })
        }
        Err(nix::Error::ENOTTY) => Err(NvmeError::NotNvme {
            path: path.to_path_buf(),
            op,
            source: nix::Error::ENOTTY.into(),
        }),
        Err(e) => Err(NvmeError::Os {
            op,
            path: path.to_path_buf(),
            slba,
            nlb,
            source: e.into(),
        }),
    }
}

fn identify_buf(
    fd: &OwnedFd,
    path: &Path,
    nsid: u32,
    cns: u32,
    op: &'static str,
) -> Result<Vec<u8>, NvmeError> {
    let mut buf = vec![0u8; 4096];
    let mut cmd = sys::nvme_passthru_cmd {
        opcode: 0x06,
        nsid,
        addr: buf.as_mut_ptr() as u64,
        data_len: 4096,
        cdw10: cns,
        ..Default::default()
    };
    admin(fd, path, &mut cmd, op)?;
    Ok(buf)
}

/// An NVMe controller (`/dev/nvmeX`).
#[derive(Debug)]
pub struct Controller {
    fd: OwnedFd,
    path: PathBuf,
}

impl Controller {
    /// Opens a controller character device.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, NvmeError> {
        let path = path.as_ref().to_path_buf();
        Ok(Self {
            fd: open_rw(&path)?,
            path,
        })
    }

    /// Identify Controller (admin opcode 0x06, CNS 1).
    pub fn identify(&self) -> Result<IdCtrl, NvmeError> {
        let b = identify_buf(&self.fd, &self.path, 0, 1, "identify controller")?;
        Ok(IdCtrl {
            vid: u16::from_le_bytes([b[0], b[1]]),
            serial: trimmed(&b[4..24]),
            model: trimmed(&b[24..64]),
            firmware: trimmed(&b[64..72]),
            mdts: b[77],
            namespaces: u32::from_le_bytes([b[516], b[517], b[518], b[519]]),
        })
    }

    /// Identify Namespace `nsid` (CNS 0).
    pub fn identify_ns(&self, nsid: u32) -> Result<IdNs, NvmeError> {
        parse_id_ns(&identify_buf(
            &self.fd,
            &self.path,
            nsid,
            0,
            "identify namespace",
        )?)
    }
}

fn parse_id_ns(b: &[u8]) -> Result<IdNs, NvmeError> {
    let u64le = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap_or([0; 8]));
    let flbas = (b[26] & 0x0f) as usize;
    let lbaf = u32::from_le_bytes(
        b[128 + 4 * flbas..132 + 4 * flbas]
            .try_into()
            .unwrap_or([0; 4]),
    );
    let lbads = (lbaf >> 16) & 0xff;
    Ok(IdNs {
        nsze: u64le(0),
        ncap: u64le(8),
        lba_size: if (9..=16).contains(&lbads) {
            1 << lbads
        } else {
            512
        },
    })
}

/// The largest transfer assumed when nothing says otherwise.
pub const DEFAULT_MAX_TRANSFER: u32 = 128 << 10;
/// The largest transfer used even where the controller allows more.
pub const MAX_TRANSFER_CAP: u32 = 1 << 20;

/// The largest read to issue as one command: the controller's MDTS (in minimum-size 4 KiB pages), the
/// kernel's queue limits where sysfs shows them (`max_hw_sectors_kb`; `max_segments` pages, since
/// each page of a fixed buffer is one segment), at most [`MAX_TRANSFER_CAP`], rounded down to 4 KiB
/// and to the LBA size. Any unknown input leaves the others to decide ([`DEFAULT_MAX_TRANSFER`]
/// when all are unknown).
pub fn transfer_limit(
    mdts: Option<u8>,
    max_hw_sectors_kb: Option<u64>,
    max_segments: Option<u64>,
    lba_size: u32,
) -> u32 {
    let mut limits = Vec::new();
    match mdts {
        // 0: no limit reported.
        Some(0) => {}
        Some(m) => limits.push(4096u64.checked_shl(m as u32).unwrap_or(u64::MAX)),
        None => limits.push(DEFAULT_MAX_TRANSFER as u64),
    }
    if let Some(kb) = max_hw_sectors_kb.filter(|&k| k > 0) {
        limits.push(kb.saturating_mul(1024));
    }
    if let Some(segs) = max_segments.filter(|&s| s > 0) {
        limits.push(segs.saturating_mul(4096));
    }
    let m = limits.into_iter().fold(MAX_TRANSFER_CAP as u64, u64::min);
    let unit = (lba_size as u64).max(4096);
    ((m / unit) * unit).max(unit) as u32
}

fn sysfs_u64(p: impl AsRef<Path>) -> Option<u64> {
    std::fs::read_to_string(p).ok()?.trim().parse().ok()
}

/// An NVMe namespace: the block device (`/dev/nvmeXnY`) or the generic char device (`/dev/ngXnY`).
#[derive(Debug)]
pub struct Namespace {
    fd: OwnedFd,
    path: PathBuf,
    nsid: u32,
    id: IdNs,
    max_transfer: u32,
}

impl Namespace {
    /// Opens a namespace and identifies it. A descriptor that is not an NVMe namespace is
    /// [`NvmeError::NotNvme`].
    pub fn open(path: impl AsRef<Path>) -> Result<Self, NvmeError> {
        let path = path.as_ref().to_path_buf();
        let fd = open_rw(&path)?;
        // SAFETY: NVME_IOCTL_ID takes no argument and only returns the namespace id.
        let r = unsafe { sys::nvme_ioctl_id(fd.as_raw_fd()) };
        let nsid = match r {
            Ok(n) if n > 0 => n as u32,
            Ok(n) => {
                return Err(NvmeError::Range {
                    path,
                    reason: format!("NVME_IOCTL_ID returned {n}"),
                });
            }
            Err(e) => {
                return Err(NvmeError::NotNvme {
                    path,
                    op: "NVME_IOCTL_ID",
                    source: e.into(),
                });
            }
        };
        let id = parse_id_ns(&identify_buf(&fd, &path, nsid, 0, "identify namespace")?)?;
        // Identify Controller through the namespace (the driver passes admin commands to its
        // controller); a refusal only leaves the default transfer size.
        let mdts = identify_buf(&fd, &path, 0, 1, "identify controller")
            .ok()
            .map(|b| b[77]);
        // /dev/ngXnY and /dev/nvmeXnY share /sys/block/nvmeXnY.
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default();
        let block = match name.strip_prefix("ng") {
            Some(rest) => format!("nvme{rest}"),
            None => name,
        };
        let q = Path::new("/sys/block").join(block).join("queue");
        let max_transfer = transfer_limit(
            mdts,
            sysfs_u64(q.join("max_hw_sectors_kb")),
            sysfs_u64(q.join("max_segments")),
            id.lba_size,
        );
        Ok(Self {
            fd,
            path,
            nsid,
            id,
            max_transfer,
        })
    }

    /// The largest read issued as one command, in bytes (see [`transfer_limit`]).
    pub fn max_transfer(&self) -> u32 {
        self.max_transfer
    }

    /// The descriptor URING_CMD commands go to.
    pub(crate) fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Checks an LBA range against the namespace (and the per-command limit).
    pub(crate) fn check_lbas(&self, slba: u64, nlb: u32) -> Result<usize, NvmeError> {
        if nlb == 0
            || nlb > 65536
            || slba
                .checked_add(nlb as u64)
                .is_none_or(|e| e > self.id.nsze)
        {
            return Err(NvmeError::Range {
                path: self.path.clone(),
                reason: format!(
                    "LBA {slba}+{nlb} outside the namespace ({} blocks, at most 65536 per command)",
                    self.id.nsze
                ),
            });
        }
        Ok(nlb as usize * self.id.lba_size as usize)
    }

    /// The read command (opcode 0x02) of `nlb` blocks at `slba` into `len` bytes at `addr`.
    pub(crate) fn read_cmd(&self, slba: u64, nlb: u32, addr: u64, len: u32) -> sys::nvme_uring_cmd {
        sys::nvme_uring_cmd {
            opcode: 0x02,
            nsid: self.nsid,
            addr,
            data_len: len,
            cdw10: slba as u32,
            cdw11: (slba >> 32) as u32,
            cdw12: nlb - 1,
            ..Default::default()
        }
    }

    /// Namespace id.
    pub fn nsid(&self) -> u32 {
        self.nsid
    }

    /// Identify Namespace data.
    pub fn id(&self) -> &IdNs {
        &self.id
    }

    /// The path it was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn check(&self, slba: u64, nlb: u32, lease: &Lease, off: usize) -> Result<usize, NvmeError> {
        let len = self.check_lbas(slba, nlb)?;
        lease.check_range(off, len)?;
        Ok(len)
    }

    fn io(
        &self,
        opcode: u8,
        slba: u64,
        nlb: u32,
        lease: &mut Lease,
        off: usize,
        op: &'static str,
    ) -> Result<(), NvmeError> {
        let len = self.check(slba, nlb, lease, off)?;
        let buf = &mut lease.as_mut_slice()?[off..off + len];
        let mut cmd = sys::nvme_passthru_cmd {
            opcode,
            nsid: self.nsid,
            addr: buf.as_mut_ptr() as u64,
            data_len: len as u32,
            cdw10: slba as u32,
            cdw11: (slba >> 32) as u32,
            cdw12: nlb - 1,
            ..Default::default()
        };
        // SAFETY: addr/data_len describe `buf`, a live, exclusively borrowed slice of the lease for the
        // whole (synchronous) ioctl.
        let r = unsafe { sys::nvme_ioctl_io_cmd(self.fd.as_raw_fd(), &mut cmd) };
        status(r, &self.path, op, slba, nlb)
    }

    /// Reads `nlb` blocks at `slba` into `lease[off..]` with `NVME_IOCTL_IO_CMD` (opcode 0x02).
    pub fn read(
        &self,
        slba: u64,
        nlb: u32,
        lease: &mut Lease,
        off: usize,
    ) -> Result<(), NvmeError> {
        self.io(0x02, slba, nlb, lease, off, "NVMe read (ioctl)")
    }

    /// Writes `nlb` blocks at `slba` from `lease[off..]` (opcode 0x01). For tests and tools.
    pub fn write(
        &self,
        slba: u64,
        nlb: u32,
        lease: &mut Lease,
        off: usize,
    ) -> Result<(), NvmeError> {
        self.io(0x01, slba, nlb, lease, off, "NVMe write (ioctl)")
    }

    /// A queue of `URING_CMD` passthrough commands on this namespace (generic char device).
    pub fn uring(&self, depth: u32) -> Result<UringCmdQueue<'_>, NvmeError> {
        let ring = IoUring::<squeue::Entry128, cqueue::Entry32>::builder()
            .build(depth.max(1).next_power_of_two())
            .map_err(|source| NvmeError::Os {
                op: "io_uring_setup(SQE128|CQE32)",
                path: self.path.clone(),
                slba: 0,
                nlb: 0,
                source,
            })?;
        Ok(UringCmdQueue {
            ns: self,
            ring,
            depth: depth.max(1) as usize,
        })
    }
}

/// One read of a [`UringCmdQueue::read_many`] batch.
#[derive(Debug)]
pub struct CmdRead<'a> {
    /// First LBA.
    pub slba: u64,
    /// Blocks.
    pub nlb: u32,
    /// Destination lease.
    pub lease: &'a mut Lease,
    /// Offset in the lease.
    pub off: usize,
}

/// NVMe reads through io_uring `IORING_OP_URING_CMD` (`NVME_URING_CMD_IO`), up to `depth` in flight.
pub struct UringCmdQueue<'a> {
    ns: &'a Namespace,
    ring: IoUring<squeue::Entry128, cqueue::Entry32>,
    depth: usize,
}

impl fmt::Debug for UringCmdQueue<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UringCmdQueue")
            .field("ns", &self.ns.path)
            .field("depth", &self.depth)
            .finish()
    }
}

impl UringCmdQueue<'_> {
    /// Runs every read, `depth` at a time, and waits for all. The leases are exclusively borrowed for
    /// the duration, so nothing else can touch their bytes while the controller writes them.
    pub fn read_many(&mut self, reads: &mut [CmdRead<'_>]) -> Result<(), NvmeError> {
        let ns = self.ns;
        let mut bufs = Vec::with_capacity(reads.len());
        for r in reads.iter_mut() {
            let len = ns.check(r.slba, r.nlb, r.lease, r.off)?;
            let b = &mut r.lease.as_mut_slice()?[r.off..r.off + len];
            bufs.push((b.as_mut_ptr() as u64, len));
        }
        let mut next = 0;
        let mut inflight = 0;
        let mut first_err = None;
        while next < reads.len() || inflight > 0 {
            while inflight < self.depth && next < reads.len() {
                let r = &reads[next];
                let payload = ns
                    .read_cmd(r.slba, r.nlb, bufs[next].0, bufs[next].1 as u32)
                    .to_cmd_bytes();
                let sqe =
                    opcode::UringCmd80::new(types::Fd(ns.fd.as_raw_fd()), sys::NVME_URING_CMD_IO)
                        .cmd(payload)
                        .build()
                        .user_data(next as u64);
                // SAFETY: the destination buffers are borrowed from `reads` (exclusive) until this
                // function returns, which is after every completion has been reaped.
                unsafe { self.ring.submission().push(&sqe) }.map_err(|_| NvmeError::Range {
                    path: ns.path.clone(),
                    reason: "submission queue full".into(),
                })?;
                next += 1;
                inflight += 1;
            }
            self.ring
                .submit_and_wait(1)
                .map_err(|source| NvmeError::Os {
                    op: "io_uring_enter",
                    path: ns.path.clone(),
                    slba: 0,
                    nlb: 0,
                    source,
                })?;
            let done: Vec<(u64, i32)> = self
                .ring
                .completion()
                .map(|c| (c.user_data(), c.result()))
                .collect();
            for (i, res) in done {
                inflight -= 1;
                let r = &reads[i as usize];
                let e = match res {
                    0 => continue,
                    res if res > 0 => {
                        let (status, dnr) = NvmeStatus::from_word(res as u32);
                        NvmeError::Status {
                            op: "NVMe read (uring_cmd)",
                            path: ns.path.clone(),
                            slba: r.slba,
                            nlb: r.nlb,
                            status,
                            dnr,
                        }
                    }
                    res => NvmeError::Os {
                        op: "NVMe read (uring_cmd)",
                        path: ns.path.clone(),
                        slba: r.slba,
                        nlb: r.nlb,
                        source: std::io::Error::from_raw_os_error(-res),
                    },
                };
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_words_decode_to_named_errors() {
        assert_eq!(
            NvmeStatus::from_word(0x0080),
            (NvmeStatus::LbaOutOfRange, false)
        );
        assert_eq!(
            NvmeStatus::from_word(0x4002),
            (NvmeStatus::InvalidField, true)
        );
        assert_eq!(
            NvmeStatus::from_word(0x0281),
            (NvmeStatus::UnrecoveredReadError, false)
        );
        assert_eq!(
            NvmeStatus::from_word(0x0199),
            (NvmeStatus::Other { sct: 1, sc: 0x99 }, false)
        );
        assert_eq!(NvmeStatus::LbaOutOfRange.to_string(), "LbaOutOfRange");
    }

    #[test]
    fn transfer_limit_takes_the_smallest_known_limit() {
        // QEMU's controller: MDTS 7 = 512 KiB; the kernel's queue says 512 KiB and 127 segments.
        assert_eq!(
            transfer_limit(Some(7), Some(512), Some(127), 512),
            127 * 4096
        );
        assert_eq!(transfer_limit(Some(5), None, None, 512), 128 << 10);
        // MDTS 0 is "no limit": the cap applies.
        assert_eq!(transfer_limit(Some(0), None, None, 4096), MAX_TRANSFER_CAP);
        // Unknown controller: the default.
        assert_eq!(transfer_limit(None, None, None, 512), DEFAULT_MAX_TRANSFER);
        // Never below one LBA, always a multiple of it and of 4 KiB.
        assert_eq!(transfer_limit(Some(1), Some(1), Some(1), 16384), 16384);
        assert_eq!(
            transfer_limit(Some(30), Some(1000), None, 4096),
            1000 * 1024 / 4096 * 4096
        );
    }

    #[test]
    fn passthrough_on_a_non_nvme_descriptor_is_a_clear_error() {
        let f = tempfile_path();
        std::fs::write(&f, [0u8; 4096]).unwrap_or_default();
        let e = Namespace::open(&f).unwrap_err();
        assert!(matches!(e, NvmeError::NotNvme { .. }), "{e}");
        assert!(e.to_string().contains("is not an NVMe"), "{e}");
        let c = Controller::open(&f).map(|c| c.identify());
        assert!(matches!(c, Ok(Err(NvmeError::NotNvme { .. }))), "{c:?}");
        let _ = std::fs::remove_file(f);
        let e = Namespace::open("/dev/null").unwrap_err();
        assert!(matches!(e, NvmeError::NotNvme { .. }), "{e}");
    }

    fn tempfile_path() -> PathBuf {
        std::env::temp_dir().join(format!("ubdirect-notnvme-{}", std::process::id()))
    }
}
