//! NVMe passthrough of a file's extents as a [`Source`]: the file's bytes read straight from the
//! namespace's LBAs with NVMe read commands on the engine's passthrough rings (`IORING_OP_URING_CMD`,
//! `NVME_URING_CMD_IO`, SQE128/CQE32, the lease's block as a fixed buffer), split at the
//! controller's maximum transfer. Extents that cannot be read raw (unwritten, inline, encoded, …) go
//! through the io_uring file path; holes read as zeros.
//!
//! The extent map is taken when the source opens: a file rewritten in place afterwards (new
//! extents) is not seen, as with any raw reader. Shards are read-only datasets.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ubdirect_ub::{
    Lease, ReadDone, ReadFuture, ReadPath, Registrar, Source, SourceError, SourceErrorKind,
    check_request, fallback,
};

use crate::extents::{Extent, FileMap, MapError};
use crate::passthru::{Namespace, NvmeError};
use crate::source::file::kind_of;
use crate::{Engine, FileHandle, IoError};

/// Why a file cannot be read by passthrough. The loader falls back to [`crate::FileSource`] (or
/// refuses, when passthrough was required).
#[derive(Debug, thiserror::Error)]
pub enum NvmeSourceError {
    /// The file is not on an NVMe namespace, or its extents cannot be mapped.
    #[error(transparent)]
    Map(#[from] MapError),
    /// The namespace cannot be opened or identified (permissions, not NVMe).
    #[error("{path}: namespace {namespace}: {source}")]
    Namespace {
        /// The file.
        path: PathBuf,
        /// The namespace's char device.
        namespace: PathBuf,
        /// Why.
        #[source]
        source: Box<NvmeError>,
    },
    /// The engine cannot run passthrough rings (kernel without SQE128/CQE32 or URING_CMD).
    #[error("{path}: no passthrough rings: {source}")]
    Rings {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: Box<IoError>,
    },
    /// The file cannot be opened on the engine (for the extents read through the file path).
    #[error("{path}: {source}")]
    File {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: Box<IoError>,
    },
}

impl NvmeSourceError {
    /// The file it concerns.
    pub fn path(&self) -> &Path {
        match self {
            NvmeSourceError::Map(
                MapError::Stat { path, .. }
                | MapError::NotBlockDevice { path, .. }
                | MapError::NotNvme { path, .. }
                | MapError::Partition { path, .. }
                | MapError::Fiemap { path, .. },
            )
            | NvmeSourceError::Namespace { path, .. }
            | NvmeSourceError::Rings { path, .. }
            | NvmeSourceError::File { path, .. } => path,
        }
    }
}

/// Opens [`NvmeSource`]s on one engine, sharing each namespace between the shards on it.
#[derive(Debug)]
pub struct NvmeOpener {
    engine: Engine,
    namespaces: HashMap<PathBuf, Arc<Namespace>>,
}

impl NvmeOpener {
    /// An opener for sources on `engine`.
    pub fn new(engine: &Engine) -> Self {
        Self {
            engine: engine.clone(),
            namespaces: HashMap::new(),
        }
    }

    /// Maps `path`'s extents, opens (or reuses) its namespace, starts the engine's passthrough rings
    /// and opens the file on the engine for the extents that cannot be read raw. Records the fallback
    /// `nvme_extent_via_file` when some extents go through the file path.
    pub fn open(&mut self, path: impl AsRef<Path>) -> Result<NvmeSource, NvmeSourceError> {
        let path = path.as_ref();
        let map = FileMap::of(path)?;
        let ns = self.namespace(path, &map.namespace)?;
        let file = self
            .engine
            .open(path)
            .map_err(|source| NvmeSourceError::File {
                path: path.to_path_buf(),
                source: Box::new(source),
            })?;
        NvmeSource::from_parts(&self.engine, file, map, ns)
    }

