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

mod budget;

pub use budget::PinBudget;
use budget::Regions;

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
mod tests;
