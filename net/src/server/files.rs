//! Files and path confinement: the exported roots, files opened on a connection (ids, engine
//! slots counted against the connection's, its address's and its token's budgets), a path resolved
//! and checked so that nothing leaves its root, and the reads of opened files into staging blocks.

use std::collections::HashMap;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::Semaphore;
use ubdirect_nvme::FileHandle;
use ubdirect_ub::Lease;

use super::config::ServerConfig;
use super::limits::{Hold, Shares, refuse, reserve};
use super::out::Out;
use super::reply::Reply;
use super::{Qp, Shared};
use crate::proto::Code;
#[cfg(feature = "rdma")]
use crate::proto::Msg;

/// The engine's registered-file slots (`EngineConfig::default().max_files`), shared by every
/// connection of the server.
pub(super) const ENGINE_FILES: usize = 1024;

/// The exported roots, canonical, each an existing directory.
pub(super) fn open_roots(cfg: &ServerConfig) -> std::io::Result<HashMap<String, PathBuf>> {
    let mut roots = HashMap::new();
    for (name, dir) in &cfg.roots {
        let canon = std::fs::canonicalize(dir).map_err(|e| {
            std::io::Error::new(e.kind(), format!("root {name:?} = {}: {e}", dir.display()))
        })?;
        if !canon.is_dir() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("root {name:?} = {}: not a directory", dir.display()),
            ));
        }
        roots.insert(name.clone(), canon);
    }
    Ok(roots)
}

/// A file opened on a connection: its handle, its size at the open, and its name as the client
/// gave it (`root/path`: error frames name files this way, never by their server path).
struct OpenFile {
    f: FileHandle,
    /// The descriptor the open was checked on (buffered): resident ranges are sent from it.
    plain: Arc<std::fs::File>,
    size: u64,
    name: String,
}

/// Files opened on one connection: ids are indices; the same name, or the same file (device, inode)
/// under another name, opened again gets its first id, so repeated opens take no more engine slots
/// (and the same name costs no system call). Its files count against its address's budget until
/// it is dropped.
pub(super) struct Files {
    list: Vec<OpenFile>,
    by_inode: HashMap<(u64, u64), u32>,
    by_name: HashMap<(String, String), u32>,
    /// Engine slots held: by this address, by this token, by the whole server.
    budgets: [Arc<AtomicUsize>; 3],
}

impl Files {
    pub(super) fn new(
        peer: Arc<AtomicUsize>,
        token: Arc<AtomicUsize>,
        all: Arc<AtomicUsize>,
    ) -> Self {
        Self {
            list: Vec::new(),
            by_inode: HashMap::new(),
            by_name: HashMap::new(),
            budgets: [peer, token, all],
        }
    }

    /// Takes one engine slot of each budget, or says which is full (and how many it holds).
    fn take_slot(&self, limits: [usize; 3]) -> Result<(), (usize, usize)> {
        for (k, (b, &limit)) in self.budgets.iter().zip(&limits).enumerate() {
            let held = b.fetch_add(1, Ordering::Relaxed);
            if held >= limit {
                for b in &self.budgets[..=k] {
                    b.fetch_sub(1, Ordering::Relaxed);
                }
                return Err((k, held));
            }
        }
        Ok(())
    }

    /// Takes one engine slot of each budget for `name`, or refuses it naming the budget that is
    /// full.
    fn reserve_slot(&self, cfg: &ServerConfig, name: &str) -> Result<(), (Code, String)> {
        let limits = [
            cfg.max_open_files_per_peer,
            cfg.max_open_files_per_token,
            ENGINE_FILES,
        ];
        if let Err((which, held)) = self.take_slot(limits) {
            let who = [
                "this address has {held} files open already (serve.max_open_files_per_peer)",
                "this token has {held} files open already (serve.max_open_files_per_token)",
                "all of the server's {held} file slots are in use (serve.max_open_files_per_token bounds each token's share)",
            ][which]
                .replace("{held}", &held.to_string());
            return Err((Code::TooLarge, format!("{name}: {who}")));
        }
        Ok(())
    }

