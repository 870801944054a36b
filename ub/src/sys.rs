//! Raw OS calls for host memory: the only place in this crate's host path with `unsafe`.

use std::io;
use std::ptr::NonNull;

/// An anonymous, page-aligned, private mapping. Unmapped on drop.
#[derive(Debug)]
pub(crate) struct HostMapping {
    ptr: NonNull<u8>,
    len: usize,
    locked: bool,
}

// SAFETY: the mapping is plain memory owned by this value; access to its bytes is coordinated by the
// pool's slot states, not by this type.
unsafe impl Send for HostMapping {}
// SAFETY: as above; `&HostMapping` only exposes the pointer and length.
unsafe impl Sync for HostMapping {}

impl HostMapping {
    /// Maps `len` bytes of anonymous memory (not yet faulted in).
    pub(crate) fn new(len: usize) -> io::Result<Self> {
        // SAFETY: anonymous private mapping with no address hint; the kernel picks the placement and
        // we check the result against MAP_FAILED.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr =
            NonNull::new(p.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned null"))?;
        Ok(Self {
            ptr,
            len,
            locked: false,
        })
    }

    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Binds the mapping's pages to one NUMA node (MPOL_BIND), or prefers it (MPOL_PREFERRED:
    /// other nodes when it is full). Must run before the pages are touched.
    pub(crate) fn bind_numa(&self, node: u32, preferred: bool) -> io::Result<()> {
        const MPOL_PREFERRED: libc::c_long = 1;
        const MPOL_BIND: libc::c_long = 2;
        const MPOL_MF_STRICT: libc::c_ulong = 1;
        const MPOL_MF_MOVE: libc::c_ulong = 2;
        if node >= 1024 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "NUMA node >= 1024",
            ));
        }
        let mut mask = [0u64; 16];
        mask[(node / 64) as usize] |= 1u64 << (node % 64);
        // SAFETY: the range is our own mapping; the mask buffer outlives the call and maxnode is its
        // size in bits.
        let r = unsafe {
            libc::syscall(
                libc::SYS_mbind,
                self.ptr.as_ptr(),
                self.len,
                if preferred { MPOL_PREFERRED } else { MPOL_BIND },
                mask.as_ptr(),
                (mask.len() * 64) as libc::c_ulong,
                MPOL_MF_STRICT | MPOL_MF_MOVE,
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Locks (and thereby faults in) every page of the mapping.
    pub(crate) fn lock(&mut self) -> io::Result<()> {
        // SAFETY: the range is our own live mapping.
        let r = unsafe { libc::mlock(self.ptr.as_ptr().cast(), self.len) };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        self.locked = true;
        Ok(())
    }
}

impl Drop for HostMapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len describe the mapping made in `new`; nothing refers to it any more (the pool
        // drops its mapping only after every lease and in-flight token is gone). munmap also unlocks.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

/// The soft RLIMIT_MEMLOCK in bytes (`u64::MAX` when unlimited).
pub(crate) fn memlock_limit() -> u64 {
    soft_limit(libc::RLIMIT_MEMLOCK)
}

/// The soft RLIMIT_NOFILE (`u64::MAX` when unlimited).
pub(crate) fn open_files_limit() -> u64 {
    soft_limit(libc::RLIMIT_NOFILE)
}

/// Raises the soft RLIMIT_NOFILE to the hard limit, as Go's runtime does at start (no privilege is
/// needed up to the hard limit), and returns the soft limit then in force. A dataset of thousands of
/// shards holds two descriptors a shard, and io_uring refuses a registered-file table larger than
/// the soft limit (`EMFILE`): the common soft default of 1,024 capped a run at 512 shards.
pub(crate) fn raise_open_files_limit() -> u64 {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we own.
    let r = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) };
    if r == 0 && rl.rlim_cur != libc::RLIM_INFINITY && rl.rlim_cur < rl.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: rl.rlim_max,
            rlim_max: rl.rlim_max,
        };
        // SAFETY: setrlimit reads the struct we own; a soft limit up to the hard one is always
        // allowed, and a refusal leaves the limits as they were (the caller reads them back).
        let _ = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) };
    }
    open_files_limit()
}

/// Grows this process's descriptor table to hold descriptor `n` (a duplicate of `fd` made at the
/// lowest free number ≥ `n`, closed at once). The kernel doubles the table as descriptors are
/// opened, and in a process of several threads each doubling waits for an RCU grace period
/// (`expand_fdtable`): opening thousands of files one after another paid tens of milliseconds of
/// such waits. Grown once here, later opens find room.
pub(crate) fn grow_fd_table(fd: std::os::fd::BorrowedFd<'_>, n: libc::c_int) -> io::Result<()> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    // SAFETY: F_DUPFD_CLOEXEC duplicates the open descriptor `fd` (borrowed, so open for the call)
    // and returns a new descriptor this function owns, checked against -1.
    let d = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, n) };
    if d < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `d` is the new descriptor F_DUPFD_CLOEXEC returned; nothing else owns it, and the
    // OwnedFd closes it once, here.
    drop(unsafe { OwnedFd::from_raw_fd(d) });
    Ok(())
}

