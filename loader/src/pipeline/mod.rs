//! The loader: plan → acquire staging lease → read → (GPU) copy into the batch's device lease,
//! event → batch. An iterator over batches with exact mid-epoch resumption.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};
use ubdirect_nvme::{Engine, FileHandle, IoError};
use ubdirect_ub::{
    CopyCompletion, Device, DeviceError, Lease, MemoryKind, PoolConfig, UbError, UbPool,
    select_device,
};

use crate::RunConfig;
use crate::formats::FormatError;
use crate::index::DatasetIndex;
use crate::planner::{EpochPlan, PlanConfig, PlanError, plan_epoch};

/// Errors from the loader. Each names the shard, sample or key concerned.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The dataset could not be indexed.
    #[error(transparent)]
    Format(#[from] FormatError),
    /// The epoch could not be planned.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// A pool could not be made, or a block was not free in time.
    #[error(transparent)]
    Pool(#[from] UbError),
    /// The device failed.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// A read failed.
    #[error(transparent)]
    Io(#[from] IoError),
    /// A delivered sample does not match its CRC sidecar.
    #[error(
        "CRC mismatch: sample {sample} of {shard} at offset {offset} ({len} bytes): delivered {got:08x}, sidecar says {expected:08x}"
    )]
    Crc {
        /// Shard path.
        shard: PathBuf,
        /// Sample id.
        sample: u64,
        /// Offset in the shard.
        offset: u64,
        /// Length.
        len: u32,
        /// CRC of the delivered bytes.
        got: u32,
        /// CRC in the sidecar.
        expected: u32,
    },
    /// A remote shard could not be read (refused, or no server within the deadline).
    #[error("remote: {0}")]
    Remote(String),
    /// No batch within the deadline.
    #[error("no batch within {0:?} (loader.batch_timeout_ms)")]
    Timeout(Duration),
    /// The configuration cannot run.
    #[error("config: {0}")]
    Config(String),
    /// A resume state does not belong to this loader.
    #[error("resume: {0}")]
    Resume(String),
    /// The pipeline stopped.
    #[error("pipeline stopped: {0}")]
    Closed(String),
}

/// Where a loader stands: enough to continue exactly where it stopped.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderState {
    /// Epoch.
    pub epoch: u64,
    /// Next batch to deliver in that epoch.
    pub next_batch: u64,
    /// Rank.
    pub rank: usize,
    /// World size.
    pub world_size: usize,
    /// Fingerprint of the planner settings.
    pub plan_fingerprint: u64,
    /// Fingerprint of the dataset index.
    pub index_fingerprint: u64,
}

/// One sample of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SampleEntry {
    /// Sample id (position in the dataset index).
    pub id: u64,
    /// Position in this rank's epoch stream.
    pub position: u64,
    /// Shard index.
    pub shard: u32,
    /// Offset in the shard.
    pub shard_offset: u64,
    /// Length.
    pub len: u32,
    /// Which memory segment of the batch holds it.
    pub segment: u32,
    /// Offset in that segment.
    pub offset: usize,
}

enum BatchMemory {
    /// Staging leases of the batch's chunk, one per read, shared by the chunk's batches (host
    /// device: zero copy).
    Host(Vec<Arc<Lease>>),
    /// One block holding every read of the batch's chunk, shared by the chunk's batches: device
    /// memory on a GPU, host memory with `loader.contiguous_batches` on the host device.
    Block(Arc<Lease>),
}

/// A batch's single block, for zero-copy hand-over (DLPack).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockRef {
    /// Device address (GPU) or host address.
    pub addr: u64,
    /// Bytes in the block.
    pub len: usize,
    /// Whether `addr` is device memory.
    pub on_device: bool,
    /// CUDA ordinal of the device memory.
    pub device_ordinal: Option<usize>,
}

/// A batch: samples over host or device memory. Dropping it returns its blocks to their pools.
pub struct Batch {
    /// Epoch.
    pub epoch: u64,
    /// Index of the batch in this rank's epoch.
    pub index: u64,
    /// Rank.
    pub rank: usize,
    samples: Vec<SampleEntry>,
    memory: BatchMemory,
    device: Arc<dyn Device>,
    read_bytes: u64,
}

impl std::fmt::Debug for Batch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batch")
            .field("epoch", &self.epoch)
            .field("index", &self.index)
            .field("samples", &self.samples.len())
            .field("device", &self.is_device())
            .finish()
    }
}

impl Batch {
    /// Samples in delivery order.
    pub fn samples(&self) -> &[SampleEntry] {
        &self.samples
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.samples.len()
    }

    /// Whether the batch has no samples.
    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// Whether the batch lives in device memory.
    pub fn is_device(&self) -> bool {
        matches!(&self.memory, BatchMemory::Block(l) if l.kind() == MemoryKind::Device)
    }

    /// The one block holding the batch (its chunk's reads; sample offsets are relative to it), when
    /// the batch is a single buffer: always on a GPU, and on the host with
    /// `loader.contiguous_batches`. `None` for zero-copy host batches spread over staging blocks.
    pub fn block(&self) -> Option<BlockRef> {
        match &self.memory {
            BatchMemory::Block(l) => Some(BlockRef {
                addr: l.device_ptr().or_else(|| l.host_ptr().map(|p| p as u64))?,
                len: l.capacity(),
                on_device: l.kind() == MemoryKind::Device,
                device_ordinal: if l.kind() == MemoryKind::Device {
                    self.device.info().ordinal
                } else {
                    None
                },
            }),
            BatchMemory::Host(_) => None,
        }
    }

    /// Bytes read from storage for this batch.
    pub fn read_bytes(&self) -> u64 {
        self.read_bytes
    }

    /// Sample bytes in this batch.
    pub fn sample_bytes(&self) -> u64 {
        self.samples.iter().map(|s| s.len as u64).sum()
    }

    fn entry(&self, i: usize) -> Result<&SampleEntry, LoadError> {
        self.samples.get(i).ok_or_else(|| {
            LoadError::Config(format!("sample {i} of a batch of {}", self.samples.len()))
        })
    }