    /// Gives one engine slot back to each budget.
    fn give_slot(&self) {
        for b in &self.budgets {
            b.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl Drop for Files {
    fn drop(&mut self) {
        for b in &self.budgets {
            b.fetch_sub(self.list.len(), Ordering::Relaxed);
        }
    }
}

/// The innermost cause of an error, for an error frame (outer layers of engine errors name server
/// paths).
pub(super) fn root_cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut e = e;
    while let Some(next) = e.source() {
        e = next;
    }
    e.to_string()
}

/// Opens `root/path` for connection `files` (or returns the id it already has there): resolved
/// under the root, opened without following a last symlink and without blocking (`O_NONBLOCK`: a
/// FIFO swapped in after the check cannot block a worker), checked on the descriptor (a regular
/// file, still under the root), then handed to the engine through the descriptor itself.
pub(super) fn open_file(
    s: &Shared,
    files: &mut Files,
    root: &str,
    path: &str,
) -> Result<(u32, u64), (Code, String)> {
    use std::os::unix::fs::MetadataExt;
    let key = (root.to_string(), path.to_string());
    if let Some(&id) = files.by_name.get(&key)
        && let Some(f) = files.list.get(id as usize)
    {
        return Ok((id, f.size));
    }
    let name = format!("{root}/{path}");
    let full = || {
        (
            Code::TooLarge,
            format!(
                "{name}: this connection has {} files open already (serve.max_open_files)",
                files.list.len()
            ),
        )
    };
    if files.list.len() >= s.cfg.max_open_files {
        // Refused before any system call: past its cap, a connection's opens cost nothing.
        return Err(full());
    }
    let (base, canon) = resolve(&s.roots, root, path)?;
    let (check, meta, fd_path) = open_checked(&name, base, &canon)?;
    let inode = (meta.dev(), meta.ino());
    if let Some(&id) = files.by_inode.get(&inode)
        && let Some(f) = files.list.get(id as usize)
    {
        // Names of files already open: remembered up to a bound (a root full of links to one file
        // cannot grow the map without end).
        if files.by_name.len() < 4 * s.cfg.max_open_files {
            files.by_name.insert(key, id);
        }
        return Ok((id, f.size));
    }
    // A slot of the address's budget of engine slots (given back if the open fails, or with the
    // connection's files).
    files.reserve_slot(&s.cfg, &name)?;
    let f = engine_open(s, files, &check, &fd_path, &canon, &name)?;
    let size = f.size().unwrap_or(meta.len());
    let id = files.list.len() as u32;
    files.list.push(OpenFile {
        f,
        plain: Arc::new(check),
        size,
        name,
    });
    files.by_inode.insert(inode, id);
    files.by_name.insert(key, id);
    Ok((id, size))
}

/// Opens the resolved `canon` (`name` as the client gave it) without following a last symlink and
/// without blocking, and checks the descriptor: a regular file, its own path still under `base`.
/// The file, its metadata and the descriptor's `/proc/self/fd` path.
fn open_checked(
    name: &str,
    base: &Path,
    canon: &Path,
) -> Result<(std::fs::File, std::fs::Metadata, String), (Code, String)> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let check = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW | libc::O_NOCTTY)
        .open(canon)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => (
                Code::Forbidden,
                format!("{name} leads out of the root (symlink)"),
            ),
            Some(libc::ENOENT) => (Code::NotFound, format!("{name}: {e}")),
            _ => (Code::Io, format!("{name}: {e}")),
        })?;
    let meta = check
        .metadata()
        .map_err(|e| (Code::Io, format!("{name}: {e}")))?;
    if !meta.is_file() {
        return Err((Code::NotFound, format!("{name} is not a regular file")));
    }
    // The descriptor's own path: a directory on the way swapped for a symlink after the check
    // shows here.
    let fd_path = format!("/proc/self/fd/{}", check.as_raw_fd());
    match std::fs::read_link(&fd_path) {
        Ok(real) if real.starts_with(base) => {}
        Ok(_) => {
            return Err((
                Code::Forbidden,
                format!("{name} leads out of the root (symlink)"),
            ));
        }
        Err(e) => return Err((Code::Io, format!("{name}: cannot check the open file: {e}"))),
    }
    Ok((check, meta, fd_path))
}

