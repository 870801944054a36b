//! `ubdirect-bench`: throughput scenarios, each measured against a baseline in the same run.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use serde::Serialize;
use ubdirect_ub::{CudaDevice, Device, MemoryKind, PoolConfig, UbPool};

mod common;
mod gpt_index;
#[cfg(feature = "object-store")]
mod objlatency;
#[cfg(feature = "object-store")]
mod objstore;
mod rawring;
mod remote;
mod scenarios;
mod smc;
mod svg;
mod sys;
mod workdir;

use common::{Row, Table, measure};

#[derive(Parser, Debug)]
#[command(
    name = "ubdirect-bench",
    version,
    about = "ubdirect throughput scenarios, each with same-run baselines and ratios"
)]
struct Cli {
    /// Scenario (all when omitted).
    #[command(subcommand)]
    cmd: Option<Cmd>,
    /// Small files and few runs: a smoke test that finishes in under two minutes.
    #[arg(long, global = true)]
    quick: bool,
    /// Where the benchmark files live (on the file system under test).
    #[arg(long, global = true, default_value = "/tmp/ubdirect-bench")]
    dir: PathBuf,
    /// Keep the files the run wrote in `--dir` (by default they are removed at the end; the peers'
    /// scripts in bench/peers read `epoch`'s shards, so keep them for those).
    #[arg(long, global = true)]
    keep: bool,
    /// Measurements per figure (median, min and max are reported).
    #[arg(long, global = true)]
    runs: Option<usize>,
    /// Write every table as JSON.
    #[arg(long, global = true)]
    json: Option<PathBuf>,
    /// Write a plot of every table as SVG.
    #[arg(long, global = true)]
    svg: Option<PathBuf>,
}

#[derive(Subcommand, Debug, Clone, Copy, PartialEq, Eq)]
enum Cmd {
    /// Large sequential reads: engine vs raw io_uring vs naive pread vs fio.
    Seq,
    /// Random 4–64 KiB samples: merged vs one read per sample vs pread per sample.
    Random,
    /// Queue-depth and read-size sweeps.
    Qd,
    /// Register once vs register per I/O (io_uring; CUDA on a GPU).
    Register,
    /// O_DIRECT vs buffered, cold and warm.
    Direct,
    /// A full loader epoch to the selected device, cold and warm.
    Epoch,
    /// GPU: pinned-lease → device-lease copies vs plain cuMemcpyHtoDAsync.
    H2d,
    /// Remote reads over loopback TCP (`ubdirect serve` + client into leases) vs a plain TCP socket.
    Remote,
    /// NVMe passthrough (ioctl, io_uring URING_CMD) vs the O_DIRECT file path on the first NVMe
    /// namespace (read-only). Under emulation the figures are functional, not performance.
    Nvme,
    /// SMC (remote memory mapped into the process) on loopback: block sync and 64 B random writes
    /// by copy + send, write-through and write-back; read-fault latency; false sharing.
    Smc,
    /// GPT mode's start-up at scale: Megatron dataset open and GPT index build time, peak memory,
    /// for 10⁶ and 10⁷ sequences (not part of `all`).
    GptIndex,
    /// `s3://` epochs against moto_server on loopback vs a plain ranged-GET client, and cache-hit
    /// epochs vs local files (needs `--features object-store` and `moto_server`; not part of `all`).
    ObjectStore,
    /// GPT epochs from `s3://` behind a proxy adding 20 ms per request (`UBDIRECT_BENCH_LATENCY_MS`):
    /// block and Megatron order, no / ½ / 2 × cache, vs local files and a whole-shard download
    /// (needs `--features object-store` and `moto_server`; not part of `all`).
    ObjectLatency,
    /// Every scenario.
    All,
}

#[derive(Serialize)]
struct Report {
    machine: common::Machine,
    device_path: String,
    fallbacks: Vec<String>,
    tables: Vec<Table>,
    smc: Vec<smc::SmcRow>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let dir = match workdir::Workdir::open(&cli.dir, cli.quick) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let r = run(&cli);
    dir.finish(cli.keep);
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn find_fio() -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| PathBuf::from(d).join("fio"))
        .find(|p| p.is_file())
}

