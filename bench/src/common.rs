//! What every scenario shares: repeated measurement with median/min/max, CPU cost, machine facts,
//! result tables.

use std::path::Path;
use std::time::{Duration, Instant};

use serde::Serialize;

/// Median, min and max of repeated measurements.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Figure {
    /// Median.
    pub median: f64,
    /// Minimum.
    pub min: f64,
    /// Maximum.
    pub max: f64,
}

impl Figure {
    pub fn of(mut v: Vec<f64>) -> Self {
        v.sort_by(|a, b| a.total_cmp(b));
        if v.is_empty() {
            return Figure {
                median: 0.0,
                min: 0.0,
                max: 0.0,
            };
        }
        Figure {
            median: v[v.len() / 2],
            min: v[0],
            max: v[v.len() - 1],
        }
    }
}

/// One measured configuration of a scenario.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// What ran.
    pub label: String,
    /// Throughput, GB/s (10^9 bytes).
    pub gbps: Figure,
    /// Process CPU seconds per GB moved (median run).
    pub cpu_s_per_gb: f64,
    /// Ratio of the median to the scenario's reference row, when there is one.
    pub ratio: Option<f64>,
    /// Whether this row is a baseline (not ubdirect).
    pub baseline: bool,
    /// Extra facts (queue depth, read size, path).
    pub note: String,
}

/// A scenario's results.
#[derive(Debug, Clone, Serialize)]
pub struct Table {
    /// Scenario name.
    pub scenario: String,
    /// What the ratio column is relative to.
    pub reference: String,
    /// Rows.
    pub rows: Vec<Row>,
}

impl Table {
    pub fn new(scenario: &str) -> Self {
        Table {
            scenario: scenario.into(),
            reference: String::new(),
            rows: Vec::new(),
        }
    }

    /// Sets ratios relative to the row labelled `reference`.
    pub fn ratios_to(&mut self, reference: &str) {
        if let Some(r) = self
            .rows
            .iter()
            .find(|r| r.label == reference)
            .map(|r| r.gbps.median)
        {
            self.reference = reference.into();
            for row in &mut self.rows {
                row.ratio = (r > 0.0).then(|| row.gbps.median / r);
            }
        }
    }

    pub fn print(&self) {
        println!(
            "\n== {}{}",
            self.scenario,
            if self.reference.is_empty() {
                String::new()
            } else {
                format!(" (ratio vs {})", self.reference)
            }
        );
        println!(
            "{:<44} {:>24} {:>10} {:>8}  note",
            "", "GB/s median [min–max]", "CPU s/GB", "ratio"
        );
        for r in &self.rows {
            println!(
                "{:<44} {:>24} {:>10.3} {:>8}  {}",
                format!("{}{}", if r.baseline { "baseline: " } else { "" }, r.label),
                format!("{:.3} [{:.3}–{:.3}]", r.gbps.median, r.gbps.min, r.gbps.max),
                r.cpu_s_per_gb,
                r.ratio.map_or("-".into(), |x| format!("{x:.3}")),
                r.note
            );
        }
    }
}

/// User + system CPU time of this process.
pub fn cpu_time() -> Duration {
    crate::sys::cpu_time()
}

/// Runs `f` `runs` times; each call returns bytes moved. Gives the GB/s figure and the CPU s/GB of
/// the median run.
pub fn measure(
    runs: usize,
    f: impl FnMut() -> Result<u64, String>,
) -> Result<(Figure, f64), String> {
    measure_with(runs, || Ok(()), f)
}

/// [`measure`], running `before` (unmeasured) ahead of every run: dropping caches, for instance.
pub fn measure_with(
    runs: usize,
    before: impl Fn() -> Result<(), String>,
    mut f: impl FnMut() -> Result<u64, String>,
) -> Result<(Figure, f64), String> {
    let mut rates = Vec::new();
    let mut cpus = Vec::new();
    for _ in 0..runs.max(1) {
        before()?;
        let c0 = cpu_time();
        let t0 = Instant::now();
        let bytes = f()?;
        let secs = t0.elapsed().as_secs_f64().max(1e-9);
        let cpu = (cpu_time() - c0).as_secs_f64();
        rates.push(bytes as f64 / secs / 1e9);
        cpus.push(if bytes > 0 {
            cpu / (bytes as f64 / 1e9)
        } else {
            0.0
        });
    }
    let mut idx: Vec<usize> = (0..rates.len()).collect();
    idx.sort_by(|&a, &b| rates[a].total_cmp(&rates[b]));
    let cpu_med = cpus[idx[idx.len() / 2]];
    Ok((Figure::of(rates), cpu_med))
}

/// Facts about the machine, printed in every report's header.
#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    pub cpu: String,
    pub cores: usize,
    pub memory_gib: f64,
    pub kernel: String,
    pub gpu: String,
    pub bench_dir: String,
    pub bench_dir_direct_io: String,
}

pub fn machine(dir: &Path, gpu: &str) -> Machine {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .unwrap_or("?")
        .trim()
        .to_string();
    let mem = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("MemTotal"))
        .and_then(|l| {
            l.split_whitespace()
                .nth(1)
                .and_then(|k| k.parse::<f64>().ok())
        })
        .unwrap_or(0.0)
        / 1048576.0;
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .unwrap_or_default()
        .trim()
        .to_string();
    Machine {
        cpu,
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        memory_gib: mem,
        kernel,
        gpu: gpu.to_string(),
        bench_dir: dir.display().to_string(),
        bench_dir_direct_io: String::new(),
    }
}

/// Writes `len` bytes of pseudo-random data to `path` unless it already has that size.
pub fn ensure_file(path: &Path, len: u64) -> Result<(), String> {
    use std::io::Write;
    if std::fs::metadata(path)
        .map(|m| m.len() == len)
        .unwrap_or(false)
    {
        return Ok(());
    }
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d).map_err(|e| e.to_string())?;
    }
    let tmp = path.with_extension("partial");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&tmp).map_err(|e| e.to_string())?);
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15 ^ len;
    let mut chunk = vec![0u8; 4 << 20];
    let mut left = len;
    while left > 0 {
        for w in chunk.chunks_exact_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            w.copy_from_slice(&x.to_le_bytes());
        }
        let n = left.min(chunk.len() as u64) as usize;
        f.write_all(&chunk[..n]).map_err(|e| e.to_string())?;
        left -= n as u64;
    }
    f.into_inner()
        .map_err(|e| e.to_string())?
        .sync_all()
        .map_err(|e| e.to_string())?;
    std::fs::rename(&tmp, path).map_err(|e| e.to_string())
}

/// Drops a file's clean pages from the page cache (posix_fadvise DONTNEED): a cold read without
/// needing root.
pub fn drop_cache(path: &Path) -> Result<(), String> {
    crate::sys::fadvise_dontneed(path).map_err(|e| format!("{}: fadvise: {e}", path.display()))
}

/// Reads a file once through the page cache (warms it).
pub fn warm(path: &Path) -> Result<u64, String> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let mut buf = vec![0u8; 4 << 20];
    let mut n = 0u64;
    loop {
        match f.read(&mut buf).map_err(|e| e.to_string())? {
            0 => return Ok(n),
            k => n += k as u64,
        }
    }
}
