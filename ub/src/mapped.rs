//! The page cache as a UB pool: a shard file mapped read-only (`MAP_SHARED`, `PROT_READ`) whose
//! pages the kernel fills, registered once with the device (CUDA: `cuMemHostRegister(READ_ONLY |
//! PORTABLE)`, which pins them), so GPU copies run straight out of the page cache at DMA speed with
//! no CPU copy.
//!
//! A mapping never hands out a Rust reference to its bytes (another process may change the file):
//! the device copies by address, the CPU through [`MappedFile::copy_out`], which copies with `pread`
//! (the kernel copies out of the same page cache; a file truncated meanwhile is a short read, never a
//! `SIGBUS`) between two checks of the file against the identity it had when mapped (size, inode,
//! mtime, ctime), so a file truncated or rewritten in place is a typed error, not a SIGBUS and not
//! different bytes. Pinned bytes are accounted against a [`PinBudget`] shared by a loader's
//! shards.

use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::{Device, DeviceError, Registration};

/// What a mapped file was when mapped; a file that no longer matches has changed under the loader.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileIdent {
    /// Size in bytes.
    pub size: u64,
    /// Modification time (ns since the epoch).
    pub mtime_ns: i128,
    /// Status change time (ns since the epoch): a file rewritten in place whose modification time
    /// was put back (`touch -d`, `utimensat`) still has a new one, and no caller can set it.
    pub ctime_ns: i128,
    /// Device and inode.
    pub dev: u64,
    /// Inode.
    pub ino: u64,
}

impl FileIdent {
    /// The identity of an open file.
    pub fn of(f: &std::fs::File) -> std::io::Result<Self> {
        let m = f.metadata()?;
        Ok(Self::of_metadata(&m))
    }

    /// The identity of an open descriptor (one `fstat`).
    pub fn of_fd(fd: std::os::fd::BorrowedFd<'_>) -> std::io::Result<Self> {
        let f = std::fs::File::from(fd.try_clone_to_owned()?);
        Self::of(&f)
    }

    /// The identity in `m`.
    pub fn of_metadata(m: &std::fs::Metadata) -> Self {
        Self {
            size: m.len(),
            mtime_ns: m.mtime() as i128 * 1_000_000_000 + m.mtime_nsec() as i128,
            ctime_ns: m.ctime() as i128 * 1_000_000_000 + m.ctime_nsec() as i128,
            dev: m.dev(),
            ino: m.ino(),
        }
    }
}

/// Errors of mapped files.
#[derive(Debug, thiserror::Error)]
pub enum MapError {
    /// The file could not be opened, examined or mapped.
    #[error("map {path}: {op}")]
    Os {
        /// The file.
        path: PathBuf,
        /// The call.
        op: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The file changed since it was mapped (truncated, replaced, rewritten).
    #[error("{path} changed under the loader: was {was:?}, is {now:?}; rebuild the index")]
    Changed {
        /// The file.
        path: PathBuf,
        /// When mapped.
        was: Box<FileIdent>,
        /// Now (`None`: it cannot be examined any more).
        now: Option<Box<FileIdent>>,
    },
    /// Registering it would exceed the pinned-memory budget.
    #[error(
        "{path}: {len} bytes would exceed the page-cache budget ({used} of {budget} bytes pinned)"
    )]
    Budget {
        /// The file.
        path: PathBuf,
        /// Its size.
        len: u64,
        /// Bytes pinned now.
        used: u64,
        /// The budget.
        budget: u64,
    },
    /// The device refused the registration.
    #[error("{path}: registering the mapping with the device")]
    Register {
        /// The file.
        path: PathBuf,
        /// The device's error.
        #[source]
        source: DeviceError,
    },
    /// A copy names bytes outside the file.
    #[error("{path}: range {offset}+{len} outside the mapping ({size} bytes)")]
    Range {
        /// The file.
        path: PathBuf,
        /// Offset.
        offset: u64,
        /// Length.
        len: usize,
        /// Mapped size.
        size: u64,
    },
}

/// Pinned bytes of a loader's mapped shards, bounded.
#[derive(Debug)]
pub struct PinBudget {
    limit: u64,
    used: AtomicU64,
    registrations: AtomicU64,
    register_ns: AtomicU64,
}

impl PinBudget {
    /// A budget of `limit` bytes.
    pub fn new(limit: u64) -> Arc<Self> {
        Arc::new(Self {
            limit,
            used: AtomicU64::new(0),
            registrations: AtomicU64::new(0),
            register_ns: AtomicU64::new(0),
        })
    }

    /// The limit.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Bytes pinned now.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    /// Registrations made (each once, never on the hot path).
    pub fn registrations(&self) -> u64 {
        self.registrations.load(Ordering::Relaxed)
    }

    /// Time spent registering, in total.
    pub fn register_time(&self) -> std::time::Duration {
        std::time::Duration::from_nanos(self.register_ns.load(Ordering::Relaxed))
    }