    /// A host batch's sample bytes (zero copy).
    pub fn sample(&self, i: usize) -> Result<&[u8], LoadError> {
        let e = self.entry(i)?;
        let l: &Lease = match &self.memory {
            BatchMemory::Host(leases) => &leases[e.segment as usize],
            BatchMemory::Block(l) if l.kind() != MemoryKind::Device => l,
            BatchMemory::Block(_) => {
                return Err(LoadError::Config(
                    "sample(): the batch is in device memory; use sample_to_vec or device_ptr"
                        .into(),
                ));
            }
        };
        Ok(&l.as_slice()?[e.offset..e.offset + e.len as usize])
    }

    /// A copy of a sample's bytes, from host or device memory.
    pub fn sample_to_vec(&self, i: usize) -> Result<Vec<u8>, LoadError> {
        let e = *self.entry(i)?;
        match &self.memory {
            BatchMemory::Block(l) if l.kind() == MemoryKind::Device => {
                let mut v = vec![0u8; e.len as usize];
                self.device
                    .copy_to_host(l, e.offset..e.offset + e.len as usize, &mut v)?;
                Ok(v)
            }
            _ => Ok(self.sample(i)?.to_vec()),
        }
    }

    /// A device batch's sample address.
    pub fn device_ptr(&self, i: usize) -> Option<u64> {
        let e = self.samples.get(i)?;
        match &self.memory {
            BatchMemory::Block(l) => l.device_ptr().map(|p| p + e.offset as u64),
            BatchMemory::Host(_) => None,
        }
    }
}

/// Read-size histogram buckets: `< 4 KiB`, then powers of two up to `>= 64 MiB`.
pub const HIST_BUCKETS: usize = 16;

/// Counters of a loader's life.
#[derive(Debug, Default)]
pub struct LoaderStats {
    /// Batches delivered.
    pub batches: AtomicU64,
    /// Samples delivered.
    pub samples: AtomicU64,
    /// Sample bytes delivered.
    pub sample_bytes: AtomicU64,
    /// Reads issued.
    pub reads: AtomicU64,
    /// Bytes read.
    pub read_bytes: AtomicU64,
    /// Samples checked against CRC sidecars.
    pub crc_checked: AtomicU64,
    /// Read sizes, bucket `i` counts reads of `[2^(11+i), 2^(12+i))` bytes (first and last open).
    pub read_hist: [AtomicU64; HIST_BUCKETS],
}

/// Histogram bucket of a read size.
pub fn hist_bucket(len: u64) -> usize {
    let b = 64 - len.max(1).leading_zeros() as usize; // bits
    b.saturating_sub(12).min(HIST_BUCKETS - 1)
}

struct Inner {
    cfg: RunConfig,
    index: Arc<DatasetIndex>,
    plan_cfg: PlanConfig,
    rank: usize,
    world: usize,
    engine: Engine,
    device: Arc<dyn Device>,
    device_reason: String,
    staging: UbPool,
    batch_pool: Option<UbPool>,
    files: Vec<FileHandle>,
    /// Per shard: the NVMe passthrough mapping, when `engine.io` selected it and the shard has one.
    nvme: Vec<Option<Arc<NvmeShard>>>,
    /// Per shard, for `ub://` datasets: the client and the remote file.
    remote: Vec<(ubdirect_net::Client, ubdirect_net::RemoteFile)>,
    crcs: Option<Arc<Vec<u32>>>,
    stats: LoaderStats,
    state: Mutex<LoaderState>,
    acquire_timeout: Duration,
}

/// The dataset iterator. Owns its runtime, engine, pools and device.
pub struct Loader {
    inner: Arc<Inner>,
    rt: Arc<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for Loader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loader")
            .field("rank", &self.inner.rank)
            .field("world", &self.inner.world)
            .field("samples", &self.inner.index.samples.len())
            .finish()
    }
}

type RemoteShards = Vec<(ubdirect_net::Client, ubdirect_net::RemoteFile)>;

/// Parses `ub://HOST:PORT[,HOST:PORT…]/ROOT/PATH`.
fn parse_ub_url(u: &str) -> Result<(Vec<std::net::SocketAddr>, String, String, String), LoadError> {
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
    Ok((addrs, auth.to_string(), root.to_string(), path.to_string()))
}

/// One host block for small remote reads (index files, format headers), registered with the
/// client's transport so that payloads land in it without a fallback.
fn remote_block_pool(
    client: &ubdirect_net::Client,
    name: &str,
    size: usize,
) -> Result<UbPool, LoadError> {
    let mut b = UbPool::builder(PoolConfig::new(name, size, 1, MemoryKind::Host));
    if let Some(r) = client.registrar() {
        b = b.register_with(r);
    }
    Ok(b.build()?)
}

/// Reads a whole (small) remote file into memory, through one host block.
async fn fetch_all(
    client: &ubdirect_net::Client,
    f: &ubdirect_net::RemoteFile,
) -> Result<Vec<u8>, LoadError> {
    let chunk = (client.max_request() as usize).clamp(4096, 4 << 20);
    let pool = remote_block_pool(client, "fetch", chunk.div_ceil(4096) * 4096)?;
    let mut out = Vec::with_capacity(f.size as usize);
    let mut lease = pool
        .try_acquire()
        .ok_or_else(|| LoadError::Closed("fetch pool empty".into()))?;
    while (out.len() as u64) < f.size {
        let n = chunk.min((f.size - out.len() as u64) as usize);
        let (r, l) = client.read(f, out.len() as u64, n, lease, 0).await;
        r.map_err(|e| LoadError::Remote(e.to_string()))?;
        lease = l.ok_or_else(|| LoadError::Remote("fetch: block lost".into()))?;
        out.extend_from_slice(&lease.as_slice()?[..n]);
    }
    Ok(out)
}

/// A `ub://` file as `Read + Seek`, for format headers and footers: reads go through the client in
/// aligned chunks into one block (registered with the transport), the last chunk cached.
struct RemoteReader<'a> {
    rt: &'a tokio::runtime::Runtime,
    client: ubdirect_net::Client,
    file: ubdirect_net::RemoteFile,
    _pool: UbPool,
    lease: Option<ubdirect_ub::Lease>,
    cached: Option<(u64, usize)>,
    pos: u64,
}

const REMOTE_CHUNK: u64 = 256 << 10;

