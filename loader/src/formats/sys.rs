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
//!
//! Because a writer outside the process may change the bytes at any time, no `&[u8]` over the
//! mapping is ever handed out (a shared reference promises bytes that do not change while it
//! lives; the compiler may rely on it). [`ReadOnlyMap::read`] copies bytes out with atomic loads
//! instead — the rule decisions.md sets for SMC's shared pages too: a racing writer can only change
//! which value is read, never make the read itself undefined.

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

    /// Bytes mapped.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Copies `dst.len()` bytes at `at` into `dst`; `false` (and `dst` untouched) when the range is
    /// not inside the mapping. Each byte is read by an atomic load (aligned 8-byte words in the
    /// middle, single bytes at the ends), so another process rewriting the file meanwhile changes
    /// what is read, never whether the read is defined.
    pub(crate) fn read(&self, at: usize, dst: &mut [u8]) -> bool {
        use std::sync::atomic::{AtomicU8, AtomicU64, Ordering::Relaxed};
        let Some(end) = at.checked_add(dst.len()).filter(|e| *e <= self.len) else {
            return false;
        };
        let base = self.ptr.as_ptr();
        let mut i = at;
        let mut o = 0;
        while i < end {
            let word = i.is_multiple_of(8) && end - i >= 8;
            if word {
                // SAFETY: `i..i + 8` lies inside the live mapping (`end <= len`) and is 8-byte
                // aligned (the mapping is page aligned and `i` a multiple of 8). An atomic load of up to 8
                // bytes is a plain load on the platforms Rust supports, so it is valid on PROT_READ
                // memory; nothing in this process writes the mapping, and writers outside it race
                // with an atomic access only.
                let v = unsafe { AtomicU64::from_ptr(base.add(i).cast::<u64>()) }.load(Relaxed);
                dst[o..o + 8].copy_from_slice(&v.to_ne_bytes());
                i += 8;
                o += 8;
            } else {
                // SAFETY: byte `i` lies inside the live mapping; see the word case above.
                dst[o] = unsafe { AtomicU8::from_ptr(base.add(i)) }.load(Relaxed);
                i += 1;
                o += 1;
            }
        }
        true
    }

    /// The `N ≤ 8` bytes at `at`, as [`Self::read`] reads them but by at most two aligned 8-byte
    /// atomic loads (the words covering them, when both lie inside the mapping): the per-element
    /// path of index arrays, which sit at any alignment. `None` past the end.
    #[inline]
    pub(crate) fn small<const N: usize>(&self, at: usize) -> Option<[u8; N]> {
        use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
        let end = at.checked_add(N).filter(|e| *e <= self.len && N <= 8)?;
        let w0 = at / 8 * 8;
        let words = if end <= w0 + 8 { 1 } else { 2 };
        if w0 + 8 * words > self.len {
            let mut b = [0u8; N];
            return self.read(at, &mut b).then_some(b);
        }
        let base = self.ptr.as_ptr();
        let mut buf = [0u8; 16];
        for k in 0..words {
            // SAFETY: word `w0 + 8k .. w0 + 8k + 8` lies inside the live mapping (checked above)
            // and is 8-byte aligned (the mapping is page aligned); as in `read`, an atomic load of
            // PROT_READ memory that only writers outside this process may change.
            let v =
                unsafe { AtomicU64::from_ptr(base.add(w0 + 8 * k).cast::<u64>()) }.load(Relaxed);
            buf[8 * k..8 * k + 8].copy_from_slice(&v.to_ne_bytes());
        }
        let mut b = [0u8; N];
        b.copy_from_slice(&buf[at - w0..at - w0 + N]);
        Some(b)
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
        // page-table entries; later reads fault the same file bytes back in (no reference into the
        // mapping exists to be invalidated: `read` copies out).
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

    /// Advises random access (`MADV_RANDOM`): a fault maps the one page read, not its neighbours
    /// (the kernel's fault-around maps up to 16), so reading a few entries of a large index at
    /// random leaves a few pages resident, not the file.
    pub(crate) fn advise_random(&self) {
        if self.len == 0 {
            return;
        }
        // SAFETY: the whole live mapping, page aligned; MADV_RANDOM changes only how later faults
        // are served, never what a read returns.
        let r = unsafe { libc::madvise(self.ptr.as_ptr().cast(), self.len, libc::MADV_RANDOM) };
        // Advice only: a failure leaves fault-around on, which is correct, just larger.
        let _ = r;
    }
}

impl Drop for ReadOnlyMap {
    fn drop(&mut self) {
        if self.len == 0 {
            return;
        }
        // SAFETY: unmaps exactly the mapping `map` created; `&mut self` means no `read` is running
        // (no reference into the mapping is ever handed out). munmap of a valid mapping cannot fail in a way that leaves it half-mapped.
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

#[cfg(test)]
mod tests {
    use super::ReadOnlyMap;

    /// `read` copies what the file holds for every start and length around the word boundaries,
    /// and refuses (leaving `dst` alone) a range that does not fit.
    #[test]
    fn read_copies_any_range_and_refuses_past_the_end() {
        let dir = std::env::temp_dir().join(format!("ubdirect-romap-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let p = dir.join("f.bin");
        let data: Vec<u8> = (0..5000u32).map(|i| (i * 7 + 3) as u8).collect();
        std::fs::write(&p, &data).expect("write");
        let f = std::fs::File::open(&p).expect("open");
        let m = ReadOnlyMap::map(&f, data.len() as u64).expect("map");
        assert_eq!(m.len(), data.len());
        for at in [0usize, 1, 7, 8, 9, 15, 4093, 4096, 4990] {
            for n in [0usize, 1, 3, 8, 9, 17, 64, 4100] {
                let mut dst = vec![0xAAu8; n];
                let fits = at + n <= data.len();
                assert_eq!(m.read(at, &mut dst), fits, "{at}+{n}");
                if fits {
                    assert_eq!(dst, data[at..at + n], "{at}+{n}");
                } else {
                    assert!(dst.iter().all(|b| *b == 0xAA), "{at}+{n} touched dst");
                }
            }
        }
        // Small reads at every alignment, up to the last bytes: the bytes `read` gives.
        for at in (0..data.len() + 2).filter(|a| *a < 64 || *a + 64 > data.len()) {
            let fits = |n: usize| at + n <= data.len();
            assert_eq!(
                m.small::<4>(at).map(|b| b.to_vec()),
                fits(4).then(|| data[at..at + 4].to_vec()),
                "{at}"
            );
            assert_eq!(
                m.small::<8>(at).map(|b| b.to_vec()),
                fits(8).then(|| data[at..at + 8].to_vec()),
                "{at}"
            );
        }
        assert_eq!(m.small::<4>(usize::MAX - 1), None);
        let mut one = [0u8; 1];
        assert!(!m.read(usize::MAX, &mut one));
        let empty = ReadOnlyMap::map(&f, 0).expect("empty map");
        assert!(empty.read(0, &mut []));
        assert!(!empty.read(0, &mut one));
        let _ = std::fs::remove_dir_all(dir);
    }
}
