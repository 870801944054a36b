//! Opening a configured dataset, and generating synthetic ones (`ubdirect gen`).

use std::path::{Path, PathBuf};

use crate::config::{DatasetSection, expand_home};
use crate::formats::index::{DatasetIndex, SampleLoc};
use crate::formats::{self, Dtype, Format, FormatError, io_err};

/// The file extension a format's shards are found by in `dataset.dir`.
pub fn extension(format: Format) -> &'static str {
    format.extension()
}

/// A synthetic dataset written because the config asked for it (`dataset.generate = true` and a
/// `dataset.dir` without shards): said loudly, in the log and the run summary.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Generated {
    /// Where it was written.
    pub dir: PathBuf,
    /// Its format.
    pub format: Format,
    /// Samples written.
    pub samples: u64,
    /// Shards written.
    pub shards: usize,
    /// Bytes written.
    pub bytes: u64,
    /// Why a synthetic dataset already there was written again (an interrupted generation, or one
    /// of other settings), if it was.
    pub regenerated: Option<String>,
}

impl std::fmt::Display for Generated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let why = match &self.regenerated {
            Some(why) => format!("held a synthetic dataset to write again ({why})"),
            None => "held no shards".to_string(),
        };
        write!(
            f,
            "SYNTHETIC data: dataset.dir {} {why}, so dataset.generate = true wrote {} {} samples ({} shard(s), {} bytes) there — not your data; set dataset.generate = false to make a missing dataset an error",
            self.dir.display(),
            self.samples,
            self.format,
            self.shards,
            self.bytes
        )
    }
}

/// Builds the index of the configured (local) dataset, generating it first if configured and absent.
pub fn open(cfg: &DatasetSection) -> Result<DatasetIndex, FormatError> {
    open_local(cfg).map(|(index, _)| index)
}

/// As [`open`], and says whether a synthetic dataset was generated (logged at `warn` too).
///
/// Generation happens only where the config asks for it (`dataset.generate`, off by default; the
/// embedded default and the sample configs ask), only into a `dataset.dir` that holds no shards of
/// the format, and never for `dataset.paths`. Otherwise a directory without shards is
/// [`FormatError::NoShards`], naming the key and the path.
pub fn open_local(cfg: &DatasetSection) -> Result<(DatasetIndex, Option<Generated>), FormatError> {
    check_listable(cfg)?;
    let dir = cfg.dir.as_deref().map(expand_home);
    let paths: Vec<PathBuf> = cfg.paths.iter().map(|p| expand_home(p)).collect();
    let mut generated = None;
    // A synthetic dataset found interrupted (its marker, no manifest) or made with other settings
    // (its manifest) is written again; shards without either are the user's and are used.
    let regenerate = match (&dir, cfg.generate && paths.is_empty()) {
        (Some(d), true) => stale_generation(d, cfg)?,
        _ => None,
    };
    if let (Some(d), Some(_)) = (&dir, &regenerate) {
        remove_generation(d, cfg.format)?;
    }
    if cfg.generate
        && paths.is_empty()
        && let Some(d) = &dir
        && let Err(FormatError::NoShards { .. }) =
            formats::shard_paths(&[], Some(d), cfg.format.extension())
    {
        let files = generate(
            d,
            cfg.format,
            cfg.generate_samples,
            cfg.generate_shards.max(1),
            cfg,
        )?;
        let bytes = files
            .iter()
            .flat_map(|f| match cfg.format {
                Format::Megatron => vec![f.clone(), f.with_extension("bin")],
                _ => vec![f.clone()],
            })
            .filter_map(|f| std::fs::metadata(f).ok())
            .map(|m| m.len())
            .sum();
        let g = Generated {
            dir: d.clone(),
            format: cfg.format,
            samples: cfg.generate_samples,
            shards: files.len(),
            bytes,
            regenerated: regenerate,
        };
        // The log target users filter on stays the one from before `dataset` moved under `shards`.
        tracing::warn!(target: "ubdirect_loader::dataset", "{g}");
        generated = Some(g);
    }
    let shard_paths = formats::shard_paths(&paths, dir.as_deref(), cfg.format.extension())?;
    Ok((
        index_with(cfg, &shard_paths, &formats::LocalFiles)?,
        generated,
    ))
}

/// `dataset.dir` as a `ub://` URL: a storage server is not listed, its shards are named.
pub fn check_listable(cfg: &DatasetSection) -> Result<(), FormatError> {
    if !cfg.paths.is_empty() {
        return Ok(());
    }
    let Some(dir) = cfg.dir.as_deref().and_then(|d| d.to_str()) else {
        return Ok(());
    };
    if dir.starts_with("ub://") {
        let base = dir.trim_end_matches('/');
        return Err(FormatError::NotListable {
            url: dir.to_string(),
            why: "a ub:// storage server does not list its roots",
            example: format!("{base}/shard-00000{}", cfg.format.extension()),
        });
    }
    Ok(())
}

