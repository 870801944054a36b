//! Raw OS calls the engine needs beyond io_uring: statx (direct-I/O alignment), fstatfs, eventfd.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// Direct-I/O alignment as reported by `statx(STATX_DIOALIGN)` (Linux ≥ 6.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DioAlign {
    /// The file system supports direct I/O with these alignments.
    Supported { mem: u32, offset: u32 },
    /// The file system says it has no direct I/O for this file.
    Unsupported,
    /// The kernel does not report it (older than 6.1).
    Unknown,
}

pub(crate) fn dio_align(path: &Path) -> io::Result<DioAlign> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))?;
    // SAFETY: statx is plain data; all-zero is a valid value.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a valid NUL-terminated path and `stx` a writable statx buffer.
    let r = unsafe {
        libc::statx(
            libc::AT_FDCWD,
            c.as_ptr(),
            0,
            libc::STATX_DIOALIGN,
            &mut stx,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(if stx.stx_mask & libc::STATX_DIOALIGN == 0 {
        DioAlign::Unknown
    } else if stx.stx_dio_mem_align == 0 || stx.stx_dio_offset_align == 0 {
        DioAlign::Unsupported
    } else {
        DioAlign::Supported {
            mem: stx.stx_dio_mem_align,
            offset: stx.stx_dio_offset_align,
        }
    })
}

/// The file system magic of an open file (`statfs.f_type`).
pub(crate) fn fs_magic(fd: &OwnedFd) -> io::Result<i64> {
    // SAFETY: statfs is plain data; all-zero is a valid value.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: fd is open; `st` is a writable buffer.
    let r = unsafe { libc::fstatfs(fd.as_raw_fd(), &mut st) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st.f_type as i64)
}

pub(crate) const TMPFS_MAGIC: i64 = 0x0102_1994;

/// A (blocking: io_uring would answer EAGAIN on a non-blocking one) eventfd that wakes a ring thread.
pub(crate) fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: creates a new descriptor; checked below.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Adds one to an eventfd's counter.
pub(crate) fn eventfd_signal(fd: &OwnedFd) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a live u64 to an eventfd we own; failure (counter overflow) only
    // means a wakeup is already pending.
    unsafe {
        libc::write(fd.as_raw_fd(), (&one as *const u64).cast(), 8);
    }
}

/// `struct cachestat_range` of `cachestat(2)`.
#[repr(C)]
struct CachestatRange {
    off: u64,
    len: u64,
}

/// `struct cachestat` of `cachestat(2)`.
#[repr(C)]
#[derive(Default)]
struct Cachestat {
    nr_cache: u64,
    nr_dirty: u64,
    nr_writeback: u64,
    nr_evicted: u64,
    nr_recently_evicted: u64,
}

/// `cachestat(2)` (Linux ≥ 6.5, syscall 451 on x86-64 and arm64): whether every page of
/// `off..off + len` of the file is in the page cache. `ENOSYS` on older kernels.
pub(crate) fn all_cached(fd: &impl AsRawFd, off: u64, len: u64) -> io::Result<bool> {
    const SYS_CACHESTAT: libc::c_long = 451;
    let page = 4096u64;
    let first = off / page * page;
    // An empty range means "to the end of the file" to cachestat; an overflowing one is the
    // caller's range error to report.
    let Some(end) = off
        .checked_add(len)
        .filter(|_| len > 0)
        .and_then(|e| e.div_ceil(page).checked_mul(page))
    else {
        return Ok(false);
    };
    let range = CachestatRange {
        off: first,
        len: end - first,
    };
    let mut cs = Cachestat::default();
    // SAFETY: cachestat reads `range` and writes `cs`, both live, correctly laid out (#[repr(C)],
    // matching include/uapi/linux/mman.h) and exclusively borrowed for the call; flags must be 0.
    let r = unsafe {
        libc::syscall(
            SYS_CACHESTAT,
            fd.as_raw_fd(),
            &range as *const CachestatRange,
            &mut cs as *mut Cachestat,
            0u32,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cs.nr_cache >= (end - first) / page)
}

/// `posix_fadvise(POSIX_FADV_WILLNEED)` over the whole file: the kernel starts reading its head into
/// the page cache (at most max(`read_ahead_kb`, `max_sectors_kb`) per call) and returns.
pub(crate) fn will_need(fd: &impl AsRawFd) -> io::Result<()> {
    // SAFETY: posix_fadvise on an open descriptor; no memory is passed.
    let r = unsafe { libc::posix_fadvise(fd.as_raw_fd(), 0, 0, libc::POSIX_FADV_WILLNEED) };
    if r != 0 {
        return Err(io::Error::from_raw_os_error(r));
    }
    Ok(())
}

/// Reads `len` bytes at `offset` of `fd` into `dst` with `pread`, retrying short reads and `EINTR`.
/// Returns the bytes read (fewer than `len` only at end of file).
///
/// # Safety
/// `dst .. dst + len` must be valid for writes for the whole call and not be read or written by
/// anything else meanwhile.
pub(crate) unsafe fn pread_full(
    fd: std::os::fd::RawFd,
    dst: *mut u8,
    len: usize,
    offset: u64,
) -> io::Result<usize> {
    let mut done = 0usize;
    while done < len {
        let off = offset
            .checked_add(done as u64)
            .and_then(|o| libc::off_t::try_from(o).ok())
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "offset overflows off_t"))?;
        // SAFETY: the caller guarantees `dst .. dst + len` is writable and ours; `done < len`.
        let r = unsafe { libc::pread(fd, dst.add(done).cast(), len - done, off) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if r == 0 {
            break;
        }
        done += r as usize;
    }
    Ok(done)
}
