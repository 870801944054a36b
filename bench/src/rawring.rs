//! Baselines with none of ubdirect's machinery: a minimal io_uring reader (the "raw io_uring
//! ceiling"), the same with registration per I/O, and a naive pread loop. This module is an FFI edge
//! (SQEs point at raw memory).

use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

use io_uring::{IoUring, opcode, types};

/// Page-aligned anonymous memory; unmapped on drop.
pub struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
}

impl AlignedBuf {
    pub fn new(len: usize) -> Result<Self, String> {
        // SAFETY: anonymous private mapping; the result is checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(format!("mmap {len}: {}", std::io::Error::last_os_error()));
        }
        Ok(Self { ptr: p.cast(), len })
    }
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }
    pub fn slice_mut(&mut self) -> &mut [u8] {
        // SAFETY: the mapping is ours, live and `len` bytes long; `&mut self` makes this unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: ptr/len are the mapping made in `new`, no longer used.
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

fn open(path: &Path, direct: bool) -> Result<std::fs::File, String> {
    let mut o = OpenOptions::new();
    o.read(true);
    if direct {
        o.custom_flags(libc::O_DIRECT);
    }
    o.open(path).map_err(|e| format!("{}: {e}", path.display()))
}

/// A minimal io_uring reader: one ring, `qd` buffers registered once, the files registered once.
/// Built outside the measured time.
pub struct RawReader {
    ring: IoUring,
    iov: Vec<libc::iovec>,
    _files: Vec<std::fs::File>,
    size: usize,
    qd: usize,
    _buf: AlignedBuf,
}

impl RawReader {
    pub fn new(paths: &[&Path], size: usize, qd: usize, direct: bool) -> Result<Self, String> {
        let files = paths
            .iter()
            .map(|p| open(p, direct))
            .collect::<Result<Vec<_>, _>>()?;
        let qd = qd.max(1);
        let ring = IoUring::new((qd as u32).next_power_of_two()).map_err(|e| e.to_string())?;
        let buf = AlignedBuf::new(qd * size)?;
        let iov: Vec<libc::iovec> = (0..qd)
            .map(|i| libc::iovec {
                // SAFETY: inside the mapping.
                iov_base: unsafe { buf.ptr().add(i * size) }.cast(),
                iov_len: size,
            })
            .collect();
        // SAFETY: the iovecs point into `buf`, which lives as long as the ring (same struct; the ring
        // field is dropped first).
        unsafe { ring.submitter().register_buffers(&iov) }
            .map_err(|e| format!("register_buffers: {e}"))?;
        let fds: Vec<i32> = files.iter().map(|f| f.as_raw_fd()).collect();
        ring.submitter()
            .register_files(&fds)
            .map_err(|e| e.to_string())?;
        Ok(Self {
            ring,
            iov,
            _files: files,
            size,
            qd,
            _buf: buf,
        })
    }

    /// Reads `size` bytes at each (file index, offset), `qd` in flight. Returns bytes read.
    pub fn run(&mut self, reads: &[(u32, u64)]) -> Result<u64, String> {
        let (size, qd) = (self.size, self.qd);
        let mut next = 0usize;
        let mut inflight = 0usize;
        let mut free: Vec<usize> = (0..qd).collect();
        let mut total = 0u64;
        while next < reads.len() || inflight > 0 {
            while inflight < qd && next < reads.len() {
                let slot = free.pop().ok_or("no free slot")?;
                let (fi, off) = reads[next];
                let sqe = opcode::ReadFixed::new(
                    types::Fixed(fi),
                    self.iov[slot].iov_base.cast(),
                    size as u32,
                    slot as u16,
                )
                .offset(off)
                .build()
                .user_data(slot as u64);
                // SAFETY: the destination is registered buffer `slot`, free until its CQE arrives.
                unsafe { self.ring.submission().push(&sqe) }
                    .map_err(|_| "submission queue full")?;
                next += 1;
                inflight += 1;
            }
            self.ring.submit_and_wait(1).map_err(|e| e.to_string())?;
            let done: Vec<(u64, i32)> = self
                .ring
                .completion()
                .map(|c| (c.user_data(), c.result()))
                .collect();
            for (ud, res) in done {
                if res < 0 {
                    return Err(format!("read: {}", std::io::Error::from_raw_os_error(-res)));
                }
                total += res as u64;
                free.push(ud as usize);
                inflight -= 1;
            }
        }
        Ok(total)
    }
}

/// One read at a time, each with its own `register_buffers` / `unregister_buffers`: what a reader that
/// does not keep a registered pool pays.
pub fn ring_read_register_per_io(
    path: &Path,
    offsets: &[u64],
    size: usize,
    direct: bool,
) -> Result<u64, String> {
    let f = open(path, direct)?;
    let mut ring = IoUring::new(4).map_err(|e| e.to_string())?;
    let buf = AlignedBuf::new(size)?;
    let mut total = 0u64;
    for &off in offsets {
        let iov = [libc::iovec {
            iov_base: buf.ptr().cast(),
            iov_len: size,
        }];
        // SAFETY: the iovec points into `buf`, unregistered again below before `buf` is dropped.
        unsafe { ring.submitter().register_buffers(&iov) }
            .map_err(|e| format!("register_buffers: {e}"))?;
        let sqe = opcode::ReadFixed::new(types::Fd(f.as_raw_fd()), buf.ptr(), size as u32, 0)
            .offset(off)
            .build();
        // SAFETY: the destination is the registered buffer, idle until the CQE.
        unsafe { ring.submission().push(&sqe) }.map_err(|_| "submission queue full")?;
        ring.submit_and_wait(1).map_err(|e| e.to_string())?;
        let res = ring
            .completion()
            .next()
            .map(|c| c.result())
            .ok_or("no completion")?;
        if res < 0 {
            return Err(format!("read: {}", std::io::Error::from_raw_os_error(-res)));
        }
        total += res as u64;
        ring.submitter()
            .unregister_buffers()
            .map_err(|e| e.to_string())?;
    }
    Ok(total)
}

/// A naive reader: one `pread` per range, one thread, into one buffer.
pub fn pread_loop(path: &Path, ranges: &[(u64, usize)], direct: bool) -> Result<u64, String> {
    let f = open(path, direct)?;
    let max = ranges.iter().map(|r| r.1).max().unwrap_or(0);
    let mut buf = AlignedBuf::new(max.div_ceil(4096).max(1) * 4096)?;
    let mut total = 0u64;
    for &(off, len) in ranges {
        let b = &mut buf.slice_mut()[..len];
        f.read_exact_at(b, off)
            .map_err(|e| format!("pread {off}+{len}: {e}"))?;
        total += len as u64;
    }
    Ok(total)
}