/// Builds the index of `paths` through `opener`: the one format dispatch for local and remote shards.
pub fn index_with(
    cfg: &DatasetSection,
    paths: &[PathBuf],
    opener: &dyn formats::Opener,
) -> Result<DatasetIndex, FormatError> {
    formats::index(
        cfg.format,
        paths,
        opener,
        cfg.dtype,
        cfg.record_len,
        &cfg.column,
    )
}

/// The other columns of a several-column dataset: each column's locations, row for row.
pub type Columns = Vec<Vec<SampleLoc>>;

/// [`index_with`], and with several `dataset.columns` the other columns' locations, row for row:
/// a WebDataset shard is scanned once for all its parts (a remote one is read once at open, not once
/// per part).
pub fn index_with_columns(
    cfg: &DatasetSection,
    paths: &[PathBuf],
    opener: &dyn formats::Opener,
) -> Result<(DatasetIndex, Option<Columns>), crate::error::LoadError> {
    if cfg.format == Format::WebDataset && cfg.columns.len() >= 2 {
        let mut files = formats::open_all(paths, opener)?;
        let (index, others) = formats::webdataset::open_readers_columns(&mut files, &cfg.columns)?;
        index.validate()?;
        return Ok((index, Some(others)));
    }
    let index = index_with(cfg, paths, opener)?;
    let others = crate::gpt::extra_columns(
        cfg.format,
        &cfg.columns,
        cfg.dtype,
        cfg.record_len,
        &index,
        opener,
    )?;
    Ok((index, others))
}

/// Deterministic pseudo-random bytes.
pub(crate) fn fill(seed: u64, buf: &mut [u8]) {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for c in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        c.copy_from_slice(&b[..c.len()]);
    }
}

/// The most shards [`generate`] writes.
pub const GEN_MAX_SHARDS: u32 = 1 << 16;

/// The largest shard [`generate`] builds (in memory, then written).
pub const GEN_MAX_SHARD_BYTES: u64 = 4 << 30;

/// Writes a synthetic dataset of `format` into `dir`: `samples` samples over `shards` shards.
/// raw: records of `record_len` × `dtype`; megatron: u16 sequences of 64–4096 tokens; npy: float32
/// arrays of shape (n, 256); arrow: a Binary `payload` column of 1–64 KiB rows (plus `id` and `vec`);
/// webdataset: `.tar` shards of samples with a 0.5–1.5 KiB `jpg` and a `cls` part.
pub fn generate(
    dir: &Path,
    format: Format,
    samples: u64,
    shards: u32,
    cfg: &DatasetSection,
) -> Result<Vec<PathBuf>, FormatError> {
    let shards = shards.max(1);
    if shards > GEN_MAX_SHARDS {
        return Err(FormatError::Config(format!(
            "gen: {shards} shards (`--shards`, dataset.generate_shards): at most {GEN_MAX_SHARDS}"
        )));
    }
    let per = samples.div_ceil(shards as u64);
    // Each shard is built in memory: its size is checked (no overflow, at most a quarter of this
    // machine's memory and 4 GiB) before anything is allocated or written.
    let most_per_sample: u64 = match format {
        Format::Raw => cfg
            .record_len
            .checked_mul(cfg.dtype.size() as u64)
            .filter(|r| *r > 0)
            .ok_or_else(|| {
                FormatError::Config(format!(
                    "dataset.record_len {} × {} is not a valid record size",
                    cfg.record_len,
                    cfg.dtype.name()
                ))
            })?,
        Format::Megatron => 2 + 2 * (64 + 4032) + 16,
        Format::Npy => 256 * 4,
        Format::Arrow => 2 + 64 * 1024 + 64,
        // A 0.5-1.5 KiB `jpg` and a `cls`, each after a header, padded to blocks.
        Format::WebDataset => 4 * 512 + 1024,
    };
    let limit = (crate::formats::memory_total() / 4).min(GEN_MAX_SHARD_BYTES);
    let shard_bytes = per.checked_mul(most_per_sample);
    if shard_bytes.is_none_or(|b| b > limit) {
        return Err(FormatError::Config(format!(
            "gen: {samples} {format} samples over {shards} shard(s) make shards of up to {} bytes, more than the {limit}-byte limit per shard (use more shards or fewer samples)",
            shard_bytes.map_or_else(|| "2^64+".to_string(), |b| b.to_string())
        )));
    }
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    // The whole dataset must fit on the file system: shards are written until the count is reached,
    // never until the disk is full.
    let total = shard_bytes.and_then(|b| b.checked_mul(shards as u64));
    let free = crate::formats::sys::free_bytes(dir).map_err(io_err(dir))?;
    if total.is_none_or(|t| t > free) {
        return Err(FormatError::Config(format!(
            "gen: {samples} {format} samples (`--samples`, dataset.generate_samples) over {shards} shard(s) (`--shards`, dataset.generate_shards) need up to {} bytes, more than the {free} bytes free in {}",
            total.map_or_else(|| "2^64+".to_string(), |b| b.to_string()),
            dir.display()
        )));
    }
    // The marker first, the manifest last: a generation cut short (kill -9 after 6 of 8 shards) is
    // known at the next start and written again, never read as a smaller dataset.
    let want = settings_line(format, samples, shards, cfg);
    let marker = dir.join(GENERATING);
    ubdirect_ub::write_new(&marker, want.as_bytes()).map_err(io_err(&marker))?;
    let mut out = Vec::new();
    for s in 0..shards as u64 {
        let n = per.min(samples.saturating_sub(s * per));
        out.push(write_shard(dir, format, s, n, s * per, cfg)?);
    }
    let mut manifest = want;
    for f in files_of(format, &out) {
        let len = std::fs::metadata(&f).map_err(io_err(&f))?.len();
        let name = f.file_name().map(|n| n.to_string_lossy().into_owned());
        manifest.push_str(&format!("{len} {}\n", name.unwrap_or_default()));
    }
    let mp = dir.join(MANIFEST);
    ubdirect_ub::write_new(&mp, manifest.as_bytes()).map_err(io_err(&mp))?;
    std::fs::remove_file(&marker).map_err(io_err(&marker))?;
    Ok(out)
}

