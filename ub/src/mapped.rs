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
    /// Mapping it would take more memory regions than the page-cache pools' share of `vm.max_map_count`: past
    /// that limit every `mmap` of the process fails (the allocator's, a thread's stack), so the
    /// pool stops well before it ([`PinBudget::region_limit`]). Not mapped this time; read as it
    /// was.
    #[error(
        "{path}: {regions} more mapped regions would exceed the share of vm.max_map_count the \
         process's page-cache pools may hold ({held} of {limit} held)"
    )]
    Regions {
        /// The (first) file.
        path: PathBuf,
        /// Regions the mapping needs (one per file, and one spare).
        regions: u64,
        /// Regions the pool's mappings hold now.
        held: u64,
        /// The pool's limit.
        limit: u64,
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
    /// Memory regions (VMAs) the mappings made within this budget hold, and their bound: shared by
    /// every budget of the process made with [`PinBudget::new`].
    regions: Arc<RegionCount>,
}

/// Memory regions held by mappings, and their bound.
#[derive(Debug)]
struct RegionCount {
    held: AtomicU64,
    limit: u64,
}

/// The process's region count: `vm.max_map_count` is a limit of the process, not of a loader, so
/// two loaders in one process (a training and an evaluation dataset) share one bound, not half
/// the limit each.
fn process_regions() -> Arc<RegionCount> {
    static REGIONS: std::sync::OnceLock<Arc<RegionCount>> = std::sync::OnceLock::new();
    REGIONS
        .get_or_init(|| {
            Arc::new(RegionCount {
                held: AtomicU64::new(0),
                limit: default_region_limit(),
            })
        })
        .clone()
}

/// The share of `vm.max_map_count` the page-cache pool's mappings may hold: half. An object's chunk files
/// are one region each (1 MiB chunks of 64 GiB are 65,536, the kernel's default limit); the rest
/// of the process (allocator, thread stacks, CUDA, io_uring rings) keeps the other half.
fn default_region_limit() -> u64 {
    static LIMIT: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *LIMIT.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/vm/max_map_count")
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .unwrap_or(65_530)
            / 2
    })
}

impl PinBudget {
    /// A budget of `limit` bytes; its mappings and those of every other budget made this way in
    /// the process hold at most half of `vm.max_map_count` regions together.
    pub fn new(limit: u64) -> Arc<Self> {
        Self::with_regions(limit, process_regions())
    }

    /// A budget of `limit` bytes whose mappings hold at most `regions` memory regions, counted
    /// apart from the process's.
    pub fn with_region_limit(limit: u64, regions: u64) -> Arc<Self> {
        Self::with_regions(
            limit,
            Arc::new(RegionCount {
                held: AtomicU64::new(0),
                limit: regions,
            }),
        )
    }

    fn with_regions(limit: u64, regions: Arc<RegionCount>) -> Arc<Self> {
        Arc::new(Self {
            limit,
            used: AtomicU64::new(0),
            registrations: AtomicU64::new(0),
            register_ns: AtomicU64::new(0),
            regions,
        })
    }

    /// Memory regions its mappings may hold (with the other budgets sharing its count).
    pub fn region_limit(&self) -> u64 {
        self.regions.limit
    }

    /// Memory regions its mappings hold now (with the other budgets sharing its count).
    pub fn regions(&self) -> u64 {
        self.regions.held.load(Ordering::Relaxed)
    }

    /// Whether a mapping of `files` more files would fit in the regions left now (a check before
    /// the files are opened; the mapping itself reserves them).
    pub fn regions_fit(&self, files: u64) -> bool {
        self.regions().saturating_add(files + 1) <= self.regions.limit
    }