impl<'a> RemoteReader<'a> {
    fn new(
        rt: &'a tokio::runtime::Runtime,
        client: ubdirect_net::Client,
        file: ubdirect_net::RemoteFile,
    ) -> Result<Self, LoadError> {
        let pool = remote_block_pool(&client, "remote-header", REMOTE_CHUNK as usize)?;
        let lease = pool.try_acquire();
        Ok(Self {
            rt,
            client,
            file,
            _pool: pool,
            lease,
            cached: None,
            pos: 0,
        })
    }
}

impl std::io::Read for RemoteReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.pos >= self.file.size || buf.is_empty() {
            return Ok(0);
        }
        let start = self.pos / REMOTE_CHUNK * REMOTE_CHUNK;
        if self.cached.is_none_or(|(s, _)| s != start) {
            let n = REMOTE_CHUNK.min(self.file.size - start) as usize;
            let lease = self
                .lease
                .take()
                .ok_or_else(|| std::io::Error::other("remote header block lost"))?;
            let (r, l) = self
                .rt
                .block_on(self.client.read(&self.file, start, n, lease, 0));
            self.lease = l;
            r.map_err(|e| std::io::Error::other(e.to_string()))?;
            self.cached = Some((start, n));
        }
        let (s, n) = self.cached.unwrap_or((start, 0));
        let at = (self.pos - s) as usize;
        let k = buf.len().min(n.saturating_sub(at));
        let data = self
            .lease
            .as_ref()
            .ok_or_else(|| std::io::Error::other("remote header block lost"))?
            .as_slice()
            .map_err(std::io::Error::other)?;
        buf[..k].copy_from_slice(&data[at..at + k]);
        self.pos += k as u64;
        Ok(k)
    }
}

impl std::io::Seek for RemoteReader<'_> {
    fn seek(&mut self, to: std::io::SeekFrom) -> std::io::Result<u64> {
        let p = match to {
            std::io::SeekFrom::Start(o) => Some(o),
            std::io::SeekFrom::End(d) => self.file.size.checked_add_signed(d),
            std::io::SeekFrom::Current(d) => self.pos.checked_add_signed(d),
        };
        self.pos = p.ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::InvalidInput, "seek before the start")
        })?;
        Ok(self.pos)
    }
}

/// The transport `[remote] transport` names, opened (RDMA: the device and its completion thread).
fn remote_transport(cfg: &RunConfig) -> Result<Arc<dyn ubdirect_net::Transport>, LoadError> {
    match cfg.remote.transport.as_str() {
        "tcp" => Ok(Arc::new(ubdirect_net::Tcp)),
        #[cfg(feature = "rdma")]
        "rdma" => {
            let r = ubdirect_net::rdma::Rdma::open(&ubdirect_net::rdma::RdmaConfig {
                device: cfg.remote.rdma_device.clone(),
                gid_index: None,
            })
            .map_err(|e| LoadError::Remote(format!("rdma: {e}")))?;
            Ok(Arc::new(ubdirect_net::transport::RdmaTransport::new(r)))
        }
        other => Err(LoadError::Config(format!(
            "remote.transport = {other:?} needs a build with --features rdma"
        ))),
    }
}

/// Opens every `ub://` shard and builds the index: raw shards from their sizes; Megatron shards from
/// their `.idx`, fetched from the server and checked against the `.bin` size.
fn open_remote(
    rt: &tokio::runtime::Runtime,
    cfg: &RunConfig,
) -> Result<(DatasetIndex, RemoteShards), LoadError> {
    if !["raw", "megatron", "npy", "arrow"].contains(&cfg.dataset.format.as_str()) {
        return Err(LoadError::Config(format!(
            "remote (ub://) datasets are raw, megatron, npy or arrow, not {:?}",
            cfg.dataset.format
        )));
    }
    let mut readers = Vec::new();
    let token = cfg.remote.token().map_err(LoadError::Config)?;
    let deadline = Duration::from_millis(cfg.remote.deadline_ms.max(1));
    let transport = remote_transport(cfg)?;
    let mut clients: std::collections::HashMap<String, ubdirect_net::Client> =
        std::collections::HashMap::new();
    let mut out = Vec::new();
    let mut sized = Vec::new();
    let mut idx = DatasetIndex {
        format: cfg.dataset.format.clone(),
        ..Default::default()
    };
    for (si, p) in cfg.dataset.paths.iter().enumerate() {
        let u = p.to_string_lossy().to_string();
        if !u.starts_with("ub://") {
            return Err(LoadError::Config(format!(
                "dataset.paths mixes ub:// and local paths ({u})"
            )));
        }
        let (addrs, auth, _, _) = parse_ub_url(&u)?;
        let client = clients
            .entry(auth)
            .or_insert_with(|| {
                ubdirect_net::Client::with_transport(
                    addrs,
                    token.clone(),
                    deadline,
                    transport.clone(),
                )
            })
            .clone();
        let open = |url: &str| -> Result<ubdirect_net::RemoteFile, LoadError> {
            let (_, _, root, path) = parse_ub_url(url)?;
            rt.block_on(client.open(&root, &path))
                .map_err(|e| LoadError::Remote(e.to_string()))
        };
        if cfg.dataset.format == "megatron" {
            let (idx_url, bin_url) =
                crate::formats::megatron::idx_and_bin(&crate::formats::megatron::prefix_of(p));
            let (iu, bu) = (
                idx_url.to_string_lossy().to_string(),
                bin_url.to_string_lossy().to_string(),
            );
            let fi = open(&iu)?;
            let bytes = rt.block_on(fetch_all(&client, &fi))?;
            let m = crate::formats::megatron::parse_idx(&idx_url, &bytes)?;
            let fb = open(&bu)?;
            crate::formats::megatron::add_shard(
                &mut idx, si as u32, &m, &idx_url, &bin_url, fb.size,
            )?;
            out.push((client.clone(), fb));
        } else if cfg.dataset.format == "raw" {
            let f = open(&u)?;
            sized.push((PathBuf::from(&u), f.size));
            out.push((client.clone(), f));
        } else {
            // npy / arrow: their headers and footers are read through a seekable remote file.
            let f = open(&u)?;
            readers.push((
                PathBuf::from(&u),
                f.size,
                RemoteReader::new(rt, client.clone(), f.clone())?,
            ));
            out.push((client.clone(), f));
        }
    }
    match cfg.dataset.format.as_str() {
        "npy" => idx = crate::formats::npy::open_readers(&mut readers)?,
        "arrow" => idx = crate::formats::arrow::open_readers(&mut readers, &cfg.dataset.column)?,
        _ => {}
    }
    if cfg.dataset.format == "raw" {
        let dtype = crate::formats::Dtype::parse(&cfg.dataset.dtype).map_err(LoadError::Config)?;
        idx = crate::formats::raw::open_sized(&sized, dtype, cfg.dataset.record_len)?;
    }
    idx.validate().map_err(LoadError::Config)?;
    Ok((idx, out))
}