/// Written into `dataset.dir` before the first shard of a synthetic dataset, removed after its
/// manifest: present alone, the generation was cut short.
pub const GENERATING: &str = ".ubdirect-generating";
/// Written into `dataset.dir` after every shard of a synthetic dataset: its settings line, then
/// each file's size and name.
pub const MANIFEST: &str = ".ubdirect-generated";

/// The first line of a generation's marker and manifest: what was asked for.
fn settings_line(format: Format, samples: u64, shards: u32, cfg: &DatasetSection) -> String {
    let rec = match format {
        Format::Raw => format!(" record_len={} dtype={}", cfg.record_len, cfg.dtype.name()),
        _ => String::new(),
    };
    format!(
        "ubdirect synthetic dataset 1: format={format} samples={samples} shards={shards}{rec}\n"
    )
}

/// Every file the shards `listed` consist of (a Megatron shard is its `.idx` and `.bin`).
fn files_of(format: Format, listed: &[PathBuf]) -> Vec<PathBuf> {
    listed
        .iter()
        .flat_map(|f| match format {
            Format::Megatron => vec![f.clone(), f.with_extension("bin")],
            _ => vec![f.clone()],
        })
        .collect()
}

/// Why the synthetic dataset in `dir` must be written again for `cfg`, if it must: its marker
/// without a manifest (cut short), a manifest of other settings, or a file it lists missing or of
/// another size. `None`: no generation there (no marker, no manifest), or a whole one of these
/// settings.
fn stale_generation(dir: &Path, cfg: &DatasetSection) -> Result<Option<String>, FormatError> {
    let (marker, mp) = (dir.join(GENERATING), dir.join(MANIFEST));
    let manifest = match formats::read_regular(&mp, 16 << 20) {
        Ok(b) => String::from_utf8_lossy(&b).into_owned(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok(marker
                .exists()
                .then(|| "a generation was cut short: its marker without a manifest".to_string()));
        }
        Err(e) => {
            return Err(FormatError::Io {
                path: mp,
                source: e,
            });
        }
    };
    let want = settings_line(
        cfg.format,
        cfg.generate_samples,
        cfg.generate_shards.max(1),
        cfg,
    );
    let mut lines = manifest.lines();
    let had = lines.next().unwrap_or_default();
    if format!("{had}\n") != want {
        return Ok(Some(format!(
            "it was made as \"{had}\", the config asks for \"{}\"",
            want.trim_end()
        )));
    }
    for l in lines {
        let (len, name) = l.split_once(' ').unwrap_or(("", l));
        let f = dir.join(name);
        let now = std::fs::metadata(&f).map(|m| m.len()).ok();
        if name.contains('/') || now.is_none_or(|n| Some(n) != len.parse().ok()) {
            return Ok(Some(format!(
                "{name} is missing or changed since it was written"
            )));
        }
    }
    Ok(None)
}

