//! The io_uring file path as a [`Source`]: `READ_FIXED` on a registered file, O_DIRECT where the file
//! system supports it, page cache otherwise.

use std::sync::Arc;
use std::time::Duration;

use ubdirect_ub::{
    Lease, ReadDone, ReadFuture, ReadPath, Registrar, Source, SourceError, SourceErrorKind,
};

use crate::{Engine, FileHandle, IoError};

/// A shard read by the engine.
#[derive(Clone)]
pub struct FileSource {
    engine: Engine,
    file: FileHandle,
    shard: String,
    size: u64,
}

impl std::fmt::Debug for FileSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileSource")
            .field("shard", &self.shard)
            .field("size", &self.size)
            .field("direct", &self.file.is_direct())
            .finish()
    }
}

impl FileSource {
    /// Opens `path` on `engine` (registered with every ring; O_DIRECT per the engine's policy).
    pub fn open(engine: &Engine, path: impl AsRef<std::path::Path>) -> Result<Self, IoError> {
        let file = engine.open(path.as_ref())?;
        Ok(Self::from_handle(engine, file))
    }

    /// A source over a file already open on `engine`.
    pub fn from_handle(engine: &Engine, file: FileHandle) -> Self {
        Self {
            engine: engine.clone(),
            shard: file.path().display().to_string(),
            size: file.size().unwrap_or(0),
            file,
        }
    }

    /// The engine's handle of the file.
    pub fn handle(&self) -> &FileHandle {
        &self.file
    }
}

/// The kind of an engine error, for callers that branch.
pub fn kind_of(e: &IoError) -> SourceErrorKind {
    match e {
        IoError::PastEof { .. } => SourceErrorKind::OutOfRange,
        IoError::UnexpectedEof { .. } => SourceErrorKind::Changed,
        IoError::NotRegistered { .. }
        | IoError::NotHostVisible { .. }
        | IoError::BufferTooSmall { .. }
        | IoError::Misaligned { .. } => SourceErrorKind::Lease,
        IoError::Timeout { .. } => SourceErrorKind::Timeout,
        IoError::Closed => SourceErrorKind::Closed,
        IoError::Open { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
            SourceErrorKind::NotFound
        }
        _ => SourceErrorKind::Io,
    }
}

impl Source for FileSource {
    fn shard(&self) -> &str {
        &self.shard
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn describe(&self) -> String {
        self.file.io_path().to_string()
    }

    fn slack(&self) -> usize {
        if self.file.is_direct() {
            self.file.offset_align() as usize
        } else {
            0
        }
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
        Box::pin(async move {
            let (r, lease) = self
                .engine
                .read_within(&self.file, offset, len, lease, lease_offset, deadline)
                .await;
            let r = r
                .map(|d| ReadDone {
                    data: d.data,
                    bytes_read: d.bytes_read,
                    path: if d.direct {
                        ReadPath::Direct
                    } else {
                        ReadPath::Buffered
                    },
                })
                .map_err(|e| {
                    SourceError::new(kind_of(&e), &self.shard, offset, len).with_source(e)
                });
            (r, lease)
        })
    }
}