/// The soft limit of `resource` (`u64::MAX` when unlimited or unknown).
fn soft_limit(resource: libc::__rlimit_resource_t) -> u64 {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we own.
    let r = unsafe { libc::getrlimit(resource, &mut rl) };
    if r != 0 || rl.rlim_cur == libc::RLIM_INFINITY {
        u64::MAX
    } else {
        rl.rlim_cur
    }
}

/// A shared, read-only mapping of a file (the page cache itself). Unmapped on drop.
#[derive(Debug)]
pub(crate) struct FileMapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is read-only memory owned by this value; nothing here writes it, and readers go
// through `pread` on the file or device DMA by address, never references.
unsafe impl Send for FileMapping {}
// SAFETY: as above; `&FileMapping` only exposes the pointer and length.
unsafe impl Sync for FileMapping {}

impl FileMapping {
    /// Maps the first `len` bytes of the open file `fd` (`PROT_READ`, `MAP_SHARED`).
    pub(crate) fn new(fd: libc::c_int, len: usize) -> io::Result<Self> {
        // SAFETY: a new read-only shared mapping of an open descriptor, no address hint; the result is
        // checked against MAP_FAILED. The mapping keeps the file referenced after `fd` is closed.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr =
            NonNull::new(p.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned null"))?;
        Ok(Self { ptr, len })
    }

    /// Maps the open files `files` (descriptor, length) end to end in one contiguous range,
    /// `PROT_READ`, `MAP_SHARED`: file `i` at byte `i × stride`. `stride` is a multiple of the page
    /// size and every file but the last is exactly `stride` bytes, so the files' pages tile the range
    /// with no gap: the range is the first `(n − 1) × stride + last` bytes, page-rounded.
    pub(crate) fn new_chunks(files: &[(libc::c_int, usize)], stride: usize) -> io::Result<Self> {
        let page = crate::PAGE_SIZE;
        let invalid = |why: &str| io::Error::new(io::ErrorKind::InvalidInput, why.to_string());
        let Some(&(_, last)) = files.last() else {
            return Err(invalid("no files"));
        };
        if stride == 0 || !stride.is_multiple_of(page) || last == 0 || last > stride {
            return Err(invalid(
                "a stride that is not a page multiple, or a last file out of it",
            ));
        }
        if files[..files.len() - 1].iter().any(|&(_, l)| l != stride) {
            return Err(invalid("a file before the last is not one stride long"));
        }
        let len = (files.len() - 1)
            .checked_mul(stride)
            .and_then(|b| b.checked_add(last.div_ceil(page) * page))
            .ok_or_else(|| invalid("too large"))?;
        // SAFETY: reserves `len` bytes of address space (no access, no backing); nothing else is at
        // the address returned, which is checked against MAP_FAILED.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(base.cast::<u8>())
            .ok_or_else(|| io::Error::other("mmap returned null"))?;
        // From here the reservation is owned: dropped (unmapped whole) on any error below.
        let me = Self { ptr, len };
        for (i, &(fd, flen)) in files.iter().enumerate() {
            let at = me.ptr.as_ptr().wrapping_add(i * stride);
            // SAFETY: MAP_FIXED over pages `[at, at + flen)` of the reservation made above and owned
            // by `me` (i × stride + flen ≤ len by the checks), so no other mapping is replaced; the
            // file mapping keeps the file referenced after `fd` is closed.
            let p = unsafe {
                libc::mmap(
                    at.cast(),
                    flen,
                    libc::PROT_READ,
                    libc::MAP_SHARED | libc::MAP_FIXED,
                    fd,
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(me)
    }

    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for FileMapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `new`, once; every registration of it was dropped
        // before (MappedFile's field order and Drop).
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

/// The path as a C string (an interior NUL is `InvalidInput`).
fn cstr(p: &std::ffi::OsStr) -> io::Result<std::ffi::CString> {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(p.as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

/// `openat(dir, name, flags, mode)`: a file relative to an open directory.
pub(crate) fn openat(
    dir: &std::fs::File,
    name: &std::ffi::OsStr,
    flags: libc::c_int,
    mode: libc::mode_t,
) -> io::Result<std::fs::File> {
    use std::os::fd::{AsRawFd, FromRawFd};
    let c = cstr(name)?;
    // SAFETY: `dir` is an open descriptor and `c` a NUL-terminated string, both alive for the call;
    // the result is a new descriptor we own (or -1).
    let fd = unsafe { libc::openat(dir.as_raw_fd(), c.as_ptr(), flags | libc::O_CLOEXEC, mode) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by openat and is owned by nothing else.
    Ok(unsafe { std::fs::File::from_raw_fd(fd) })
}

/// Gives the open (possibly unnamed, `O_TMPFILE`) `file` the name `name` in `dir`:
/// `linkat("/proc/self/fd/N", AT_SYMLINK_FOLLOW)`. An existing name is `AlreadyExists`, never
/// replaced or followed.
pub(crate) fn link_fd(
    file: &std::fs::File,
    dir: &std::fs::File,
    name: &std::ffi::OsStr,
) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let from = cstr(std::ffi::OsStr::new(&format!(
        "/proc/self/fd/{}",
        file.as_raw_fd()
    )))?;
    let to = cstr(name)?;
    // SAFETY: two NUL-terminated strings and an open directory descriptor, alive for the call.
    let r = unsafe {
        libc::linkat(
            libc::AT_FDCWD,
            from.as_ptr(),
            dir.as_raw_fd(),
            to.as_ptr(),
            libc::AT_SYMLINK_FOLLOW,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `renameat(dir, from, dir, to)`: replaces `to` (a symlink there is replaced, not followed).
pub(crate) fn rename_in(
    dir: &std::fs::File,
    from: &std::ffi::OsStr,
    to: &std::ffi::OsStr,
) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let (f, t) = (cstr(from)?, cstr(to)?);
    // SAFETY: an open directory descriptor and two NUL-terminated strings, alive for the call.
    let r = unsafe { libc::renameat(dir.as_raw_fd(), f.as_ptr(), dir.as_raw_fd(), t.as_ptr()) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `unlinkat(dir, name, 0)`: removes a name (never what a symlink there points at).
pub(crate) fn unlink_in(dir: &std::fs::File, name: &std::ffi::OsStr) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let c = cstr(name)?;
    // SAFETY: an open directory descriptor and a NUL-terminated string, alive for the call.
    let r = unsafe { libc::unlinkat(dir.as_raw_fd(), c.as_ptr(), 0) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::os::fd::AsRawFd;

    /// The descriptor table is grown to hold the descriptor asked for (`FDSize` in
    /// /proc/self/status is its size), and the duplicate that grew it is closed.
    #[test]
    fn the_descriptor_table_grows_ahead() {
        let fd_size = || -> u64 {
            let st = std::fs::read_to_string("/proc/self/status").unwrap();
            let l = st.lines().find(|l| l.starts_with("FDSize:")).unwrap();
            l.split_whitespace().nth(1).unwrap().parse().unwrap()
        };
        let want = (crate::raise_open_files_limit().saturating_sub(1)).min(5000);
        if want < 1024 {
            let why = format!(
                "the descriptor limit {} leaves nothing to grow into",
                want + 1
            );
            ubdirect_testkit::skip("the_descriptor_table_grows_ahead", &why);
            return;
        }
        crate::reserve_descriptors(want).unwrap();
        assert!(
            fd_size() > want,
            "FDSize {} after asking for {want}",
            fd_size()
        );
        // The duplicate is closed: the next descriptor opened is a low one.
        let f = std::fs::File::open("/").unwrap();
        assert!((f.as_raw_fd() as u64) < want);
        // Beyond the soft limit: clamped, never an error.
        crate::reserve_descriptors(u64::MAX).unwrap();
    }

    /// The files' bytes tile the mapping at their strides: what a device reading the range by address
    /// sees is their concatenation.
    #[test]
    fn chunk_files_map_end_to_end() {
        let d = std::env::temp_dir().join(format!("ubdirect-sys-chunks-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        let stride = 64 << 10;
        let lens = [stride, stride, 10_000];
        let mut files = Vec::new();
        let mut want = Vec::new();
        for (i, &l) in lens.iter().enumerate() {
            let bytes: Vec<u8> = (0..l).map(|j| (i * 7 + j % 251) as u8).collect();
            let p = d.join(format!("c{i}"));
            std::fs::write(&p, &bytes).unwrap();
            want.extend_from_slice(&bytes);
            files.push(std::fs::File::open(&p).unwrap());
        }
        let fds: Vec<_> = files
            .iter()
            .zip(lens)
            .map(|(f, l)| (f.as_raw_fd(), l))
            .collect();
        let m = FileMapping::new_chunks(&fds, stride).unwrap();
        assert_eq!(
            m.len(),
            2 * stride + 12_288,
            "the last file's pages, rounded"
        );
        drop(files); // the mappings keep the files
        // SAFETY: the mapping is `m.len()` readable bytes owned by `m`, alive for the slice's use;
        // the files are not truncated meanwhile (this test owns them).
        let got = unsafe { std::slice::from_raw_parts(m.as_ptr(), want.len()) };
        assert!(got == want.as_slice());
        // A file before the last that is not one stride long, a stride not of pages: refused.
        let f = std::fs::File::open(d.join("c2")).unwrap();
        let short = [(f.as_raw_fd(), 10_000), (f.as_raw_fd(), 10_000)];
        assert!(FileMapping::new_chunks(&short, stride).is_err());
        assert!(FileMapping::new_chunks(&[(f.as_raw_fd(), 100)], 1000).is_err());
        assert!(FileMapping::new_chunks(&[], stride).is_err());
        let _ = std::fs::remove_dir_all(&d);
    }
}
