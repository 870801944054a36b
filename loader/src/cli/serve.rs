//! `ubdirect serve --config FILE`: one storage server per node, exporting root directories read-only.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use ubdirect_loader::config::{ByteSize, expand_home, read_token_file};
use ubdirect_net::ServerConfig;

/// Declares [`ServeSection`]. The keys listed in the macro's call are `ServerConfig` fields of the
/// same name and type (each at least 1): written once, their default is read from
/// `ServerConfig::default()` and their value copied into the server's configuration by name, so the
/// two cannot drift. `ServeSection::default` destructures `ServerConfig` without `..`: a field added
/// to the server's configuration does not compile here until `[serve]` has a key for it.
macro_rules! serve_section {
    ($($(#[doc = $doc:literal])* $key:ident: $ty:ty,)*) => {
        /// `[serve]` of `configs/serve.toml`.
        #[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
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
            /// Deadline for a client's hello, each frame once begun, and each reply's write, in
            /// milliseconds.
            pub io_timeout_ms: u64,
            /// Microseconds a connection polls for its next SMC request after answering a read (0:
            /// never).
            pub smc_poll_us: u64,
            $($(#[doc = $doc])* pub $key: $ty,)*
            /// Exported roots: name = directory.
            pub roots: BTreeMap<String, PathBuf>,
            /// Tokens that grant read-only access (files, and SMC regions without writes).
            pub read_only_tokens: Vec<String>,
            /// SMC memory regions: name = { size, key, writable }.
            pub regions: BTreeMap<String, RegionSection>,
            /// Offer RDMA on this device (`rxe0`; `"*"`: the first device). Unset: TCP only. Needs a
            /// build with `--features rdma`.
            pub rdma_device: Option<String>,
        }

        impl Default for ServeSection {
            /// The server's own defaults ([`ubdirect_net::ServerConfig::default`]): one truth.
            fn default() -> Self {
                let ServerConfig {
                    listen,
                    token: _,
                    roots: _,
                    max_request,
                    io_timeout,
                    smc_poll,
                    rdma_device,
                    read_only_tokens: _,
                    regions: _,
                    $($key,)*
                } = ServerConfig::default();
                Self {
                    listen: listen.to_string(),
                    token: String::new(),
                    token_file: None,
                    max_request: ByteSize(max_request as u64),
                    io_timeout_ms: io_timeout.as_millis() as u64,
                    smc_poll_us: smc_poll.as_micros() as u64,
                    $($key,)*
                    roots: BTreeMap::new(),
                    read_only_tokens: Vec::new(),
                    regions: BTreeMap::new(),
                    rdma_device,
                }
            }
        }

        impl ServeSection {
            /// `cfg` with the keys that are its fields by name copied in (each at least 1).
            fn same_named(&self, cfg: ServerConfig) -> ServerConfig {
                ServerConfig {
                    $($key: self.$key.max(1),)*
                    ..cfg
                }
            }
        }
    };
}

serve_section! {
    /// Reads in flight per client.
    max_inflight: u32,
    /// Staging blocks of the server's pool (each `max_request` + 8 KiB).
    blocks: usize,
    /// Connections open at once (more are closed as they arrive).
    max_connections: usize,
    /// Connections open at once from one IP address.
    max_connections_per_peer: usize,
    /// Staging blocks one IP address may hold at once (reads in progress, replies not yet written).
    max_staging_per_peer: usize,
    /// Files one connection may have open.
    max_open_files: usize,
    /// Files the connections of one IP address may have open together.
    max_open_files_per_peer: usize,
    /// Connections open at once presenting one token (over all addresses).
    max_connections_per_token: usize,
    /// Staging blocks the connections of one token may hold at once (over all addresses).
    max_staging_per_token: usize,
    /// Files the connections of one token may have open together (over all addresses).
    max_open_files_per_token: usize,
    /// Connections that have not said hello yet (more are closed as they arrive).
    max_pending_hellos: usize,
    /// Opens, registrations and refused requests per second per connection (past it, it waits).
    max_control_rate: u32,
}

/// `[serve.regions.NAME]`: an SMC region in the server's host memory (zero-filled at start).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
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

/// A secret copied from the sample configs (`change-me…`): public, so refused.
fn is_placeholder(secret: &str) -> bool {
    secret.starts_with("change-me")
}

/// Reads and checks a serve config into the server's configuration.
pub fn load(path: &Path) -> Result<ServerConfig, String> {
    let s = read_serve_file(path)?;
    let token = s.checked_token(path)?;
    if s.roots.is_empty() && s.regions.is_empty() {
        return Err(format!(
            "{}: neither [serve.roots] nor [serve.regions.*]: the server would export nothing",
            path.display()
        ));
    }
    let regions = s.checked_regions(path)?;
    s.check_bounds(&token, path)?;
    let cfg = s.server_config(token, regions, path)?;
    Ok(s.same_named(cfg))
}

/// `[serve]` of the config file at `path`.
fn read_serve_file(path: &Path) -> Result<ServeSection, String> {
    // A regular file only (a FIFO would block, a device never end), of bounded size.
    let text =
        ubdirect_loader::formats::read_regular(path, ubdirect_loader::config::MAX_CONFIG_BYTES)
            .and_then(|b| {
                String::from_utf8(b)
                    .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
            })
            .map_err(|e| format!("{}: {e}", path.display()))?;
    let f: ServeFile = toml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(f.serve)
}

impl ServeSection {
    /// The token (`token_file`'s, else `token`), refused when short or the sample's placeholder.
    fn checked_token(&self, path: &Path) -> Result<String, String> {
        let token = match &self.token_file {
            Some(p) => read_token_file(p, "serve.token_file").map_err(|e| e.to_string())?,
            None => self.token.clone(),
        };
        if token.len() < 16 {
            return Err(format!(
                "{}: serve.token must be at least 16 characters (it is the only credential)",
                path.display()
            ));
        }
        if is_placeholder(&token) {
            return Err(format!(
                "{}: serve.token is the sample config's placeholder {token:?}, which anyone can read: set a long random one (e.g. `openssl rand -hex 32`), or serve.token_file, and the same token in the clients' remote.token",
                path.display()
            ));
        }
        Ok(token)
    }

    /// The SMC regions, each with its key (`key_file`'s, else `key`), refused when short or the
    /// sample's placeholder.
    fn checked_regions(&self, path: &Path) -> Result<Vec<ubdirect_net::RegionConfig>, String> {
        let mut regions = Vec::new();
        for (name, r) in &self.regions {
            let key = match &r.key_file {
                Some(p) => read_token_file(p, &format!("serve.regions.{name}.key_file"))
                    .map_err(|e| e.to_string())?,
                None => r.key.clone(),
            };
            if is_placeholder(&key) {
                return Err(format!(
                    "{}: serve.regions.{name}.key is the sample config's placeholder: set a random one, or key_file",
                    path.display()
                ));
            }
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
        Ok(regions)
    }

    /// Refuses read-only tokens that are short or `token` itself, and a `max_request` out of bounds.
    fn check_bounds(&self, token: &str, path: &Path) -> Result<(), String> {
        if self
            .read_only_tokens
            .iter()
            .any(|t| t.len() < 16 || *t == token)
        {
            return Err(format!(
                "{}: serve.read_only_tokens must be at least 16 characters and differ from serve.token",
                path.display()
            ));
        }
        if self.max_request.0 == 0 || self.max_request.0 > 1 << 30 {
            return Err(format!(
                "{}: serve.max_request must be 1 B ..= 1 GiB",
                path.display()
            ));
        }
        Ok(())
    }

    /// The server's configuration of the keys not named alike (`same_named` copies the others).
    fn server_config(
        &self,
        token: String,
        regions: Vec<ubdirect_net::RegionConfig>,
        path: &Path,
    ) -> Result<ServerConfig, String> {
        Ok(ServerConfig {
            listen: self.listen.parse().map_err(|_| {
                format!(
                    "{}: serve.listen {:?} is not an address",
                    path.display(),
                    self.listen
                )
            })?,
            token: token.into_bytes(),
            roots: self
                .roots
                .iter()
                .map(|(k, v)| (k.clone(), expand_home(v)))
                .collect(),
            max_request: self.max_request.0 as u32,
            io_timeout: std::time::Duration::from_millis(self.io_timeout_ms.max(1)),
            smc_poll: std::time::Duration::from_micros(self.smc_poll_us.min(10_000)),
            read_only_tokens: self
                .read_only_tokens
                .iter()
                .map(|t| t.as_bytes().to_vec())
                .collect(),
            regions,
            rdma_device: self
                .rdma_device
                .clone()
                .map(|d| if d == "*" { String::new() } else { d }),
            ..ServerConfig::default()
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_sample_configs_placeholder_token_is_refused() {
        let d = std::env::temp_dir().join(format!("ubdirect-serve-ph-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let sample = include_str!("../../../configs/serve.toml");
        let p = d.join("serve.toml");
        std::fs::write(&p, sample).unwrap();
        let e = load(&p).unwrap_err();
        assert!(
            e.contains("serve.token is the sample config's placeholder"),
            "{e}"
        );
        // With a real token, the sample's region key placeholder is refused next.
        std::fs::write(
            &p,
            sample.replace("change-me-to-a-long-random-token", "0123456789abcdef0123"),
        )
        .unwrap();
        let e = load(&p).unwrap_err();
        assert!(e.contains("serve.regions.scratch.key"), "{e}");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn defaults_are_the_servers_own() {
        let d = ubdirect_net::ServerConfig::default();
        let s = ServeSection::default();
        assert_eq!(s.listen.parse::<std::net::SocketAddr>().unwrap(), d.listen);
        assert_eq!(s.max_request.0, d.max_request as u64);
        assert_eq!(s.max_inflight, d.max_inflight);
        assert_eq!(s.blocks, d.blocks);
        assert_eq!(s.io_timeout_ms, d.io_timeout.as_millis() as u64);
        assert_eq!(s.max_connections, d.max_connections);
        assert_eq!(s.max_connections_per_peer, d.max_connections_per_peer);
        assert_eq!(s.max_staging_per_peer, d.max_staging_per_peer);
        assert_eq!(s.max_open_files, d.max_open_files);
        assert_eq!(s.max_open_files_per_peer, d.max_open_files_per_peer);
        assert_eq!(s.max_connections_per_token, d.max_connections_per_token);
        assert_eq!(s.max_staging_per_token, d.max_staging_per_token);
        assert_eq!(s.max_open_files_per_token, d.max_open_files_per_token);
        assert_eq!(s.max_pending_hellos, d.max_pending_hellos);
        assert_eq!(s.max_control_rate, d.max_control_rate);
        assert_eq!(s.smc_poll_us, d.smc_poll.as_micros() as u64);
    }

    #[test]
    fn docs_list_every_serve_key_with_its_default() {
        let doc = include_str!("../../../docs/remote.md");
        let v = toml::Value::try_from(ServeSection::default()).unwrap();
        let toml::Value::Table(t) = v else {
            panic!("not a table")
        };
        let mut n = 0;
        for (k, val) in t {
            let row = match k.as_str() {
                // Documented together, or as tables of their own.
                "token" => "| `serve.token` / `serve.token_file` |".to_string(),
                "roots" => "| `[serve.roots]` |".to_string(),
                "regions" => "| `[serve.regions.NAME]` |".to_string(),
                _ => format!("| `serve.{k}` | `{val}` |"),
            };
            assert!(doc.contains(&row), "docs/remote.md lacks the row {row}");
            n += 1;
        }
        for unset in ["token_file", "rdma_device"] {
            let row = format!("`serve.{unset}`");
            assert!(doc.contains(&row), "docs/remote.md lacks {row}");
        }
        assert!(n >= 15, "only {n} keys");
    }
}