    fn reserve(&self, n: u64) -> Result<(), (u64, u64)> {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                u.checked_add(n).filter(|t| *t <= self.limit)
            })
            .map(|_| ())
            .map_err(|u| (u, self.limit))
    }

    fn release(&self, n: u64) {
        let _ = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                Some(u.saturating_sub(n))
            });
    }
}

/// A shard file mapped read-only and registered with a device. See the module docs.
pub struct MappedFile {
    path: PathBuf,
    file: std::fs::File,
    ident: FileIdent,
    // Field order: the registration goes before the mapping it describes.
    registration: Option<Box<dyn Registration>>,
    map: crate::sys::FileMapping,
    budget: Arc<PinBudget>,
    reserved: u64,
    /// [`MappedFile::check`] compares the times too (false: the file is never written in place and
    /// others may touch it — an object cache's chunk, whose mtime orders its eviction).
    times: bool,
}

impl std::fmt::Debug for MappedFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MappedFile")
            .field("path", &self.path)
            .field("len", &self.map.len())
            .field("registered", &self.registration.is_some())
            .finish()
    }
}

impl MappedFile {
    /// Maps `path` read-only and registers it with `device`, within `budget`. Slow (the kernel
    /// populates and pins every page): call it between epochs, never per read.
    pub fn open(
        path: &Path,
        device: &dyn Device,
        budget: &Arc<PinBudget>,
    ) -> Result<Self, MapError> {
        Self::open_with(path, Some(device), budget)
    }

    /// Maps `path` read-only without registering it: for copies the CPU makes out of the page cache
    /// (packed batches assembled on the host), which need no pinned pages. Cheap (no page is
    /// populated or pinned up front) and outside the pin budget; a device must not DMA from it.
    pub fn open_unregistered(path: &Path, budget: &Arc<PinBudget>) -> Result<Self, MapError> {
        Self::open_with(path, None, budget)
    }

    /// Whether the mapping is registered with a device (DMA may copy from it).
    pub fn is_registered(&self) -> bool {
        self.registration.is_some()
    }

    fn open_with(
        path: &Path,
        device: Option<&dyn Device>,
        budget: &Arc<PinBudget>,
    ) -> Result<Self, MapError> {
        let os = |op, source| MapError::Os {
            path: path.to_path_buf(),
            op,
            source,
        };
        let file = std::fs::File::open(path).map_err(|e| os("open", e))?;
        let ident = FileIdent::of(&file).map_err(|e| os("fstat", e))?;
        let meta = file.metadata().map_err(|e| os("fstat", e))?;
        if !meta.is_file() || ident.size == 0 {
            return Err(os(
                "open",
                std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "not a non-empty regular file",
                ),
            ));
        }
        let len = usize::try_from(ident.size).map_err(|_| {
            os(
                "mmap",
                std::io::Error::new(std::io::ErrorKind::InvalidInput, "too large"),
            )
        })?;
        let reserved = match device {
            Some(_) => (ident.size).div_ceil(crate::PAGE_SIZE as u64) * crate::PAGE_SIZE as u64,
            None => 0, // nothing pinned
        };
        budget
            .reserve(reserved)
            .map_err(|(used, budget)| MapError::Budget {
                path: path.to_path_buf(),
                len: reserved,
                used,
                budget,
            })?;
        let map = match crate::sys::FileMapping::new(file.as_raw_fd(), len) {
            Ok(m) => m,
            Err(e) => {
                budget.release(reserved);
                return Err(os("mmap", e));
            }
        };
        let mut me = Self {
            path: path.to_path_buf(),
            file,
            ident,
            registration: None,
            map,
            budget: budget.clone(),
            reserved,
            times: true,
        };
        let Some(device) = device else {
            return Ok(me);
        };
        let t = std::time::Instant::now();
        // SAFETY: `me.map` is this MappedFile's own mapping; the registration is stored in `me`
        // and dropped before the mapping (field order), so the range stays mapped while registered.
        let reg = unsafe { device.register_host_readonly(me.map.as_ptr(), me.map.len()) }.map_err(
            |source| MapError::Register {
                path: path.to_path_buf(),
                source,
            },
        )?;
        budget
            .register_ns
            .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        budget.registrations.fetch_add(1, Ordering::Relaxed);
        me.registration = Some(reg);
        Ok(me)
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Mapped bytes (the file's size when mapped).
    pub fn len(&self) -> u64 {
        self.ident.size
    }

    /// Whether the mapping is empty (never: empty files are not mapped).
    pub fn is_empty(&self) -> bool {
        self.ident.size == 0
    }

    /// What the file was when mapped.
    pub fn ident(&self) -> FileIdent {
        self.ident
    }

    /// The same mapping, checked by size alone: for a file that is only ever replaced whole (renamed
    /// over, never written in place) and whose times others change — an object cache's chunk, whose
    /// mtime orders its eviction. A truncation is still [`MapError::Changed`].
    pub fn times_ignored(mut self) -> Self {
        self.times = false;
        self
    }

    /// Checks the file still is what was mapped (one `fstat`).
    pub fn check(&self) -> Result<(), MapError> {
        match FileIdent::of(&self.file) {
            Ok(now) if now == self.ident => Ok(()),
            Ok(now) if !self.times && now.size == self.ident.size => Ok(()),
            Ok(now) => Err(MapError::Changed {
                path: self.path.clone(),
                was: Box::new(self.ident),
                now: Some(Box::new(now)),
            }),
            Err(_) => Err(MapError::Changed {
                path: self.path.clone(),
                was: Box::new(self.ident),
                now: None,
            }),
        }
    }

    /// The address of byte `offset`, after checking `offset + len` lies inside the mapping. For
    /// devices that copy by address (DMA); the memory may change if another process writes the file.
    pub fn addr(&self, offset: u64, len: usize) -> Result<*const u8, MapError> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.ident.size => {
                Ok(self.map.as_ptr().wrapping_add(offset as usize))
            }
            _ => Err(MapError::Range {
                path: self.path.clone(),
                offset,
                len,
                size: self.ident.size,
            }),
        }
    }

    /// Copies `dst.len()` bytes at `offset` into `dst`: `pread` from the file (the page cache the
    /// mapping shows), never a load from the mapping, so a file truncated at any moment is a short
    /// read and [`MapError::Changed`], not a `SIGBUS`. The file is checked before and after (a
    /// rewrite in place changes its ctime even when its mtime is put back).
    pub fn copy_out(&self, offset: u64, dst: &mut [u8]) -> Result<(), MapError> {
        use std::os::unix::fs::FileExt;
        self.check()?;
        self.addr(offset, dst.len())?;
        match self.file.read_exact_at(dst, offset) {
            Ok(()) => self.check(),
            Err(_) => Err(self.check().err().unwrap_or_else(|| MapError::Changed {
                path: self.path.clone(),
                was: Box::new(self.ident),
                now: None,
            })),
        }
    }
}