/// Hands the checked file to the engine through its descriptor's path, then makes the descriptor
/// blocking again; the engine slot taken for it is given back if either fails.
fn engine_open(
    s: &Shared,
    files: &Files,
    check: &std::fs::File,
    fd_path: &str,
    canon: &Path,
    name: &str,
) -> Result<FileHandle, (Code, String)> {
    // Through the checked descriptor: the engine opens that very file (O_DIRECT where it can).
    let f = s.engine.open(fd_path).map_err(|e| {
        files.give_slot();
        tracing::debug!("open {}: {e}", canon.display());
        (Code::Io, format!("{name}: cannot open: {}", root_cause(&e)))
    })?;
    // A regular file now: blocking again, so that `sendfile` from it never answers EAGAIN for the
    // file's side (which would read as a full socket).
    nix::fcntl::fcntl(
        check,
        nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::empty()),
    )
    .map_err(|e| {
        files.give_slot();
        (Code::Io, format!("{name}: {e}"))
    })?;
    Ok(f)
}

/// Resolves `path` under root `root`, refusing anything that leaves it: the root's directory and
/// the canonical path.
fn resolve<'a>(
    roots: &'a HashMap<String, PathBuf>,
    root: &str,
    path: &str,
) -> Result<(&'a Path, PathBuf), (Code, String)> {
    let base = roots
        .get(root)
        .ok_or_else(|| (Code::NotFound, format!("no exported root {root:?}")))?;
    let p = Path::new(path);
    if p.as_os_str().is_empty()
        || p.is_absolute()
        || p.components().any(|c| !matches!(c, Component::Normal(_)))
    {
        return Err((
            Code::Forbidden,
            format!("path {path:?} is absolute or leaves the root"),
        ));
    }
    let canon = std::fs::canonicalize(base.join(p))
        .map_err(|e| (Code::NotFound, format!("{root}/{path}: {e}")))?;
    if !canon.starts_with(base) {
        return Err((
            Code::Forbidden,
            format!("{root}/{path} leads out of the root (symlink)"),
        ));
    }
    Ok((base, canon))
}

/// Checks a read (file opened here, size within max_request, range within the file) and takes an
/// in-flight permit. `Err(None)`: the connection is closing.
#[allow(clippy::type_complexity)]
pub(super) async fn admit(
    s: &Shared,
    peer: &str,
    files: &Files,
    inflight: &Arc<Semaphore>,
    file: u32,
    offset: u64,
    len: u32,
) -> Result<
    (
        FileHandle,
        Arc<std::fs::File>,
        String,
        tokio::sync::OwnedSemaphorePermit,
    ),
    Option<Reply>,
> {
    let Some((f, plain, size, name)) = files
        .list
        .get(file as usize)
        .map(|o| (o.f.clone(), o.plain.clone(), o.size, o.name.clone()))
    else {
        refuse(s, peer, &format!("read of unopened file {file}"));
        return Err(Some(Reply(
            Code::BadFile,
            format!("file {file} was not opened on this connection"),
        )));
    };
    if len > s.cfg.max_request {
        refuse(s, peer, &format!("read of {len} bytes"));
        return Err(Some(Reply(
            Code::TooLarge,
            format!(
                "read of {len} bytes exceeds max_request {}",
                s.cfg.max_request
            ),
        )));
    }
    if offset.checked_add(len as u64).is_none_or(|e| e > size) {
        refuse(
            s,
            peer,
            &format!("read {offset}+{len} past the end ({size})"),
        );
        return Err(Some(Reply(
            Code::Range,
            format!("{name}: {offset}+{len} is past the end of the file ({size} bytes)"),
        )));
    }
    match inflight.clone().acquire_owned().await {
        Ok(p) => Ok((f, plain, name, p)),
        Err(_) => Err(None),
    }
}

