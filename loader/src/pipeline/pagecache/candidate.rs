//! A page-cache candidate — a local shard, or an object held whole in its cache's chunk files —
//! and its state at an epoch's start: resident, cold, mapped, staged, refused.

use super::*;

/// What a candidate is mapped from.
pub(super) enum Backing {
    /// A local shard: its io_uring file source and its path.
    File {
        file: Arc<FileSource>,
        path: PathBuf,
    },
    /// An object held whole in local chunk files of its cache ([`Source::chunk_files`]).
    Chunks(Arc<dyn Source>),
}

/// A candidate's state at an epoch's start ([`Candidate::state`]).
pub(super) struct State {
    /// It can be mapped now: a local shard wholly in the page cache, an object whose chunks are all
    /// present, checked, and wholly in the page cache (a chunk file the kernel evicted, or a cache
    /// left by an earlier boot, would be read from the disk page by page by the registration's
    /// faults: it is filled by an epoch's reads first, as a cold shard is).
    pub(super) resident: bool,
    /// Its data is on local disk but not all in the page cache: a local shard, or an object whose
    /// chunk files are all present (a cold object that is not, the cache fetches).
    pub(super) cold: bool,
    /// A resident object's chunk files as the check mapped them, unregistered.
    pub(super) chunks: Option<MappedFile>,
    /// A resident object's staged mapping of the epoch before, checked again and still right: read
    /// out of it again (no open, `mmap` or sidecar per chunk file at every epoch's start).
    pub(super) kept: Option<Arc<ShardMap>>,
}

pub(super) struct Candidate {
    pub(super) backing: Backing,
    pub(super) mapped: Mutex<Option<Arc<ShardMap>>>,
    /// An object's staged mapping (unregistered; [`ShardMap::staged`]) while it is not registered.
    pub(super) staged: Mutex<Option<Arc<ShardMap>>>,
    /// The device refused it once: read through the engine from then on.
    pub(super) refused: std::sync::atomic::AtomicBool,
    /// A mapping of it was put off ([`Candidate::unless_not_now`]), recorded once.
    pub(super) noted: std::sync::atomic::AtomicBool,
    /// Being mapped now: [`Shared::map_and_publish`] holds `mapped` across the registration
    /// (about the shard's size ÷ 40 GB/s), which an epoch's start and a metrics read must not
    /// wait for ([`Candidate::mapping`]).
    pub(super) registering: std::sync::atomic::AtomicBool,
}

impl Candidate {
    /// A shard the pool may map, not mapped yet.
    pub(super) fn new(backing: Backing) -> Self {
        Self {
            backing,
            mapped: Mutex::new(None),
            staged: Mutex::new(None),
            refused: AtomicBool::new(false),
            noted: AtomicBool::new(false),
            registering: AtomicBool::new(false),
        }
    }

    /// The shard could not be mapped (or registered): it is read through the engine from now on,
    /// recorded as a fallback.
    pub(super) fn refuse(&self, e: &MapError) {
        self.refused.store(true, Ordering::Relaxed);
        self.set_populate(false);
        // Its staged mapping is not checked again: let its descriptors go (the epoch's view drops
        // its own reference at the next start), so that chunks evicted from the cache do not stay
        // allocated outside the cache's bound for the rest of the run.
        lock(&self.staged).take();
        ubdirect_ub::fallback::record(
            "page_cache_not_mapped",
            format!("{e}: read through the engine instead"),
        );
    }

    /// The shard's path or URL.
    pub(super) fn name(&self) -> String {
        match &self.backing {
            Backing::File { path, .. } => path.display().to_string(),
            Backing::Chunks(src) => src.shard().to_string(),
        }
    }

    /// Its mapping now, without waiting for one being made (`None` meanwhile: it is not mapped yet).
    pub(super) fn mapping(&self) -> Option<Arc<ShardMap>> {
        if self.registering.load(Ordering::Acquire) {
            return None;
        }
        lock(&self.mapped).clone()
    }

    /// A mapping that cannot be made now but may be later is put off (`Ok(None)`: read as before),
    /// recorded once per shard: one that would take more memory regions than the pool may hold
    /// (mapped once others are dropped), and an object's chunk files that are not what its cache
    /// wrote, or cannot be opened or mapped now (another process of the node may be replacing
    /// them: the cache reads and fetches what it must, and maps the object once its chunks check
    /// out). Any other result is passed on.
    pub(super) fn unless_not_now<T>(
        &self,
        r: Result<Option<T>, MapError>,
    ) -> Result<Option<T>, MapError> {
        let (kind, then) = match &r {
            Err(MapError::Regions { .. }) => (
                "page_cache_map_regions",
                "read as before (raise vm.max_map_count, or cache.chunk_size)",
            ),
            Err(MapError::Os { .. }) if matches!(self.backing, Backing::Chunks(_)) => (
                "object_cache_chunks_not_mapped",
                "the object is read through its cache, and mapped once its chunks check out",
            ),
            _ => return r,
        };
        if let Err(e) = r
            && !self.noted.swap(true, Ordering::Relaxed)
        {
            ubdirect_ub::fallback::record(kind, format!("{e}: {then}"));
        }
        Ok(None)
    }

