//! The run configuration: one struct is the truth; TOML sets it (docs/configuration.md lists every
//! key and default, and a test checks the two agree).

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

mod gpt;
mod sections;
mod sets;
#[cfg(test)]
mod tests;

pub use sections::*;

/// The embedded default (`configs/default.toml`).
pub const DEFAULT_CONFIG: &str = include_str!("../../../configs/default.toml");

/// Errors reading a config.
/// The longest `dataset.sequence_length`: a sample of `sequence_length + 1` tokens of up to 8 bytes
/// is one read, and reads are at most 1 GiB (`loader.max_read`).
pub const MAX_SEQUENCE_LENGTH: u32 = (1 << 27) - 1;
/// The most `dataset.num_samples` (2⁴⁰): Megatron's indices count tokens in `int64`.
pub const MAX_NUM_SAMPLES: u64 = 1 << 40;
/// The largest `dataset.blend[].weight` (weights are summed before they are normalized).
pub const MAX_BLEND_WEIGHT: f64 = 1e15;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("config {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The TOML is malformed or has unknown or mistyped keys.
    #[error("config {origin}: {source}")]
    Parse {
        /// The file, or `<embedded default>`.
        origin: String,
        /// The parser's error (with line and column).
        #[source]
        source: Box<toml::de::Error>,
    },
    /// A JSON config has a bad value.
    #[error("config {origin}: {path}: {source}")]
    Json {
        /// Where it came from.
        origin: String,
        /// The key path (`dataset.format`).
        path: String,
        /// The parser's error.
        #[source]
        source: serde_json::Error,
    },
    /// A token or key file could not be read.
    #[error("{key} {}: {source}", path.display())]
    TokenFile {
        /// The key naming the file (`remote.token_file`).
        key: String,
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A value is out of range.
    #[error("config {origin}: {key}: {reason}")]
    Invalid {
        /// The file, or `<embedded default>`.
        origin: String,
        /// The key.
        key: &'static str,
        /// Why.
        reason: String,
    },
}

/// A whole run configuration.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct RunConfig {
    /// `[dataset]`
    pub dataset: DatasetSection,
    /// `[loader]`
    pub loader: LoaderSection,
    /// `[device]`
    pub device: DeviceSection,
    /// `[engine]`
    pub engine: EngineSection,
    /// `[pool]`
    pub pool: PoolSection,
    /// `[metrics]`
    pub metrics: MetricsSection,
    /// `[remote]`
    pub remote: RemoteSection,
    /// `[object_store]` (`s3://` shards)
    pub object_store: ObjectStoreSection,
    /// `[cache]` (local cache of object-store chunks)
    pub cache: CacheSection,
}

/// The first line of a token file (`~/` expanded), trimmed. The error names the key and the file.
/// Only a regular file is read (a FIFO would block), and at most 64 KiB of it.
pub fn read_token_file(p: &std::path::Path, key: &str) -> Result<String, ConfigError> {
    use std::io::Read;
    let path = expand_home(p);
    let err = |source| ConfigError::TokenFile {
        key: key.to_string(),
        path: path.clone(),
        source,
    };
    // Checked on the descriptor (O_NONBLOCK, fstat), so a FIFO swapped in after a check cannot block.
    let (f, _) = crate::formats::open_regular(&path).map_err(err)?;
    let mut text = String::new();
    f.take(64 << 10).read_to_string(&mut text).map_err(err)?;
    Ok(text.lines().next().unwrap_or("").trim().to_string())
}

/// Expands a leading `~/` with `$HOME` (or `/tmp` when unset).
pub fn expand_home(p: &std::path::Path) -> PathBuf {
    match p.to_str().and_then(|s| s.strip_prefix("~/")) {
        Some(rest) => {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/tmp".into())).join(rest)
        }
        None => p.to_path_buf(),
    }
}

/// The largest config file read (a larger one is refused, not read).
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;
/// The largest `loader.prefetch` (batches decoded ahead; each holds a batch block).
pub const MAX_PREFETCH: usize = 1 << 16;
/// The largest `loader.max_read` (a staging block holds one read; io_uring registers ≤ 1 GiB).
pub const MAX_READ: u64 = 1 << 30;
/// The most blocks a pool may have.
pub const MAX_POOL_BLOCKS: usize = 1 << 20;

