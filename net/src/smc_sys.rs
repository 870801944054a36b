//! The FFI edge of SMC: an anonymous mapping registered with userfaultfd (missing + write-protect
//! faults), resolved with UFFDIO_COPY, write-protected and released with UFFDIO_WRITEPROTECT, and —
//! when the region becomes unavailable — replaced by a mapping that raises SIGBUS. The ioctl structs are
//! written here from `linux/userfaultfd.h` (the `userfaultfd` crate needs libclang and a second nix;
//! docs/decisions.md). Every unsafe block of SMC is in this file.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

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
///
/// Its bytes are shared memory in the full sense: the kernel writes them (UFFDIO_COPY, the MAP_FIXED
/// replacement of [`UffdMapping::poison`]) and other threads store into them while this process reads
/// them. So no method hands out a Rust reference over them: [`UffdMapping::load`] and
/// [`UffdMapping::store`] copy out and in with relaxed atomic accesses of aligned 8-byte words
/// through raw pointers (no data race, whoever else loads and stores them through these methods),
/// and [`UffdMapping::base`] is a raw pointer whose users take on the same rules.
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

// SAFETY: the only field that is not `Send` is `base`, a raw pointer to an anonymous mapping that
// belongs to the process, not to the thread that made it: any thread may access it or unmap it (Drop,
// which runs once, with no other reference alive). The descriptors are process-wide.
unsafe impl Send for UffdMapping {}
// SAFETY: every `&self` method is safe to run from several threads at once:
// * the fields are never written after `new`;
// * `wait`/`try_read` read whole `uffd_msg` records (the kernel hands each one to one reader),
//   `fill`/`protect`/`wake`/`poison`/`scan_written_from` are ioctls and mmaps that the kernel serialises
//   on the mm (each call uses its own argument structs and buffers);
// * `load`/`store` are bounds-checked copies whose every access to the mapped bytes is a relaxed
//   atomic access of an aligned 8-byte word (`load_words`/`store_words`), and no method creates a
//   Rust reference over them, so a concurrent store, UFFDIO_COPY or `poison()` (MAP_FIXED) never
//   changes memory behind a `&[u8]` the compiler may assume frozen. Two threads storing and loading
//   the same bytes at once are atomic accesses of one size: no data race; a reader sees each word
//   either before or after a store to it (a copy of several words may mix them, as with any shared
//   memory), and a partial-word store keeps the word's other bytes (compare-exchange);
// * the mapping stays mapped for as long as any `&self` exists: only Drop unmaps it, and
//   `poison()` replaces it in place (MAP_FIXED over exactly this range) instead of unmapping it.
unsafe impl Sync for UffdMapping {}

/// What an access to a poisoned mapping raises (see [`UffdMapping::poison`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Poisoned {
    /// SIGBUS: the mapping is a shared mapping of an empty memfd (the designed path).
    Sigbus,
    /// SIGSEGV: the memfd could not be made or mapped (`why`), so the range was made inaccessible
    /// instead (an anonymous `PROT_NONE` mapping, or `mprotect(PROT_NONE)`).
    Sigsegv {
        /// Why the SIGBUS mapping could not be installed.
        why: String,
    },
}

fn last(what: &str) -> String {
    format!("{what}: {}", std::io::Error::last_os_error())
}

/// The 8-byte words of the mapping that `[at, at + len)` touches, each with the part of it in the
/// range (`lo..hi` of its bytes) and that part's place in the range. Words are 8-byte aligned (the
/// mapping is page-aligned), so a word never crosses a page and always holds a byte of the range.
fn words(at: usize, len: usize) -> impl Iterator<Item = (usize, usize, usize, usize)> {
    let end = at + len;
    let first = at & !7;
    (first..end).step_by(8).map(move |w| {
        let (lo, hi) = (at.max(w) - w, end.min(w + 8) - w);
        (w - first, lo, hi, w + lo - at)
    })
}

