//! `ubdirect-bench gpt-index`: start-up cost of GPT mode at scale — opening a Megatron dataset of N
//! sequences (`.idx` parsed, index built) and building its GPT sample indices in the block and the
//! Megatron order — wall time and the process's peak resident memory after each step — and a second
//! start's Megatron indices from the on-disk cache (`dataset.gpt_index_cache`), for N = 10⁶
//! and 10⁷ (10⁵ and 10⁶ with `--quick`; `UBDIRECT_BENCH_GPT_MAX=100000000` adds 10⁸). Not a
//! timed test: a measurement of what is.

use std::io::Write;
use std::path::Path;
use std::time::Instant;

use serde::Serialize;
use ubdirect_loader::formats::{Dtype, megatron};
use ubdirect_loader::gpt::{self, GptSettings, Order, SplitPart};

/// One measured size.
#[derive(Debug, Clone, Serialize)]
pub struct GptIndexRow {
    /// Sequences in the dataset.
    pub sequences: u64,
    /// `.idx` bytes.
    pub idx_bytes: u64,
    /// Seconds to open the dataset (map the `.idx`, check its header and every sequence).
    pub open_s: f64,
    /// Seconds to build the block-order windows.
    pub block_s: f64,
    /// Seconds to build Megatron's three indices.
    pub megatron_s: f64,
    /// Seconds of a first start with the index cache on: Megatron's build and writing the cache.
    pub megatron_store_s: f64,
    /// Seconds of the next start: the cache file mapped and checked instead of the build.
    pub megatron_cached_s: f64,
    /// GPT samples (windows) per epoch.
    pub samples: u64,
    /// Peak resident memory of the process after the step, MiB (`VmHWM`).
    pub peak_mib_after_open: f64,
    /// Same, after both builds.
    pub peak_mib_after_build: f64,
}

fn vm_hwm_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|k| k.parse::<f64>().ok())
        })
        .map_or(0.0, |kib| kib / 1024.0)
}

/// Resets the process's peak resident memory to the current one (`/proc/self/clear_refs` 5,
/// Linux ≥ 4.0), so each size's peak is its own; false where the kernel refuses.
fn reset_hwm() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// The lengths of the synthetic dataset: 64–4095 tokens, the same sequence on every call.
fn lengths(n: u64) -> impl Iterator<Item = i32> {
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    (0..n).map(move |_| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        64 + (x % 4032) as i32
    })
}

/// Writes `PREFIX.idx` for `n` u16 sequences of 64–4095 tokens and a sparse `PREFIX.bin` of the
/// matching size (the bytes are never read here). Streamed: nothing per sequence is kept.
fn write_dataset(prefix: &Path, n: u64) -> Result<u64, String> {
    let err = |e: std::io::Error| format!("{}: {e}", prefix.display());
    let idx = prefix.with_extension("idx");
    let mut f =
        std::io::BufWriter::with_capacity(1 << 20, std::fs::File::create(&idx).map_err(err)?);
    f.write_all(megatron::MAGIC).map_err(err)?;
    f.write_all(&1u64.to_le_bytes()).map_err(err)?;
    f.write_all(&[8u8]).map_err(err)?; // u16
    f.write_all(&n.to_le_bytes()).map_err(err)?;
    f.write_all(&(n + 1).to_le_bytes()).map_err(err)?;
    for l in lengths(n) {
        f.write_all(&l.to_le_bytes()).map_err(err)?;
    }
    let mut off = 0i64;
    for l in lengths(n) {
        f.write_all(&off.to_le_bytes()).map_err(err)?;
        off += l as i64 * 2;
    }
    for d in 0..=n as i64 {
        f.write_all(&d.to_le_bytes()).map_err(err)?;
    }
    f.flush().map_err(err)?;
    std::fs::File::create(prefix.with_extension("bin"))
        .and_then(|b| b.set_len(off as u64))
        .map_err(err)?;
    std::fs::metadata(&idx).map(|m| m.len()).map_err(err)
}