impl Drop for MappedFile {
    fn drop(&mut self) {
        // Unregister (unpin) first, then unmap (the map field drops after this), then give back the
        // budget.
        drop(self.registration.take());
        self.budget.release(self.reserved);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn file(tag: &str, len: usize) -> PathBuf {
        let d = std::env::temp_dir().join(format!("ubdirect-mapped-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        let p = d.join("shard");
        std::fs::write(&p, vec![7u8; len]).unwrap();
        p
    }

    /// Issue 23: a shard truncated between the check and the copy killed the process with SIGBUS
    /// (3 of 105 host epochs). Copies race a thread that truncates and restores the file; with the
    /// old `check` + load from the mapping this test dies of SIGBUS within milliseconds; with
    /// `pread` every copy is whole and right or a `Changed` error.
    #[test]
    fn copies_racing_truncation_are_errors_never_sigbus() {
        const LEN: usize = 4 << 20;
        let p = file("race", LEN);
        let dev = crate::HostDevice::new();
        let m = MappedFile::open(&p, &dev, &PinBudget::new(1 << 30)).unwrap();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let t = {
            let (p, stop) = (p.clone(), stop.clone());
            std::thread::spawn(move || {
                let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
                while !stop.load(Ordering::Relaxed) {
                    f.set_len(4096).unwrap();
                    f.set_len(LEN as u64).unwrap();
                }
            })
        };
        let mut buf = vec![0u8; 1 << 20];
        let (mut ok, mut changed) = (0, 0);
        let t0 = std::time::Instant::now();
        while t0.elapsed() < std::time::Duration::from_millis(500) {
            match m.copy_out((LEN - buf.len()) as u64, &mut buf) {
                Ok(()) => ok += 1,
                Err(MapError::Changed { .. }) => changed += 1,
                Err(e) => panic!("{e}"),
            }
        }
        stop.store(true, Ordering::Relaxed);
        t.join().unwrap();
        assert!(changed > 0, "{ok} copies, none saw the truncation");
    }

    /// Issue 23: a file rewritten in place with its old mtime put back passed the check (size,
    /// mtime, inode) and was served with different bytes; the ctime catches it.
    #[test]
    fn a_rewrite_with_its_mtime_put_back_is_a_change() {
        let p = file("rewrite", 8192);
        let dev = crate::HostDevice::new();
        let m = MappedFile::open(&p, &dev, &PinBudget::new(1 << 30)).unwrap();
        let mtime = std::fs::metadata(&p).unwrap().modified().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, &[9u8; 4096], 0).unwrap();
        f.set_modified(mtime).unwrap();
        drop(f);
        let mut buf = [0u8; 16];
        assert!(matches!(m.check(), Err(MapError::Changed { .. })));
        assert!(matches!(
            m.copy_out(0, &mut buf),
            Err(MapError::Changed { .. })
        ));
    }
}