/// `/dev/ngXnY` → `/dev/nvmeX`.
fn controller_of(ns: &std::path::Path) -> PathBuf {
    let s = ns.to_string_lossy();
    let ctrl = s
        .strip_prefix("/dev/ng")
        .and_then(|r| r.split('n').next())
        .unwrap_or("0");
    PathBuf::from(format!("/dev/nvme{ctrl}"))
}

fn env_usize(name: &str) -> Result<Option<usize>, LoadError> {
    match std::env::var(name) {
        Ok(v) => v.trim().parse().map(Some).map_err(|_| {
            LoadError::Config(format!("environment variable {name}={v:?} is not a number"))
        }),
        Err(_) => Ok(None),
    }
}

impl Loader {
    /// Builds a loader: indexes the dataset, selects the device, starts the engine, makes the pools
    /// (registered once) and opens every shard. Rank and world size come from the config, else from
    /// torchrun's `RANK` / `WORLD_SIZE`; the GPU from `device.ordinal`, else `LOCAL_RANK`.
    pub fn from_config(cfg: &RunConfig) -> Result<Self, LoadError> {
        cfg.validate("config")
            .map_err(|e| LoadError::Config(e.to_string()))?;
        let rank = match cfg.loader.rank {
            Some(r) => r,
            None => env_usize("RANK")?.unwrap_or(0),
        };
        let world = match cfg.loader.world_size {
            Some(w) => w,
            None => env_usize("WORLD_SIZE")?.unwrap_or(1),
        };
        if world == 0 || rank >= world {
            return Err(LoadError::Config(format!(
                "rank {rank} is not below world size {world}"
            )));
        }
        let ordinal = match cfg.device.ordinal {
            Some(o) => o,
            None => env_usize("LOCAL_RANK")?.unwrap_or(0),
        };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(cfg.loader.threads)
            .thread_name("ubdirect-loader")
            .enable_all()
            .build()
            .map_err(|e| LoadError::Config(format!("cannot start the loader runtime: {e}")))?;
        if let Some(addr) = &cfg.metrics.listen {
            // Installed before the pools exist, so their gauges report to it.
            install_prometheus(&rt, addr)?;
        }
        let is_remote = |p: &PathBuf| p.to_string_lossy().starts_with("ub://");
        let (index, remote) = if cfg.dataset.paths.iter().any(is_remote) {
            let (idx, remote) = open_remote(&rt, cfg)?;
            (Arc::new(idx), remote)
        } else {
            (Arc::new(crate::dataset::open(&cfg.dataset)?), Vec::new())
        };
        let crcs = if cfg.dataset.verify_crc {
            Some(Arc::new(crate::formats::crc::load_sidecars(&index)?))
        } else {
            None
        };
        let selection = cfg.device.select.parse().map_err(LoadError::Config)?;
        let selected = select_device(selection, ordinal)?;
        let device = selected.device.clone();
        let engine = Engine::new(cfg.engine_config())?;
        let staging = UbPool::builder(PoolConfig {
            name: "staging".into(),
            block_size: cfg.pool.staging_block_size.0 as usize,
            block_count: cfg.pool.staging_blocks,
            kind: device.staging_kind(),
            numa_node: cfg.pool.numa_node,
        })
        .device(device.clone())
        .register_with(engine.registrar());
        // Remote payloads land in staging blocks: register them once with the transport (RDMA).
        let staging = match remote.first().and_then(|(c, _)| c.registrar()) {
            Some(r) => staging.register_with(r),
            None => staging,
        }
        .build()?;
        let n = if cfg.pool.batch_blocks == 0 {
            cfg.loader.prefetch + 2
        } else {
            cfg.pool.batch_blocks
        };
        let batch_kind = if device.batch_kind() == MemoryKind::Device {
            Some(MemoryKind::Device)
        } else if cfg.loader.contiguous_batches {
            Some(MemoryKind::Host)
        } else {
            None
        };
        let batch_pool = match batch_kind {
            Some(kind) => Some(
                UbPool::builder(PoolConfig::new(
                    "batch",
                    cfg.pool.batch_block_size.0 as usize,
                    n,
                    kind,
                ))
                .device(device.clone())
                .build()?,
            ),
            None => None,
        };
        let files = if remote.is_empty() {
            index
                .shards
                .iter()
                .map(|s| engine.open(&s.path))
                .collect::<Result<Vec<_>, _>>()?
        } else {
            Vec::new()
        };
        let mut nvme = Vec::with_capacity(files.len());
        let mut namespaces: std::collections::HashMap<PathBuf, Arc<ubdirect_nvme::Namespace>> =
            std::collections::HashMap::new();
        for s in &index.shards {
            if cfg.engine.io == "file" || !remote.is_empty() {
                nvme.push(None);
                continue;
            }
            let mapped = ubdirect_nvme::extents::map_file(&s.path).and_then(|map| {
                let ns = match namespaces.get(&map.namespace) {
                    Some(n) => n.clone(),
                    None => {
                        let n = Arc::new(
                            ubdirect_nvme::Namespace::open(&map.namespace)
                                .map_err(|e| e.to_string())?,
                        );
                        namespaces.insert(map.namespace.clone(), n.clone());
                        n
                    }
                };
                Ok((ns, map))
            });
            match mapped {
                Ok((ns, map)) => {
                    let via_file = map.extents.iter().filter(|e| e.not_raw.is_some()).count();
                    if via_file > 0 {
                        ubdirect_ub::fallback::record(
                            "nvme_extent_via_file",
                            format!(
                                "{}: {via_file} extent(s) cannot be read raw ({}); read through the file path",
                                s.path.display(),
                                map.extents.iter().find_map(|e| e.not_raw).unwrap_or("?")
                            ),
                        );
                    }
                    let max_transfer =
                        ubdirect_nvme::Controller::open(controller_of(&map.namespace))
                            .and_then(|c| c.identify())
                            .ok()
                            .and_then(|id| id.max_transfer())
                            .unwrap_or(128 << 10)
                            .min(1 << 20);
                    nvme.push(Some(Arc::new(NvmeShard {
                        ns,
                        map,
                        max_transfer,
                    })));
                }
                Err(reason) if cfg.engine.io == "nvme" => {
                    return Err(LoadError::Config(format!("engine.io = \"nvme\": {reason}")));
                }
                Err(reason) => {
                    ubdirect_ub::fallback::record(
                        "nvme_unavailable",
                        format!("engine.io = \"auto\": {reason}; reading through the file path"),
                    );
                    nvme.push(None);
                }
            }
        }
        for (f, s) in files.iter().zip(&index.shards) {
            if f.size() != Some(s.size) {
                return Err(LoadError::Config(format!(
                    "{} changed size while opening",
                    s.path.display()
                )));
            }
        }
        let plan_cfg = cfg.plan_config();
        plan_cfg.validate()?;
        let state = LoaderState {
            epoch: 0,
            next_batch: 0,
            rank,
            world_size: world,
            plan_fingerprint: plan_cfg.fingerprint(),
            index_fingerprint: index.fingerprint(),
        };
        Ok(Self {
            inner: Arc::new(Inner {
                acquire_timeout: Duration::from_millis(cfg.pool.acquire_timeout_ms),
                cfg: cfg.clone(),
                index,
                plan_cfg,
                rank,
                world,
                engine,
                device,
                device_reason: selected.reason,
                staging,
                batch_pool,
                files,
                nvme,
                remote,
                crcs,
                stats: LoaderStats::default(),
                state: Mutex::new(state),
            }),
            rt: Arc::new(rt),
        })
    }

