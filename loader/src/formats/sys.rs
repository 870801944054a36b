//! Raw OS calls of the formats: a read-only memory mapping of an index file (Megatron's `.idx`).
//!
//! # What a mapping can and cannot promise
//! The mapping is `PROT_READ`, `MAP_PRIVATE`, of a regular file whose size was read with `fstat` just
//! before. Two things outside this process can still change what it shows, and neither can be
//! prevented by any mapping (numpy's `memmap`, which Megatron uses for the same file, and the
//! `memmap2` crate have the same contract):
//! - **the file is truncated** while mapped: touching a page past the new end raises `SIGBUS` and the
//!   process dies (no wrong data is ever read);
//! - **the file is rewritten in place** while mapped: later reads see the new bytes.
//!
//! Datasets are written once and replaced by rename (Megatron's builder writes a new file); a rename
//! or an unlink leaves this mapping on the old inode, which stays intact. Everything read from the
//! mapping is a plain integer that the format layer bounds-checks where it is used as a length or an
//! offset, so changed bytes give wrong or refused samples, never out-of-bounds memory access in this
//! process.

use std::os::fd::AsRawFd;
use std::ptr::NonNull;

/// A read-only mapping of a whole file.
pub(crate) struct ReadOnlyMap {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is read-only and owned by this value (unmapped once, in Drop); sharing `&[u8]`
// views of it across threads is what `Vec<u8>` allows too.
unsafe impl Send for ReadOnlyMap {}
// SAFETY: as above: no interior mutability, every access is a read.
unsafe impl Sync for ReadOnlyMap {}

impl std::fmt::Debug for ReadOnlyMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadOnlyMap")
            .field("len", &self.len)
            .finish()
    }
}

impl ReadOnlyMap {
    /// Maps the first `len` bytes of `file` (its size from `fstat`; 0 maps nothing).
    pub(crate) fn map(file: &std::fs::File, len: u64) -> std::io::Result<Self> {
        let len = usize::try_from(len).map_err(|_| std::io::Error::other("file too large"))?;
        if len == 0 {
            return Ok(Self {
                ptr: NonNull::dangling(),
                len: 0,
            });
        }
        // SAFETY: a fresh mapping (addr = NULL) of a file descriptor we hold open for the call; it
        // aliases no Rust memory. The kernel keeps its own reference to the file afterwards.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_PRIVATE,
                file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let ptr =
            NonNull::new(p.cast::<u8>()).ok_or_else(|| std::io::Error::other("mmap gave NULL"))?;
        Ok(Self { ptr, len })
    }

    /// The mapped bytes.
    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr..ptr + len` is a live PROT_READ mapping owned by `self` (or a dangling,
        // aligned pointer with len 0), valid for the lifetime of `&self`; nothing in this process
        // writes to it (see the module notes for writers outside it).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// Drops the pages wholly inside `range` from this process's page tables (they stay in the page
    /// cache and come back on the next access): a scan that reads the file once does not leave it
    /// all resident.
    pub(crate) fn release(&self, range: std::ops::Range<usize>) {
        const PAGE: usize = 4096;
        let start = range.start.div_ceil(PAGE) * PAGE;
        let end = (range.end.min(self.len) / PAGE) * PAGE;
        if end <= start {
            return;
        }
        // SAFETY: `start..end` lies inside our mapping and is page-aligned (the mapping itself is).
        // MADV_DONTNEED on a read-only private file mapping with no private copies only removes
        // page-table entries; later reads fault the same file bytes back in, so no `&[u8]` handed
        // out by `bytes` sees different contents because of it.
        let r = unsafe {
            libc::madvise(
                self.ptr.as_ptr().add(start).cast(),
                end - start,
                libc::MADV_DONTNEED,
            )
        };
        // Advice only: a failure leaves the pages resident, which is correct, just larger.
        let _ = r;
    }
}

impl Drop for ReadOnlyMap {
    fn drop(&mut self) {
        if self.len == 0 {
            return;
        }
        // SAFETY: unmaps exactly the mapping `map` created; `&mut self` means no `bytes` borrow is
        // alive. munmap of a valid mapping cannot fail in a way that leaves it half-mapped.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

/// Bytes an unprivileged writer may still write on the file system holding `dir` (`statvfs`:
/// available blocks × fragment size).
pub(crate) fn free_bytes(dir: &std::path::Path) -> std::io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: a NUL-terminated path and a pointer to writable memory of statvfs's size, both alive
    // for the call; statvfs fills the struct when it returns 0.
    let r = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: statvfs returned 0, so it initialized the struct.
    let st = unsafe { st.assume_init() };
    Ok(st.f_bavail.saturating_mul(st.f_frsize))
}