/// Runs the scenario in `dir`.
pub fn run(dir: &Path, quick: bool) -> Result<Vec<GptIndexRow>, String> {
    let mut sizes: Vec<u64> = if quick {
        vec![100_000, 1_000_000]
    } else {
        vec![1_000_000, 10_000_000]
    };
    if let Some(max) = std::env::var("UBDIRECT_BENCH_GPT_MAX")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        let mut n = sizes.last().copied().unwrap_or(1) * 10;
        while n <= max {
            sizes.push(n);
            n *= 10;
        }
    }
    println!("\n== gpt-index: open a Megatron dataset and build GPT indices (seq 4096, u16) ==");
    println!(
        "{:>12} {:>10} {:>9} {:>9} {:>11} {:>9} {:>9} {:>12} {:>12} {:>12}",
        "sequences",
        "idx MiB",
        "open s",
        "block s",
        "megatron s",
        "store s",
        "cached s",
        "samples",
        "peak MiB¹",
        "peak MiB²"
    );
    let mut rows = Vec::new();
    let mut hwm_resets = true;
    for n in sizes {
        let prefix = dir.join(format!("gpt-index-{n}"));
        let idx_bytes = write_dataset(&prefix, n)?;
        let own_peak = reset_hwm();
        let t = Instant::now();
        let index = megatron::open(std::slice::from_ref(&prefix)).map_err(|e| e.to_string())?;
        let open_s = t.elapsed().as_secs_f64();
        let peak_open = vm_hwm_mib();
        let settings = |order| GptSettings {
            sequence_length: 4096,
            add_extra_token: true,
            seed: 1234,
            num_samples: 0,
            split: "969,30,1".into(),
            part: SplitPart::Train,
            order,
            blend: Vec::new(),
        };
        let t = Instant::now();
        let block =
            gpt::build(&index, Dtype::U16, &settings(Order::Block)).map_err(|e| e.to_string())?;
        let block_s = t.elapsed().as_secs_f64();
        drop(block);
        let t = Instant::now();
        let meg = gpt::build(&index, Dtype::U16, &settings(Order::Megatron))
            .map_err(|e| e.to_string())?;
        let megatron_s = t.elapsed().as_secs_f64();
        let peak_build = vm_hwm_mib();
        // A first start with the cache (build + write), then the next one (map + check).
        let cached = |want: gpt::cache::CacheUse| -> Result<f64, String> {
            let t = Instant::now();
            let g = gpt::build_with_cache(&index, Dtype::U16, &settings(Order::Megatron), true)
                .map_err(|e| e.to_string())?;
            let s = t.elapsed().as_secs_f64();
            if g.parts[0].cache != want || g.len() != meg.len() {
                return Err(format!(
                    "gpt-index: the index cache did {:?}, not {want:?}",
                    g.parts[0].cache
                ));
            }
            Ok(s)
        };
        let idx_path = prefix.with_extension("idx");
        for f in gpt::cache::cache_files(&idx_path) {
            let _ = std::fs::remove_file(f);
        }
        let megatron_store_s = cached(gpt::cache::CacheUse::Stored)?;
        let megatron_cached_s = cached(gpt::cache::CacheUse::Hit)?;
        for f in gpt::cache::cache_files(&idx_path) {
            let _ = std::fs::remove_file(f);
        }
        let row = GptIndexRow {
            sequences: n,
            idx_bytes,
            open_s,
            block_s,
            megatron_s,
            megatron_store_s,
            megatron_cached_s,
            samples: meg.len(),
            peak_mib_after_open: peak_open,
            peak_mib_after_build: peak_build,
        };
        println!(
            "{:>12} {:>10.1} {:>9.3} {:>9.3} {:>11.3} {:>9.3} {:>9.3} {:>12} {:>12.0} {:>12.0}",
            n,
            idx_bytes as f64 / (1 << 20) as f64,
            open_s,
            block_s,
            megatron_s,
            megatron_store_s,
            megatron_cached_s,
            row.samples,
            row.peak_mib_after_open,
            row.peak_mib_after_build
        );
        drop((meg, index));
        for ext in ["idx", "bin"] {
            let _ = std::fs::remove_file(prefix.with_extension(ext));
        }
        hwm_resets &= own_peak;
        rows.push(row);
    }
    if let Some(r) = rows.last() {
        println!(
            "Megatron indices from the cache: {:.1}x faster than building them ({} sequences)",
            r.megatron_s / r.megatron_cached_s.max(1e-9),
            r.sequences
        );
    }
    println!(
        "¹ process peak (VmHWM) after opening, ² after both builds; {}",
        if hwm_resets {
            "reset before each size (/proc/self/clear_refs)"
        } else {
            "not resettable here: later sizes include earlier ones"
        }
    );
    Ok(rows)
}
