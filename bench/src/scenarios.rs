//! The scenarios. Each measures ubdirect and its baselines in the same run and returns tables.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use ubdirect_nvme::{DirectMode, Engine, EngineConfig};
use ubdirect_ub::{Device, MemoryKind, PoolConfig, UbPool};

use crate::common::{Row, Table, drop_cache, ensure_file, measure, warm};
use crate::rawring;

/// Settings shared by the scenarios.
pub struct Ctx {
    pub dir: PathBuf,
    pub quick: bool,
    pub runs: usize,
    pub cuda: Option<Arc<ubdirect_ub::CudaDevice>>,
    pub fio: Option<PathBuf>,
    pub rt: tokio::runtime::Runtime,
}

impl Ctx {
    pub(crate) fn seq_file(&self) -> Result<(PathBuf, u64), String> {
        let size: u64 = if self.quick { 256 << 20 } else { 4 << 30 };
        let p = self.dir.join(format!("seq-{}.bin", size >> 20));
        ensure_file(&p, size)?;
        Ok((p, size))
    }
}

fn row(
    label: impl Into<String>,
    fig: (crate::common::Figure, f64),
    baseline: bool,
    note: impl Into<String>,
) -> Row {
    Row {
        label: label.into(),
        gbps: fig.0,
        cpu_s_per_gb: fig.1,
        ratio: None,
        baseline,
        note: note.into(),
    }
}

/// An engine, a registered pool and an open file, made once, outside the measured time.
pub struct EngineBench {
    engine: Engine,
    pool: UbPool,
    file: ubdirect_nvme::FileHandle,
    size: usize,
}

impl EngineBench {
    pub fn new(
        path: &Path,
        size: usize,
        qd: u32,
        rings: usize,
        direct: DirectMode,
    ) -> Result<Self, String> {
        let engine = Engine::new(EngineConfig {
            queue_depth: qd,
            rings,
            direct,
            ..EngineConfig::default()
        })
        .map_err(|e| e.to_string())?;
        let blocks = ((qd as usize * rings).min(4096)).min(((1usize << 30) / size).max(2));
        let pool = UbPool::builder(PoolConfig::new(
            "bench",
            size.div_ceil(4096) * 4096 + 4096,
            blocks,
            MemoryKind::Host,
        ))
        .register_with(engine.registrar())
        .build()
        .map_err(|e| e.to_string())?;
        let file = engine.open(path).map_err(|e| e.to_string())?;
        Ok(Self {
            engine,
            pool,
            file,
            size,
        })
    }

    /// Reads `size` bytes at each offset, as many in flight as the pool has blocks.
    pub fn run(&self, rt: &tokio::runtime::Runtime, offsets: &[u64]) -> Result<u64, String> {
        let blocks = self.pool.block_count();
        rt.block_on(async {
            let mut set = tokio::task::JoinSet::new();
            let mut total = 0u64;
            for &off in offsets {
                while set.len() >= blocks {
                    total += set
                        .join_next()
                        .await
                        .ok_or("empty")?
                        .map_err(|e| e.to_string())??;
                }
                let (engine, pool, file, size) = (
                    self.engine.clone(),
                    self.pool.clone(),
                    self.file.clone(),
                    self.size,
                );
                set.spawn(async move {
                    let lease = pool
                        .acquire(Duration::from_secs(60))
                        .await
                        .map_err(|e| e.to_string())?;
                    let (r, _lease) = engine.read(&file, off, size, lease, 0).await;
                    r.map(|d| d.data.len() as u64).map_err(|e| e.to_string())
                });
            }
            while let Some(r) = set.join_next().await {
                total += r.map_err(|e| e.to_string())??;
            }
            Ok::<u64, String>(total)
        })
    }
}