    /// The dataset index.
    pub fn index(&self) -> &DatasetIndex {
        &self.inner.index
    }

    /// Rank and world size.
    pub fn rank_world(&self) -> (usize, usize) {
        (self.inner.rank, self.inner.world)
    }

    /// The device batches go to, and why it was chosen.
    pub fn device(&self) -> (&Arc<dyn Device>, &str) {
        (&self.inner.device, &self.inner.device_reason)
    }

    /// The io_uring engine.
    pub fn engine(&self) -> &Engine {
        &self.inner.engine
    }

    /// The staging pool and, on a GPU, the batch pool.
    pub fn pools(&self) -> (&UbPool, Option<&UbPool>) {
        (&self.inner.staging, self.inner.batch_pool.as_ref())
    }

    /// I/O path of the shards (the first shard's; all are opened the same way).
    pub fn io_path(&self) -> &'static str {
        if let Some((c, _)) = self.inner.remote.first() {
            return if c.transport() == "rdma" {
                "ubdirect RDMA from storage servers: one-sided RDMA WRITE into registered staging leases (control on TCP)"
            } else {
                "ubdirect TCP from storage servers, payloads received into staging leases"
            };
        }
        if self.inner.nvme.first().is_some_and(|n| n.is_some()) {
            return "NVMe passthrough (NVME_IOCTL_IO_CMD on /dev/ngXnY) of the file's extents";
        }
        self.inner.files.first().map_or("none", |f| f.io_path())
    }

    /// Counters.
    pub fn stats(&self) -> &LoaderStats {
        &self.inner.stats
    }

    /// The configuration.
    pub fn config(&self) -> &RunConfig {
        &self.inner.cfg
    }

    /// This rank's plan for an epoch.
    pub fn plan(&self, epoch: u64) -> Result<EpochPlan, LoadError> {
        Ok(plan_epoch(
            &self.inner.index,
            &self.inner.plan_cfg,
            epoch,
            self.inner.rank,
            self.inner.world,
        )?)
    }

    /// Where the loader stands (after the last batch an iterator delivered).
    pub fn state(&self) -> LoaderState {
        self.inner
            .state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Iterates the batches of `epoch` from its start.
    pub fn epoch(&self, epoch: u64) -> Result<EpochIter, LoadError> {
        self.epoch_from(epoch, 0)
    }

    /// Continues exactly where `state` stood. Refused if the state belongs to another dataset,
    /// planner setting, rank or world size.
    pub fn resume(&self, state: &LoaderState) -> Result<EpochIter, LoadError> {
        let mine = self.state();
        if state.index_fingerprint != mine.index_fingerprint {
            return Err(LoadError::Resume(
                "the dataset differs from the one the state was saved with".into(),
            ));
        }
        if state.plan_fingerprint != mine.plan_fingerprint {
            return Err(LoadError::Resume(
                "loader settings (batch size, seed, shuffle, reads) differ from the saved state's"
                    .into(),
            ));
        }
        if (state.rank, state.world_size) != (mine.rank, mine.world_size) {
            return Err(LoadError::Resume(format!(
                "state is rank {}/{}, this loader is rank {}/{}",
                state.rank, state.world_size, mine.rank, mine.world_size
            )));
        }
        self.epoch_from(state.epoch, state.next_batch)
    }

    fn epoch_from(&self, epoch: u64, start: u64) -> Result<EpochIter, LoadError> {
        let plan = Arc::new(self.plan(epoch)?);
        let inner = &self.inner;
        for (ci, c) in plan.chunks.iter().enumerate() {
            if inner.batch_pool.is_none() && c.reads.len() > inner.staging.block_count() {
                return Err(LoadError::Config(format!(
                    "chunk {ci} (batches {:?}) needs {} reads but pool.staging_blocks is {}: host batches hold their reads; raise pool.staging_blocks, loader.max_gap or loader.shuffle_block",
                    c.batch_range(),
                    c.reads.len(),
                    inner.staging.block_count()
                )));
            }
            if let Some(bp) = &inner.batch_pool {
                let need: u64 = c.reads.iter().map(|r| r.len.div_ceil(4096) * 4096).sum();
                if need > bp.block_size() as u64 {
                    return Err(LoadError::Config(format!(
                        "chunk {ci} (batches {:?}) reads {need} bytes but pool.batch_block_size is {}: raise it, or lower loader.batch_size or loader.max_chunk_batches",
                        c.batch_range(),
                        bp.block_size()
                    )));
                }
            }
        }
        let total = plan.batches.len() as u64;
        let start = start.min(total);
        {
            let mut st = inner.state.lock().unwrap_or_else(|p| p.into_inner());
            st.epoch = epoch;
            st.next_batch = start;
        }
        let (tx, rx) = mpsc::channel(inner.cfg.loader.prefetch);
        let producer = self
            .rt
            .spawn(produce(inner.clone(), plan.clone(), start, tx));
        Ok(EpochIter {
            inner: inner.clone(),
            rt: self.rt.clone(),
            rx,
            ready: std::collections::VecDeque::new(),
            pending: None,
            waiting_since: None,
            producer,
            epoch,
            next: start,
            total,
            timeout: Duration::from_millis(inner.cfg.loader.batch_timeout_ms),
            done: false,
        })
    }
}