/// A key that cannot run, and why (the config's origin is added by `validate`).
type Invalid = (&'static str, String);

impl RunConfig {
    /// Parses and validates TOML; `origin` names it in errors.
    pub fn from_toml(text: &str, origin: &str) -> Result<Self, ConfigError> {
        let cfg: RunConfig = toml::from_str(text).map_err(|e| ConfigError::Parse {
            origin: origin.to_string(),
            source: Box::new(e),
        })?;
        cfg.validate(origin)?;
        Ok(cfg)
    }

    /// Parses and validates JSON (the Python package's config dicts); errors name the key path
    /// (`dataset.format: unknown variant …`).
    pub fn from_json(text: &str, origin: &str) -> Result<Self, ConfigError> {
        let mut de = serde_json::Deserializer::from_str(text);
        let cfg: RunConfig =
            serde_path_to_error::deserialize(&mut de).map_err(|e| ConfigError::Json {
                origin: origin.to_string(),
                path: e.path().to_string(),
                source: e.into_inner(),
            })?;
        cfg.validate(origin)?;
        Ok(cfg)
    }

    /// Reads a config file, or the embedded default when `path` is `None`.
    pub fn load(path: Option<&std::path::Path>) -> Result<Self, ConfigError> {
        match path {
            None => Self::from_toml(DEFAULT_CONFIG, "<embedded default>"),
            Some(p) => {
                let err = |source| ConfigError::Read {
                    path: p.to_path_buf(),
                    source,
                };
                // A regular file only (a FIFO would block, a device never end), of bounded size.
                let bytes = crate::formats::read_regular(p, MAX_CONFIG_BYTES).map_err(err)?;
                let text = String::from_utf8(bytes)
                    .map_err(|e| err(std::io::Error::new(std::io::ErrorKind::InvalidData, e)))?;
                Self::from_toml(&text, &p.display().to_string())
            }
        }
    }

    /// Checks every value that can be checked without touching files.
    pub fn validate(&self, origin: &str) -> Result<(), ConfigError> {
        self.check_loader()
            .and_then(|()| self.check_pool())
            .and_then(|()| self.check_gpt())
            .and_then(|()| self.check_metrics())
            .map_err(|(key, reason)| ConfigError::Invalid {
                origin: origin.to_string(),
                key,
                reason,
            })
    }

    /// `[dataset]` basics, `[loader]`, `[remote]`: the first key that cannot run, and why.
    fn check_loader(&self) -> Result<(), Invalid> {
        let bad = |key, reason: String| Err((key, reason));
        if self.dataset.format == crate::formats::Format::Raw && self.dataset.record_len == 0 {
            return bad("dataset.record_len", "must be at least 1".into());
        }
        if self.dataset.dir.is_none() && self.dataset.paths.is_empty() {
            return bad("dataset.dir", "set dataset.dir or dataset.paths".into());
        }
        if let Some(f) = self.cache.window_fraction
            && !(0.0..=1.0).contains(&f)
        {
            return bad(
                "cache.window_fraction",
                format!("{f} (expected 0 to 1: the share of cache.max_bytes kept as windows)"),
            );
        }
        if self.loader.batch_size == 0 || self.loader.batch_size > crate::planner::MAX_BATCH_SIZE {
            return bad(
                "loader.batch_size",
                format!(
                    "{} (expected 1..={})",
                    self.loader.batch_size,
                    crate::planner::MAX_BATCH_SIZE
                ),
            );
        }
        if let Some(w) = self.loader.world_size
            && (w == 0 || w > crate::planner::MAX_WORLD_SIZE)
        {
            return bad(
                "loader.world_size",
                format!("{w} (expected 1..={})", crate::planner::MAX_WORLD_SIZE),
            );
        }
        if self.loader.max_chunk_batches == 0 {
            return bad("loader.max_chunk_batches", "must be at least 1".into());
        }
        if self.remote.connections == 0 || self.remote.connections > 64 {
            return bad(
                "remote.connections",
                format!("{} (expected 1..=64)", self.remote.connections),
            );
        }
        if self.loader.threads == 0 || self.loader.threads > 256 {
            return bad(
                "loader.threads",
                format!("{} (expected 1..=256)", self.loader.threads),
            );
        }
        if self.loader.prefetch == 0 || self.loader.prefetch > MAX_PREFETCH {
            return bad(
                "loader.prefetch",
                format!("{} (expected 1..={MAX_PREFETCH})", self.loader.prefetch),
            );
        }
        let o = &self.object_store;
        for (key, v) in [
            ("object_store.estimate_request_ms", o.estimate_request_ms),
            ("object_store.estimate_gbps", o.estimate_gbps),
            (
                "object_store.price_per_1k_requests",
                o.price_per_1k_requests,
            ),
            ("object_store.price_per_gb", o.price_per_gb),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return bad(key, format!("{v} (expected a finite number >= 0)"));
            }
        }
        if self.loader.min_read.0 > self.loader.max_read.0
            || self.loader.max_read.0 < 4096
            || self.loader.max_read.0 > MAX_READ
        {
            return bad(
                "loader.max_read",
                format!(
                    "{} must be in 4096..={MAX_READ} and >= loader.min_read ({})",
                    self.loader.max_read.0, self.loader.min_read.0
                ),
            );
        }
        Ok(())
    }

    /// `[pool]` against `loader.max_read` and this machine, rank and deadlines.
    fn check_pool(&self) -> Result<(), Invalid> {
        let bad = |key, reason: String| Err((key, reason));
        if self.pool.staging_block_size.0 < self.loader.max_read.0 + 4096 {
            return bad(
                "pool.staging_block_size",
                format!(
                    "{} must hold loader.max_read ({}) plus 4 KiB of alignment",
                    self.pool.staging_block_size.0, self.loader.max_read.0
                ),
            );
        }
        let staging =
            (self.pool.staging_blocks.max(64) as u64).checked_mul(self.pool.staging_block_size.0);
        let memory = crate::formats::memory_total();
        if staging.is_none_or(|b| b > memory) {
            return bad(
                "pool.staging_blocks",
                format!(
                    "{} × pool.staging_block_size {} is more than this machine's memory ({memory} bytes)",
                    self.pool.staging_blocks, self.pool.staging_block_size.0
                ),
            );
        }
        if self.pool.batch_blocks > MAX_POOL_BLOCKS {
            return bad(
                "pool.batch_blocks",
                format!(
                    "{} (expected 0..={MAX_POOL_BLOCKS})",
                    self.pool.batch_blocks
                ),
            );
        }
        if let (Some(r), Some(w)) = (self.loader.rank, self.loader.world_size)
            && r >= w
        {
            return bad(
                "loader.rank",
                format!("{r} is not below loader.world_size {w}"),
            );
        }
        if self.pool.acquire_timeout_ms == 0
            || self.engine.op_timeout_ms == 0
            || self.loader.batch_timeout_ms == 0
        {
            return bad("*_timeout_ms", "deadlines must be positive".into());
        }
        Ok(())
    }

    /// GPT sizes, which multiply.
    fn check_gpt(&self) -> Result<(), Invalid> {
        let bad = |key, reason: String| Err((key, reason));
        // GPT sizes multiply (tokens × bytes per token, samples × tokens, weights summed): each is
        // bounded where the product still fits, so nothing wraps into an empty or wrong dataset.
        if self.dataset.sequence_length > MAX_SEQUENCE_LENGTH {
            return bad(
                "dataset.sequence_length",
                format!(
                    "{} (expected 0..={MAX_SEQUENCE_LENGTH}: a sample of sequence_length + 1 tokens of up to 8 bytes is one read of at most 1 GiB)",
                    self.dataset.sequence_length
                ),
            );
        }
        if self.dataset.num_samples > MAX_NUM_SAMPLES {
            return bad(
                "dataset.num_samples",
                format!(
                    "{} (expected 0..={MAX_NUM_SAMPLES}; 0: one epoch)",
                    self.dataset.num_samples
                ),
            );
        }
        for (i, b) in self.dataset.blend.iter().enumerate() {
            if !(b.weight.is_finite() && b.weight > 0.0 && b.weight <= MAX_BLEND_WEIGHT) {
                return bad(
                    "dataset.blend.weight",
                    format!(
                        "dataset.blend[{i}].weight = {} (expected a number in (0, {MAX_BLEND_WEIGHT:e}]; weights are normalized over the entries)",
                        b.weight
                    ),
                );
            }
        }
        Ok(())
    }

    /// `[metrics]`.
    fn check_metrics(&self) -> Result<(), Invalid> {
        let bad = |key, reason: String| Err((key, reason));
        if let Some(l) = &self.metrics.listen
            && l.parse::<std::net::SocketAddr>().is_err()
        {
            return bad(
                "metrics.listen",
                format!("{l:?} is not an address like 127.0.0.1:9100"),
            );
        }
        Ok(())
    }

    /// The engine configuration this run asks for.
    pub fn engine_config(&self) -> ubdirect_nvme::EngineConfig {
        ubdirect_nvme::EngineConfig {
            rings: self.engine.rings,
            queue_depth: self.engine.queue_depth,
            sqpoll: self.engine.sqpoll,
            direct: self.engine.direct,
            op_timeout: Duration::from_millis(self.engine.op_timeout_ms),
            async_buffered: self.engine.async_buffered,
            thread_copies: self.engine.thread_copies,
            copy_threads: self.engine.copy_threads,
            // Registered-file slots: two per open file with `direct = "auto"` (O_DIRECT and
            // buffered), for every shard and for the object cache's open chunk files (up to 1,024
            // of them). The engine's 1,024 capped a local dataset at 512 shards and sent a warm
            // cache's hits past its 512th chunk to the store. io_uring refuses a table larger than
            // the soft RLIMIT_NOFILE, which the loader raises to the hard limit before starting the
            // engine (`ubdirect_ub::raise_open_files_limit`). A sparse table: a slot costs a
            // pointer in the kernel.
            max_files: ubdirect_ub::open_files_limit().clamp(1, 1 << 16) as u32,
            ..ubdirect_nvme::EngineConfig::default()
        }
    }

    /// The planner configuration.
    pub fn plan_config(&self) -> crate::planner::PlanConfig {
        let l = &self.loader;
        crate::planner::PlanConfig {
            batch_size: l.batch_size,
            seed: l.seed,
            shuffle: l.shuffle,
            shuffle_block: l.shuffle_block.0,
            window: l.window,
            remainder: l.remainder,
            min_read: l.min_read.0,
            max_gap: l.max_gap.0,
            max_read: l.max_read.0,
            align: 4096,
            max_chunk_batches: l.max_chunk_batches,
            chunk_bytes: l.chunk_bytes.0,
            max_amplification: 0,
        }
    }
}

/// A key's value as the loader runs with it, and why.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Resolved {
    /// The config key.
    pub key: &'static str,
    /// The value in use.
    pub value: usize,
    /// Why: "set", or how `0 = auto` was decided.
    pub why: String,
}
