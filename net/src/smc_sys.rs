//! The FFI edge of SMC: an anonymous mapping registered with userfaultfd (missing + write-protect
//! faults), resolved with UFFDIO_COPY, write-protected and released with UFFDIO_WRITEPROTECT, and —
//! when the region becomes unavailable — replaced by a mapping that raises SIGBUS. The ioctl structs are
//! written here from `linux/userfaultfd.h` (the `userfaultfd` crate needs libclang and a second nix;
//! docs/decisions.md). Every unsafe block of SMC is in this file.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

#[repr(C)]
#[derive(Default)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
#[derive(Default, Clone, Copy)]
struct UffdioRange {
    start: u64,
    len: u64,
}

#[repr(C)]
#[derive(Default)]
struct UffdioRegister {
    range: UffdioRange,
    mode: u64,
    ioctls: u64,
}

#[repr(C)]
#[derive(Default)]
struct UffdioCopy {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    copy: i64,
}

#[repr(C)]
#[derive(Default)]
struct UffdioWriteprotect {
    range: UffdioRange,
    mode: u64,
}

/// `struct uffd_msg` (32 bytes) for page-fault events.
#[repr(C)]
#[derive(Default, Clone, Copy)]
struct UffdMsg {
    event: u8,
    _r1: u8,
    _r2: u16,
    _r3: u32,
    flags: u64,
    address: u64,
    _feat: u64,
}

const UFFD_API: u64 = 0xAA;
const UFFD_EVENT_PAGEFAULT: u8 = 0x12;
const UFFD_FEATURE_PAGEFAULT_FLAG_WP: u64 = 1 << 0;
const UFFD_FEATURE_WP_ASYNC: u64 = 1 << 15;
const REGISTER_MODE_MISSING: u64 = 1;
const REGISTER_MODE_WP: u64 = 2;
const COPY_MODE_WP: u64 = 2;
const WRITEPROTECT_MODE_WP: u64 = 1;
const FLAG_WRITE: u64 = 1;
const FLAG_WP: u64 = 2;

nix::ioctl_readwrite!(uffdio_api, 0xAA, 0x3F, UffdioApi);
nix::ioctl_readwrite!(uffdio_register, 0xAA, 0x00, UffdioRegister);
nix::ioctl_read!(uffdio_wake, 0xAA, 0x02, UffdioRange);
nix::ioctl_readwrite!(uffdio_copy, 0xAA, 0x03, UffdioCopy);
nix::ioctl_readwrite!(uffdio_writeprotect, 0xAA, 0x06, UffdioWriteprotect);

/// `struct pm_scan_arg` (linux/fs.h, 6.7+).
#[repr(C)]
#[derive(Default)]
struct PmScanArg {
    size: u64,
    flags: u64,
    start: u64,
    end: u64,
    walk_end: u64,
    vec: u64,
    vec_len: u64,
    max_pages: u64,
    category_inverted: u64,
    category_mask: u64,
    category_anyof_mask: u64,
    return_mask: u64,
}

/// `struct page_region`.
#[repr(C)]
#[derive(Default, Clone, Copy)]
struct PageRegion {
    start: u64,
    end: u64,
    categories: u64,
}

const PM_SCAN_WP_MATCHING: u64 = 1 << 0;
const PM_SCAN_CHECK_WPASYNC: u64 = 1 << 1;
const PAGE_IS_WRITTEN: u64 = 1 << 1;
const PAGE_IS_PRESENT: u64 = 1 << 3;

nix::ioctl_readwrite!(pagemap_scan, b'f', 16, PmScanArg);

/// A page fault reported by the kernel.
#[derive(Debug, Clone, Copy)]
pub struct Fault {
    /// Faulting address.
    pub addr: u64,
    /// The access was a write.
    pub write: bool,
    /// A write to a write-protected (present) page.
    pub wp: bool,
}