/// Removes a synthetic dataset of `format` from `dir`: the files named as [`generate`] names them
/// (`shard-NNNNN` with the format's extensions), its marker and its manifest.
fn remove_generation(dir: &Path, format: Format) -> Result<(), FormatError> {
    let exts: &[&str] = match format {
        Format::Megatron => &["idx", "bin"],
        _ => &[format.extension().trim_start_matches('.')],
    };
    let rd = std::fs::read_dir(dir).map_err(io_err(dir))?;
    for e in rd.filter_map(|e| e.ok()) {
        let name = e.file_name().to_string_lossy().into_owned();
        let ours = name
            .strip_prefix("shard-")
            .and_then(|r| r.split_once('.'))
            .is_some_and(|(n, ext)| {
                n.len() == 5 && n.bytes().all(|b| b.is_ascii_digit()) && exts.contains(&ext)
            });
        if ours || name == GENERATING || name == MANIFEST {
            let p = e.path();
            std::fs::remove_file(&p).map_err(io_err(&p))?;
        }
    }
    Ok(())
}

/// Writes shard `s` of a synthetic dataset (`n` samples, the first numbered `first`); returns the
/// path the dataset lists it by.
fn write_shard(
    dir: &Path,
    format: Format,
    s: u64,
    n: u64,
    first: u64,
    cfg: &DatasetSection,
) -> Result<PathBuf, FormatError> {
    let seed = 0xDA7A ^ (s << 32);
    Ok(match format {
        Format::Raw => {
            let dtype = cfg.dtype;
            let rec = cfg.record_len as usize * dtype.size();
            let p = dir.join(format!("shard-{s:05}.bin"));
            let mut buf = vec![0u8; rec * n as usize];
            fill(seed, &mut buf);
            ubdirect_ub::write_new(&p, &buf).map_err(io_err(&p))?;
            p
        }
        Format::Megatron => {
            let mut lens = vec![0u8; n as usize * 2];
            fill(seed ^ 1, &mut lens);
            let seqs: Vec<Vec<u8>> = lens
                .chunks_exact(2)
                .enumerate()
                .map(|(i, l)| {
                    let toks = 64 + (u16::from_le_bytes([l[0], l[1]]) as usize % 4033);
                    let mut v = vec![0u8; toks * 2];
                    fill(seed ^ (i as u64 + 2), &mut v);
                    v
                })
                .collect();
            let prefix = dir.join(format!("shard-{s:05}"));
            formats::megatron::write(&prefix, Dtype::U16, &seqs)?;
            prefix.with_extension("idx")
        }
        Format::Npy => {
            let p = dir.join(format!("shard-{s:05}.npy"));
            let mut buf = vec![0u8; n as usize * 256 * 4];
            fill(seed, &mut buf);
            // Keep the floats finite: clear the exponent's top bit.
            for c in buf.chunks_exact_mut(4) {
                c[3] &= 0x3F;
            }
            formats::npy::write(&p, "<f4", &[n, 256], &buf)?;
            p
        }
        Format::Arrow => {
            let mut lens = vec![0u8; n as usize * 2];
            fill(seed ^ 1, &mut lens);
            let rows: Vec<Vec<u8>> = lens
                .chunks_exact(2)
                .enumerate()
                .map(|(i, l)| {
                    let len = 1024 + (u16::from_le_bytes([l[0], l[1]]) as usize % (63 * 1024));
                    let mut v = vec![0u8; len];
                    fill(seed ^ (i as u64 + 2), &mut v);
                    v
                })
                .collect();
            let p = dir.join(format!("shard-{s:05}.arrow"));
            formats::arrow::write(&p, &rows, 256)?;
            p
        }
        Format::WebDataset => {
            let p = dir.join(format!("shard-{s:05}.tar"));
            formats::webdataset::write(&p, &webdataset_members(seed, first, n))?;
            p
        }
    })
}

/// The members of `n` synthetic WebDataset samples numbered from `first`: a 0.5-1.5 KiB `jpg` of
/// random bytes and a `cls` (a class number as text) each.
fn webdataset_members(seed: u64, first: u64, n: u64) -> Vec<(String, Vec<u8>)> {
    let mut lens = vec![0u8; n as usize * 2];
    fill(seed ^ 1, &mut lens);
    let mut out = Vec::with_capacity(n as usize * 2);
    for (i, l) in lens.chunks_exact(2).enumerate() {
        let k = first + i as u64;
        let mut jpg = vec![0u8; 512 + (u16::from_le_bytes([l[0], l[1]]) as usize % 1025)];
        fill(seed ^ (i as u64 + 2), &mut jpg);
        out.push((format!("sample{k:09}.jpg"), jpg));
        out.push((
            format!("sample{k:09}.cls"),
            (k % 1000).to_string().into_bytes(),
        ));
    }
    out
}