/// Reads into a staging block of the server's pool, within the address's and the token's shares of
/// blocks (the permits come back with the block and are held until the reply is written).
pub(super) async fn read_block(
    s: &Shared,
    staging: &[Arc<Semaphore>; 2],
    f: &FileHandle,
    name: &str,
    offset: u64,
    len: u32,
) -> Result<(Lease, std::ops::Range<usize>, Shares), Reply> {
    let (lease, share) = reserve(s, staging).await?;
    let (r, lease) = s.engine.read(f, offset, len as usize, lease, 0).await;
    match r {
        Ok(d) => {
            s.stats.reads.fetch_add(1, Ordering::Relaxed);
            s.stats.bytes.fetch_add(len as u64, Ordering::Relaxed);
            Ok((lease, d.data, share))
        }
        Err(e) => {
            tracing::debug!("read {name} at {offset}+{len}: {e}");
            Err(Reply(
                Code::Io,
                format!("read {name} at {offset}+{len}: {}", root_cause(&e)),
            ))
        }
    }
}

/// What answers a read whose bytes are in `lease[range]`: the bytes on the stream, or — with a queue
/// pair and a target — an RDMA WRITE into the client's memory and `ReadDone` once its completion
/// arrived (the completion, not this function, releases the block).
#[cfg(feature = "rdma")]
pub(super) async fn deliver(
    s: &Shared,
    id: u64,
    lease: Lease,
    range: std::ops::Range<usize>,
    q: Option<Qp>,
    to: Option<(u64, u32)>,
    hold: Hold,
) -> Out {
    match (q, to) {
        (Some(q), Some((addr, rkey))) => {
            match q.write(lease, range, addr, rkey, s.cfg.io_timeout).await {
                Ok(()) => {
                    s.stats.rdma_reads.fetch_add(1, Ordering::Relaxed);
                    Out::Control(Msg::ReadDone.frame(id))
                }
                Err(e) => {
                    tracing::warn!("rdma write to the client failed: {e}; closing");
                    Out::Close
                }
            }
        }
        _ => Out::Data {
            id,
            lease,
            range,
            _hold: hold,
        },
    }
}

#[cfg(not(feature = "rdma"))]
pub(super) async fn deliver(
    _: &Shared,
    id: u64,
    lease: Lease,
    range: std::ops::Range<usize>,
    _: Option<Qp>,
    _: Option<(u64, u32)>,
    hold: Hold,
) -> Out {
    Out::Data {
        id,
        lease,
        range,
        _hold: hold,
    }
}

/// A read admitted on a connection (its in-flight permit taken), for [`serve_read`].
pub(super) struct ReadJob {
    pub(super) id: u64,
    pub(super) f: FileHandle,
    /// The descriptor resident ranges are sent from.
    pub(super) plain: Arc<std::fs::File>,
    pub(super) name: String,
    pub(super) offset: u64,
    pub(super) len: u32,
    /// `ReadTo`'s target in the client's memory (address, key); `None`: on the stream.
    pub(super) to: Option<(u64, u32)>,
    /// The connection's queue pair, when it has one.
    pub(super) q: Option<Qp>,
    pub(super) permit: tokio::sync::OwnedSemaphorePermit,
}

/// Serves an admitted read (a task of its own) and queues its reply for the connection's writer: a
/// resident range on the stream from the page cache by `sendfile` (no copy here), else a read into
/// a staging block, then [`deliver`].
pub(super) async fn serve_read(
    s: Arc<Shared>,
    tx: tokio::sync::mpsc::Sender<Out>,
    staging: [Arc<Semaphore>; 2],
    j: ReadJob,
) {
    let (id, offset, len) = (j.id, j.offset, j.len);
    if j.to.is_none() && crate::zerocopy::resident(&j.plain, offset, len as u64) {
        let out = match reserve(&s, &staging).await {
            Ok((block, share)) => {
                s.stats.reads.fetch_add(1, Ordering::Relaxed);
                s.stats.bytes.fetch_add(len as u64, Ordering::Relaxed);
                s.stats.page_cache_reads.fetch_add(1, Ordering::Relaxed);
                Out::File {
                    id,
                    file: j.plain,
                    offset,
                    len,
                    block,
                    _hold: (j.permit, share),
                }
            }
            Err(r) => r.into_frame(id),
        };
        let _ = tx.send(out).await;
        return;
    }
    let out = match read_block(&s, &staging, &j.f, &j.name, offset, len).await {
        Ok((lease, range, block)) => {
            deliver(&s, id, lease, range, j.q, j.to, (j.permit, block)).await
        }
        Err(r) => r.into_frame(id),
    };
    let _ = tx.send(out).await;
}
