//! `ubdirect-bench`: throughput scenarios, each measured against a baseline in the same run.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use serde::Serialize;
use ubdirect_ub::{CudaDevice, Device, MemoryKind, PoolConfig, UbPool};

mod sys;

#[derive(Parser, Debug)]
#[command(
    name = "ubdirect-bench",
    version,
    about = "ubdirect throughput scenarios with same-run baselines"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Pinned-lease → device-lease copies through `CudaDevice` vs plain cuMemcpyHtoDAsync, per size.
    H2d {
        /// Copy sizes.
        #[arg(long, value_delimiter = ',', default_value = "1MiB,4MiB,16MiB,64MiB")]
        sizes: Vec<String>,
        /// Bytes moved per measurement.
        #[arg(long, default_value = "4GiB")]
        total: String,
        /// Measurements per figure (median, min and max are reported).
        #[arg(long, default_value_t = 5)]
        runs: usize,
        /// Blocks per pool (copies in flight).
        #[arg(long, default_value_t = 8)]
        blocks: usize,
        /// CUDA ordinal.
        #[arg(long, default_value_t = 0)]
        ordinal: usize,
        /// Write results as JSON.
        #[arg(long)]
        json: Option<PathBuf>,
    },
}

#[derive(Debug, Serialize)]
struct Figure {
    median: f64,
    min: f64,
    max: f64,
}

fn figure(mut v: Vec<f64>) -> Figure {
    v.sort_by(|a, b| a.total_cmp(b));
    Figure {
        median: v[v.len() / 2],
        min: v[0],
        max: v[v.len() - 1],
    }
}

#[derive(Debug, Serialize)]
struct H2dRow {
    size: usize,
    copies: usize,
    raw_pool_memory_gbps: Figure,
    raw_cumemhostalloc_gbps: Figure,
    ubdirect_leases_gbps: Figure,
    ratio_vs_raw_pool_memory: f64,
    ratio_vs_raw_cumemhostalloc: f64,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::H2d {
            sizes,
            total,
            runs,
            blocks,
            ordinal,
            json,
        } => h2d(&sizes, &total, runs, blocks, ordinal, json),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn h2d(
    sizes: &[String],
    total: &str,
    runs: usize,
    blocks: usize,
    ordinal: usize,
    json: Option<PathBuf>,
) -> Result<(), String> {
    let total = ubdirect_loader::config::parse_size(total)? as usize;
    let runs = runs.max(1);
    let cuda = match CudaDevice::new(ordinal) {
        Ok(c) => Arc::new(c),
        Err(e) => {
            println!("h2d: skipped — {e}");
            return Ok(());
        }
    };
    let dev: Arc<dyn Device> = cuda.clone();
    let info = dev.info();
    println!(
        "h2d on {} (pci {}, numa {}), {} MiB per measurement, {runs} runs, {blocks} blocks per pool",
        info.name,
        info.pci_bus_id.as_deref().unwrap_or("?"),
        info.numa_node.map_or("?".into(), |n| n.to_string()),
        total >> 20
    );
    println!(
        "{:>10} {:>7} {:>22} {:>22} {:>22} {:>8}",
        "size",
        "copies",
        "raw pool mem GB/s",
        "raw cuMemHostAlloc",
        "ubdirect leases GB/s",
        "ratio"
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let mut rows = Vec::new();
    for s in sizes {
        let size = ubdirect_loader::config::parse_size(s)? as usize;
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
        let (mut raw_pool, mut raw_alloc, mut ub) = (Vec::new(), Vec::new(), Vec::new());
        // Warm up both paths once.
        raw_copies(&staging, &batch, &stream, copies.min(16), None)?;
        rt.block_on(lease_copies(&dev, &staging, &batch, copies.min(16)))?;
        for _ in 0..runs {
            let t = raw_copies(&staging, &batch, &stream, copies, None)?;
            raw_pool.push((copies * size) as f64 / t / 1e9);
            let t = raw_copies(&staging, &batch, &stream, copies, Some(&alloc))?;
            raw_alloc.push((copies * size) as f64 / t / 1e9);
            let t = rt.block_on(lease_copies(&dev, &staging, &batch, copies))?;
            ub.push((copies * size) as f64 / t / 1e9);
        }
        let (a, b, c) = (figure(raw_pool), figure(raw_alloc), figure(ub));
        let row = H2dRow {
            size,
            copies,
            ratio_vs_raw_pool_memory: c.median / a.median,
            ratio_vs_raw_cumemhostalloc: c.median / b.median,
            raw_pool_memory_gbps: a,
            raw_cumemhostalloc_gbps: b,
            ubdirect_leases_gbps: c,
        };
        let f = |x: &Figure| format!("{:.2} [{:.2}–{:.2}]", x.median, x.min, x.max);
        println!(
            "{:>10} {:>7} {:>22} {:>22} {:>22} {:>8.3}",
            s,
            copies,
            f(&row.raw_pool_memory_gbps),
            f(&row.raw_cumemhostalloc_gbps),
            f(&row.ubdirect_leases_gbps),
            row.ratio_vs_raw_pool_memory
        );
        if staging.stats().registrations != 1 {
            return Err(format!(
                "staging pool registered {} times",
                staging.stats().registrations
            ));
        }
        rows.push(row);
    }
    if let Some(p) = json {
        let j = serde_json::to_string_pretty(&rows).map_err(|e| e.to_string())?;
        std::fs::write(&p, j).map_err(|e| format!("{}: {e}", p.display()))?;
    }
    Ok(())
}

/// Baseline: plain cuMemcpyHtoDAsync calls round-robin over the same blocks, one synchronize at the end.
fn raw_copies(
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
