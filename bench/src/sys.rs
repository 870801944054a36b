//! Raw CUDA calls for the baselines: plain copies with none of ubdirect's machinery.

use cudarc::driver::{CudaStream, sys};

/// Enqueues a plain `cuMemcpyHtoDAsync` of `len` bytes.
///
/// # Safety
/// `src..src+len` must be live, page-locked host memory and `dst..dst+len` live device memory of the
/// stream's context, both untouched by anything else until the stream is synchronized.
pub unsafe fn raw_h2d(
    dst: u64,
    src: *const u8,
    len: usize,
    stream: &CudaStream,
) -> Result<(), String> {
    // SAFETY: guaranteed by the caller.
    unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), len, stream.cu_stream()) }
        .result()
        .map_err(|e| format!("cuMemcpyHtoDAsync: {e:?}"))
}

/// Page-locked host memory from `cuMemHostAlloc` (portable, not write-combined); freed on drop.
pub struct HostAlloc {
    ptr: *mut u8,
    len: usize,
}

impl HostAlloc {
    /// Allocates `len` bytes. The stream's context must be current.
    pub fn new(stream: &CudaStream, len: usize) -> Result<Self, String> {
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| format!("{e:?}"))?;
        // SAFETY: plain allocation, owned by the returned value.
        let p = unsafe { cudarc::driver::result::malloc_host(len, sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(|e| format!("cuMemHostAlloc: {e:?}"))?;
        Ok(Self { ptr: p.cast(), len })
    }

    /// First byte.
    pub fn ptr(&self) -> *const u8 {
        self.ptr
    }
}

impl Drop for HostAlloc {
    fn drop(&mut self) {
        // SAFETY: ptr came from cuMemHostAlloc and is not used after this (the benchmark synchronizes
        // its stream before dropping).
        let _ = unsafe { cudarc::driver::result::free_host(self.ptr.cast()) };
        let _ = self.len;
    }
}

/// User + system CPU time of this process (all threads, including io_uring workers).
pub fn cpu_time() -> std::time::Duration {
    // SAFETY: rusage is plain data; all-zero is valid.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes into the struct we own.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return std::time::Duration::ZERO;
    }
    let tv =
        |t: libc::timeval| std::time::Duration::new(t.tv_sec as u64, (t.tv_usec as u32) * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Evicts a file's clean pages from the page cache.
pub fn fadvise_dontneed(path: &std::path::Path) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path)?;
    f.sync_all()?;
    // SAFETY: the descriptor is open for the duration of the call; advice only.
    let r = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if r != 0 {
        return Err(std::io::Error::from_raw_os_error(r));
    }
    Ok(())
}

/// Registers `len` bytes at `ptr` with CUDA, copies them to `dst`, waits, unregisters: what a loader
/// without a registered pool pays per copy.
///
/// # Safety
/// `ptr..ptr+len` must be live, page-aligned host memory not registered with CUDA, and `dst..dst+len`
/// live device memory of the stream's context.
pub unsafe fn register_copy_unregister(
    ptr: *mut u8,
    len: usize,
    dst: u64,
    stream: &CudaStream,
) -> Result<(), String> {
    // SAFETY: guaranteed by the caller; every call is checked and the registration undone.
    unsafe {
        sys::cuMemHostRegister_v2(ptr.cast(), len, sys::CU_MEMHOSTREGISTER_PORTABLE)
            .result()
            .map_err(|e| format!("cuMemHostRegister: {e:?}"))?;
        let r = sys::cuMemcpyHtoDAsync_v2(dst, ptr.cast_const().cast(), len, stream.cu_stream())
            .result();
        let s = sys::cuStreamSynchronize(stream.cu_stream()).result();
        sys::cuMemHostUnregister(ptr.cast())
            .result()
            .map_err(|e| format!("cuMemHostUnregister: {e:?}"))?;
        r.map_err(|e| format!("cuMemcpyHtoDAsync: {e:?}"))?;
        s.map_err(|e| format!("cuStreamSynchronize: {e:?}"))
    }
}