/// An anonymous mapping whose faults are delivered to us.
pub struct UffdMapping {
    base: *mut u8,
    len: usize,
    uffd: OwnedFd,
    /// Wakes the fault thread for shutdown.
    stop: OwnedFd,
    wp: bool,
    /// Write-protect faults are resolved by the kernel (UFFD_FEATURE_WP_ASYNC) and written pages
    /// found with PAGEMAP_SCAN on this /proc/self/pagemap descriptor.
    pagemap: Option<std::fs::File>,
}

// SAFETY: the mapping is plain memory; the kernel serialises the ioctls; fields are immutable.
unsafe impl Send for UffdMapping {}
// SAFETY: as above — concurrent loads and stores by users are the point of the mapping.
unsafe impl Sync for UffdMapping {}

fn last(what: &str) -> String {
    format!("{what}: {}", std::io::Error::last_os_error())
}

impl UffdMapping {
    /// Maps `len` bytes (a multiple of 4 KiB) and registers them for missing-page faults and, when
    /// `wp`, write-protect faults. `writable = false` maps them read-only (stores raise SIGSEGV).
    pub fn new(len: usize, writable: bool, wp: bool, want_async: bool) -> Result<Self, String> {
        let prot = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: a fresh anonymous private mapping; checked for MAP_FAILED.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(last(&format!("mmap {len} bytes")));
        }
        // SAFETY: userfaultfd(2) returns a new descriptor or -1.
        let fd =
            unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK) };
        if fd < 0 {
            let e = last("userfaultfd (needs root or vm.unprivileged_userfaultfd=1)");
            // SAFETY: unmapping what we mapped.
            unsafe { libc::munmap(base, len) };
            return Err(e);
        }
        // SAFETY: fd is a new descriptor we own.
        let uffd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        // SAFETY: eventfd(2) returns a new descriptor or -1.
        let ev = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        let mut m = Self {
            base: base.cast(),
            len,
            uffd,
            // SAFETY: ev is a new descriptor (checked below before use).
            stop: unsafe { OwnedFd::from_raw_fd(ev.max(0)) },
            wp,
            pagemap: None,
        };
        if ev < 0 {
            return Err(last("eventfd"));
        }
        // Ask for asynchronous write-protect faults when wanted and the kernel has them (6.7+: then
        // PAGEMAP_SCAN exists too); features can be asked only once per descriptor, so a throwaway
        // descriptor probes first.
        let async_ok = wp && want_async && probe_wp_async();
        let mut api = UffdioApi {
            api: UFFD_API,
            features: if wp {
                UFFD_FEATURE_PAGEFAULT_FLAG_WP
            } else {
                0
            } | if async_ok { UFFD_FEATURE_WP_ASYNC } else { 0 },
            ioctls: 0,
        };
        // SAFETY: valid uffd and struct.
        unsafe { uffdio_api(m.uffd.as_raw_fd(), &mut api) }
            .map_err(|e| format!("UFFDIO_API: {e}"))?;
        if async_ok {
            m.pagemap = std::fs::File::open("/proc/self/pagemap").ok();
        }
        let mut reg = UffdioRegister {
            range: UffdioRange {
                start: m.base as u64,
                len: len as u64,
            },
            mode: REGISTER_MODE_MISSING | if wp { REGISTER_MODE_WP } else { 0 },
            ioctls: 0,
        };
        // SAFETY: the range is our mapping.
        unsafe { uffdio_register(m.uffd.as_raw_fd(), &mut reg) }
            .map_err(|e| format!("UFFDIO_REGISTER: {e}"))?;
        Ok(m)
    }

    /// Start of the mapping.
    pub fn base(&self) -> *mut u8 {
        self.base
    }

    /// Whether write-protect faults are resolved by the kernel (see [`UffdMapping::scan_written`]).
    pub fn wp_async(&self) -> bool {
        self.pagemap.is_some()
    }

    /// Written pages since the last scan, as (offset, len) runs (the kernel merges adjacent pages),
    /// write-protected again atomically by the same call. Only with [`UffdMapping::wp_async`].
    pub fn scan_written(&self) -> Result<Vec<(usize, usize)>, String> {
        let pm = self
            .pagemap
            .as_ref()
            .ok_or("no asynchronous write-protect")?;
        let mut out = Vec::new();
        let mut start = self.base as u64;
        let end = self.base as u64 + self.len as u64;
        let mut regs = vec![PageRegion::default(); 512];
        while start < end {
            let mut a = PmScanArg {
                size: std::mem::size_of::<PmScanArg>() as u64,
                flags: PM_SCAN_WP_MATCHING | PM_SCAN_CHECK_WPASYNC,
                start,
                end,
                vec: regs.as_mut_ptr() as u64,
                vec_len: regs.len() as u64,
                // Present and written: an unpopulated page counts as "written" to the kernel.
                category_mask: PAGE_IS_WRITTEN | PAGE_IS_PRESENT,
                return_mask: PAGE_IS_WRITTEN | PAGE_IS_PRESENT,
                ..Default::default()
            };
            // SAFETY: the range is our mapping; `vec` has `vec_len` entries.
            let n = unsafe { pagemap_scan(pm.as_raw_fd(), &mut a) }
                .map_err(|e| format!("PAGEMAP_SCAN: {e}"))?;
            for r in &regs[..n as usize] {
                out.push((
                    (r.start - self.base as u64) as usize,
                    (r.end - r.start) as usize,
                ));
            }
            if a.walk_end <= start {
                break;
            }
            start = a.walk_end;
        }
        Ok(out)
    }

    /// Waits for faults (or a stop request); returns the faults read, empty on stop.
    pub fn wait(&self, out: &mut Vec<Fault>) -> Result<bool, String> {
        let mut fds = [
            libc::pollfd {
                fd: self.uffd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.stop.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: two valid pollfds.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                return Ok(true);
            }
            return Err(format!("poll: {e}"));
        }
        if fds[1].revents != 0 {
            return Ok(false);
        }
        self.try_read(out)?;
        Ok(true)
    }

    /// Reads pending faults without blocking; returns how many were read.
    pub fn try_read(&self, out: &mut Vec<Fault>) -> Result<usize, String> {
        let mut msgs = [UffdMsg::default(); 16];
        // SAFETY: reading whole uffd_msg records into a buffer of the right size.
        let r = unsafe {
            libc::read(
                self.uffd.as_raw_fd(),
                msgs.as_mut_ptr().cast(),
                std::mem::size_of_val(&msgs),
            )
        };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            return if e.kind() == std::io::ErrorKind::WouldBlock {
                Ok(0)
            } else {
                Err(format!("read userfaultfd: {e}"))
            };
        }
        let n = r as usize / std::mem::size_of::<UffdMsg>();
        for m in &msgs[..n] {
            if m.event == UFFD_EVENT_PAGEFAULT {
                out.push(Fault {
                    addr: m.address,
                    write: m.flags & FLAG_WRITE != 0,
                    wp: m.flags & FLAG_WP != 0,
                });
            }
        }
        Ok(n)
    }

    /// Asks the fault thread to return from [`UffdMapping::wait`].
    pub fn stop(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writing 8 bytes to our eventfd.
        unsafe { libc::write(self.stop.as_raw_fd(), one.as_ptr().cast(), 8) };
    }

    /// Fills `[off, off + src.len())` (page aligned, not yet present) with `src` and wakes the
    /// faulting threads; `protect` installs the pages write-protected. Returns false when the pages
    /// were already present (EEXIST: someone else filled them).
    pub fn fill(&self, off: usize, src: &[u8], protect: bool) -> Result<bool, String> {
        if off + src.len() > self.len {
            return Err("fill past the mapping".into());
        }
        let mut c = UffdioCopy {
            dst: self.base as u64 + off as u64,
            src: src.as_ptr() as u64,
            len: src.len() as u64,
            mode: if protect && self.wp { COPY_MODE_WP } else { 0 },
            copy: 0,
        };
        // SAFETY: dst is inside our registered mapping; src is a live slice of len bytes.
        match unsafe { uffdio_copy(self.uffd.as_raw_fd(), &mut c) } {
            Ok(_) => Ok(true),
            Err(nix::errno::Errno::EEXIST) => {
                self.wake(off, src.len());
                Ok(false)
            }
            Err(e) => Err(format!("UFFDIO_COPY at {off}: {e}")),
        }
    }

    /// Write-protects (`on`) or releases `[off, off + len)`, waking writers on release.
    pub fn protect(&self, off: usize, len: usize, on: bool) -> Result<(), String> {
        let mut w = UffdioWriteprotect {
            range: UffdioRange {
                start: self.base as u64 + off as u64,
                len: len as u64,
            },
            mode: if on { WRITEPROTECT_MODE_WP } else { 0 },
        };
        // SAFETY: the range is inside our registered mapping.
        unsafe { uffdio_writeprotect(self.uffd.as_raw_fd(), &mut w) }
            .map(|_| ())
            .map_err(|e| format!("UFFDIO_WRITEPROTECT at {off}+{len}: {e}"))
    }

    /// Wakes threads waiting on faults in the range.
    pub fn wake(&self, off: usize, len: usize) {
        let mut r = UffdioRange {
            start: self.base as u64 + off as u64,
            len: len as u64,
        };
        // SAFETY: the range is inside our mapping.
        let _ = unsafe { uffdio_wake(self.uffd.as_raw_fd(), &mut r) };
    }

    /// Replaces the whole mapping with one that raises SIGBUS on any access (a shared mapping of an
    /// empty memfd), then wakes every faulting thread: they retry on the new mapping and get SIGBUS
    /// instead of waiting forever.
    pub fn poison(&self) {
        // SAFETY: memfd_create with a static name; MAP_FIXED over exactly our own mapping.
        unsafe {
            let fd = libc::memfd_create(c"ubdirect-smc-unavailable".as_ptr(), libc::MFD_CLOEXEC);
            if fd >= 0 {
                libc::mmap(
                    self.base.cast(),
                    self.len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED | libc::MAP_FIXED,
                    fd,
                    0,
                );
                libc::close(fd);
            }
        }
        self.wake(0, self.len);
    }

    /// Copies `src` into the mapping at `off` (stores: they fault like any other).
    pub fn store(&self, off: usize, src: &[u8]) -> Result<(), String> {
        if off.checked_add(src.len()).is_none_or(|e| e > self.len) {
            return Err(format!("store {off}+{} past {}", src.len(), self.len));
        }
        // SAFETY: in bounds of our mapping; concurrent stores to the same bytes are the caller's
        // race, as with any shared memory.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.base.add(off), src.len()) };
        Ok(())
    }

    /// Copies from the mapping at `off` into `dst` (loads: they fault like any other).
    pub fn load(&self, off: usize, dst: &mut [u8]) -> Result<(), String> {
        if off.checked_add(dst.len()).is_none_or(|e| e > self.len) {
            return Err(format!("load {off}+{} past {}", dst.len(), self.len));
        }
        // SAFETY: in bounds of our mapping.
        unsafe { std::ptr::copy_nonoverlapping(self.base.add(off), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// The mapping as bytes (reads fault pages in).
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping lives as long as self; concurrent writers are the documented race of
        // shared memory.
        unsafe { std::slice::from_raw_parts(self.base, self.len) }
    }
}

/// Whether this kernel grants UFFD_FEATURE_WP_ASYNC (and so PAGEMAP_SCAN).
fn probe_wp_async() -> bool {
    // SAFETY: a throwaway userfaultfd, closed by OwnedFd.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK) };
    if fd < 0 {
        return false;
    }
    // SAFETY: fd is new and ours.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let mut api = UffdioApi {
        api: UFFD_API,
        features: UFFD_FEATURE_PAGEFAULT_FLAG_WP | UFFD_FEATURE_WP_ASYNC,
        ioctls: 0,
    };
    // SAFETY: valid descriptor and struct.
    unsafe { uffdio_api(fd.as_raw_fd(), &mut api) }.is_ok()
        && api.features & UFFD_FEATURE_WP_ASYNC != 0
        && std::path::Path::new("/proc/self/pagemap").exists()
}

impl Drop for UffdMapping {
    fn drop(&mut self) {
        // SAFETY: our mapping, unmapped once (the fds close after).
        unsafe {
            libc::munmap(self.base.cast(), self.len);
        }
    }
}