    /// Its [`State`] now. An object's chunk files are mapped (unregistered, within `budget`'s
    /// accounting) to be checked: a chunk evicted or replaced meanwhile makes it cold, not an error.
    pub(super) fn state(&self, budget: &Arc<PinBudget>) -> State {
        match &self.backing {
            Backing::File { file, .. } => {
                let resident = file.fully_resident();
                State {
                    resident,
                    cold: !resident,
                    chunks: None,
                    kept: None,
                }
            }
            Backing::Chunks(src) => {
                // The staged mapping of the epoch before, if every chunk file is still the one it
                // maps (same inode at its path, same size) and wholly in the page cache: the checks
                // a registered mapping gets at each epoch's start (`Shared::recheck`), plus
                // residency.
                let prev = lock(&self.staged).take();
                if let Some(prev) =
                    prev.filter(|m| m.check().is_ok() && !m.evicted() && chunks_resident(m.file()))
                {
                    *lock(&self.staged) = Some(prev.clone());
                    return State {
                        resident: true,
                        cold: false,
                        chunks: None,
                        kept: Some(prev),
                    };
                }
                let Some(files) = src.chunk_files() else {
                    return State {
                        resident: false,
                        cold: false,
                        chunks: None,
                        kept: None,
                    };
                };
                let m = self
                    .unless_not_now(map_chunks(&files, src.size(), None, budget))
                    .ok()
                    .flatten()
                    .filter(chunks_resident);
                State {
                    resident: m.is_some(),
                    cold: m.is_none(),
                    chunks: m,
                    kept: None,
                }
            }
        }
    }

    /// Its reads that miss the page cache go through it (filling it) or around it (`O_DIRECT`).
    pub(super) fn set_populate(&self, on: bool) {
        match &self.backing {
            Backing::File { file, .. } => file.set_populate(on),
            Backing::Chunks(src) => src.fill_page_cache(on),
        }
    }

    /// At an epoch's start, a cold candidate the run reads again is filled by this epoch's reads
    /// (true), one read once is read with `O_DIRECT` and left out of the page cache (false).
    pub(super) fn fill_if(&self, reads_again: bool) {
        self.set_populate(reads_again);
        if let (true, Backing::File { file, .. }) = (reads_again, &self.backing) {
            // The kernel starts on the file's head (a header the plan's reads may skip).
            if let Err(e) = file.prefetch() {
                ubdirect_ub::fallback::record("page_cache_prefetch", e.to_string());
            }
        }
    }

    /// Maps it, registered with `device` (`None`: for CPU copies). `Ok(None)`: an object's chunks
    /// are no longer all present (or one was replaced since it was checked): not this time.
    pub(super) fn map(
        &self,
        device: Option<&dyn Device>,
        budget: &Arc<PinBudget>,
    ) -> Result<Option<ShardMap>, MapError> {
        match &self.backing {
            Backing::File { path, file } => {
                // Mapped unregistered first: the identity is checked before any page is pinned.
                let m = MappedFile::open_unregistered(path, budget);
                let Some(m) = self.unless_not_now(m.map(Some))? else {
                    return Ok(None);
                };
                // The path is mapped; the shard is the file opened (and checked against the index)
                // when the loader started. Another file renamed over the path since is not it.
                let was = file.handle().ident().map_err(|source| MapError::Os {
                    path: path.clone(),
                    op: "fstat",
                    source,
                })?;
                let now = m.ident();
                if (now.dev, now.ino) != (was.dev, was.ino) {
                    return Err(MapError::Changed {
                        path: path.clone(),
                        was: Box::new(was),
                        now: Some(Box::new(now)),
                    });
                }
                let m = match device {
                    Some(d) => m.into_registered(d)?,
                    None => m,
                };
                Ok(Some(ShardMap::whole(m)))
            }
            Backing::Chunks(src) => match src.chunk_files() {
                Some(files) => Ok(self
                    .unless_not_now(map_chunks(&files, src.size(), device, budget))?
                    .map(ShardMap::chunks)),
                None => Ok(None),
            },
        }
    }
}

/// The chunk files `files` of an object of `size` bytes mapped end to end (registered with
/// `device`, or not), or `None` when one was evicted, replaced or resized since `files` was made
/// (a last chunk cut short in place keeps its inode: mapped, every read of the object's tail would
/// fail, epoch after epoch, while the cache would never fetch it again).
pub(super) fn map_chunks(
    files: &ubdirect_ub::ChunkFiles,
    size: u64,
    device: Option<&dyn Device>,
    budget: &Arc<PinBudget>,
) -> Result<Option<MappedFile>, MapError> {
    // Short of memory regions: known before a file is opened.
    let n = files.chunks.len() as u64;
    if !budget.regions_fit(n) {
        return Err(MapError::Regions {
            path: files
                .chunks
                .first()
                .map(|(p, _)| p.clone())
                .unwrap_or_default(),
            regions: n + 1,
            held: budget.regions(),
            limit: budget.region_limit(),
        });
    }
    let paths: Vec<PathBuf> = files.chunks.iter().map(|(p, _)| p.clone()).collect();
    // One mapping of the chunk files end to end, registered once.
    let m = match MappedFile::open_chunks(&paths, files.chunk_size, device, budget) {
        Ok(m) => m,
        // Evicted between the check and here: not mapped this time.
        Err(MapError::Os { path, .. }) if !path.exists() => return Ok(None),
        Err(e) => return Err(e),
    };
    // Replaced since this process checked it: not mapped this time.
    let same = m
        .files()
        .zip(&files.chunks)
        .all(|((_, id), (_, ino))| id.ino == *ino);
    Ok((same && m.len() == size).then_some(m))
}

/// Whether every chunk file of the mapping is wholly in the page cache (`cachestat` on the
/// mapping's own descriptors). A kernel without `cachestat` (before 6.5) cannot say: a chunk is
/// taken to be resident there, as the cache wrote it through the page cache.
pub(super) fn chunks_resident(m: &MappedFile) -> bool {
    m.open_files().all(
        |(_, f, len)| match ubdirect_nvme::page_cache_resident(f, 0, len) {
            Ok(r) => r,
            Err(e) => e.raw_os_error() == Some(libc::ENOSYS),
        },
    )
}
