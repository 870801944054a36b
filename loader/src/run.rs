//! `ubdirect run`: storage → register-once staging pool → (GPU) device pool, measured.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use ubdirect_nvme::{Engine, IoError};
use ubdirect_ub::{
    DeviceError, DeviceSelection, MemoryKind, PoolConfig, UbError, UbPool, select_device,
};

use crate::RunConfig;

/// Errors of a run.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// Bad configuration.
    #[error(transparent)]
    Config(#[from] crate::ConfigError),
    /// A pool could not be made or a block acquired.
    #[error(transparent)]
    Pool(#[from] UbError),
    /// The device could not be opened or a copy failed.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// A read failed.
    #[error(transparent)]
    Io(#[from] IoError),
    /// Generating or checking the input file failed.
    #[error("{path}: {what}: {source}")]
    File {
        /// The file.
        path: PathBuf,
        /// What was being done.
        what: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Delivered bytes differ from the file.
    #[error(
        "verify {path} at {offset}+{len}: CRC-32 {got:08x} delivered, {expected:08x} in the file"
    )]
    Verify {
        /// The file.
        path: PathBuf,
        /// Offset of the read.
        offset: u64,
        /// Length.
        len: usize,
        /// CRC delivered.
        got: u32,
        /// CRC expected.
        expected: u32,
    },
    /// A pipeline task failed to run.
    #[error("pipeline task: {0}")]
    Task(String),
}

/// One fallback taken, for the summary.
#[derive(Debug, Clone, Serialize)]
pub struct FallbackRow {
    /// Kind.
    pub kind: String,
    /// Times taken.
    pub count: u64,
    /// First occurrence.
    pub detail: String,
}

/// What a run did and how fast.
#[derive(Debug, Clone, Serialize)]
pub struct RunSummary {
    /// Device used (`host`, or the GPU's name).
    pub device: String,
    /// Why that device.
    pub device_reason: String,
    /// Where batches landed.
    pub delivered_to: String,
    /// The I/O path reads took.
    pub io_path: String,
    /// The file read.
    pub path: PathBuf,
    /// Its size.
    pub file_bytes: u64,
    /// Bytes per read.
    pub read_size: u64,
    /// Passes over the file.
    pub passes: u32,
    /// io_uring rings.
    pub rings: usize,
    /// Queue depth per ring.
    pub queue_depth: u32,
    /// SQPOLL running.
    pub sqpoll: bool,
    /// Bytes delivered over all passes.
    pub bytes: u64,
    /// Wall time over all passes.
    pub seconds: f64,
    /// Delivered GB/s (10^9 bytes) over all passes.
    pub gb_per_s: f64,
    /// GB/s of each pass.
    pub pass_gb_per_s: Vec<f64>,
    /// Process CPU seconds per delivered GB.
    pub cpu_s_per_gb: f64,
    /// Reads completed.
    pub reads: u64,
    /// Reads completed in more than one piece.
    pub short_reads: u64,
    /// EINTR/EAGAIN retries.
    pub retries: u64,
    /// Registrations of the staging pool (all at creation).
    pub staging_registrations: u64,
    /// Registrations with consumers, by name.
    pub registered_with: Vec<String>,
    /// Longest wait for a staging block.
    pub max_acquire_wait_ms: f64,
    /// Whether every block's CRC was checked against the file.
    pub verified: bool,
    /// Every fallback taken in this process.
    pub fallbacks: Vec<FallbackRow>,
}

/// Runs the configured job.
pub async fn run(cfg: &RunConfig, progress: bool) -> Result<RunSummary, RunError> {
    let selection: DeviceSelection =
        cfg.device
            .select
            .parse()
            .map_err(|reason: String| crate::ConfigError::Invalid {
                origin: "run".into(),
                key: "device.select",
                reason,
            })?;
    let selected = select_device(selection, cfg.device.ordinal)?;
    let dev = selected.device.clone();
    let path = cfg.source.path.clone();
    if cfg.source.generate {
        ensure_file(&path, cfg.source.size.0)?;
    }
    let engine = Engine::new(cfg.engine_config())?;
    let block_size = cfg.pool.block_size.0 as usize;
    let staging = UbPool::builder(PoolConfig {
        name: "staging".into(),
        block_size,
        block_count: cfg.pool.blocks,
        kind: dev.staging_kind(),
        numa_node: cfg.pool.numa_node,
    })
    .device(dev.clone())
    .register_with(engine.registrar())
    .build()?;
    let batch = if dev.batch_kind() == MemoryKind::Device {
        Some(
            UbPool::builder(PoolConfig::new(
                "batch",
                block_size,
                cfg.pool.blocks,
                MemoryKind::Device,
            ))
            .device(dev.clone())
            .build()?,
        )
    } else {
        None
    };
    let file = engine.open(&path)?;
    let size = file.size().unwrap_or(0);
    let rs = cfg.source.read_size.0;
    let reads: Vec<(u64, usize)> = (0..size.div_ceil(rs))
        .map(|i| (i * rs, (rs.min(size - i * rs)) as usize))
        .collect();
    let expected: Arc<Vec<u32>> = Arc::new(if cfg.source.verify {
        file_crcs(&path, &reads)?
    } else {
        Vec::new()
    });

    let acquire_timeout = Duration::from_millis(cfg.pool.acquire_timeout_ms);
    let cpu0 = crate::sys::cpu_time();
    let start = Instant::now();
    let mut pass_rates = Vec::new();
    for pass in 0..cfg.source.passes {
        let t0 = Instant::now();
        let mut set = tokio::task::JoinSet::new();
        let max_tasks = cfg.pool.blocks * 2;
        for (i, &(off, len)) in reads.iter().enumerate() {
            while set.len() >= max_tasks {
                join_one(&mut set).await?;
            }
            let (engine, file, staging, batch, dev, expected, path) = (
                engine.clone(),
                file.clone(),
                staging.clone(),
                batch.clone(),
                dev.clone(),
                expected.clone(),
                path.clone(),
            );
            set.spawn(async move {
                let lease = staging.acquire(acquire_timeout).await?;
                let (r, mut lease) = engine.read(&file, off, len, lease, 0).await;
                let done = r?;
                if let Some(&want) = expected.get(i) {
                    let got = crc32fast::hash(&lease.as_slice()?[done.data.clone()]);
                    if got != want {
                        return Err(RunError::Verify {
                            path,
                            offset: off,
                            len,
                            got,
                            expected: want,
                        });
                    }
                }
                if let Some(batch) = batch {
                    let mut dst = batch.acquire(acquire_timeout).await?;
                    let c = dev.copy_to_device(&mut lease, done.data, &mut dst, 0)?;
                    // The staging block is orphaned until the copy's event fires, then recycled.
                    drop(lease);
                    c.wait(acquire_timeout).await?;
                    drop(dst);
                }
                Ok::<(), RunError>(())
            });
        }
        while !set.is_empty() {
            join_one(&mut set).await?;
        }
        let secs = t0.elapsed().as_secs_f64();
        let rate = size as f64 / secs / 1e9;
        pass_rates.push(rate);
        if progress {
            eprintln!(
                "pass {}/{}: {:.2} GB/s ({} reads of {} B)",
                pass + 1,
                cfg.source.passes,
                rate,
                reads.len(),
                rs
            );
        }
    }
    dev.synchronize()?;
    let seconds = start.elapsed().as_secs_f64();
    let cpu = (crate::sys::cpu_time() - cpu0).as_secs_f64();
    let bytes = size * cfg.source.passes as u64;
    let st = engine.stats();
    let ld = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
    let rep = engine.report();
    let pst = staging.stats();
    Ok(RunSummary {
        device: dev.info().name.clone(),
        device_reason: selected.reason,
        delivered_to: if batch.is_some() {
            "device memory".into()
        } else {
            "host memory (zero copy)".into()
        },
        io_path: file.io_path().to_string(),
        path,
        file_bytes: size,
        read_size: rs,
        passes: cfg.source.passes,
        rings: rep.rings,
        queue_depth: rep.queue_depth,
        sqpoll: rep.sqpoll_active,
        bytes,
        seconds,
        gb_per_s: bytes as f64 / seconds / 1e9,
        pass_gb_per_s: pass_rates,
        cpu_s_per_gb: if bytes > 0 {
            cpu / (bytes as f64 / 1e9)
        } else {
            0.0
        },
        reads: ld(&st.reads),
        short_reads: ld(&st.short_reads),
        retries: ld(&st.retries),
        staging_registrations: pst.registrations,
        registered_with: staging.consumers().to_vec(),
        max_acquire_wait_ms: pst.acquire_wait_max.as_secs_f64() * 1e3,
        verified: cfg.source.verify,
        fallbacks: ubdirect_ub::fallback::snapshot()
            .into_iter()
            .map(|f| FallbackRow {
                kind: f.kind.to_string(),
                count: f.count,
                detail: f.first_detail,
            })
            .collect(),
    })
}

async fn join_one(set: &mut tokio::task::JoinSet<Result<(), RunError>>) -> Result<(), RunError> {
    match set.join_next().await {
        Some(Ok(r)) => r,
        Some(Err(e)) => Err(RunError::Task(e.to_string())),
        None => Ok(()),
    }
}

/// CRC-32 of each read range, computed with plain `std::fs` reads (the reference).
fn file_crcs(path: &Path, reads: &[(u64, usize)]) -> Result<Vec<u32>, RunError> {
    let err = |what, source| RunError::File {
        path: path.to_path_buf(),
        what,
        source,
    };
    let mut f = std::fs::File::open(path).map_err(|e| err("open for verification", e))?;
    let mut buf = Vec::new();
    let mut out = Vec::with_capacity(reads.len());
    for &(_off, len) in reads {
        buf.resize(len, 0);
        f.read_exact(&mut buf)
            .map_err(|e| err("read for verification", e))?;
        out.push(crc32fast::hash(&buf));
    }
    Ok(out)
}

/// Writes `size` bytes of deterministic pseudo-random data to `path` unless it already has that size.
pub fn ensure_file(path: &Path, size: u64) -> Result<(), RunError> {
    let err = |what, source| RunError::File {
        path: path.to_path_buf(),
        what,
        source,
    };
    if std::fs::metadata(path)
        .map(|m| m.len() == size)
        .unwrap_or(false)
    {
        return Ok(());
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| err("create directory", e))?;
    }
    let tmp = path.with_extension("partial");
    let mut f = std::fs::File::create(&tmp).map_err(|e| err("create", e))?;
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut chunk = vec![0u8; 4 << 20];
    let mut left = size;
    while left > 0 {
        for w in chunk.chunks_exact_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            w.copy_from_slice(&x.to_le_bytes());
        }
        let n = left.min(chunk.len() as u64) as usize;
        f.write_all(&chunk[..n]).map_err(|e| err("write", e))?;
        left -= n as u64;
    }
    f.sync_all().map_err(|e| err("sync", e))?;
    std::fs::rename(&tmp, path).map_err(|e| err("rename", e))?;
    Ok(())
}
