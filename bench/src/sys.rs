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