/// Copies `len` bytes out of the mapping at `src` into ordinary memory at `dst`, with relaxed atomic
/// 8-byte loads of the mapping's aligned words (only the bytes in range are kept).
///
/// Every access to the mapping's bytes made by this module is an `AtomicU64` access of an aligned
/// word, so loads and stores of the same bytes from several threads are atomic accesses of one size:
/// they may interleave (a reader sees each word old or new), never a data race.
///
/// # Safety
/// `src` must point into a live mapping of this module, with `[src, src + len)` inside it; `dst`
/// must be valid for `len` bytes of writes and not overlap the mapping.
unsafe fn load_words(dst: *mut u8, src: *const u8, len: usize) {
    let head = src as usize % 8;
    // SAFETY: `src - head` is the aligned start of the word holding `src`, inside the same page of
    // the mapping (pages are 4096-aligned), so it stays in the mapping's allocation.
    let base = unsafe { src.sub(head) };
    for (w, lo, hi, at) in words(head, len) {
        // SAFETY: `base + w` is 8-byte aligned and inside the mapping (the word holds a byte of the
        // range, and mmap maps whole pages); the mapping stays mapped
        // while the caller's `&UffdMapping` lives; every access to it is an atomic word access
        // (see above), as `AtomicU64::from_ptr` requires.
        let word = unsafe { AtomicU64::from_ptr(base.add(w).cast::<u64>().cast_mut()) }
            .load(Ordering::Relaxed)
            .to_ne_bytes();
        // SAFETY: `dst + at .. dst + at + (hi - lo)` is inside `dst`'s `len` bytes (caller), and
        // `word` is a local array.
        unsafe { std::ptr::copy_nonoverlapping(word[lo..hi].as_ptr(), dst.add(at), hi - lo) };
    }
}

/// Copies `len` bytes of ordinary memory at `src` into the mapping at `dst`: whole words with relaxed
/// atomic stores, the partial words at either end with a compare-exchange that keeps the bytes
/// outside the range (a concurrent store to them is not undone).
///
/// # Safety
/// As [`load_words`], with the roles swapped: `dst` points into a live, writable mapping of this
/// module with `[dst, dst + len)` inside it; `src` is valid for `len` bytes of reads.
unsafe fn store_words(dst: *mut u8, src: *const u8, len: usize) {
    let head = dst as usize % 8;
    // SAFETY: as in `load_words`.
    let base = unsafe { dst.sub(head) };
    for (w, lo, hi, at) in words(head, len) {
        // SAFETY: as in `load_words`: an aligned word inside the live mapping, accessed atomically
        // only.
        let a = unsafe { AtomicU64::from_ptr(base.add(w).cast::<u64>()) };
        let mut part = [0u8; 8];
        // SAFETY: `src + at .. src + at + (hi - lo)` is inside `src`'s `len` bytes (caller).
        unsafe { std::ptr::copy_nonoverlapping(src.add(at), part[lo..hi].as_mut_ptr(), hi - lo) };
        if hi - lo == 8 {
            a.store(u64::from_ne_bytes(part), Ordering::Relaxed);
            continue;
        }
        let mut cur = a.load(Ordering::Relaxed);
        loop {
            let mut b = cur.to_ne_bytes();
            b[lo..hi].copy_from_slice(&part[lo..hi]);
            match a.compare_exchange_weak(
                cur,
                u64::from_ne_bytes(b),
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => break,
                Err(now) => cur = now,
            }
        }
    }
}

