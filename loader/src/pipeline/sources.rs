//! Opening a dataset's shards as [`Source`]s — the io_uring file path, NVMe passthrough, `ub://`
//! servers — and indexing them through one format dispatch ([`crate::formats::index`]).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ubdirect_nvme::Engine;
use ubdirect_ub::{Lease, MemoryKind, PoolConfig, Registrar, Source, UbPool};

use super::LoadError;
use crate::RunConfig;
use crate::config::{IoMode, TransportKind};
use crate::formats::{FormatError, Opener, ShardFile};
use crate::formats::index::DatasetIndex;

/// A dataset's index and one source per shard (same order as `index.shards`).
pub(crate) struct Opened {
    pub index: DatasetIndex,
    pub sources: Vec<Arc<dyn Source>>,
    /// What the staging pool must be registered with (deduplicated by consumer).
    pub registrars: Vec<Arc<dyn Registrar>>,
    /// Deadline of one read.
    pub deadline: Duration,
    /// Per shard: the io_uring file source, where that is the shard's source (page-cache mapping
    /// candidates).
    pub files: Vec<Option<Arc<ubdirect_nvme::FileSource>>>,
    /// The smallest read these sources should be planned with (object stores:
    /// `object_store.min_read`); 0: `loader.min_read` alone.
    pub min_read: u64,
    /// A synthetic dataset written at open (`dataset.generate`), said in the summary.
    pub generated: Option<crate::dataset::Generated>,
}

/// Runs `f` to completion on `rt` from synchronous code — also when the caller is itself on a
/// multi-threaded tokio runtime (through `block_in_place`). On a current-thread runtime that would
/// stall the caller's own tasks, so it is a clear error instead of tokio's panic.
pub(crate) fn block_on<F: std::future::Future>(
    rt: &tokio::runtime::Runtime,
    f: F,
) -> Result<F::Output, LoadError> {
    match tokio::runtime::Handle::try_current() {
        Err(_) => Ok(rt.block_on(f)),
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            Ok(tokio::task::block_in_place(|| rt.block_on(f)))
        }
        Ok(_) => Err(LoadError::Config(
            "the blocking loader API was called on a current-thread tokio runtime, where waiting \
             would stall the caller's own tasks: use the async API (`Loader::stream`, \
             `EpochIter::next_async`) or a multi-threaded runtime"
                .into(),
        )),
    }
}

/// Opens the configured dataset: local shards on `engine`, or `ub://` shards on their servers.
pub(crate) fn open(
    rt: &tokio::runtime::Runtime,
    cfg: &RunConfig,
    dataset: &crate::config::DatasetSection,
    engine: &Engine,
) -> Result<Opened, LoadError> {
    let mut c = cfg.clone();
    c.dataset = dataset.clone();
    let cfg = &c;
    if cfg
        .dataset
        .paths
        .iter()
        .any(|p| crate::objstore::is_object_url(p))
        || (cfg.dataset.paths.is_empty()
            && cfg
                .dataset
                .dir
                .as_deref()
                .is_some_and(crate::objstore::is_object_url))
    {
        return crate::objstore::open(rt, cfg, engine);
    }
    let is_remote = |p: &PathBuf| p.to_string_lossy().starts_with("ub://");
    if cfg.dataset.paths.iter().any(is_remote) {
        if let Some(p) = cfg.dataset.paths.iter().find(|p| !is_remote(p)) {
            return Err(LoadError::Config(format!(
                "dataset.paths mixes ub:// and local paths ({})",
                p.display()
            )));
        }
        return open_remote(rt, cfg);
    }
    let (index, generated) = crate::dataset::open_local(&cfg.dataset)?;
    let mut sources: Vec<Arc<dyn Source>> = Vec::with_capacity(index.shards.len());
    let mut files = Vec::with_capacity(index.shards.len());
    let mut nvme = ubdirect_nvme::source::NvmeOpener::new(engine);
    for s in &index.shards {
        let passthru =
            |files: &mut Vec<_>, n: ubdirect_nvme::source::NvmeSource| -> Arc<dyn Source> {
                files.push(None);
                Arc::new(n)
            };
        let file = |files: &mut Vec<_>| -> Result<Arc<dyn Source>, LoadError> {
            let f = Arc::new(ubdirect_nvme::FileSource::open(engine, &s.path)?);
            files.push(Some(f.clone()));
            Ok(f)
        };
        let src: Arc<dyn Source> = match cfg.engine.io {
            IoMode::File => file(&mut files)?,
            IoMode::Nvme => passthru(
                &mut files,
                nvme.open(&s.path).map_err(|e| {
                    LoadError::Config(format!("engine.io = \"nvme\": {}: {e}", s.path.display()))
                })?,
            ),
            IoMode::Auto => match nvme.open(&s.path) {
                Ok(n) => passthru(&mut files, n),
                Err(e) => {
                    ubdirect_ub::fallback::record(
                        "nvme_unavailable",
                        format!(
                            "engine.io = \"auto\": {}: {e}; reading through the file path",
                            s.path.display()
                        ),
                    );
                    file(&mut files)?
                }
            },
        };
        if src.size() != s.size {
            return Err(LoadError::Config(format!(
                "{} changed size while opening ({} bytes when indexed, {} now)",
                s.path.display(),
                s.size,
                src.size()
            )));
        }
        sources.push(src);
    }
    Ok(Opened {
        registrars: dedupe(sources.iter().flat_map(|s| s.registrars()).collect()),
        index,
        sources,
        deadline: Duration::from_millis(cfg.engine.op_timeout_ms),
        files,
        min_read: 0,
        generated,
    })
}

