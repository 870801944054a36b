//! Raw calls of the server outside SMC and RDMA: giving freed heap memory back to the system.

/// Returns the heap memory the allocator holds free to the system (glibc `malloc_trim(0)`): after
/// connections that buffered frames close, the server's RSS goes back to where it was. Elsewhere
/// (not glibc) it does nothing.
pub(crate) fn trim_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim has no preconditions; it only releases memory the allocator holds free.
    unsafe {
        libc::malloc_trim(0);
    }
}