/// Serves Prometheus metrics on `addr` from the loader's runtime. One per process: a second call (or
/// another recorder already installed) is an error.
fn install_prometheus(rt: &tokio::runtime::Runtime, addr: &str) -> Result<(), LoadError> {
    let sock: std::net::SocketAddr = addr
        .parse()
        .map_err(|_| LoadError::Config(format!("metrics.listen {addr:?} is not an address")))?;
    let _guard = rt.enter();
    let (recorder, exporter) = metrics_exporter_prometheus::PrometheusBuilder::new()
        .with_http_listener(sock)
        .build()
        .map_err(|e| LoadError::Config(format!("metrics.listen {addr}: {e}")))?;
    metrics::set_global_recorder(recorder).map_err(|_| {
        LoadError::Config(
            "metrics.listen: a metrics recorder is already installed in this process".into(),
        )
    })?;
    rt.spawn(async move {
        if let Err(e) = exporter.await {
            tracing::error!("prometheus endpoint stopped: {e:?}");
        }
    });
    Ok(())
}

/// A shard read by NVMe passthrough: its namespace and extents.
struct NvmeShard {
    ns: Arc<ubdirect_nvme::Namespace>,
    map: ubdirect_nvme::extents::FileMap,
    max_transfer: u64,
}

/// One piece of a read: raw (LBAs on the namespace), through the file, or a hole.
enum Piece {
    Raw { pos: usize, phys: u64, len: u64 },
    File { pos: usize, off: u64, len: u64 },
    Hole { pos: usize, len: u64 },
}

fn pieces(map: &ubdirect_nvme::extents::FileMap, off: u64, len: u64) -> Vec<Piece> {
    let mut v = Vec::new();
    let mut at = off;
    let end = off + len;
    for e in &map.extents {
        let (es, ee) = (e.logical, e.logical + e.len);
        if ee <= at || es >= end {
            continue;
        }
        if es > at {
            v.push(Piece::Hole {
                pos: (at - off) as usize,
                len: es - at,
            });
            at = es;
        }
        let stop = ee.min(end);
        let pos = (at - off) as usize;
        match e.not_raw {
            None => v.push(Piece::Raw {
                pos,
                phys: e.physical + (at - es),
                len: stop - at,
            }),
            Some(_) => v.push(Piece::File {
                pos,
                off: at,
                len: stop - at,
            }),
        }
        at = stop;
    }
    if at < end {
        v.push(Piece::Hole {
            pos: (at - off) as usize,
            len: end - at,
        });
    }
    v
}

/// Reads `len` bytes at `off` of an NVMe-mapped shard into `lease[0..]`: raw extents by passthrough
/// (on a blocking thread: the ioctl is synchronous), the rest through the engine's file path.
async fn read_nvme(
    inner: Arc<Inner>,
    shard: usize,
    nv: Arc<NvmeShard>,
    off: u64,
    len: usize,
    lease: Lease,
) -> (Result<ubdirect_nvme::ReadDone, LoadError>, Lease) {
    let ps = pieces(&nv.map, off, len as u64);
    let nv2 = nv.clone();
    let raw: Vec<(usize, u64, u64)> = ps
        .iter()
        .filter_map(|p| {
            if let Piece::Raw { pos, phys, len } = p {
                Some((*pos, *phys, *len))
            } else {
                None
            }
        })
        .collect();
    // The ioctl is synchronous: run it in place, telling the runtime to move other tasks off this
    // worker meanwhile (the loader's runtime is multi-threaded).
    let mut lease = lease;
    let r = tokio::task::block_in_place(|| {
        let bs = nv2.ns.id().lba_size as u64;
        for (pos, phys, len) in raw {
            let mut done = 0u64;
            while done < len {
                let chunk = (len - done).min(nv2.max_transfer);
                let nlb = chunk.div_ceil(bs) as u32;
                nv2.ns
                    .read((phys + done) / bs, nlb, &mut lease, pos + done as usize)
                    .map_err(|e| LoadError::Config(e.to_string()))?;
                done += chunk;
            }
        }
        Ok::<(), LoadError>(())
    });
    if let Err(e) = r {
        return (Err(e), lease);
    }
    for p in &ps {
        match *p {
            Piece::File {
                pos,
                off: foff,
                len: flen,
            } => {
                let (r, l) = inner
                    .engine
                    .read(&inner.files[shard], foff, flen as usize, lease, pos)
                    .await;
                lease = l;
                if let Err(e) = r {
                    return (Err(e.into()), lease);
                }
            }
            Piece::Hole { pos, len: hlen } => match lease.as_mut_slice() {
                Ok(b) => b[pos..pos + hlen as usize].fill(0),
                Err(e) => return (Err(e.into()), lease),
            },
            Piece::Raw { .. } => {}
        }
    }
    (
        Ok(ubdirect_nvme::ReadDone {
            data: 0..len,
            bytes_read: len,
            direct: true,
        }),
        lease,
    )
}

type ChunkHandle = JoinHandle<Result<Vec<Batch>, LoadError>>;

