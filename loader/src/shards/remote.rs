//! `ub://HOST:PORT[,HOST:PORT…]/ROOT/PATH` shards: a client per server set (`[remote]`), a
//! [`RemoteSource`](ubdirect_net::RemoteSource) per file, indexed through the one format dispatch.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ubdirect_ub::Source;

use super::{Opened, ShardConfig, SourceReader, UbUrl, block_on};
use crate::config::{RemoteSection, TransportKind};
use crate::error::LoadError;
use crate::formats::{FormatError, Opener, ShardFile};

/// The transport `[remote] transport` names, opened (RDMA: the device and its completion thread).
fn remote_transport(remote: &RemoteSection) -> Result<Arc<dyn ubdirect_net::Transport>, LoadError> {
    match remote.transport {
        TransportKind::Tcp => Ok(Arc::new(ubdirect_net::Tcp)),
        #[cfg(feature = "rdma")]
        TransportKind::Rdma => {
            let r = ubdirect_net::rdma::Rdma::open(&ubdirect_net::rdma::RdmaConfig {
                device: remote.rdma_device.clone(),
                gid_index: None,
            })
            .map_err(|e| LoadError::Remote(e.into()))?;
            Ok(Arc::new(ubdirect_net::transport::RdmaTransport::new(r)))
        }
        #[cfg(not(feature = "rdma"))]
        TransportKind::Rdma => Err(LoadError::Config(
            "remote.transport = \"rdma\" needs a build with --features rdma".into(),
        )),
    }
}

/// `ub://` files: a client per server set, a [`RemoteSource`](ubdirect_net::RemoteSource) per file.
pub(super) struct RemoteFiles<'a> {
    rt: &'a tokio::runtime::Runtime,
    token: String,
    deadline: Duration,
    transport: Arc<dyn ubdirect_net::Transport>,
    connections: usize,
    clients: Mutex<HashMap<String, ubdirect_net::Client>>,
    opened: Mutex<HashMap<String, Arc<ubdirect_net::RemoteSource>>>,
}

impl RemoteFiles<'_> {
    fn source(&self, url: &str) -> Result<Arc<ubdirect_net::RemoteSource>, LoadError> {
        if let Some(s) = self.opened.lock().ok().and_then(|m| m.get(url).cloned()) {
            return Ok(s);
        }
        let u = UbUrl::parse(url)?;
        let client = {
            let mut m = self.clients.lock().unwrap_or_else(|p| p.into_inner());
            m.entry(u.authority.clone())
                .or_insert_with(|| {
                    ubdirect_net::Client::with_connections(
                        u.addrs.clone(),
                        self.token.clone(),
                        self.deadline,
                        self.transport.clone(),
                        self.connections,
                    )
                })
                .clone()
        };
        let file = block_on(self.rt, client.open(&u.root, &u.path))?
            .map_err(|e| LoadError::Remote(e.into()))?;
        let s = Arc::new(ubdirect_net::RemoteSource::new(client, file, url));
        if let Ok(mut m) = self.opened.lock() {
            m.insert(url.to_string(), s.clone());
        }
        Ok(s)
    }
}

fn remote_err(path: &Path, e: LoadError) -> FormatError {
    FormatError::Io {
        path: path.to_path_buf(),
        source: std::io::Error::other(e),
    }
}

impl Opener for RemoteFiles<'_> {
    fn open(&self, path: &Path) -> Result<Box<dyn ShardFile + '_>, FormatError> {
        let src = self
            .source(&path.to_string_lossy())
            .map_err(|e| remote_err(path, e))?;
        let r = SourceReader::new(self.rt, src, self.deadline).map_err(|e| remote_err(path, e))?;
        Ok(Box::new(r))
    }

    fn size(&self, path: &Path) -> Result<u64, FormatError> {
        self.source(&path.to_string_lossy())
            .map(|s| s.size())
            .map_err(|e| remote_err(path, e))
    }
}

/// The opener of `ub://` files for `cfg`'s `[remote]` settings.
pub(super) fn remote_files<'a>(
    rt: &'a tokio::runtime::Runtime,
    remote: &RemoteSection,
) -> Result<RemoteFiles<'a>, LoadError> {
    Ok(RemoteFiles {
        rt,
        token: remote
            .token()
            .map_err(|e| LoadError::Config(e.to_string()))?,
        deadline: Duration::from_millis(remote.deadline_ms.max(1)),
        transport: remote_transport(remote)?,
        connections: remote.connections,
        clients: Mutex::new(HashMap::new()),
        opened: Mutex::new(HashMap::new()),
    })
}

/// Opens every `ub://` shard and builds the index through the same format dispatch as local shards:
/// headers, footers and Megatron `.idx` files are read through the shard's own source.
pub(super) fn open(rt: &tokio::runtime::Runtime, c: &ShardConfig<'_>) -> Result<Opened, LoadError> {
    let files = remote_files(rt, c.remote)?;
    // Every file is opened first, so that a refusal or an unreachable server is the client's typed
    // error (`LoadError::Remote`), not an I/O error inside a format parser.
    for p in &c.dataset.paths {
        if c.dataset.format == crate::formats::Format::Megatron {
            let (i, b) =
                crate::formats::megatron::idx_and_bin(&crate::formats::megatron::prefix_of(p));
            files.source(&i.to_string_lossy())?;
            files.source(&b.to_string_lossy())?;
        } else {
            files.source(&p.to_string_lossy())?;
        }
    }
    let (index, columns) = super::dataset::index_with_columns(c.dataset, &c.dataset.paths, &files)?;
    let mut sources: Vec<Arc<dyn Source>> = Vec::with_capacity(index.shards.len());
    for s in &index.shards {
        sources.push(files.source(&s.path.to_string_lossy())?);
    }
    Ok(Opened {
        columns,
        ..Opened::new(index, sources, files.deadline)
    })
}
