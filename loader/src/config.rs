//! The run configuration: one struct is the truth; TOML sets it (docs/configuration.md lists every
//! key and default, and a test checks the two agree).

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

/// The embedded default (`configs/default.toml`).
pub const DEFAULT_CONFIG: &str = include_str!("../../configs/default.toml");

/// Errors reading a config.
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

/// A byte size: an integer, or a string with a unit (`"256KiB"`, `"4MiB"`, `"1GiB"`, `"512"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(try_from = "SizeRepr")]
pub struct ByteSize(pub u64);

#[derive(Deserialize)]
#[serde(untagged)]
enum SizeRepr {
    Int(u64),
    Str(String),
}

impl TryFrom<SizeRepr> for ByteSize {
    type Error = String;
    fn try_from(v: SizeRepr) -> Result<Self, String> {
        match v {
            SizeRepr::Int(n) => Ok(ByteSize(n)),
            SizeRepr::Str(s) => parse_size(&s).map(ByteSize),
        }
    }
}

/// Parses `"4MiB"`-style sizes (KiB, MiB, GiB, TiB, or plain bytes; `K`/`M`/`G` also mean binary units).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("invalid size {s:?}: expected e.g. 4096, \"256KiB\", \"4MiB\""))?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "K" | "KiB" | "k" => 1 << 10,
        "M" | "MiB" => 1 << 20,
        "G" | "GiB" => 1 << 30,
        "T" | "TiB" => 1 << 40,
        u => {
            return Err(format!(
                "invalid size unit {u:?} in {s:?}: use B, KiB, MiB, GiB or TiB"
            ));
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("size {s:?} overflows"))
}

/// `[device]`
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DeviceSection {
    /// `auto | cuda | host`.
    pub select: String,
    /// CUDA ordinal.
    pub ordinal: usize,
}

impl Default for DeviceSection {
    fn default() -> Self {
        Self {
            select: "auto".into(),
            ordinal: 0,
        }
    }
}

/// `[engine]`
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct EngineSection {
    /// io_uring rings.
    pub rings: usize,
    /// Reads in flight per ring.
    pub queue_depth: u32,
    /// Kernel submission polling.
    pub sqpoll: bool,
    /// `auto | on | off`.
    pub direct: String,
    /// Deadline of one read in milliseconds.
    pub op_timeout_ms: u64,
}

impl Default for EngineSection {
    fn default() -> Self {
        Self {
            rings: 1,
            queue_depth: 64,
            sqpoll: false,
            direct: "auto".into(),
            op_timeout_ms: 30_000,
        }
    }
}

/// `[pool]`
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct PoolSection {
    /// Bytes per block.
    pub block_size: ByteSize,
    /// Blocks.
    pub blocks: usize,
    /// NUMA node to bind host blocks to.
    pub numa_node: Option<u32>,
    /// Deadline of one acquire in milliseconds.
    pub acquire_timeout_ms: u64,
}

impl Default for PoolSection {
    fn default() -> Self {
        Self {
            block_size: ByteSize(4 << 20),
            blocks: 32,
            numa_node: None,
            acquire_timeout_ms: 30_000,
        }
    }
}

/// `[source]`
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct SourceSection {
    /// The file to read.
    pub path: PathBuf,
    /// Size of the generated file.
    pub size: ByteSize,
    /// Generate the file if missing or of another size.
    pub generate: bool,
    /// Bytes per read.
    pub read_size: ByteSize,
    /// Times the file is read.
    pub passes: u32,
    /// Check block CRCs against plain reads.
    pub verify: bool,
}

impl Default for SourceSection {
    fn default() -> Self {
        Self {
            path: PathBuf::from("/tmp/ubdirect-default/shard-000.bin"),
            size: ByteSize(256 << 20),
            generate: true,
            read_size: ByteSize(4 << 20),
            passes: 3,
            verify: true,
        }
    }
}