/// Acquires blocks in chunk order (so chunks never wait on each other's blocks) and spawns one task
/// per chunk; the bounded channel is the prefetch depth.
async fn produce(
    inner: Arc<Inner>,
    plan: Arc<EpochPlan>,
    start: u64,
    tx: mpsc::Sender<ChunkHandle>,
) {
    let Some(first_chunk) = plan.batches.get(start as usize).map(|b| b.chunk as usize) else {
        return;
    };
    for ci in first_chunk..plan.chunks.len() {
        let chunk = &plan.chunks[ci];
        let batches: Vec<usize> = chunk.batch_range().filter(|&b| b as u64 >= start).collect();
        let dev = match &inner.batch_pool {
            Some(bp) => match bp.acquire(inner.acquire_timeout).await {
                Ok(l) => Some(l),
                Err(e) => {
                    let _ = tx.send(tokio::spawn(async move { Err(e.into()) })).await;
                    return;
                }
            },
            None => None,
        };
        let nreads = chunk.reads.len();
        let (ltx, lrx) = mpsc::channel(nreads.max(1));
        let (etx, erx) = tokio::sync::oneshot::channel();
        let h = tokio::spawn(build_chunk(
            inner.clone(),
            plan.clone(),
            ci,
            batches,
            lrx,
            dev,
            erx,
        ));
        if tx.send(h).await.is_err() {
            return; // the iterator is gone
        }
        for _ in 0..nreads {
            match inner.staging.acquire(inner.acquire_timeout).await {
                Ok(l) => {
                    if ltx.send(l).await.is_err() {
                        break; // the chunk failed; its error reaches the consumer
                    }
                }
                Err(e) => {
                    let _ = etx.send(e);
                    return;
                }
            }
        }
    }
}

async fn build_chunk(
    inner: Arc<Inner>,
    plan: Arc<EpochPlan>,
    ci: usize,
    batches: Vec<usize>,
    mut leases: mpsc::Receiver<Lease>,
    mut dev: Option<Lease>,
    acquire_err: tokio::sync::oneshot::Receiver<UbError>,
) -> Result<Vec<Batch>, LoadError> {
    let chunk = &plan.chunks[ci];
    let n = chunk.reads.len();
    // Where each read lands in the chunk's device block (4 KiB aligned).
    let mut dst = Vec::with_capacity(n);
    let mut acc = 0usize;
    for r in &chunk.reads {
        dst.push(acc);
        acc += (r.len as usize).div_ceil(4096) * 4096;
    }
    // Which samples of the chunk each read holds (for CRC checks).
    let mut holds: Vec<Vec<(usize, usize)>> = vec![Vec::new(); n];
    for &b in &batches {
        for (si, s) in plan.batches[b].samples.iter().enumerate() {
            holds[s.read as usize].push((b, si));
        }
    }
    let mut host: Vec<Option<Arc<Lease>>> = (0..n).map(|_| None).collect();
    let mut base = vec![0usize; n];
    let mut copies: Vec<CopyCompletion> = Vec::new();
    let mut reads: JoinSet<(
        usize,
        Result<ubdirect_nvme::ReadDone, LoadError>,
        Option<Lease>,
    )> = JoinSet::new();
    let mut received = 0;
    let mut acquire_err = acquire_err;
    while received < n || !reads.is_empty() {
        tokio::select! {
            l = leases.recv(), if received < n => {
                let Some(lease) = l else {
                    return Err(match (&mut acquire_err).await {
                        Ok(e) => e.into(),
                        Err(_) => LoadError::Closed(format!("chunk {ci}: staging blocks stopped coming")),
                    });
                };
                let r = &chunk.reads[received];
                let (engine, file, ri, off, len) = (inner.engine.clone(), inner.files.get(r.shard as usize).cloned(), received, r.offset, r.len as usize);
                let nv = inner.nvme.get(r.shard as usize).cloned().flatten();
                let remote = inner.remote.get(r.shard as usize).cloned();
                let (inner2, shard) = (inner.clone(), r.shard as usize);
                reads.spawn(async move {
                    match (remote, nv, file) {
                        (Some((client, rf)), _, _) => {
                            let (res, lease) = client.read(&rf, off, len, lease, 0).await;
                            let res = res
                                .map(|()| ubdirect_nvme::ReadDone { data: 0..len, bytes_read: len, direct: false })
                                .map_err(|e| LoadError::Remote(e.to_string()));
                            (ri, res, lease)
                        }
                        (None, Some(nv), _) => {
                            let (res, lease) = read_nvme(inner2, shard, nv, off, len, lease).await;
                            (ri, res, Some(lease))
                        }
                        (None, None, Some(file)) => {
                            let (res, lease) = engine.read(&file, off, len, lease, 0).await;
                            (ri, res.map_err(LoadError::from), Some(lease))
                        }
                        (None, None, None) => (ri, Err(LoadError::Closed(format!("shard {shard} has no reader"))), Some(lease)),
                    }
                });
                received += 1;
            }
            Some(j) = reads.join_next(), if !reads.is_empty() => {
                let (ri, res, lease) = j.map_err(|e| LoadError::Closed(format!("read task: {e}")))?;
                let done = res?;
                let mut lease = lease.ok_or_else(|| LoadError::Closed("read returned no block".into()))?;
                let r = &chunk.reads[ri];
                inner.stats.reads.fetch_add(1, Ordering::Relaxed);
                inner.stats.read_bytes.fetch_add(r.len, Ordering::Relaxed);
                inner.stats.read_hist[hist_bucket(r.len)].fetch_add(1, Ordering::Relaxed);
                if let Some(crcs) = &inner.crcs {
                    let bytes = lease.as_slice()?;
                    for &(b, si) in &holds[ri] {
                        let s = &plan.batches[b].samples[si];
                        let at = done.data.start + s.offset_in_read as usize;
                        let got = crc32fast::hash(&bytes[at..at + s.len as usize]);
                        let want = crcs[s.id as usize];
                        if got != want {
                            let loc = inner.index.samples[s.id as usize];
                            return Err(LoadError::Crc {
                                shard: inner.index.shards[loc.shard as usize].path.clone(),
                                sample: s.id,
                                offset: loc.offset,
                                len: s.len,
                                got,
                                expected: want,
                            });
                        }
                    }
                    inner.stats.crc_checked.fetch_add(holds[ri].len() as u64, Ordering::Relaxed);
                }
                match dev.as_mut() {
                    Some(d) => {
                        copies.push(inner.device.copy_to_device(&mut lease, done.data.clone(), d, dst[ri])?);
                        base[ri] = dst[ri];
                        // The staging block is orphaned until the copy's event fires, then recycled.
                        drop(lease);
                    }
                    None => {
                        base[ri] = done.data.start;
                        host[ri] = Some(Arc::new(lease));
                    }
                }
            }
        }
    }
    for c in copies {
        c.wait(inner.acquire_timeout).await?;
    }
    let dev = dev.map(Arc::new);
    let host: Vec<Arc<Lease>> = if dev.is_none() {
        host.into_iter()
            .map(|l| l.ok_or_else(|| LoadError::Closed("missing read".into())))
            .collect::<Result<_, _>>()?
    } else {
        Vec::new()
    };
    let chunk_read = chunk.read_bytes() / chunk.batches.max(1) as u64;
    let mut out = Vec::with_capacity(batches.len());
    for &b in &batches {
        let samples = plan.batches[b]
            .samples
            .iter()
            .map(|s| {
                let loc = inner.index.samples[s.id as usize];
                SampleEntry {
                    id: s.id,
                    position: s.position,
                    shard: loc.shard,
                    shard_offset: loc.offset,
                    len: s.len,
                    segment: if dev.is_some() { 0 } else { s.read },
                    offset: base[s.read as usize] + s.offset_in_read as usize,
                }
            })
            .collect();
        let memory = match &dev {
            Some(d) => BatchMemory::Block(d.clone()),
            None => BatchMemory::Host(host.clone()),
        };
        out.push(Batch {
            epoch: plan.epoch,
            index: b as u64,
            rank: plan.rank,
            samples,
            memory,
            device: inner.device.clone(),
            read_bytes: chunk_read,
        });
    }
    Ok(out)
}