fn run(cli: &Cli) -> Result<(), String> {
    std::fs::create_dir_all(&cli.dir).map_err(|e| format!("{}: {e}", cli.dir.display()))?;
    let cuda = if ubdirect_ub::cuda_driver_present() {
        CudaDevice::new(0).ok().map(Arc::new)
    } else {
        None
    };
    let gpu = cuda
        .as_ref()
        .map_or("none (CUDA scenarios skipped)".to_string(), |c| {
            let i = c.info();
            format!(
                "{} (pci {}, numa {})",
                i.name,
                i.pci_bus_id.as_deref().unwrap_or("?"),
                i.numa_node.map_or("?".into(), |n| n.to_string())
            )
        });
    let mut machine = common::machine(&cli.dir, &gpu);
    let probe = cli.dir.join("probe.bin");
    common::ensure_file(&probe, 1 << 20)?;
    let eng = ubdirect_nvme::Engine::new(ubdirect_nvme::EngineConfig::default())
        .map_err(|e| e.to_string())?;
    let f = eng.open(&probe).map_err(|e| e.to_string())?;
    machine.bench_dir_direct_io = f.io_path().to_string();
    drop((f, eng));
    let ctx = scenarios::Ctx {
        dir: cli.dir.clone(),
        quick: cli.quick,
        runs: cli.runs.unwrap_or(if cli.quick { 2 } else { 5 }),
        cuda: cuda.clone(),
        fio: find_fio(),
        rt: tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?,
    };
    println!(
        "ubdirect-bench{} — {} runs per figure",
        if cli.quick { " --quick" } else { "" },
        ctx.runs
    );
    println!(
        "machine: {} ({} cores), {:.1} GiB, kernel {}",
        machine.cpu, machine.cores, machine.memory_gib, machine.kernel
    );
    println!("gpu:     {}", machine.gpu);
    println!(
        "files:   {} — {}",
        machine.bench_dir, machine.bench_dir_direct_io
    );
    println!(
        "fio:     {}",
        ctx.fio
            .as_ref()
            .map_or("not installed (fio rows skipped)".into(), |p| p
                .display()
                .to_string())
    );
    let which = cli.cmd.unwrap_or(Cmd::All);
    let all = which == Cmd::All;
    let mut tables = Vec::new();
    let mut go =
        |c: Cmd, f: &dyn Fn(&scenarios::Ctx) -> Result<Vec<Table>, String>| -> Result<(), String> {
            if all || which == c {
                for t in f(&ctx)? {
                    t.print();
                    tables.push(t);
                }
            }
            Ok(())
        };
    go(Cmd::Seq, &scenarios::seq)?;
    go(Cmd::Random, &scenarios::random)?;
    go(Cmd::Qd, &scenarios::qd)?;
    go(Cmd::Register, &scenarios::register)?;
    go(Cmd::Direct, &scenarios::direct)?;
    go(Cmd::Epoch, &scenarios::epoch)?;
    go(Cmd::H2d, &|c: &scenarios::Ctx| h2d(c))?;
    go(Cmd::Remote, &remote::run)?;
    if which == Cmd::GptIndex {
        gpt_index::run(&cli.dir, cli.quick)?;
    }
    if which == Cmd::ObjectStore {
        #[cfg(feature = "object-store")]
        for t in objstore::run(&ctx)? {
            t.print();
            tables.push(t);
        }
        #[cfg(not(feature = "object-store"))]
        return Err("object-store needs a build with --features object-store".into());
    }
    if which == Cmd::ObjectLatency {
        #[cfg(feature = "object-store")]
        for t in objlatency::run(&ctx)? {
            t.print();
            tables.push(t);
        }
        #[cfg(not(feature = "object-store"))]
        return Err("object-latency needs a build with --features object-store".into());
    }
    if which == Cmd::Nvme {
        for t in scenarios::nvme(&ctx)? {
            t.print();
            tables.push(t);
        }
    }
    let smc_rows = if all || which == Cmd::Smc {
        smc::run(cli.quick)?
    } else {
        Vec::new()
    };
    let fallbacks: Vec<String> = ubdirect_ub::fallback::snapshot()
        .into_iter()
        .map(|f| format!("{} ×{}: {}", f.kind, f.count, f.first_detail))
        .collect();
    println!(
        "
fallbacks: {}",
        if fallbacks.is_empty() {
            "none".into()
        } else {
            fallbacks.join("; ")
        }
    );
    let report = Report {
        device_path: machine.bench_dir_direct_io.clone(),
        machine,
        fallbacks,
        tables,
        smc: smc_rows,
    };
    if let Some(p) = &cli.json {
        std::fs::write(
            p,
            serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?,
        )
        .map_err(|e| format!("{}: {e}", p.display()))?;
    }
    if let Some(p) = &cli.svg {
        let title = format!(
            "ubdirect-bench — {} — {}",
            report.machine.cpu, report.machine.gpu
        );
        std::fs::write(p, svg::render(&title, &report.tables))
            .map_err(|e| format!("{}: {e}", p.display()))?;
    }
    Ok(())
}