    /// The namespace at `namespace` (char device), opened once.
    pub fn namespace(
        &mut self,
        path: &Path,
        namespace: &Path,
    ) -> Result<Arc<Namespace>, NvmeSourceError> {
        if let Some(n) = self.namespaces.get(namespace) {
            return Ok(n.clone());
        }
        let n =
            Arc::new(
                Namespace::open(namespace).map_err(|source| NvmeSourceError::Namespace {
                    path: path.to_path_buf(),
                    namespace: namespace.to_path_buf(),
                    source: Box::new(source),
                })?,
            );
        self.namespaces.insert(namespace.to_path_buf(), n.clone());
        Ok(n)
    }
}

/// A file on an NVMe namespace, read by passthrough.
#[derive(Clone)]
pub struct NvmeSource {
    engine: Engine,
    file: FileHandle,
    map: Arc<FileMap>,
    ns: Arc<Namespace>,
    shard: String,
    size: u64,
    /// Reads are widened to this (LBA size, file-path alignment, 4 KiB: the largest).
    align: usize,
    via_file: usize,
}

impl fmt::Debug for NvmeSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NvmeSource")
            .field("shard", &self.shard)
            .field("size", &self.size)
            .field("namespace", &self.ns.path())
            .field("extents", &self.map.extents.len())
            .field("via_file", &self.via_file)
            .field("max_transfer", &self.ns.max_transfer())
            .finish()
    }
}

impl NvmeSource {
    /// Opens `path` for passthrough reads on `engine` (a one-file [`NvmeOpener`]).
    pub fn open(engine: &Engine, path: impl AsRef<Path>) -> Result<Self, NvmeSourceError> {
        NvmeOpener::new(engine).open(path)
    }

    /// A source from its parts: the file open on `engine` (for extents that cannot be read raw),
    /// its extent map, and the namespace the map points at.
    pub fn from_parts(
        engine: &Engine,
        file: FileHandle,
        map: FileMap,
        ns: Arc<Namespace>,
    ) -> Result<Self, NvmeSourceError> {
        let path = file.path().to_path_buf();
        engine
            .passthru_rings()
            .map_err(|source| NvmeSourceError::Rings {
                path: path.clone(),
                source: Box::new(source),
            })?;
        let size = file.size().unwrap_or(0);
        let via_file = map
            .extents
            .iter()
            .filter(|e| e.not_raw.is_some() && e.logical < size)
            .count();
        if via_file > 0 {
            fallback::record(
                "nvme_extent_via_file",
                format!(
                    "{}: {via_file} extent(s) cannot be read raw ({}); read through the file path",
                    path.display(),
                    map.extents.iter().find_map(|e| e.not_raw).unwrap_or("?")
                ),
            );
        }
        let align = (ns.id().lba_size as usize)
            .max(file.offset_align() as usize)
            .max(ubdirect_ub::PAGE_SIZE);
        Ok(Self {
            engine: engine.clone(),
            shard: path.display().to_string(),
            size,
            file,
            map: Arc::new(map),
            ns,
            align,
            via_file,
        })
    }

    /// The namespace it reads.
    pub fn namespace(&self) -> &Arc<Namespace> {
        &self.ns
    }

    /// The extent map taken at open.
    pub fn map(&self) -> &FileMap {
        &self.map
    }

    /// Extents read through the file path (not raw-readable).
    pub fn extents_via_file(&self) -> usize {
        self.via_file
    }

    /// The engine's handle of the file.
    pub fn handle(&self) -> &FileHandle {
        &self.file
    }

    fn err(&self, kind: SourceErrorKind, offset: u64, len: usize) -> SourceError {
        SourceError::new(kind, &self.shard, offset, len)
    }