/// A whole run configuration.
#[derive(Debug, Clone, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct RunConfig {
    /// `[device]`
    pub device: DeviceSection,
    /// `[engine]`
    pub engine: EngineSection,
    /// `[pool]`
    pub pool: PoolSection,
    /// `[source]`
    pub source: SourceSection,
}

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

    /// Reads a config file, or the embedded default when `path` is `None`.
    pub fn load(path: Option<&std::path::Path>) -> Result<Self, ConfigError> {
        match path {
            None => Self::from_toml(DEFAULT_CONFIG, "<embedded default>"),
            Some(p) => {
                let text = std::fs::read_to_string(p).map_err(|source| ConfigError::Read {
                    path: p.to_path_buf(),
                    source,
                })?;
                Self::from_toml(&text, &p.display().to_string())
            }
        }
    }

    fn validate(&self, origin: &str) -> Result<(), ConfigError> {
        let bad = |key, reason: String| {
            Err(ConfigError::Invalid {
                origin: origin.to_string(),
                key,
                reason,
            })
        };
        if self
            .device
            .select
            .parse::<ubdirect_ub::DeviceSelection>()
            .is_err()
        {
            return bad(
                "device.select",
                format!("{:?}: expected auto, cuda or host", self.device.select),
            );
        }
        if self
            .engine
            .direct
            .parse::<ubdirect_nvme::DirectMode>()
            .is_err()
        {
            return bad(
                "engine.direct",
                format!("{:?}: expected auto, on or off", self.engine.direct),
            );
        }
        if self.source.read_size.0 == 0 || self.source.read_size.0 > self.pool.block_size.0 {
            return bad(
                "source.read_size",
                format!(
                    "{} must be between 1 and pool.block_size ({})",
                    self.source.read_size.0, self.pool.block_size.0
                ),
            );
        }
        if self.source.passes == 0 {
            return bad("source.passes", "must be at least 1".into());
        }
        if self.pool.acquire_timeout_ms == 0 || self.engine.op_timeout_ms == 0 {
            return bad("*_timeout_ms", "deadlines must be positive".into());
        }
        Ok(())
    }

    /// The engine configuration this run asks for.
    pub fn engine_config(&self) -> ubdirect_nvme::EngineConfig {
        ubdirect_nvme::EngineConfig {
            rings: self.engine.rings,
            queue_depth: self.engine.queue_depth,
            sqpoll: self.engine.sqpoll,
            direct: self.engine.direct.parse().unwrap_or_default(),
            op_timeout: Duration::from_millis(self.engine.op_timeout_ms),
            ..ubdirect_nvme::EngineConfig::default()
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn embedded_default_equals_struct_defaults() {
        let parsed = RunConfig::from_toml(DEFAULT_CONFIG, "default").expect("default parses");
        assert_eq!(
            parsed,
            RunConfig::default(),
            "configs/default.toml and the Default impls disagree"
        );
    }

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_size("4MiB"), Ok(4 << 20));
        assert_eq!(parse_size("256KiB"), Ok(256 << 10));
        assert_eq!(parse_size("512"), Ok(512));
        assert!(parse_size("4 parsecs").is_err());
        assert!(parse_size("99999999999TiB").is_err());
    }

    #[test]
    fn unknown_keys_and_bad_values_are_clear_errors() {
        let e = RunConfig::from_toml("[engine]\nqueue_dept = 3\n", "t").unwrap_err();
        assert!(e.to_string().contains("queue_dept"), "{e}");
        let e = RunConfig::from_toml("[device]\nselect = \"tpu\"\n", "t").unwrap_err();
        assert!(e.to_string().contains("device.select"), "{e}");
        let e = RunConfig::from_toml("[source]\nread_size = \"8MiB\"\n", "t").unwrap_err();
        assert!(e.to_string().contains("source.read_size"), "{e}");
    }

    #[test]
    fn docs_list_every_key_with_its_default() {
        let doc = include_str!("../../docs/configuration.md");
        let d = RunConfig::default();
        let rows = [
            ("device.select", format!("\"{}\"", d.device.select)),
            ("device.ordinal", d.device.ordinal.to_string()),
            ("engine.rings", d.engine.rings.to_string()),
            ("engine.queue_depth", d.engine.queue_depth.to_string()),
            ("engine.sqpoll", d.engine.sqpoll.to_string()),
            ("engine.direct", format!("\"{}\"", d.engine.direct)),
            ("engine.op_timeout_ms", d.engine.op_timeout_ms.to_string()),
            ("pool.block_size", "\"4MiB\"".into()),
            ("pool.blocks", d.pool.blocks.to_string()),
            ("pool.numa_node", "unset".into()),
            (
                "pool.acquire_timeout_ms",
                d.pool.acquire_timeout_ms.to_string(),
            ),
            ("source.path", format!("\"{}\"", d.source.path.display())),
            ("source.size", "\"256MiB\"".into()),
            ("source.generate", d.source.generate.to_string()),
            ("source.read_size", "\"4MiB\"".into()),
            ("source.passes", d.source.passes.to_string()),
            ("source.verify", d.source.verify.to_string()),
        ];
        for (key, default) in rows {
            let row = format!("| `{key}` | `{default}` |");
            assert!(
                doc.contains(&row),
                "docs/configuration.md lacks the row {row}"
            );
        }
    }
}
