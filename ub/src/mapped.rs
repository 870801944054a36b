//! The page cache as a UB pool: a shard file mapped read-only (`MAP_SHARED`, `PROT_READ`) whose
//! pages the kernel fills, registered once with the device (CUDA: `cuMemHostRegister(READ_ONLY |
//! PORTABLE)`, which pins them), so GPU copies run straight out of the page cache at DMA speed with
//! no CPU copy.
//!
//! A mapping never hands out a Rust reference to its bytes (another process may change the file):
//! the device copies by address, the CPU through [`MappedFile::copy_out`], which first checks the
//! file against the identity it had when mapped (size, mtime, inode) so a truncated file is a typed
//! error, not a SIGBUS. Pinned bytes are accounted against a [`PinBudget`] shared by a loader's
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
    /// Device and inode.
    pub dev: u64,
    /// Inode.
    pub ino: u64,
}

impl FileIdent {
    /// The identity of an open file.
    pub fn of(f: &std::fs::File) -> std::io::Result<Self> {
        let m = f.metadata()?;
        Ok(Self {
            size: m.len(),
            mtime_ns: m.mtime() as i128 * 1_000_000_000 + m.mtime_nsec() as i128,
            dev: m.dev(),
            ino: m.ino(),
        })
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
        };
        let Some(device) = device else {
            return Ok(me);
        };
        let t = std::time::Instant::now();
        let reg = device
            .register_host_readonly(me.map.as_ptr(), me.map.len())
            .map_err(|source| MapError::Register {
                path: path.to_path_buf(),
                source,
            })?;
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

    /// Checks the file still is what was mapped (one `fstat`).
    pub fn check(&self) -> Result<(), MapError> {
        match FileIdent::of(&self.file) {
            Ok(now) if now == self.ident => Ok(()),
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

    /// Copies `dst.len()` bytes at `offset` into `dst` after checking the file has not changed (a
    /// truncated file would raise SIGBUS on access).
    pub fn copy_out(&self, offset: u64, dst: &mut [u8]) -> Result<(), MapError> {
        self.check()?;
        let src = self.addr(offset, dst.len())?;
        crate::sys::copy_from_mapping(src, dst);
        Ok(())
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