    /// Checks the request, zero-fills holes and submits the raw pieces; the file pieces are left for
    /// the caller.
    fn issue(
        &self,
        offset: u64,
        len: usize,
        l: &mut Lease,
        lease_offset: usize,
    ) -> Result<Issued, SourceError> {
        let err = |k| self.err(k, offset, len);
        check_request(self, offset, len, l, lease_offset)?;
        let a = self.align as u64;
        if !lease_offset.is_multiple_of(self.align) {
            return Err(err(SourceErrorKind::Lease).with_source(format!(
                "lease offset {lease_offset} is not a multiple of {a} (LBA / direct-I/O alignment)"
            )));
        }
        // `check_request` bounded offset + len by the size.
        let start = offset / a * a;
        let end = (offset + len as u64).div_ceil(a) * a;
        let need = (end - start) as usize;
        if lease_offset
            .checked_add(need)
            .is_none_or(|e| e > l.capacity())
        {
            return Err(err(SourceErrorKind::Lease).with_source(format!(
                "widened to {start}+{need} for alignment; the block holds {} bytes from {lease_offset}",
                l.capacity()
            )));
        }
        let plan = if len == 0 {
            Vec::new()
        } else {
            plan(
                &self.map.extents,
                start,
                end - start,
                self.ns.id().lba_size as u64,
                self.ns.max_transfer() as u64,
                self.size,
            )
        };
        if plan.iter().any(|p| matches!(p, Piece::Zero { .. })) {
            let buf = l
                .as_mut_slice()
                .map_err(|e| err(SourceErrorKind::Lease).with_source(e))?;
            for p in &plan {
                if let Piece::Zero { pos, len } = *p {
                    let at = lease_offset + pos;
                    buf[at..at + len as usize].fill(0);
                }
            }
        }
        let mut pending = Vec::new();
        for p in &plan {
            if let Piece::Raw { pos, slba, nlb } = *p {
                // Commands already issued keep the block in flight by themselves if this fails.
                let cmds = self
                    .engine
                    .nvme_submit(&self.ns, slba, nlb, l, lease_offset + pos)
                    .map_err(|e| err(nvme_kind(&e)).with_source(e))?;
                pending.extend(cmds);
            }
        }
        Ok(Issued {
            raw: !pending.is_empty(),
            pending,
            plan,
            head: (offset - start) as usize,
            need: if len == 0 { 0 } else { need },
        })
    }

    async fn read_into(
        &self,
        offset: u64,
        len: usize,
        mut lease: Lease,
        lease_offset: usize,
        until: Instant,
    ) -> (Result<ReadDone, SourceError>, Lease) {
        let err = |k| self.err(k, offset, len);
        let issued = match self.issue(offset, len, &mut lease, lease_offset) {
            Ok(i) => i,
            Err(e) => return (Err(e), lease),
        };
        let mut path = ReadPath::NvmePassthru;
        for p in &issued.plan {
            let Piece::File { pos, off, len: n } = *p else {
                continue;
            };
            let left = until.saturating_duration_since(Instant::now());
            let (r, l) = self
                .engine
                .read_within(&self.file, off, n as usize, lease, lease_offset + pos, left)
                .await;
            lease = l;
            match r {
                Ok(d) if d.data.start == lease_offset + pos => {
                    if !issued.raw {
                        path = if d.direct {
                            ReadPath::Direct
                        } else {
                            ReadPath::Buffered
                        };
                    }
                }
                Ok(d) => {
                    let e = err(SourceErrorKind::Io).with_source(format!(
                        "file read at {off}+{n} landed at {:?}, expected at {}",
                        d.data,
                        lease_offset + pos
                    ));
                    return (Err(e), lease);
                }
                Err(e) => return (Err(err(kind_of(&e)).with_source(e)), lease),
            }
        }
        if let Err(e) = self.engine.nvme_wait(&self.ns, issued.pending, until).await {
            return (Err(err(nvme_kind(&e)).with_source(e)), lease);
        }
        let data = lease_offset + issued.head..lease_offset + issued.head + len;
        let done = ReadDone {
            data: if len == 0 {
                lease_offset..lease_offset
            } else {
                data
            },
            bytes_read: issued.need,
            path,
        };
        (Ok(done), lease)
    }
}

/// A read whose checks passed and whose raw pieces are in flight.
struct Issued {
    plan: Vec<Piece>,
    pending: Vec<crate::engine::NvmePending>,
    raw: bool,
    /// Where the requested bytes start in the widened range.
    head: usize,
    /// Bytes moved (the widened range).
    need: usize,
}

/// The kind of a passthrough error, for callers that branch.
pub fn nvme_kind(e: &NvmeError) -> SourceErrorKind {
    match e {
        NvmeError::Timeout { .. } => SourceErrorKind::Timeout,
        NvmeError::Closed => SourceErrorKind::Closed,
        NvmeError::NotRegistered { .. } | NvmeError::Lease(_) => SourceErrorKind::Lease,
        NvmeError::Rings { .. } | NvmeError::NotNvme { .. } | NvmeError::Open { .. } => {
            SourceErrorKind::Unavailable
        }
        NvmeError::Os { source, .. }
            if matches!(
                source.kind(),
                std::io::ErrorKind::PermissionDenied | std::io::ErrorKind::InvalidInput
            ) =>
        {
            SourceErrorKind::Refused
        }
        NvmeError::Status { status, .. }
            if *status == crate::passthru::NvmeStatus::AccessDenied =>
        {
            SourceErrorKind::Refused
        }
        _ => SourceErrorKind::Io,
    }
}