    fn reserve_regions(self: &Arc<Self>, n: u64, path: &Path) -> Result<Regions, MapError> {
        self.regions
            .held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                u.checked_add(n).filter(|t| *t <= self.regions.limit)
            })
            .map(|_| Regions {
                budget: self.clone(),
                n,
            })
            .map_err(|held| MapError::Regions {
                path: path.to_path_buf(),
                regions: n,
                held,
                limit: self.regions.limit,
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

/// A piece of a range of a mapping that lies in one of its files ([`MappedFile::pieces`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// The file ([`MappedFile::part`]).
    pub file: usize,
    /// Where the piece starts in that file.
    pub file_offset: u64,
    /// Its bytes.
    pub len: usize,
    /// Where it starts in the range.
    pub at: usize,
}

/// One file of a mapping: where its bytes start in it.
struct Part {
    path: PathBuf,
    file: std::fs::File,
    ident: FileIdent,
    at: u64,
}

/// Memory regions a mapping holds of its budget's bound, given back when it is dropped.
#[derive(Debug)]
struct Regions {
    budget: Arc<PinBudget>,
    n: u64,
}

impl Drop for Regions {
    fn drop(&mut self) {
        let _ = self
            .budget
            .regions
            .held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                Some(u.saturating_sub(self.n))
            });
    }
}