pub(crate) fn dedupe(rs: Vec<Arc<dyn Registrar>>) -> Vec<Arc<dyn Registrar>> {
    let mut seen = std::collections::HashSet::new();
    rs.into_iter()
        .filter(|r| seen.insert(r.consumer()))
        .collect()
}

/// A parsed `ub://HOST:PORT[,HOST:PORT…]/ROOT/PATH`.
#[derive(Debug, Clone)]
pub(crate) struct UbUrl {
    pub addrs: Vec<std::net::SocketAddr>,
    pub authority: String,
    pub root: String,
    pub path: String,
}

/// Parses `ub://HOST:PORT[,HOST:PORT…]/ROOT/PATH`.
pub(crate) fn parse_ub_url(u: &str) -> Result<UbUrl, LoadError> {
    use std::net::ToSocketAddrs;
    let bad = |why: &str| {
        LoadError::Config(format!(
            "dataset path {u:?}: {why} (expected ub://HOST:PORT[,HOST:PORT]/ROOT/PATH)"
        ))
    };
    let rest = u
        .strip_prefix("ub://")
        .ok_or_else(|| bad("not a ub:// URL"))?;
    let (auth, rest) = rest.split_once('/').ok_or_else(|| bad("no root"))?;
    let (root, path) = rest
        .split_once('/')
        .ok_or_else(|| bad("no path under the root"))?;
    let mut addrs = Vec::new();
    for h in auth.split(',') {
        let a = h
            .to_socket_addrs()
            .map_err(|e| bad(&format!("{h}: {e}")))?
            .next()
            .ok_or_else(|| bad(&format!("{h} resolves to nothing")))?;
        addrs.push(a);
    }
    Ok(UbUrl {
        addrs,
        authority: auth.to_string(),
        root: root.to_string(),
        path: path.to_string(),
    })
}

/// The transport `[remote] transport` names, opened (RDMA: the device and its completion thread).
fn remote_transport(cfg: &RunConfig) -> Result<Arc<dyn ubdirect_net::Transport>, LoadError> {
    match cfg.remote.transport {
        TransportKind::Tcp => Ok(Arc::new(ubdirect_net::Tcp)),
        #[cfg(feature = "rdma")]
        TransportKind::Rdma => {
            let r = ubdirect_net::rdma::Rdma::open(&ubdirect_net::rdma::RdmaConfig {
                device: cfg.remote.rdma_device.clone(),
                gid_index: None,
            })
            .map_err(|e| LoadError::Remote(e.into()))?;
            Ok(Arc::new(ubdirect_net::transport::RdmaTransport::new(r)))
        }
        #[cfg(not(feature = "rdma"))]
        TransportKind::Rdma => Err(LoadError::Config(
            "remote.transport = \"rdma\" needs a build with --features rdma".into(),
        )),
    }
}

