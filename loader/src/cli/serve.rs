//! `ubdirect serve --config FILE`: one storage server per node, exporting root directories read-only.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::config::{ByteSize, expand_home, read_token_file};

/// `[serve]` of `configs/serve.toml`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ServeSection {
    /// Address to listen on.
    pub listen: String,
    /// The token clients must present (prefer `token_file`).
    pub token: String,
    /// A file whose first line is the token.
    pub token_file: Option<PathBuf>,
    /// Largest read one request may ask for.
    pub max_request: ByteSize,
    /// Reads in flight per client.
    pub max_inflight: u32,
    /// Staging blocks of the server's pool (each `max_request` + 8 KiB).
    pub blocks: usize,
    /// Deadline for a client's hello and each frame, in milliseconds.
    pub io_timeout_ms: u64,
    /// Exported roots: name = directory.
    pub roots: BTreeMap<String, PathBuf>,
    /// Tokens that grant read-only access (files, and SMC regions without writes).
    pub read_only_tokens: Vec<String>,
    /// SMC memory regions: name = { size, key, writable }.
    pub regions: BTreeMap<String, RegionSection>,
    /// Offer RDMA on this device (`rxe0`; `"*"`: the first device). Unset: TCP only. Needs a build
    /// with `--features rdma`.
    pub rdma_device: Option<String>,
}

impl Default for ServeSection {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:7447".into(),
            token: String::new(),
            token_file: None,
            max_request: ByteSize(16 << 20),
            max_inflight: 32,
            blocks: 64,
            io_timeout_ms: 30_000,
            roots: BTreeMap::new(),
            rdma_device: None,
            read_only_tokens: Vec::new(),
            regions: BTreeMap::new(),
        }
    }
}

/// `[serve.regions.NAME]`: an SMC region in the server's host memory (zero-filled at start).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RegionSection {
    /// Bytes.
    pub size: ByteSize,
    /// The key clients present to register it (prefer `key_file`).
    #[serde(default)]
    pub key: String,
    /// A file whose first line is the key.
    #[serde(default)]
    pub key_file: Option<PathBuf>,
    /// Whether read-write tokens may write it.
    #[serde(default = "yes")]
    pub writable: bool,
    /// Hold it in this GPU's memory (CUDA) instead of host memory.
    #[serde(default)]
    pub gpu: Option<usize>,
}

fn yes() -> bool {
    true
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ServeFile {
    serve: ServeSection,
}

/// Reads and checks a serve config into the server's configuration.
pub fn load(path: &Path) -> Result<ubdirect_net::ServerConfig, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let f: ServeFile = toml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let s = f.serve;
    let token = match &s.token_file {
        Some(p) => read_token_file(p).map_err(|e| format!("serve.{e}"))?,
        None => s.token.clone(),
    };
    if token.len() < 16 {
        return Err(format!(
            "{}: serve.token must be at least 16 characters (it is the only credential)",
            path.display()
        ));
    }
    if s.roots.is_empty() && s.regions.is_empty() {
        return Err(format!(
            "{}: neither [serve.roots] nor [serve.regions.*]: the server would export nothing",
            path.display()
        ));
    }
    let mut regions = Vec::new();
    for (name, r) in &s.regions {
        let key = match &r.key_file {
            Some(p) => read_token_file(p).map_err(|e| format!("serve.regions.{name}.{e}"))?,
            None => r.key.clone(),
        };
        if key.len() < 8 {
            return Err(format!(
                "{}: serve.regions.{name}.key must be at least 8 characters",
                path.display()
            ));
        }
        regions.push(ubdirect_net::RegionConfig {
            name: name.clone(),
            size: r.size.0,
            key: key.into_bytes(),
            writable: r.writable,
            gpu: r.gpu,
        });
    }
    if s.read_only_tokens
        .iter()
        .any(|t| t.len() < 16 || *t == token)
    {
        return Err(format!(
            "{}: serve.read_only_tokens must be at least 16 characters and differ from serve.token",
            path.display()
        ));
    }
    if s.max_request.0 == 0 || s.max_request.0 > 1 << 30 {
        return Err(format!(
            "{}: serve.max_request must be 1 B ..= 1 GiB",
            path.display()
        ));
    }
    Ok(ubdirect_net::ServerConfig {
        listen: s.listen.parse().map_err(|_| {
            format!(
                "{}: serve.listen {:?} is not an address",
                path.display(),
                s.listen
            )
        })?,
        token: token.into_bytes(),
        roots: s
            .roots
            .iter()
            .map(|(k, v)| (k.clone(), expand_home(v)))
            .collect(),
        max_request: s.max_request.0 as u32,
        max_inflight: s.max_inflight.max(1),
        blocks: s.blocks.max(1),
        io_timeout: std::time::Duration::from_millis(s.io_timeout_ms.max(1)),
        read_only_tokens: s
            .read_only_tokens
            .iter()
            .map(|t| t.as_bytes().to_vec())
            .collect(),
        regions,
        rdma_device: s
            .rdma_device
            .map(|d| if d == "*" { String::new() } else { d }),
    })
}