/// A shard file mapped read-only and registered with a device — or several files laid end to end in
/// one contiguous mapping (an object's chunk files, [`MappedFile::open_chunks`]). See the module docs.
pub struct MappedFile {
    path: PathBuf,
    file: std::fs::File,
    ident: FileIdent,
    /// Files after the first, for a mapping of chunks (empty for one file).
    more: Vec<Part>,
    /// Bytes mapped (all files).
    size: u64,
    // Field order: the registration goes before the mapping it describes.
    registration: Option<Box<dyn Registration>>,
    map: crate::sys::FileMapping,
    /// After the mapping: given back once it is unmapped.
    _regions: Regions,
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
        let file = open_nonblocking(path).map_err(|e| os("open", e))?;
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
        let regions = budget.reserve_regions(1, path)?;
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
        let me = Self {
            path: path.to_path_buf(),
            file,
            ident,
            more: Vec::new(),
            size: ident.size,
            registration: None,
            map,
            _regions: regions,
            budget: budget.clone(),
            reserved,
            times: true,
        };
        me.register(device)
    }

    /// Registers a mapping made without a device ([`MappedFile::open_unregistered`],
    /// [`MappedFile::open_chunks`] with `None`) with `device`, within its budget: the kernel
    /// populates and pins every page now, so call it between epochs or in the background. Already
    /// registered: returned as it is.
    pub fn into_registered(mut self, device: &dyn Device) -> Result<Self, MapError> {
        if self.registration.is_some() {
            return Ok(self);
        }
        let need = self.size.div_ceil(crate::PAGE_SIZE as u64) * crate::PAGE_SIZE as u64;
        self.budget
            .reserve(need)
            .map_err(|(used, budget)| MapError::Budget {
                path: self.path.clone(),
                len: need,
                used,
                budget,
            })?;
        // From here the reservation is the mapping's: dropped with it on failure too.
        self.reserved += need;
        self.register(Some(device))
    }

    /// Each mapped file, open, with the bytes it maps (a mapping's own descriptors: asking about a
    /// file through them needs no `open` and names the mapped inode, whatever its path names now).
    pub fn open_files(&self) -> impl Iterator<Item = (&Path, &std::fs::File, u64)> {
        std::iter::once((self.path.as_path(), &self.file, self.ident.size)).chain(
            self.more
                .iter()
                .map(|p| (p.path.as_path(), &p.file, p.ident.size)),
        )
    }

    /// Registers the mapping with `device` (none: left unregistered), timed into the budget's counters.
    fn register(mut self, device: Option<&dyn Device>) -> Result<Self, MapError> {
        let Some(device) = device else {
            return Ok(self);
        };
        let t = std::time::Instant::now();
        // SAFETY: `self.map` is this MappedFile's own mapping; the registration is stored in `self`
        // and dropped before the mapping (field order), so the range stays mapped while registered.
        let reg = unsafe { device.register_host_readonly(self.map.as_ptr(), self.map.len()) }
            .map_err(|source| MapError::Register {
                path: self.path.clone(),
                source,
            })?;
        self.budget
            .register_ns
            .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.budget.registrations.fetch_add(1, Ordering::Relaxed);
        self.registration = Some(reg);
        Ok(self)
    }

    /// Maps the files `chunks` end to end in one contiguous mapping — file `i` at byte `i × chunk`,
    /// every file but the last exactly `chunk` bytes (a multiple of the page size) — read-only, and
    /// registers it with `device` once (`None`: for CPU copies). An object's chunk files read as one
    /// shard: one registration, and a copy that spans chunks is one copy. Every file is checked by
    /// size only ([`MappedFile::times_ignored`]: chunks are replaced whole, never written in place).
    pub fn open_chunks(
        chunks: &[PathBuf],
        chunk: u64,
        device: Option<&dyn Device>,
        budget: &Arc<PinBudget>,
    ) -> Result<Self, MapError> {
        let first = chunks.first().cloned().unwrap_or_default();
        let bad = |path: &Path, why: &str| MapError::Os {
            path: path.to_path_buf(),
            op: "open",
            source: std::io::Error::new(std::io::ErrorKind::InvalidInput, why.to_string()),
        };
        if chunks.is_empty() || chunk == 0 || !chunk.is_multiple_of(crate::PAGE_SIZE as u64) {
            return Err(bad(
                &first,
                "no chunks, or a chunk size that is not a multiple of the page size",
            ));
        }
        let mut parts = Vec::with_capacity(chunks.len());
        for (i, p) in chunks.iter().enumerate() {
            let os = |op, source| MapError::Os {
                path: p.clone(),
                op,
                source,
            };
            let file = open_nonblocking(p).map_err(|e| os("open", e))?;
            let meta = file.metadata().map_err(|e| os("fstat", e))?;
            let ident = FileIdent::of_metadata(&meta);
            let last = i + 1 == chunks.len();
            if !meta.is_file()
                || ident.size == 0
                || (!last && ident.size != chunk)
                || ident.size > chunk
            {
                return Err(bad(p, "not a regular file of the chunk's size"));
            }
            parts.push(Part {
                path: p.clone(),
                file,
                ident,
                at: i as u64 * chunk,
            });
        }
        let size = parts.last().map_or(0, |l| l.at + l.ident.size);
        let too_large = || bad(&first, "too large");
        let lens: Vec<(libc::c_int, usize)> = parts
            .iter()
            .map(|p| {
                Ok((
                    p.file.as_raw_fd(),
                    usize::try_from(p.ident.size).map_err(|_| too_large())?,
                ))
            })
            .collect::<Result<_, MapError>>()?;
        let stride = usize::try_from(chunk).map_err(|_| too_large())?;
        // One region per file (they tile the reservation), and one spare.
        let regions = budget.reserve_regions(parts.len() as u64 + 1, &first)?;
        let reserved = match device {
            Some(_) => size.div_ceil(crate::PAGE_SIZE as u64) * crate::PAGE_SIZE as u64,
            None => 0,
        };
        budget
            .reserve(reserved)
            .map_err(|(used, limit)| MapError::Budget {
                path: first.clone(),
                len: reserved,
                used,
                budget: limit,
            })?;
        let map = match crate::sys::FileMapping::new_chunks(&lens, stride) {
            Ok(m) => m,
            Err(e) => {
                budget.release(reserved);
                return Err(MapError::Os {
                    path: first,
                    op: "mmap",
                    source: e,
                });
            }
        };
        let mut it = parts.into_iter();
        let Some(head) = it.next() else {
            budget.release(reserved);
            return Err(bad(&first, "no chunks"));
        };
        let me = Self {
            path: head.path,
            file: head.file,
            ident: head.ident,
            more: it.collect(),
            size,
            registration: None,
            map,
            _regions: regions,
            budget: budget.clone(),
            reserved,
            times: false,
        };
        me.register(device)
    }

    /// Each mapped file with the identity it had when mapped, in order.
    pub fn files(&self) -> impl Iterator<Item = (&Path, FileIdent)> {
        std::iter::once((self.path.as_path(), self.ident))
            .chain(self.more.iter().map(|p| (p.path.as_path(), p.ident)))
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Mapped bytes (the file's size when mapped; all the files' of a mapping of chunks).
    pub fn len(&self) -> u64 {
        self.size
    }

    /// Whether the mapping is empty (never: empty files are not mapped).
    pub fn is_empty(&self) -> bool {
        self.size == 0
    }

    /// What the (first) file was when mapped.
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
        self.check_file(&self.path, &self.file, self.ident)?;
        self.more
            .iter()
            .try_for_each(|p| self.check_file(&p.path, &p.file, p.ident))
    }

    fn check_file(
        &self,
        path: &Path,
        file: &std::fs::File,
        was: FileIdent,
    ) -> Result<(), MapError> {
        match FileIdent::of(file) {
            Ok(now) if now == was => Ok(()),
            Ok(now) if !self.times && now.size == was.size => Ok(()),
            Ok(now) => Err(MapError::Changed {
                path: path.to_path_buf(),
                was: Box::new(was),
                now: Some(Box::new(now)),
            }),
            Err(_) => Err(MapError::Changed {
                path: path.to_path_buf(),
                was: Box::new(was),
                now: None,
            }),
        }
    }

    /// The address of byte `offset`, after checking `offset + len` lies inside the mapping. For
    /// devices that copy by address (DMA); the memory may change if another process writes the file.
    pub fn addr(&self, offset: u64, len: usize) -> Result<*const u8, MapError> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.size => Ok(self.map.as_ptr().wrapping_add(offset as usize)),
            _ => Err(MapError::Range {
                path: self.path.clone(),
                offset,
                len,
                size: self.size,
            }),
        }
    }

    /// Each file's share of `offset..end` (one file but for a mapping of chunks), in order: (its
    /// index in [`MappedFile::open_files`], path, descriptor, identity when mapped, where its bytes
    /// start in the mapping).
    fn spanned(
        &self,
        offset: u64,
        end: u64,
    ) -> impl Iterator<Item = (usize, &PathBuf, &std::fs::File, FileIdent, u64)> {
        std::iter::once((&self.path, &self.file, self.ident, 0u64))
            .chain(self.more.iter().map(|p| (&p.path, &p.file, p.ident, p.at)))
            .enumerate()
            .map(|(i, (p, f, ident, at))| (i, p, f, ident, at))
            .filter(move |&(_, _, _, ident, at)| at < end && offset < at + ident.size)
    }

    /// The pieces of `len` bytes at `offset`, one per file the range spans, in order: for a caller
    /// that reads them itself, each with its own `pread` (the engine's copy threads, several files at
    /// once). What [`MappedFile::copy_out`] reads, without its checks: a piece that reads short is a
    /// file changed since it was mapped.
    pub fn pieces(&self, offset: u64, len: usize) -> Result<Vec<Piece>, MapError> {
        self.addr(offset, len)?;
        let end = offset + len as u64;
        let mut done = 0usize;
        Ok(self
            .spanned(offset, end)
            .map(|(file, _, _, ident, at)| {
                let pos = offset + done as u64;
                let n = (len - done).min((at + ident.size - pos) as usize);
                let p = Piece {
                    file,
                    file_offset: pos - at,
                    len: n,
                    at: done,
                };
                done += n;
                p
            })
            .collect())
    }

    /// File `i` of the mapping ([`MappedFile::open_files`]' order): its path and descriptor.
    pub fn part(&self, i: usize) -> Option<(&Path, &std::fs::File)> {
        match i {
            0 => Some((self.path.as_path(), &self.file)),
            i => self.more.get(i - 1).map(|p| (p.path.as_path(), &p.file)),
        }
    }

    /// Copies `dst.len()` bytes at `offset` into `dst`: `pread` from the file (the page cache the
    /// mapping shows), never a load from the mapping, so a file truncated at any moment is a short
    /// read and [`MapError::Changed`], not a `SIGBUS`. The files the range spans are checked before
    /// and after (a rewrite in place changes its ctime even when its mtime is put back); only those:
    /// a mapping of an object's chunks spans dozens of files, and a small copy touches one or two.
    /// Files checked by size alone (chunks) are not checked around the copy: their truncation shows
    /// as a short read, which is checked.
    pub fn copy_out(&self, offset: u64, dst: &mut [u8]) -> Result<(), MapError> {
        use std::os::unix::fs::FileExt;
        self.addr(offset, dst.len())?;
        let end = offset + dst.len() as u64;
        let spanned = || {
            self.spanned(offset, end)
                .map(|(_, p, f, ident, at)| (p, f, ident, at))
        };
        // A file checked by size alone ([`MappedFile::times_ignored`]: replaced whole, never written
        // in place) needs no check around the copy: a truncation is a short `pread`, checked below.
        let check = || {
            if !self.times {
                return Ok(());
            }
            spanned().try_for_each(|(p, f, ident, _)| self.check_file(p, f, ident))
        };
        check()?;
        let mut done = 0usize;
        for (path, file, ident, at) in spanned() {
            let pos = offset + done as u64;
            let n = (dst.len() - done).min((at + ident.size - pos) as usize);
            if file
                .read_exact_at(&mut dst[done..done + n], pos - at)
                .is_err()
            {
                return Err(self.check_file(path, file, ident).err().unwrap_or_else(|| {
                    MapError::Changed {
                        path: path.clone(),
                        was: Box::new(ident),
                        now: None,
                    }
                }));
            }
            done += n;
        }
        check()
    }
}