/// `ub://` files: a client per server set, a [`RemoteSource`](ubdirect_net::RemoteSource) per file.
struct RemoteFiles<'a> {
    rt: &'a tokio::runtime::Runtime,
    token: String,
    deadline: Duration,
    transport: Arc<dyn ubdirect_net::Transport>,
    connections: usize,
    clients: Mutex<HashMap<String, ubdirect_net::Client>>,
    opened: Mutex<HashMap<String, Arc<ubdirect_net::RemoteSource>>>,
}

impl RemoteFiles<'_> {
    fn source(&self, url: &str) -> Result<Arc<ubdirect_net::RemoteSource>, LoadError> {
        if let Some(s) = self.opened.lock().ok().and_then(|m| m.get(url).cloned()) {
            return Ok(s);
        }
        let u = parse_ub_url(url)?;
        let client = {
            let mut m = self.clients.lock().unwrap_or_else(|p| p.into_inner());
            m.entry(u.authority.clone())
                .or_insert_with(|| {
                    ubdirect_net::Client::with_connections(
                        u.addrs.clone(),
                        self.token.clone(),
                        self.deadline,
                        self.transport.clone(),
                        self.connections,
                    )
                })
                .clone()
        };
        let file = block_on(self.rt, client.open(&u.root, &u.path))?
            .map_err(|e| LoadError::Remote(e.into()))?;
        let s = Arc::new(ubdirect_net::RemoteSource::new(client, file, url));
        if let Ok(mut m) = self.opened.lock() {
            m.insert(url.to_string(), s.clone());
        }
        Ok(s)
    }
}

fn remote_err(path: &Path, e: LoadError) -> FormatError {
    FormatError::Io {
        path: path.to_path_buf(),
        source: std::io::Error::other(e),
    }
}

impl Opener for RemoteFiles<'_> {
    fn open(&self, path: &Path) -> Result<Box<dyn ShardFile + '_>, FormatError> {
        let src = self
            .source(&path.to_string_lossy())
            .map_err(|e| remote_err(path, e))?;
        let r = SourceReader::new(self.rt, src, self.deadline).map_err(|e| remote_err(path, e))?;
        Ok(Box::new(r))
    }

    fn size(&self, path: &Path) -> Result<u64, FormatError> {
        self.source(&path.to_string_lossy())
            .map(|s| s.size())
            .map_err(|e| remote_err(path, e))
    }
}

/// The opener of `ub://` files for `cfg`'s `[remote]` settings.
fn remote_files<'a>(
    rt: &'a tokio::runtime::Runtime,
    cfg: &RunConfig,
) -> Result<RemoteFiles<'a>, LoadError> {
    Ok(RemoteFiles {
        rt,
        token: cfg
            .remote
            .token()
            .map_err(|e| LoadError::Config(e.to_string()))?,
        deadline: Duration::from_millis(cfg.remote.deadline_ms.max(1)),
        transport: remote_transport(cfg)?,
        connections: cfg.remote.connections,
        clients: Mutex::new(HashMap::new()),
        opened: Mutex::new(HashMap::new()),
    })
}

/// Runs `f` with the opener of `index`'s shards — `ub://` files (on their servers, with `cfg`'s
/// `[remote]` settings) or local files — for what is read from the shards after indexing (an Arrow
/// schema's token type, the other columns of several-column samples).
pub(crate) fn with_opener<T>(
    rt: &tokio::runtime::Runtime,
    cfg: &RunConfig,
    index: &DatasetIndex,
    f: impl FnOnce(&dyn Opener) -> T,
) -> Result<T, LoadError> {
    if index
        .shards
        .iter()
        .any(|s| s.path.to_string_lossy().starts_with("ub://"))
    {
        let files = remote_files(rt, cfg)?;
        Ok(f(&files))
    } else {
        Ok(f(&crate::formats::LocalFiles))
    }
}