/// The batches of one epoch, in order.
pub struct EpochIter {
    inner: Arc<Inner>,
    rt: Arc<tokio::runtime::Runtime>,
    rx: mpsc::Receiver<ChunkHandle>,
    ready: std::collections::VecDeque<Batch>,
    pending: Option<ChunkHandle>,
    waiting_since: Option<std::time::Instant>,
    producer: JoinHandle<()>,
    epoch: u64,
    next: u64,
    total: u64,
    timeout: Duration,
    done: bool,
}

impl std::fmt::Debug for EpochIter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EpochIter")
            .field("epoch", &self.epoch)
            .field("next", &self.next)
            .field("total", &self.total)
            .finish()
    }
}

impl EpochIter {
    /// Batches in the epoch (for this rank).
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Index of the next batch.
    pub fn position(&self) -> u64 {
        self.next
    }
}

/// What [`EpochIter::next_within`] found.
#[derive(Debug)]
pub enum Next {
    /// A batch, or the error that ended the epoch.
    Batch(Result<Batch, LoadError>),
    /// Nothing yet; call again (the batch deadline keeps running).
    Pending,
    /// The epoch is over.
    End,
}

impl EpochIter {
    /// Waits at most `wait` for the next batch: lets a caller check for interruption (Ctrl-C) between
    /// waits. `loader.batch_timeout_ms` still bounds the total wait for one batch.
    pub fn next_within(&mut self, wait: Duration) -> Next {
        if self.done || self.next >= self.total {
            return Next::End;
        }
        let r = match self.ready.pop_front() {
            Some(b) => Ok(b),
            None => {
                let since = *self
                    .waiting_since
                    .get_or_insert_with(std::time::Instant::now);
                let left = self.timeout.saturating_sub(since.elapsed());
                if left.is_zero() {
                    self.done = true;
                    return Next::Batch(Err(LoadError::Timeout(self.timeout)));
                }
                let wait = wait.min(left);
                let (rx, pending) = (&mut self.rx, &mut self.pending);
                let got = self.rt.block_on(async {
                    let deadline = tokio::time::Instant::now() + wait;
                    if pending.is_none() {
                        match tokio::time::timeout_at(deadline, rx.recv()).await {
                            Ok(Some(h)) => *pending = Some(h),
                            Ok(None) => {
                                return Some(Err(LoadError::Closed("the producer stopped".into())));
                            }
                            Err(_) => return None,
                        }
                    }
                    let h = pending.as_mut()?;
                    match tokio::time::timeout_at(deadline, h).await {
                        Ok(res) => {
                            *pending = None;
                            Some(
                                res.map_err(|e| LoadError::Closed(format!("chunk task: {e}")))
                                    .and_then(|r| r),
                            )
                        }
                        Err(_) => None,
                    }
                });
                match got {
                    None => return Next::Pending,
                    Some(r) => r.and_then(|v| {
                        self.ready.extend(v);
                        self.ready
                            .pop_front()
                            .ok_or_else(|| LoadError::Closed("empty chunk".into()))
                    }),
                }
            }
        };
        self.waiting_since = None;
        match &r {
            Ok(b) => {
                self.next += 1;
                let s = &self.inner.stats;
                s.batches.fetch_add(1, Ordering::Relaxed);
                s.samples.fetch_add(b.len() as u64, Ordering::Relaxed);
                s.sample_bytes
                    .fetch_add(b.sample_bytes(), Ordering::Relaxed);
                metrics::counter!("ubdirect_loader_batches_total").increment(1);
                metrics::counter!("ubdirect_loader_samples_total").increment(b.len() as u64);
                metrics::counter!("ubdirect_loader_sample_bytes_total").increment(b.sample_bytes());
                metrics::counter!("ubdirect_loader_read_bytes_total").increment(b.read_bytes());
                let mut st = self.inner.state.lock().unwrap_or_else(|p| p.into_inner());
                st.epoch = self.epoch;
                st.next_batch = self.next;
            }
            Err(_) => self.done = true,
        }
        Next::Batch(r)
    }
}

impl Iterator for EpochIter {
    type Item = Result<Batch, LoadError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            match self.next_within(self.timeout) {
                Next::Batch(r) => return Some(r),
                Next::End => return None,
                Next::Pending => continue,
            }
        }
    }
}

impl Drop for EpochIter {
    fn drop(&mut self) {
        self.producer.abort();
        self.rx.close();
        while let Ok(h) = self.rx.try_recv() {
            h.abort();
        }
        if let Some(h) = self.pending.take() {
            h.abort();
        }
    }
}