/// Sets up an engine bench and measures it.
pub fn engine_read(
    ctx: &Ctx,
    path: &Path,
    offsets: &[u64],
    size: usize,
    qd: u32,
    rings: usize,
    direct: DirectMode,
) -> Result<(crate::common::Figure, f64), String> {
    let b = EngineBench::new(path, size, qd, rings, direct)?;
    measure(ctx.runs, || b.run(&ctx.rt, offsets))
}

/// Like [`engine_read`], with `before` run (unmeasured) ahead of every measurement.
#[allow(clippy::too_many_arguments)]
pub fn engine_read_with(
    ctx: &Ctx,
    path: &Path,
    offsets: &[u64],
    size: usize,
    qd: u32,
    rings: usize,
    direct: DirectMode,
    before: impl Fn() -> Result<(), String>,
) -> Result<(crate::common::Figure, f64), String> {
    let b = EngineBench::new(path, size, qd, rings, direct)?;
    crate::common::measure_with(ctx.runs, before, || b.run(&ctx.rt, offsets))
}

fn one_file(offs: &[u64]) -> Vec<(u32, u64)> {
    offs.iter().map(|&o| (0, o)).collect()
}

/// Builds a raw reader once and measures it.
fn raw(
    runs: usize,
    paths: &[&Path],
    reads: &[(u32, u64)],
    size: usize,
    qd: usize,
    direct: bool,
) -> Result<(crate::common::Figure, f64), String> {
    let mut r = rawring::RawReader::new(paths, size, qd, direct)?;
    measure(runs, || r.run(reads))
}

fn seq_offsets(size: u64, read: usize, limit: u64) -> Vec<u64> {
    (0..size.min(limit) / read as u64)
        .map(|i| i * read as u64)
        .collect()
}