impl UffdMapping {
    /// Maps `len` bytes (a multiple of 4 KiB) and registers them for missing-page faults and, when
    /// `wp`, write-protect faults. `writable = false` maps them read-only (stores raise SIGSEGV).
    pub fn new(len: usize, writable: bool, wp: bool, want_async: bool) -> Result<Self, String> {
        // Descriptors first, each owned as soon as it exists, so that every error path below closes
        // exactly what was opened (and never a descriptor we do not own).
        // SAFETY: userfaultfd(2) returns a new descriptor or -1; no memory is passed.
        let fd =
            unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK) };
        if fd < 0 {
            return Err(last(
                "userfaultfd (needs root or vm.unprivileged_userfaultfd=1)",
            ));
        }
        // SAFETY: fd >= 0 is a new descriptor nobody else owns.
        let uffd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        // SAFETY: eventfd(2) returns a new descriptor or -1; no memory is passed.
        let ev = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if ev < 0 {
            return Err(last("eventfd")); // `uffd` closes here; nothing else was made
        }
        // SAFETY: ev >= 0 (checked above) is a new descriptor nobody else owns.
        let stop = unsafe { OwnedFd::from_raw_fd(ev) };
        let prot = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: a fresh anonymous private mapping at an address the kernel picks (it replaces
        // nothing); checked for MAP_FAILED.
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
        // From here on, Drop unmaps the mapping and closes both descriptors on any error.
        let mut m = Self {
            base: base.cast(),
            len,
            uffd,
            stop,
            wp,
            pagemap: None,
        };
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

    /// Bytes mapped (never 0).
    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether write-protect faults are resolved by the kernel (see [`UffdMapping::scan_written_from`]).
    pub fn wp_async(&self) -> bool {
        self.pagemap.is_some()
    }

    /// Written pages since the last scan from offset `from`, as (offset, len) runs (the kernel merges
    /// adjacent pages), write-protected again atomically by the same call, stopping after
    /// `max_pages` written 4 KiB pages (0: no limit) or when its output is full; returns the runs
    /// found and the offset the walk reached (the mapping's length when it is done). Only with
    /// [`UffdMapping::wp_async`].
    pub fn scan_written_from(
        &self,
        from: usize,
        max_pages: usize,
    ) -> Result<(Vec<(usize, usize)>, usize), String> {
        let pm = self
            .pagemap
            .as_ref()
            .ok_or("no asynchronous write-protect")?;
        let start = self.base as u64 + from.min(self.len) as u64;
        let end = self.base as u64 + self.len as u64;
        let mut regs = vec![PageRegion::default(); 512];
        let mut a = PmScanArg {
            size: std::mem::size_of::<PmScanArg>() as u64,
            flags: PM_SCAN_WP_MATCHING | PM_SCAN_CHECK_WPASYNC,
            start,
            end,
            vec: regs.as_mut_ptr() as u64,
            vec_len: regs.len() as u64,
            max_pages: max_pages as u64,
            // Present and written: an unpopulated page counts as "written" to the kernel.
            category_mask: PAGE_IS_WRITTEN | PAGE_IS_PRESENT,
            return_mask: PAGE_IS_WRITTEN | PAGE_IS_PRESENT,
            ..Default::default()
        };
        // SAFETY: the range is our mapping; `vec` has `vec_len` entries.
        let n = unsafe { pagemap_scan(pm.as_raw_fd(), &mut a) }
            .map_err(|e| format!("PAGEMAP_SCAN: {e}"))?;
        let runs = regs[..(n as usize).min(regs.len())]
            .iter()
            .map(|r| {
                (
                    (r.start - self.base as u64) as usize,
                    (r.end - r.start) as usize,
                )
            })
            .collect();
        let next = (a.walk_end.clamp(start, end) - self.base as u64) as usize;
        Ok((runs, next))
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
        if off.checked_add(src.len()).is_none_or(|e| e > self.len) {
            return Err(format!("fill {off}+{} past {}", src.len(), self.len));
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
        if off.checked_add(len).is_none_or(|e| e > self.len) {
            return Err(format!("write-protect {off}+{len} past {}", self.len));
        }
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
        if off.checked_add(len).is_none_or(|e| e > self.len) {
            return;
        }
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
    ///
    /// When the memfd cannot be made or mapped (no descriptor left, no memory), the range is made
    /// inaccessible instead and accesses raise SIGSEGV ([`Poisoned::Sigsegv`]): still a signal, never
    /// a hang. `Err` only when even that failed; then the faulting threads are not woken (they would
    /// only fault again) and stay blocked: the caller must report it.
    pub fn poison(&self) -> Result<Poisoned, String> {
        self.poison_with(true)
    }

    /// [`UffdMapping::poison`]; `memfd = false` skips the SIGBUS mapping (tests of the fallback).
    fn poison_with(&self, memfd: bool) -> Result<Poisoned, String> {
        let got = match if memfd {
            self.map_sigbus()
        } else {
            Err("skipped".to_string())
        } {
            Ok(()) => Ok(Poisoned::Sigbus),
            Err(why) => self.map_none().map(|()| Poisoned::Sigsegv { why }),
        };
        if got.is_ok() {
            self.wake(0, self.len);
        }
        got
    }

    /// MAP_FIXED of an empty memfd, shared, over exactly this mapping: any access is beyond the
    /// file's end, so SIGBUS.
    fn map_sigbus(&self) -> Result<(), String> {
        // SAFETY: memfd_create with a static NUL-terminated name returns a new descriptor or -1.
        let fd =
            unsafe { libc::memfd_create(c"ubdirect-smc-unavailable".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(last("memfd_create"));
        }
        // SAFETY: fd >= 0 is new and ours (closed when this returns; the mapping keeps the file).
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: MAP_FIXED over exactly [base, base + len), which this object mapped and still owns;
        // no Rust reference covers those bytes (see the type's documentation), so replacing them
        // invalidates nothing the compiler relies on.
        let p = unsafe {
            libc::mmap(
                self.base.cast(),
                self.len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(last("mmap of the SIGBUS memfd"));
        }
        Ok(())
    }

    /// Makes the whole range inaccessible (SIGSEGV): an anonymous `PROT_NONE` mapping replacing it,
    /// or, if even that fails, `mprotect(PROT_NONE)` of the range itself.
    fn map_none(&self) -> Result<(), String> {
        // SAFETY: as in `map_sigbus`: MAP_FIXED over exactly our own range, no reference into it.
        let p = unsafe {
            libc::mmap(
                self.base.cast(),
                self.len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if p != libc::MAP_FAILED {
            return Ok(());
        }
        let first = last("mmap PROT_NONE");
        // SAFETY: changes the protection of our own range only; no reference into it.
        if unsafe { libc::mprotect(self.base.cast(), self.len, libc::PROT_NONE) } == 0 {
            return Ok(());
        }
        Err(format!("{first}; {}", last("mprotect PROT_NONE")))
    }

    /// One `writev(2)` on the nonblocking socket `fd` of `head` followed by the mapped bytes of
    /// `ranges` ((offset, len) pairs inside the mapping), skipping the first `skip` bytes of that
    /// stream (what earlier calls sent): the kernel copies straight out of the mapping, no user-space
    /// copy. At most `IOV_MAX` pieces per call; returns the bytes written (the caller loops, and
    /// waits for the socket on `WouldBlock`). A store racing with it may or may not be in the bytes
    /// sent (as with any read of the page); the page stays dirty for the next push either way.
    pub fn writev_from(
        &self,
        fd: std::os::fd::BorrowedFd<'_>,
        head: &[u8],
        ranges: &[(usize, usize)],
        skip: usize,
    ) -> std::io::Result<usize> {
        const IOV_MAX: usize = 1024;
        let mut iov: Vec<libc::iovec> = Vec::with_capacity(ranges.len().min(IOV_MAX - 1) + 1);
        let mut skip = skip;
        if skip < head.len() {
            iov.push(libc::iovec {
                iov_base: head[skip..].as_ptr() as *mut libc::c_void,
                iov_len: head.len() - skip,
            });
            skip = 0;
        } else {
            skip -= head.len();
        }
        for &(o, l) in ranges {
            if o.checked_add(l).is_none_or(|e| e > self.len) {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("send {o}+{l} past {}", self.len),
                ));
            }
            if skip >= l {
                skip -= l;
                continue;
            }
            if iov.len() == IOV_MAX {
                break;
            }
            iov.push(libc::iovec {
                iov_base: self.base.wrapping_add(o + skip).cast(),
                iov_len: l - skip,
            });
            skip = 0;
        }
        if iov.is_empty() {
            return Ok(0);
        }
        // SAFETY: every iovec covers live memory for the call: `head` (a borrowed slice) or a range
        // of this mapping checked above, which stays mapped while `&self` lives (`poison()` replaces
        // it in place: the kernel then reports EFAULT, never touches other memory). The kernel only
        // reads through them; no Rust reference covers the mapped bytes.
        let n = unsafe { libc::writev(fd.as_raw_fd(), iov.as_ptr(), iov.len() as i32) };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(n as usize)
    }

    /// Copies `src` into the mapping at `off` (stores: they fault like any other), with atomic
    /// stores through a raw pointer (see the type's documentation).
    pub fn store(&self, off: usize, src: &[u8]) -> Result<(), String> {
        if off.checked_add(src.len()).is_none_or(|e| e > self.len) {
            return Err(format!("store {off}+{} past {}", src.len(), self.len));
        }
        // SAFETY: [off, off + len) is inside our mapping (checked), which stays mapped while
        // `&self` lives; `src` is a live slice that cannot overlap it (no reference into the mapping
        // exists to make one from).
        unsafe { store_words(self.base.add(off), src.as_ptr(), src.len()) };
        Ok(())
    }

    /// Copies from the mapping at `off` into `dst` (loads: they fault like any other), with
    /// atomic word loads through a raw pointer: the bytes are read now, never assumed unchanged.
    pub fn load(&self, off: usize, dst: &mut [u8]) -> Result<(), String> {
        if off.checked_add(dst.len()).is_none_or(|e| e > self.len) {
            return Err(format!("load {off}+{} past {}", dst.len(), self.len));
        }
        // SAFETY: as in `store`, with the roles of the two ranges swapped.
        unsafe { load_words(dst.as_mut_ptr(), self.base.add(off), dst.len()) };
        Ok(())
    }
}

/// Waits until `fd` is ready for `events` (`libc::POLLIN` / `libc::POLLOUT`) or `timeout` passed;
/// `Ok(false)` on timeout. An interrupted wait reads as ready (the caller retries its I/O).
pub fn wait_fd(
    fd: std::os::fd::BorrowedFd<'_>,
    events: i16,
    timeout: std::time::Duration,
) -> std::io::Result<bool> {
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events,
        revents: 0,
    };
    // Rounded up: a wait of 0.4 ms must not turn into a busy loop of zero-timeout polls.
    let ms = timeout.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
    // SAFETY: one valid pollfd on the stack, for the duration of the call.
    let n = unsafe { libc::poll(&mut p, 1, ms) };
    if n < 0 {
        let e = std::io::Error::last_os_error();
        return if e.kind() == std::io::ErrorKind::Interrupted {
            Ok(true)
        } else {
            Err(e)
        };
    }
    Ok(n > 0)
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

#[cfg(test)]
mod tests;