impl Source for NvmeSource {
    fn shard(&self) -> &str {
        &self.shard
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn describe(&self) -> String {
        let mut s = format!(
            "NVMe passthrough (io_uring URING_CMD, fixed buffers) on {}, max transfer {} KiB",
            self.ns.path().display(),
            self.ns.max_transfer() >> 10
        );
        if self.via_file > 0 {
            s.push_str(&format!(
                "; {} of {} extents through the file path ({})",
                self.via_file,
                self.map.extents.len(),
                self.file.io_path()
            ));
        }
        s
    }

    fn slack(&self) -> usize {
        self.align
    }

    fn registrars(&self) -> Vec<Arc<dyn Registrar>> {
        vec![self.engine.registrar()]
    }

    fn read(
        &self,
        offset: u64,
        len: usize,
        lease: Lease,
        lease_offset: usize,
        deadline: Duration,
    ) -> ReadFuture<'_> {
        let until = crate::engine::deadline_at(deadline.min(self.engine.config().op_timeout));
        Box::pin(self.read_into(offset, len, lease, lease_offset, until))
    }
}

/// One piece of a (widened) read, at `pos` bytes from the read's start in the lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Piece {
    /// LBAs on the namespace: one passthrough command (at most the max transfer).
    Raw { pos: usize, slba: u64, nlb: u32 },
    /// Through the file path (an extent that cannot be read raw, or one not LBA-aligned).
    File { pos: usize, off: u64, len: u64 },
    /// Zeros (a hole, or past the end of the file).
    Zero { pos: usize, len: u64 },
}