/// Opens every `ub://` shard and builds the index through the same format dispatch as local shards:
/// headers, footers and Megatron `.idx` files are read through the shard's own source.
fn open_remote(rt: &tokio::runtime::Runtime, cfg: &RunConfig) -> Result<Opened, LoadError> {
    let files = remote_files(rt, cfg)?;
    // Every file is opened first, so that a refusal or an unreachable server is the client's typed
    // error (`LoadError::Remote`), not an I/O error inside a format parser.
    for p in &cfg.dataset.paths {
        if cfg.dataset.format == crate::formats::Format::Megatron {
            let (i, b) =
                crate::formats::megatron::idx_and_bin(&crate::formats::megatron::prefix_of(p));
            files.source(&i.to_string_lossy())?;
            files.source(&b.to_string_lossy())?;
        } else {
            files.source(&p.to_string_lossy())?;
        }
    }
    let index = crate::dataset::index_with(&cfg.dataset, &cfg.dataset.paths, &files)?;
    let mut sources: Vec<Arc<dyn Source>> = Vec::with_capacity(index.shards.len());
    for s in &index.shards {
        sources.push(files.source(&s.path.to_string_lossy())?);
    }
    Ok(Opened {
        registrars: dedupe(sources.iter().flat_map(|s| s.registrars()).collect()),
        files: vec![None; index.shards.len()],
        index,
        sources,
        deadline: files.deadline,
        min_read: 0,
        generated: None,
    })
}

/// Any [`Source`] as `Read + Seek`, for format headers and footers: reads go through the source in
/// aligned chunks into one block (registered with the source's consumers), the last chunk cached.
pub(crate) struct SourceReader<'a> {
    rt: &'a tokio::runtime::Runtime,
    src: Arc<dyn Source>,
    deadline: Duration,
    _pool: UbPool,
    lease: Option<Lease>,
    /// (chunk start, where its bytes are in the block, length).
    cached: Option<(u64, usize, usize)>,
    pos: u64,
}

const READER_CHUNK: u64 = 256 << 10;

impl<'a> SourceReader<'a> {
    pub(crate) fn new(
        rt: &'a tokio::runtime::Runtime,
        src: Arc<dyn Source>,
        deadline: Duration,
    ) -> Result<Self, LoadError> {
        let block = (READER_CHUNK as usize + 2 * src.slack()).div_ceil(4096) * 4096;
        let mut b = UbPool::builder(PoolConfig::new("shard-header", block, 1, MemoryKind::Host));
        for r in src.registrars() {
            b = b.register_with(r);
        }
        let pool = b.build()?;
        let lease = pool.try_acquire();
        Ok(Self {
            rt,
            src,
            deadline,
            _pool: pool,
            lease,
            cached: None,
            pos: 0,
        })
    }
}

impl std::io::Read for SourceReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let size = self.src.size();
        if self.pos >= size || buf.is_empty() {
            return Ok(0);
        }
        let start = self.pos / READER_CHUNK * READER_CHUNK;
        if self.cached.is_none_or(|(s, _, _)| s != start) {
            self.cached = None;
            let n = READER_CHUNK.min(size - start) as usize;
            let lease = self
                .lease
                .take()
                .ok_or_else(|| std::io::Error::other("shard header block lost"))?;
            let (r, l) = block_on(self.rt, self.src.read(start, n, lease, 0, self.deadline))
                .map_err(std::io::Error::other)?;
            self.lease = Some(l);
            let done = r.map_err(std::io::Error::other)?;
            self.cached = Some((start, done.data.start, n));
        }
        let (s, at0, n) = self.cached.unwrap_or((start, 0, 0));
        let at = (self.pos - s) as usize;
        let k = buf.len().min(n.saturating_sub(at));
        let data = self
            .lease
            .as_ref()
            .ok_or_else(|| std::io::Error::other("shard header block lost"))?
            .as_slice()
            .map_err(std::io::Error::other)?;
        buf[..k].copy_from_slice(&data[at0 + at..at0 + at + k]);
        self.pos += k as u64;
        Ok(k)
    }
}

impl std::io::Seek for SourceReader<'_> {
    fn seek(&mut self, to: std::io::SeekFrom) -> std::io::Result<u64> {
        let p = match to {
            std::io::SeekFrom::Start(o) => Some(o),
            std::io::SeekFrom::End(d) => self.src.size().checked_add_signed(d),
            std::io::SeekFrom::Current(d) => self.pos.checked_add_signed(d),
        };
        self.pos = p.ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::InvalidInput, "seek before the start")
        })?;
        Ok(self.pos)
    }
}

impl ShardFile for SourceReader<'_> {
    fn size(&self) -> u64 {
        self.src.size()
    }
}