/// Pinned-lease → device-lease copies vs plain cuMemcpyHtoDAsync on the same blocks, per size.
fn h2d(ctx: &scenarios::Ctx) -> Result<Vec<Table>, String> {
    let Some(cuda) = &ctx.cuda else {
        println!(
            "
== h2d: skipped — no usable CUDA device"
        );
        return Ok(Vec::new());
    };
    let dev: Arc<dyn Device> = cuda.clone();
    let total: usize = if ctx.quick { 512 << 20 } else { 4 << 30 };
    let blocks = 8;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    for size in [1usize << 20, 4 << 20, 16 << 20, 64 << 20] {
        let copies = (total / size).max(blocks * 2);
        let staging = UbPool::builder(PoolConfig::new(
            "h2d-staging",
            size,
            blocks,
            MemoryKind::Pinned,
        ))
        .device(dev.clone())
        .build()
        .map_err(|e| e.to_string())?;
        let batch = UbPool::builder(PoolConfig::new(
            "h2d-device",
            size,
            blocks,
            MemoryKind::Device,
        ))
        .device(dev.clone())
        .build()
        .map_err(|e| e.to_string())?;
        let stream = cuda.stream().clone();
        let alloc = sys::HostAlloc::new(&stream, size)?;
        raw_copies(&staging, &batch, &stream, copies.min(16), None)?;
        rt.block_on(lease_copies(&dev, &staging, &batch, copies.min(16)))?;
        let bytes = (copies * size) as u64;
        let mut t = Table::new(&format!("h2d: {} MiB copies × {copies}", size >> 20));
        t.rows.push(Row {
            label: "ubdirect leases".into(),
            gbps: measure(ctx.runs, || {
                rt.block_on(lease_copies(&dev, &staging, &batch, copies))
                    .map(|_| bytes)
            })?
            .0,
            cpu_s_per_gb: 0.0,
            ratio: None,
            baseline: false,
            note: format!("{blocks} blocks per pool, events, completion thread"),
        });
        t.rows.push(Row {
            label: "raw cuMemcpyHtoDAsync (pool memory)".into(),
            gbps: measure(ctx.runs, || {
                raw_copies(&staging, &batch, &stream, copies, None).map(|_| bytes)
            })?
            .0,
            cpu_s_per_gb: 0.0,
            ratio: None,
            baseline: true,
            note: "one synchronize at the end".into(),
        });
        t.rows.push(Row {
            label: "raw cuMemcpyHtoDAsync (cuMemHostAlloc)".into(),
            gbps: measure(ctx.runs, || {
                raw_copies(&staging, &batch, &stream, copies, Some(&alloc)).map(|_| bytes)
            })?
            .0,
            cpu_s_per_gb: 0.0,
            ratio: None,
            baseline: true,
            note: "portable pinned allocation".into(),
        });
        t.ratios_to("raw cuMemcpyHtoDAsync (pool memory)");
        if staging.stats().registrations != 1 {
            return Err(format!(
                "staging pool registered {} times",
                staging.stats().registrations
            ));
        }
        out.push(t);
    }
    Ok(out)
}

/// Baseline: plain cuMemcpyHtoDAsync calls round-robin over the same blocks, one synchronize at the end.
pub(crate) fn raw_copies(
    staging: &UbPool,
    batch: &UbPool,
    stream: &Arc<cudarc::driver::CudaStream>,
    copies: usize,
    alloc: Option<&sys::HostAlloc>,
) -> Result<f64, String> {
    let size = staging.block_size();
    let src: Vec<_> = (0..staging.block_count())
        .filter_map(|_| staging.try_acquire())
        .collect();
    let dst: Vec<_> = (0..batch.block_count())
        .filter_map(|_| batch.try_acquire())
        .collect();
    stream
        .context()
        .bind_to_thread()
        .map_err(|e| format!("{e:?}"))?;
    stream.synchronize().map_err(|e| format!("{e:?}"))?;
    let t0 = Instant::now();
    for i in 0..copies {
        let s = match alloc {
            Some(a) => a.ptr(),
            None => src[i % src.len()]
                .host_ptr()
                .ok_or("staging not host-visible")?
                .cast_const(),
        };
        let d = dst[i % dst.len()]
            .device_ptr()
            .ok_or("batch not device memory")?;
        // SAFETY: both blocks are held by leases for the whole loop and the stream is synchronized
        // before they are released; the staging pool is page-locked (Pinned), `alloc` is cuMemHostAlloc.
        unsafe { sys::raw_h2d(d, s, size, stream)? };
    }
    stream.synchronize().map_err(|e| format!("{e:?}"))?;
    Ok(t0.elapsed().as_secs_f64())
}

/// ubdirect: acquire a pinned lease and a device lease, copy, drop the source at once (it recycles
/// when the copy's event fires), keep at most one pool's worth of copies outstanding.
async fn lease_copies(
    dev: &Arc<dyn Device>,
    staging: &UbPool,
    batch: &UbPool,
    copies: usize,
) -> Result<f64, String> {
    let size = staging.block_size();
    let deadline = Duration::from_secs(30);
    let mut outstanding = VecDeque::new();
    let t0 = Instant::now();
    for _ in 0..copies {
        let mut src = staging.acquire(deadline).await.map_err(|e| e.to_string())?;
        if outstanding.len() >= batch.block_count() {
            let (c, dst): (ubdirect_ub::CopyCompletion, ubdirect_ub::Lease) =
                outstanding.pop_front().ok_or("empty")?;
            c.wait(deadline).await.map_err(|e| e.to_string())?;
            drop(dst);
        }
        let mut dst = batch.acquire(deadline).await.map_err(|e| e.to_string())?;
        let c = dev
            .copy_to_device(&mut src, 0..size, &mut dst, 0)
            .map_err(|e| e.to_string())?;
        drop(src);
        outstanding.push_back((c, dst));
    }
    while let Some((c, dst)) = outstanding.pop_front() {
        c.wait(deadline).await.map_err(|e| e.to_string())?;
        drop(dst);
    }
    Ok(t0.elapsed().as_secs_f64())
}