/// Splits `len` bytes at file offset `off` into pieces: raw extents as LBA runs of at most
/// `max_transfer` bytes, extents that cannot be read raw (or are not LBA-aligned) through the file
/// (clipped at `size`), holes and the part past `size` as zeros. Pure: no device needed.
pub(crate) fn plan(
    extents: &[Extent],
    off: u64,
    len: u64,
    lba: u64,
    max_transfer: u64,
    size: u64,
) -> Vec<Piece> {
    let lba = lba.max(1);
    let per_cmd = (max_transfer / lba).clamp(1, 65536);
    let end = off.saturating_add(len);
    let mut v = Vec::new();
    let mut at = off;
    let zero_or_file = |v: &mut Vec<Piece>, from: u64, to: u64, file: bool| {
        // The file path only up to the end of the file; zeros after it.
        let file_to = if file { to.min(size.max(from)) } else { from };
        if file_to > from {
            v.push(Piece::File {
                pos: (from - off) as usize,
                off: from,
                len: file_to - from,
            });
        }
        if to > file_to {
            v.push(Piece::Zero {
                pos: (file_to - off) as usize,
                len: to - file_to,
            });
        }
    };
    for e in extents {
        let (es, ee) = (e.logical, e.logical.saturating_add(e.len));
        if ee <= at || es >= end {
            continue;
        }
        if es > at {
            zero_or_file(&mut v, at, es, false);
            at = es;
        }
        let stop = ee.min(end);
        let phys = e.physical + (at - es);
        let raw_ok =
            e.not_raw.is_none() && phys.is_multiple_of(lba) && (stop - at).is_multiple_of(lba);
        if raw_ok {
            let mut slba = phys / lba;
            let mut left = (stop - at) / lba;
            let mut pos = (at - off) as usize;
            while left > 0 {
                let n = left.min(per_cmd);
                v.push(Piece::Raw {
                    pos,
                    slba,
                    nlb: n as u32,
                });
                slba += n;
                left -= n;
                pos += (n * lba) as usize;
            }
        } else {
            zero_or_file(&mut v, at, stop, true);
        }
        at = stop;
    }
    if at < end {
        zero_or_file(&mut v, at, end, false);
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ext(logical: u64, physical: u64, len: u64, not_raw: Option<&'static str>) -> Extent {
        Extent {
            logical,
            physical,
            len,
            not_raw,
        }
    }

    /// Every byte of the range is covered exactly once, in order.
    fn covers(p: &[Piece], len: u64, lba: u64) {
        let mut at = 0u64;
        for x in p {
            let (pos, n) = match *x {
                Piece::Raw { pos, nlb, .. } => (pos, nlb as u64 * lba),
                Piece::File { pos, len, .. } | Piece::Zero { pos, len } => (pos, len),
            };
            assert_eq!(pos as u64, at, "{p:?}");
            at += n;
        }
        assert_eq!(at, len, "{p:?}");
    }

    #[test]
    fn raw_extents_become_lba_runs() {
        let ex = [
            ext(0, 1 << 20, 64 << 10, None),
            ext(64 << 10, 8 << 20, 64 << 10, None),
        ];
        let p = plan(&ex, 4096, 96 << 10, 512, 1 << 20, 128 << 10);
        assert_eq!(
            p,
            vec![
                Piece::Raw {
                    pos: 0,
                    slba: ((1 << 20) + 4096) / 512,
                    nlb: (60 << 10) / 512
                },
                Piece::Raw {
                    pos: 60 << 10,
                    slba: (8 << 20) / 512,
                    nlb: (36 << 10) / 512
                },
            ]
        );
        covers(&p, 96 << 10, 512);
    }

    #[test]
    fn runs_split_at_the_max_transfer() {
        let ex = [ext(0, 0, 1 << 20, None)];
        let p = plan(&ex, 0, 1 << 20, 4096, 384 << 10, 1 << 20);
        let lens: Vec<u32> = p
            .iter()
            .map(|x| match x {
                Piece::Raw { nlb, .. } => *nlb,
                _ => 0,
            })
            .collect();
        assert_eq!(lens, vec![96, 96, 64]);
        covers(&p, 1 << 20, 4096);
        assert!(matches!(p[1], Piece::Raw { pos, slba: 96, .. } if pos == 384 << 10));
        // A max transfer below one LBA still makes progress, one LBA per command.
        let p = plan(&ex, 0, 16384, 4096, 100, 1 << 20);
        assert_eq!(p.len(), 4);
        covers(&p, 16384, 4096);
    }

    #[test]
    fn holes_and_the_tail_past_the_end_are_zeros() {
        // Extent at 8 KiB..12 KiB only; the file is 14 KiB; the read is widened to 16 KiB.
        let ex = [ext(8192, 40960, 4096, None)];
        let p = plan(&ex, 0, 16384, 512, 1 << 20, 14336);
        assert_eq!(
            p,
            vec![
                Piece::Zero { pos: 0, len: 8192 },
                Piece::Raw {
                    pos: 8192,
                    slba: 80,
                    nlb: 8
                },
                Piece::Zero {
                    pos: 12288,
                    len: 4096
                },
            ]
        );
        covers(&p, 16384, 512);
        // No extents at all (a sparse file): all zeros.
        assert_eq!(
            plan(&[], 0, 4096, 512, 1 << 20, 4096),
            vec![Piece::Zero { pos: 0, len: 4096 }]
        );
    }

    #[test]
    fn extents_that_cannot_be_read_raw_go_through_the_file() {
        let ex = [
            ext(0, 4096, 4096, None),
            ext(4096, 0, 8192, Some("unwritten (preallocated)")),
            // Not LBA-aligned on the device: through the file too.
            ext(12288, 100, 4096, None),
        ];
        let p = plan(&ex, 0, 16384, 512, 1 << 20, 15000);
        assert_eq!(
            p,
            vec![
                Piece::Raw {
                    pos: 0,
                    slba: 8,
                    nlb: 8
                },
                Piece::File {
                    pos: 4096,
                    off: 4096,
                    len: 8192
                },
                Piece::File {
                    pos: 12288,
                    off: 12288,
                    len: 15000 - 12288
                },
                Piece::Zero {
                    pos: 15000,
                    len: 16384 - 15000
                },
            ]
        );
        covers(&p, 16384, 512);
    }

    #[test]
    fn a_range_inside_one_extent_starts_at_its_offset() {
        let ex = [ext(0, 1 << 30, 1 << 20, None)];
        let p = plan(&ex, 512 << 10, 4096, 4096, 1 << 20, 1 << 20);
        assert_eq!(
            p,
            vec![Piece::Raw {
                pos: 0,
                slba: ((1u64 << 30) + (512 << 10)) / 4096,
                nlb: 1
            }]
        );
        // Out of every extent: zeros, never a panic.
        let p = plan(&ex, 2 << 20, 4096, 4096, 1 << 20, 1 << 20);
        assert_eq!(p, vec![Piece::Zero { pos: 0, len: 4096 }]);
    }
}