/// Opens `path` read-only with `O_NONBLOCK`: a FIFO put in a shard's or chunk's place between a
/// `stat` and this open is refused as no regular file (the callers check) instead of blocking on a
/// writer that never comes. On a regular file the flag changes nothing.
fn open_nonblocking(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
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

    /// Each mapping holds a memory region per file (and a spare) of its budget's bound, refused past
    /// it, given back when dropped; the default bound is half of `vm.max_map_count`.
    #[test]
    fn mappings_hold_their_regions_within_the_bound_and_give_them_back() {
        let p0 = file("regions", 64 << 10);
        let d = p0.parent().unwrap().to_path_buf();
        let p1 = d.join("c1");
        std::fs::write(&p1, vec![1u8; 64 << 10]).unwrap();
        let p2 = d.join("c2");
        std::fs::write(&p2, vec![2u8; 100]).unwrap();
        let budget = PinBudget::with_region_limit(1 << 30, 5);
        assert!(budget.regions_fit(3) && !budget.regions_fit(5));
        let paths = [p0.clone(), p1, p2];
        let chunks = MappedFile::open_chunks(&paths, 64 << 10, None, &budget).unwrap();
        assert_eq!(budget.regions(), 4, "three files and a spare");
        let one = MappedFile::open_unregistered(&p0, &budget).unwrap();
        assert_eq!(budget.regions(), 5);
        match MappedFile::open_unregistered(&p0, &budget) {
            Err(MapError::Regions {
                regions: 1,
                held: 5,
                limit: 5,
                ..
            }) => {}
            r => panic!("expected the region bound, got {r:?}"),
        }
        match MappedFile::open_chunks(&paths, 64 << 10, None, &budget) {
            Err(e @ MapError::Regions { .. }) => {
                assert!(e.to_string().contains("vm.max_map_count"), "{e}")
            }
            r => panic!("expected the region bound, got {r:?}"),
        }
        assert_eq!(budget.regions(), 5, "a refused mapping holds nothing");
        drop(chunks);
        assert_eq!(budget.regions(), 1);
        drop(one);
        assert_eq!(budget.regions(), 0);
        assert!(MappedFile::open_chunks(&paths, 64 << 10, None, &budget).is_ok());
        // The default bound is half the kernel's limit.
        let max: u64 = std::fs::read_to_string("/proc/sys/vm/max_map_count")
            .map_or(65_530, |s| s.trim().parse().unwrap());
        assert_eq!(PinBudget::new(0).region_limit(), max / 2);
    }

    /// `vm.max_map_count` bounds the process: the budgets of two loaders in one process count their
    /// mappings' regions against one bound, not half the limit each.
    #[test]
    fn budgets_of_one_process_share_one_region_bound() {
        let p = file("shared-regions", 64 << 10);
        let (a, b) = (PinBudget::new(1 << 30), PinBudget::new(1 << 30));
        assert_eq!(a.region_limit(), b.region_limit());
        let m = MappedFile::open_unregistered(&p, &a).unwrap();
        // Other tests of this process may hold regions too, never fewer than this one.
        assert!(
            b.regions() >= 1,
            "a mapping of a is counted against b's bound too"
        );
        drop(m);
        let own = PinBudget::with_region_limit(1 << 30, 8);
        let m = MappedFile::open_unregistered(&p, &own).unwrap();
        assert_eq!(own.regions(), 1, "a budget with its own bound counts alone");
        drop(m);
        assert_eq!(own.regions(), 0);
    }

    /// An object's chunk files as one mapping: one registration, copies across chunk boundaries
    /// equal the files' concatenation, each file checked; a chunk of the wrong size is refused.
    #[test]
    fn chunk_files_map_as_one_registered_range() {
        let p0 = file("chunks", 64 << 10);
        let d = p0.parent().unwrap().to_path_buf();
        let mut want = std::fs::read(&p0).unwrap();
        let p1 = d.join("c1");
        let b1: Vec<u8> = (0..(64 << 10)).map(|i| (i % 13) as u8).collect();
        std::fs::write(&p1, &b1).unwrap();
        want.extend_from_slice(&b1);
        let p2 = d.join("c2");
        let b2: Vec<u8> = (0..5000).map(|i| (i % 7 + 100) as u8).collect();
        std::fs::write(&p2, &b2).unwrap();
        want.extend_from_slice(&b2);
        let dev = crate::HostDevice::new();
        let budget = PinBudget::new(1 << 30);
        let paths = [p0.clone(), p1.clone(), p2.clone()];
        let m = MappedFile::open_chunks(&paths, 64 << 10, Some(&dev), &budget).unwrap();
        assert_eq!(m.len(), want.len() as u64);
        assert!(m.is_registered());
        assert_eq!(
            budget.registrations(),
            1,
            "one registration for the three files"
        );
        assert_eq!(m.files().count(), 3);
        let mut out = vec![0u8; 70_000];
        m.copy_out(60_000, &mut out).unwrap();
        assert!(out == want[60_000..130_000], "a copy across two boundaries");
        let mut tail = vec![0u8; 100];
        m.copy_out(want.len() as u64 - 100, &mut tail).unwrap();
        assert!(tail == want[want.len() - 100..]);
        assert!(
            m.copy_out(want.len() as u64 - 99, &mut tail).is_err(),
            "past the end"
        );
        // Touched by another process (its mtime): still fine; truncated: changed.
        let now = std::time::SystemTime::now();
        std::fs::File::options()
            .write(true)
            .open(&p1)
            .unwrap()
            .set_modified(now)
            .unwrap();
        m.check().unwrap();
        std::fs::File::options()
            .write(true)
            .open(&p1)
            .unwrap()
            .set_len(100)
            .unwrap();
        assert!(matches!(m.check(), Err(MapError::Changed { .. })));
        // A CPU copy checks the files it spans, only those: one within the first or the last chunk
        // still copies, one that reaches into the truncated chunk is `Changed`.
        let mut head = vec![0u8; 1000];
        m.copy_out(1000, &mut head).unwrap();
        assert!(head == want[1000..2000]);
        assert!(matches!(
            m.copy_out(60_000, &mut out),
            Err(MapError::Changed { ref path, .. }) if *path == p1
        ));
        m.copy_out((128 << 10) + 10, &mut tail).unwrap();
        assert!(
            tail == want[(128 << 10) + 10..(128 << 10) + 110],
            "the last chunk"
        );
        drop(m);
        assert_eq!(budget.used(), 0);
        // A chunk before the last that is not one chunk long: refused, nothing reserved.
        let e = MappedFile::open_chunks(&paths, 64 << 10, Some(&dev), &budget);
        assert!(e.is_err());
        assert_eq!(budget.used(), 0);
    }

    /// A mapping made for CPU copies and registered later: nothing is reserved until then, the
    /// registration takes its pages from the budget (refused whole beyond it), and dropping it gives
    /// them back.
    #[test]
    fn an_unregistered_mapping_registers_later_within_its_budget() {
        let p0 = file("later", 64 << 10);
        let d = p0.parent().unwrap().to_path_buf();
        let p1 = d.join("later1");
        std::fs::write(&p1, vec![7u8; 3000]).unwrap();
        let want = [std::fs::read(&p0).unwrap(), std::fs::read(&p1).unwrap()].concat();
        let dev = crate::HostDevice::new();
        let paths = [p0.clone(), p1.clone()];
        let small = PinBudget::new(64 << 10);
        let m = MappedFile::open_chunks(&paths, 64 << 10, None, &small).unwrap();
        assert!(!m.is_registered());
        assert_eq!(small.used(), 0, "an unregistered mapping pins nothing");
        let sizes: Vec<u64> = m
            .open_files()
            .map(|(_, f, n)| {
                assert_eq!(f.metadata().unwrap().len(), n);
                n
            })
            .collect();
        assert_eq!(sizes, vec![64 << 10, 3000]);
        assert!(matches!(
            m.into_registered(&dev),
            Err(MapError::Budget { len, .. }) if len == (64 << 10) + 4096
        ));
        assert_eq!(small.used(), 0, "a refused registration reserves nothing");
        let budget = PinBudget::new(1 << 30);
        let m = MappedFile::open_chunks(&paths, 64 << 10, None, &budget).unwrap();
        let m = m.into_registered(&dev).unwrap();
        assert!(m.is_registered());
        assert_eq!(budget.used(), (64 << 10) + 4096);
        assert_eq!(budget.registrations(), 1);
        let mut out = vec![0u8; want.len()];
        m.copy_out(0, &mut out).unwrap();
        assert!(out == want);
        let m = m.into_registered(&dev).unwrap();
        assert_eq!(budget.registrations(), 1, "registered once");
        drop(m);
        assert_eq!(budget.used(), 0);
    }

    /// A FIFO in a shard's or chunk's place is refused at once, never waited on.
    #[test]
    fn a_fifo_is_refused_without_waiting_for_a_writer() {
        let p = file("fifo", 4096);
        let fifo = p.with_file_name("fifo");
        assert!(
            std::process::Command::new("mkfifo")
                .arg(&fifo)
                .status()
                .unwrap()
                .success()
        );
        let budget = PinBudget::new(1 << 30);
        let t = std::time::Instant::now();
        assert!(MappedFile::open_unregistered(&fifo, &budget).is_err());
        let chunks = [p.clone(), fifo.clone()];
        assert!(MappedFile::open_chunks(&chunks, 4096, None, &budget).is_err());
        assert!(t.elapsed() < std::time::Duration::from_secs(5));
        assert_eq!(budget.used(), 0);
    }
}
