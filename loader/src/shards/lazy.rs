//! Local shards opened on demand: when a dataset has more shards than the process may keep open
//! (two descriptors and up to two registered-file slots each, within `RLIMIT_NOFILE` and the
//! engine's table), each shard is a [`LazyFile`] that opens its [`FileSource`] at its first read and
//! shares a bounded set of open files ([`OpenFiles`], least recently used closed first). A read in
//! flight holds its file: closing one only drops the set's reference, and its descriptors close
//! when its last read completes. Each (re)open checks the file against what the index saw (size,
//! and the identity of its first open): a shard changed under the loader is an error, as when every
//! shard stays open.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ubdirect_nvme::{Engine, FileSource};
use ubdirect_ub::{FileIdent, Lease, ReadFuture, Registrar, Source, SourceError, SourceErrorKind};

/// The open files of one dataset's lazy shards: at most `cap`, least recently used closed first.
#[derive(Debug)]
pub struct OpenFiles {
    engine: Engine,
    cap: usize,
    state: Mutex<Lru>,
    /// Opens (first and again after a close), for the summary and tests.
    opens: std::sync::atomic::AtomicU64,
}

#[derive(Debug, Default)]
struct Lru {
    tick: u64,
    /// Open shards by last use.
    by_use: BTreeMap<u64, usize>,
    /// Per shard: its open file and last use, and the identity of its first open.
    slots: Vec<Slot>,
}

/// A shard's open file with its last use (`None`: closed), and the identity of its first open.
type Slot = (Option<(Arc<FileSource>, u64)>, Option<FileIdent>);

impl OpenFiles {
    /// A set for `shards` shards on `engine`, keeping at most `cap` of them open.
    pub fn new(engine: Engine, shards: usize, cap: usize) -> Arc<Self> {
        Arc::new(OpenFiles {
            engine,
            cap: cap.max(1),
            state: Mutex::new(Lru {
                slots: (0..shards).map(|_| (None, None)).collect(),
                ..Lru::default()
            }),
            opens: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// The most files it keeps open.
    pub fn cap(&self) -> usize {
        self.cap
    }

    /// Files opened so far (reopens counted).
    pub fn opens(&self) -> u64 {
        self.opens.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Shards open now.
    pub fn open_now(&self) -> usize {
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .by_use
            .len()
    }

    /// Shard `k`'s open file (`path`, indexed with `size` bytes), opened now if it is not.
    fn get(&self, k: usize, path: &std::path::Path, size: u64) -> Result<Arc<FileSource>, String> {
        {
            let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
            st.tick += 1;
            let tick = st.tick;
            if let Some((f, last)) = st.slots.get(k).and_then(|s| s.0.clone()) {
                st.by_use.remove(&last);
                st.by_use.insert(tick, k);
                if let Some(slot) = st.slots.get_mut(k) {
                    slot.0 = Some((f.clone(), tick));
                }
                return Ok(f);
            }
        }
        // Opened outside the lock (an open is a few syscalls; reads of other shards go on).
        let f = Arc::new(FileSource::open(&self.engine, path).map_err(|e| e.to_string())?);
        self.opens
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if f.size() != size {
            return Err(format!(
                "the shard has {} bytes, the index {size}: it changed under the loader",
                f.size()
            ));
        }
        let ident = f.handle().ident().ok();
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let Some(slot) = st.slots.get_mut(k) else {
            return Err(format!("shard {k} is not in the set"));
        };
        match (&slot.1, &ident) {
            (Some(was), Some(now)) if was != now => {
                return Err(
                    "the shard is another file than when it was first opened (its identity changed): it changed under the loader"
                        .into(),
                );
            }
            (None, _) => slot.1 = ident,
            _ => {}
        }
        // Another read may have opened it meanwhile: keep that one.
        if let Some((f0, _)) = &slot.0 {
            return Ok(f0.clone());
        }
        st.tick += 1;
        let tick = st.tick;
        st.slots[k].0 = Some((f.clone(), tick));
        st.by_use.insert(tick, k);
        while st.by_use.len() > self.cap {
            let Some((_, victim)) = st.by_use.pop_first() else {
                break;
            };
            // Its descriptors close when its reads in flight (which hold it) complete.
            st.slots[victim].0 = None;
        }
        Ok(f)
    }
}

/// A local shard opened on demand in an [`OpenFiles`] set.
pub struct LazyFile {
    files: Arc<OpenFiles>,
    k: usize,
    path: PathBuf,
    name: String,
    size: u64,
    /// Alignment slack of the file this dataset's first shard opened with (they share a file
    /// system): leases are sized for it.
    slack: usize,
    describe: String,
    registrar: Arc<dyn Registrar>,
}

impl LazyFile {
    /// Shard `k` of `files`: `path`, indexed with `size` bytes. `probe` is a shard of the same
    /// dataset opened once (its read path and alignment stand for every shard's).
    pub fn new(
        files: Arc<OpenFiles>,
        k: usize,
        path: PathBuf,
        size: u64,
        probe: &FileSource,
    ) -> Self {
        LazyFile {
            name: path.display().to_string(),
            describe: format!(
                "{} (shards opened on demand, at most {} at once)",
                probe.describe(),
                files.cap()
            ),
            slack: probe.slack(),
            registrar: files.engine.registrar(),
            files,
            k,
            path,
            size,
        }
    }
}

impl std::fmt::Debug for LazyFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LazyFile")
            .field("shard", &self.name)
            .field("size", &self.size)
            .finish()
    }
}

impl Source for LazyFile {
    fn shard(&self) -> &str {
        &self.name
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn describe(&self) -> String {
        self.describe.clone()
    }

    fn slack(&self) -> usize {
        self.slack
    }

    fn registrars(&self) -> Vec<Arc<dyn Registrar>> {
        vec![self.registrar.clone()]
    }

    fn read(
        &self,
        offset: u64,
        len: usize,
        lease: Lease,
        lease_offset: usize,
        deadline: Duration,
    ) -> ReadFuture<'_> {
        Box::pin(async move {
            let f = match self.files.get(self.k, &self.path, self.size) {
                Ok(f) => f,
                Err(why) => {
                    let e = SourceError::new(SourceErrorKind::Io, &self.name, offset, len)
                        .with_source(std::io::Error::other(why));
                    return (Err(e), lease);
                }
            };
            if f.slack() > self.slack {
                let e = SourceError::new(SourceErrorKind::Io, &self.name, offset, len).with_source(
                    std::io::Error::other(format!(
                        "opened with alignment {} where the dataset's first shard had {}: shards opened on demand must share one file system",
                        f.slack(),
                        self.slack
                    )),
                );
                return (Err(e), lease);
            }
            f.read(offset, len, lease, lease_offset, deadline).await
        })
    }
}