fn fio_seq(fio: &Path, path: &Path, bs: usize, qd: u32, size: u64) -> Result<(f64, f64), String> {
    let out = std::process::Command::new(fio)
        .args([
            "--name=seq",
            &format!("--filename={}", path.display()),
            "--rw=read",
            &format!("--bs={bs}"),
            &format!("--iodepth={qd}"),
            "--ioengine=io_uring",
            "--direct=1",
            &format!("--size={size}"),
            "--output-format=json",
        ])
        .output()
        .map_err(|e| format!("fio: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "fio failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let j: serde_json::Value =
        serde_json::from_slice(&out.stdout).map_err(|e| format!("fio json: {e}"))?;
    let job = &j["jobs"][0];
    let bw = job["read"]["bw_bytes"]
        .as_f64()
        .ok_or("fio: no read.bw_bytes")?;
    let cpu_pct = job["usr_cpu"].as_f64().unwrap_or(0.0) + job["sys_cpu"].as_f64().unwrap_or(0.0);
    // CPU s per GB: (cpu fraction × seconds) / GB = cpu fraction / (GB/s)
    Ok((
        bw / 1e9,
        if bw > 0.0 {
            cpu_pct / 100.0 / (bw / 1e9)
        } else {
            0.0
        },
    ))
}

/// Large sequential reads: engine vs raw io_uring vs naive pread vs fio.
pub fn seq(ctx: &Ctx) -> Result<Vec<Table>, String> {
    let (path, size) = ctx.seq_file()?;
    let (read, qd) = if ctx.quick {
        (1usize << 20, 32u32)
    } else {
        (4 << 20, 64)
    };
    let offs = seq_offsets(size, read, u64::MAX);
    let mut t = Table::new(&format!(
        "seq: {} MiB file, {} KiB reads, O_DIRECT",
        size >> 20,
        read >> 10
    ));
    t.rows.push(row(
        "ubdirect engine",
        engine_read(ctx, &path, &offs, read, qd, 1, DirectMode::Auto)?,
        false,
        format!("QD {qd}, READ_FIXED into a registered pool"),
    ));
    t.rows.push(row(
        "raw io_uring",
        raw(
            ctx.runs,
            &[&path],
            &one_file(&offs),
            read,
            qd as usize,
            true,
        )?,
        true,
        format!("QD {qd}, one ring, no pool"),
    ));
    let ranges: Vec<(u64, usize)> = offs.iter().map(|&o| (o, read)).collect();
    t.rows.push(row(
        "naive pread",
        measure(ctx.runs, || rawring::pread_loop(&path, &ranges, true))?,
        true,
        "QD 1, O_DIRECT",
    ));
    let mut reference = "raw io_uring";
    if let Some(fio) = &ctx.fio {
        let mut v = Vec::new();
        let mut cpu = Vec::new();
        for _ in 0..ctx.runs {
            let (g, c) = fio_seq(fio, &path, read, qd, size)?;
            v.push(g);
            cpu.push(c);
        }
        cpu.sort_by(|a, b| a.total_cmp(b));
        t.rows.push(row(
            "fio io_uring",
            (crate::common::Figure::of(v), cpu[cpu.len() / 2]),
            true,
            format!("--direct=1 --iodepth={qd}"),
        ));
        reference = "fio io_uring";
    }
    t.ratios_to(reference);
    Ok(vec![t])
}

/// Writes a Megatron dataset of `n` sequences of 4–64 KiB (u16 tokens).
fn random_dataset(dir: &Path, total: u64) -> Result<PathBuf, String> {
    let d = dir.join(format!("random-{}", total >> 20));
    let idx = d.join("shard-00000.idx");
    if idx.exists() {
        return Ok(d);
    }
    std::fs::create_dir_all(&d).map_err(|e| e.to_string())?;
    let mut x: u64 = 0x5EED;
    let mut seqs = Vec::new();
    let mut bytes = 0u64;
    while bytes < total {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let len = (4096 + (x % (60 * 1024))) as usize & !1;
        let mut v = vec![0u8; len];
        for (i, b) in v.iter_mut().enumerate() {
            *b = (i as u64 ^ x) as u8;
        }
        bytes += len as u64;
        seqs.push(v);
    }
    ubdirect_loader::formats::megatron::write(
        &d.join("shard-00000"),
        ubdirect_loader::formats::Dtype::U16,
        &seqs,
    )
    .map_err(|e| e.to_string())?;
    Ok(d)
}

fn loader_cfg(dir: &Path, format: &str, device: &str) -> ubdirect_loader::RunConfig {
    let mut c = ubdirect_loader::RunConfig::default();
    c.dataset.format = format.parse().expect("format");
    c.dataset.dir = Some(dir.to_path_buf());
    c.dataset.generate = false;
    c.device.select = device.parse().expect("device");
    c
}

/// Builds a loader once (outside the measured time) and measures whole epochs, running `before`
/// (unmeasured) ahead of each.
fn loader_epochs(
    ctx: &Ctx,
    cfg: &ubdirect_loader::RunConfig,
    before: impl Fn(&ubdirect_loader::Loader),
) -> Result<(crate::common::Figure, f64), String> {
    let l = ubdirect_loader::Loader::from_config(cfg).map_err(|e| e.to_string())?;
    crate::common::measure_with(
        ctx.runs,
        || {
            before(&l);
            Ok(())
        },
        || {
            let mut bytes = 0u64;
            for b in l.epoch(0).map_err(|e| e.to_string())? {
                bytes += b.map_err(|e| e.to_string())?.sample_bytes();
            }
            l.device().0.synchronize().map_err(|e| e.to_string())?;
            Ok(bytes)
        },
    )
}

fn drop_all(l: &ubdirect_loader::Loader) {
    for s in &l.index().shards {
        let _ = drop_cache(&s.path);
    }
}

/// Random 4–64 KiB samples (shuffled): merged reads vs one io_uring read per sample vs a naive pread
/// per sample. Cold: the page cache is dropped before every run.
pub fn random(ctx: &Ctx) -> Result<Vec<Table>, String> {
    let total: u64 = if ctx.quick { 64 << 20 } else { 1 << 30 };
    let d = random_dataset(&ctx.dir, total)?;
    let mut merged = loader_cfg(&d, "megatron", "host");
    merged.loader.batch_size = 32;
    let mut unmerged = merged.clone();
    // What a per-sample loader does: a uniform shuffle (every sample its own shuffle block).
    unmerged.loader.shuffle_block = ubdirect_loader::config::ByteSize(1);
    unmerged.loader.min_read = ubdirect_loader::config::ByteSize(0);
    unmerged.loader.max_gap = ubdirect_loader::config::ByteSize(0);
    unmerged.loader.max_chunk_batches = 1;
    unmerged.pool.staging_block_size = ubdirect_loader::config::ByteSize(192 << 10);
    unmerged.pool.staging_blocks = 256;
    unmerged.loader.max_read = ubdirect_loader::config::ByteSize(128 << 10);
    let mut t = Table::new(&format!(
        "random: {} MiB of 4–64 KiB samples, shuffled, cold cache",
        total >> 20
    ));
    t.rows.push(row(
        "ubdirect, merged reads",
        loader_epochs(ctx, &merged, drop_all)?,
        false,
        "block shuffle 4 MiB, min_read 1 MiB, max_gap 64 KiB",
    ));
    t.rows.push(row(
        "ubdirect, one read per sample",
        loader_epochs(ctx, &unmerged, drop_all)?,
        false,
        "uniform shuffle, merging off, io_uring QD 64",
    ));
    // The naive reader reads the same samples in the same uniformly shuffled order.
    let l = ubdirect_loader::Loader::from_config(&unmerged).map_err(|e| e.to_string())?;
    let plan = l.plan(0).map_err(|e| e.to_string())?;
    let shard = l.index().shards[0].path.clone();
    let ranges: Vec<(u64, usize)> = plan
        .batches
        .iter()
        .flat_map(|b| {
            b.samples.iter().map(|s| {
                let loc = l.index().samples.loc(s.id as usize);
                (loc.offset, loc.len as usize)
            })
        })
        .collect();
    t.rows.push(row(
        "pread per sample",
        crate::common::measure_with(
            ctx.runs,
            || drop_cache(&shard),
            || rawring::pread_loop(&shard, &ranges, false),
        )?,
        true,
        "one thread, buffered, uniform shuffle",
    ));
    t.ratios_to("pread per sample");
    Ok(vec![t])
}

/// Queue-depth sweep and read-size sweep (engine vs raw io_uring), O_DIRECT.
pub fn qd(ctx: &Ctx) -> Result<Vec<Table>, String> {
    let (path, size) = ctx.seq_file()?;
    let per_point: u64 = if ctx.quick { 64 << 20 } else { 1 << 30 };
    let runs = if ctx.quick { 1 } else { ctx.runs.min(3) };
    let mut t = Table::new("qd: queue-depth sweep, 1 MiB reads, O_DIRECT");
    let qds: &[u32] = if ctx.quick {
        &[1, 8, 64]
    } else {
        &[1, 2, 4, 8, 16, 32, 64, 128, 256]
    };
    for &q in qds {
        let offs = seq_offsets(size, 1 << 20, per_point);
        t.rows.push(row(
            format!("ubdirect QD {q}"),
            {
                let b = EngineBench::new(&path, 1 << 20, q, 1, DirectMode::Auto)?;
                measure(runs, || b.run(&ctx.rt, &offs))?
            },
            false,
            "1 MiB",
        ));
        t.rows.push(row(
            format!("raw io_uring QD {q}"),
            raw(runs, &[&path], &one_file(&offs), 1 << 20, q as usize, true)?,
            true,
            "1 MiB",
        ));
    }
    let mut s = Table::new("qd: read-size sweep, QD 64, O_DIRECT");
    let sizes: &[usize] = if ctx.quick {
        &[4 << 10, 256 << 10, 4 << 20]
    } else {
        &[
            4 << 10,
            16 << 10,
            64 << 10,
            256 << 10,
            1 << 20,
            4 << 20,
            16 << 20,
        ]
    };
    for &rs in sizes {
        let limit = per_point.min(rs as u64 * 16384);
        let offs = seq_offsets(size, rs, limit);
        let qd = if rs >= 16 << 20 { 16 } else { 64 };
        s.rows.push(row(
            format!("ubdirect {} KiB", rs >> 10),
            {
                let b = EngineBench::new(&path, rs, qd, 1, DirectMode::Auto)?;
                measure(runs, || b.run(&ctx.rt, &offs))?
            },
            false,
            format!("QD {qd}"),
        ));
        s.rows.push(row(
            format!("raw io_uring {} KiB", rs >> 10),
            raw(runs, &[&path], &one_file(&offs), rs, qd as usize, true)?,
            true,
            format!("QD {qd}"),
        ));
    }
    Ok(vec![t, s])
}

/// Register once vs register per I/O (io_uring buffers; CUDA host registration on a GPU).
pub fn register(ctx: &Ctx) -> Result<Vec<Table>, String> {
    let (path, size) = ctx.seq_file()?;
    warm(&path)?;
    let rs = 256usize << 10;
    let offs = seq_offsets(size, rs, if ctx.quick { 64 << 20 } else { 1 << 30 });
    let mut t = Table::new("register: io_uring buffers, 256 KiB warm-cache reads, QD 1");
    t.rows.push(row(
        "registered once (pool)",
        raw(ctx.runs, &[&path], &one_file(&offs), rs, 1, false)?,
        false,
        "READ_FIXED, QD 1",
    ));
    t.rows.push(row(
        "register + unregister per read",
        measure(ctx.runs, || {
            rawring::ring_read_register_per_io(&path, &offs, rs, false)
        })?,
        true,
        "READ_FIXED, QD 1",
    ));
    t.ratios_to("register + unregister per read");
    let mut out = vec![t];
    if let Some(cuda) = &ctx.cuda {
        let dev: Arc<dyn Device> = cuda.clone();
        let mut g = Table::new("register: CUDA host registration per copy vs a pinned pool");
        for sz in [1usize << 20, 4 << 20, 16 << 20] {
            let n = if ctx.quick { 32 } else { 256 };
            let staging = UbPool::builder(PoolConfig::new("reg-pinned", sz, 2, MemoryKind::Pinned))
                .device(dev.clone())
                .build()
                .map_err(|e| e.to_string())?;
            let batch = UbPool::builder(PoolConfig::new("reg-dev", sz, 2, MemoryKind::Device))
                .device(dev.clone())
                .build()
                .map_err(|e| e.to_string())?;
            g.rows.push(row(
                format!("pinned pool, {} MiB", sz >> 20),
                measure(ctx.runs, || {
                    let mut s = staging.try_acquire().ok_or("busy")?;
                    let mut d = batch.try_acquire().ok_or("busy")?;
                    for _ in 0..n {
                        dev.copy_to_device(&mut s, 0..sz, &mut d, 0)
                            .map_err(|e| e.to_string())?
                            .wait_blocking(Duration::from_secs(10))
                            .map_err(|e| e.to_string())?;
                    }
                    Ok((n * sz) as u64)
                })?,
                false,
                "one copy at a time",
            ));
            let mut host = rawring::AlignedBuf::new(sz)?;
            host.slice_mut().fill(1);
            let d = batch.try_acquire().ok_or("busy")?;
            let dptr = d.device_ptr().ok_or("no device pointer")?;
            g.rows.push(row(
                format!("register per copy, {} MiB", sz >> 20),
                measure(ctx.runs, || {
                    for _ in 0..n {
                        // SAFETY: `host` is a live page-aligned mapping not registered elsewhere; `d` holds the
                        // device block for the whole loop.
                        unsafe {
                            crate::sys::register_copy_unregister(
                                host.ptr(),
                                sz,
                                dptr,
                                cuda.stream(),
                            )?
                        };
                    }
                    Ok((n * sz) as u64)
                })?,
                true,
                "cuMemHostRegister + copy + unregister",
            ));
            drop(d);
        }
        out.push(g);
    }
    Ok(out)
}

/// O_DIRECT vs buffered, cold and warm.
pub fn direct(ctx: &Ctx) -> Result<Vec<Table>, String> {
    let (path, size) = ctx.seq_file()?;
    let rs = 4usize << 20;
    let offs = seq_offsets(size, rs, u64::MAX);
    let rings = (std::thread::available_parallelism().map_or(2, |n| n.get()) / 2).clamp(1, 8);
    let cold_ok = drop_cache(&path).is_ok();
    let mut t = Table::new(&format!(
        "direct: {} MiB file, 4 MiB reads, QD 64",
        size >> 20
    ));
    t.rows.push(row(
        "O_DIRECT",
        engine_read(ctx, &path, &offs, rs, 64, 1, DirectMode::On)?,
        false,
        "1 ring",
    ));
    t.rows.push(row(
        "raw io_uring O_DIRECT",
        raw(ctx.runs, &[&path], &one_file(&offs), rs, 64, true)?,
        true,
        "1 ring",
    ));
    t.rows.push(row(
        "buffered, cold",
        engine_read_with(ctx, &path, &offs, rs, 64, 1, DirectMode::Off, || {
            drop_cache(&path)
        })?,
        false,
        if cold_ok {
            "page cache dropped (fadvise) before each run"
        } else {
            "cache drop refused: not cold"
        },
    ));
    warm(&path)?;
    t.rows.push(row(
        "buffered, warm, 1 ring",
        engine_read(ctx, &path, &offs, rs, 64, 1, DirectMode::Off)?,
        false,
        "page cache",
    ));
    t.rows.push(row(
        format!("buffered, warm, {rings} ring(s), QD 16"),
        engine_read(ctx, &path, &offs, rs, 16, rings, DirectMode::Off)?,
        false,
        "page cache",
    ));
    t.ratios_to("raw io_uring O_DIRECT");
    Ok(vec![t])
}

fn epoch_dataset(ctx: &Ctx) -> Result<PathBuf, String> {
    let total: u64 = if ctx.quick { 128 << 20 } else { 4 << 30 };
    let d = ctx.dir.join(format!("epoch-{}", total >> 20));
    let shards = 8u64;
    for s in 0..shards {
        ensure_file(&d.join(format!("shard-{s:05}.bin")), total / shards)?;
    }
    Ok(d)
}

/// Pinned H2D ceiling: plain cuMemcpyHtoDAsync of 4 MiB blocks, one synchronize.
fn h2d_ceiling(
    ctx: &Ctx,
    cuda: &Arc<ubdirect_ub::CudaDevice>,
) -> Result<(crate::common::Figure, f64), String> {
    let dev: Arc<dyn Device> = cuda.clone();
    let sz = 4usize << 20;
    let s = UbPool::builder(PoolConfig::new("ceil-pinned", sz, 8, MemoryKind::Pinned))
        .device(dev.clone())
        .build()
        .map_err(|e| e.to_string())?;
    let d = UbPool::builder(PoolConfig::new("ceil-dev", sz, 8, MemoryKind::Device))
        .device(dev.clone())
        .build()
        .map_err(|e| e.to_string())?;
    let n = if ctx.quick { 256 } else { 1024 };
    measure(ctx.runs, || {
        crate::raw_copies(&s, &d, cuda.stream(), n, None).map(|_| (n * sz) as u64)
    })
}

/// A full loader epoch to the selected device, cold (O_DIRECT) and warm (page cache).
pub fn epoch(ctx: &Ctx) -> Result<Vec<Table>, String> {
    let d = epoch_dataset(ctx)?;
    let dev = if ctx.cuda.is_some() { "cuda" } else { "host" };
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let mut cold = loader_cfg(&d, "raw", dev);
    cold.loader.batch_size = 256; // 1 MiB batches of 4 KiB records
    cold.loader.min_read = ubdirect_loader::config::ByteSize(4 << 20);
    cold.loader.prefetch = 48;
    cold.pool.staging_blocks = 128;
    cold.pool.batch_block_size = ubdirect_loader::config::ByteSize(8 << 20);
    cold.engine.rings = 2;
    let mut warm_cfg = cold.clone();
    warm_cfg.engine.direct = ubdirect_nvme::DirectMode::Off;
    warm_cfg.engine.rings = (cores / 2).clamp(1, 8);
    warm_cfg.engine.queue_depth = 16;
    warm_cfg.loader.prefetch = 48;
    warm_cfg.loader.threads = (cores / 2).clamp(2, 8);
    warm_cfg.pool.staging_blocks = 128;
    let l = ubdirect_loader::Loader::from_config(&cold).map_err(|e| e.to_string())?;
    let shards: Vec<PathBuf> = l.index().shards.iter().map(|s| s.path.clone()).collect();
    let bytes: u64 = l.index().shards.iter().map(|s| s.size).sum();
    let dev_name = l.device().0.info().name.clone();
    drop(l);
    let mut t = Table::new(&format!(
        "epoch: {} MiB of 4 KiB token records → {dev_name}",
        bytes >> 20
    ));
    // What users run: the default config, nothing but the dataset and the device set.
    let default_cfg = loader_cfg(&d, "raw", dev);
    t.rows.push(row(
        "ubdirect epoch, cold, DEFAULT config",
        loader_epochs(ctx, &default_cfg, drop_all)?,
        false,
        "configs/default.toml: direct = auto (cachestat per read → O_DIRECT here)",
    ));
    t.rows.push(row(
        "ubdirect epoch, cold (O_DIRECT)",
        loader_epochs(ctx, &cold, drop_all)?,
        false,
        "2 rings, 4 MiB reads, 48 chunks ahead",
    ));
    let reads: Vec<(u32, u64)> = shards
        .iter()
        .enumerate()
        .flat_map(|(i, p)| {
            let size = std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
            seq_offsets(size, 4 << 20, u64::MAX)
                .into_iter()
                .map(move |o| (i as u32, o))
        })
        .collect();
    let paths: Vec<&Path> = shards.iter().map(|p| p.as_path()).collect();
    t.rows.push(row(
        "raw io_uring ceiling, cold",
        raw(ctx.runs, &paths, &reads, 4 << 20, 64, true)?,
        true,
        "O_DIRECT, QD 64, 4 MiB, all shards",
    ));
    for p in &shards {
        warm(p)?;
    }
    t.rows.push(row(
        "ubdirect epoch, warm, DEFAULT config",
        loader_epochs(ctx, &default_cfg, |_| {})?,
        false,
        "configs/default.toml: GPU — resident shards mapped + registered once (pool.page_cache_budget), copied straight from the page cache; host — cachestat → buffered io_uring",
    ));
    t.rows.push(row(
        "ubdirect epoch, warm (page cache)",
        loader_epochs(ctx, &warm_cfg, |_| {})?,
        false,
        format!(
            "{} rings, {} loader threads, buffered",
            warm_cfg.engine.rings, warm_cfg.loader.threads
        ),
    ));
    let limit = if ctx.quick { 16 << 20 } else { 256 << 20 };
    let ranges: Vec<(u64, usize)> = (0..limit / 4096).map(|i| (i * 4096, 4096)).collect();
    t.rows.push(row(
        "pread per sample, warm",
        measure(ctx.runs, || rawring::pread_loop(&shards[0], &ranges, false))?,
        true,
        "one thread, 4 KiB, first shard",
    ));
    if let Some(cuda) = &ctx.cuda {
        t.rows.push(row(
            "pinned H2D ceiling",
            h2d_ceiling(ctx, cuda)?,
            true,
            "cuMemcpyHtoDAsync 4 MiB",
        ));
    }
    let mut cold_t = Table {
        scenario: t.scenario.clone() + " — cold vs disk ceiling",
        reference: String::new(),
        rows: t
            .rows
            .iter()
            .filter(|r| r.label.contains("cold"))
            .cloned()
            .collect(),
    };
    cold_t.ratios_to("raw io_uring ceiling, cold");
    let mut warm_t = Table {
        scenario: t.scenario.clone() + " — warm",
        reference: String::new(),
        rows: t
            .rows
            .iter()
            .filter(|r| !r.label.contains("cold"))
            .cloned()
            .collect(),
    };
    if ctx.cuda.is_some() {
        warm_t.ratios_to("pinned H2D ceiling");
    } else {
        warm_t.ratios_to("pread per sample, warm");
    }
    Ok(vec![cold_t, warm_t])
}

/// NVMe passthrough vs the O_DIRECT block-device path, same LBAs, read-only.
pub fn nvme(ctx: &Ctx) -> Result<Vec<Table>, String> {
    let ctrl = std::fs::read_dir("/sys/class/nvme")
        .ok()
        .and_then(|r| r.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().to_string()).min())
        .ok_or("no NVMe controller (/sys/class/nvme is empty): run this in the project's QEMU guest or on an NVMe machine")?;
    let n = ctrl.trim_start_matches("nvme");
    let (blk, chr) = (
        PathBuf::from(format!("/dev/nvme{n}n1")),
        PathBuf::from(format!("/dev/ng{n}n1")),
    );
    let ns = ubdirect_nvme::Namespace::open(&chr).map_err(|e| e.to_string())?;
    let bs = ns.id().lba_size as u64;
    let size: usize = 128 << 10;
    let total: u64 = (if ctx.quick { 16u64 << 20 } else { 1 << 30 }).min(ns.id().nsze * bs / 2);
    let offs: Vec<u64> = (0..total / size as u64).map(|i| i * size as u64).collect();
    let nlb = (size as u64 / bs) as u32;
    let mut t = Table::new(&format!(
        "nvme: {} reads of 128 KiB on {} (emulated devices: functional figures, not performance)",
        offs.len(),
        chr.display()
    ));
    t.rows.push(row(
        "O_DIRECT file path (engine)",
        engine_read(ctx, &blk, &offs, size, 32, 1, DirectMode::On)?,
        true,
        "QD 32",
    ));
    let pool = UbPool::new_host(PoolConfig::new("nvme-bench", size, 32, MemoryKind::Host))
        .map_err(|e| e.to_string())?;
    t.rows.push(row(
        "passthrough ioctl",
        measure(ctx.runs, || {
            let mut l = pool.try_acquire().ok_or("busy")?;
            for &o in &offs {
                ns.read(o / bs, nlb, &mut l, 0).map_err(|e| e.to_string())?;
            }
            Ok(total)
        })?,
        false,
        "NVME_IOCTL_IO_CMD, QD 1",
    ));
    t.rows.push(row(
        "passthrough io_uring URING_CMD",
        measure(ctx.runs, || {
            let mut q = ns.uring(32).map_err(|e| e.to_string())?;
            for chunk in offs.chunks(32) {
                let mut leases: Vec<_> = chunk
                    .iter()
                    .map(|_| pool.try_acquire().ok_or("busy"))
                    .collect::<Result<_, _>>()?;
                let mut reads: Vec<ubdirect_nvme::passthru::CmdRead<'_>> = chunk
                    .iter()
                    .zip(leases.iter_mut())
                    .map(|(&o, lease)| ubdirect_nvme::passthru::CmdRead {
                        slba: o / bs,
                        nlb,
                        lease,
                        off: 0,
                    })
                    .collect();
                q.read_many(&mut reads).map_err(|e| e.to_string())?;
            }
            Ok(total)
        })?,
        false,
        "SQE128/CQE32, 32 in flight",
    ));
    t.ratios_to("O_DIRECT file path (engine)");
    Ok(vec![t])
}
