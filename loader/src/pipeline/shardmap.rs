//! A shard as the page-cache pool maps it: one mapped file (a local shard), or the mapped chunk
//! files of an object cache that holds the whole object ([`ubdirect_ub::ChunkFiles`]). Batches copy
//! a shard's byte range out of it without caring which: a range that spans chunks is one copy per
//! chunk.

use std::path::Path;
use std::sync::Arc;

use ubdirect_ub::{CopyCompletion, Device, DeviceError, Lease, MapError, MappedFile};

/// One shard's mapping.
#[derive(Debug)]
pub(crate) struct ShardMap {
    /// Bytes of every mapped file but the last (`u64::MAX`: one file holds the shard).
    chunk: u64,
    maps: Vec<Arc<MappedFile>>,
}

impl ShardMap {
    /// A local shard mapped whole.
    pub fn whole(m: MappedFile) -> Self {
        Self {
            chunk: u64::MAX,
            maps: vec![Arc::new(m)],
        }
    }

    /// An object's chunk files, `chunk` bytes each but the last, in order.
    pub fn chunks(chunk: u64, maps: Vec<MappedFile>) -> Self {
        Self {
            chunk: chunk.max(1),
            maps: maps.into_iter().map(Arc::new).collect(),
        }
    }

    /// Whether it maps chunk files of an object cache (not a shard's own file).
    pub fn is_chunked(&self) -> bool {
        self.chunk != u64::MAX
    }

    /// Calls `f(map, offset in it, len, offset in the range)` for each mapped file that
    /// `offset..offset + len` of the shard touches, in order.
    fn pieces<E>(
        &self,
        offset: u64,
        len: usize,
        range: impl Fn(MapError) -> E,
        mut f: impl FnMut(&Arc<MappedFile>, u64, usize, usize) -> Result<(), E>,
    ) -> Result<(), E> {
        let mut at = offset;
        let mut done = 0usize;
        while done < len {
            let i = (at / self.chunk) as usize;
            let Some(m) = self.maps.get(i) else {
                let path = self.maps.last().map(|m| m.path().to_path_buf());
                return Err(range(MapError::Range {
                    path: path.unwrap_or_default(),
                    offset,
                    len,
                    size: self.len(),
                }));
            };
            let off = if self.is_chunked() {
                at - i as u64 * self.chunk
            } else {
                at
            };
            let n = (len - done).min(m.len().saturating_sub(off) as usize);
            if n == 0 {
                return Err(range(MapError::Range {
                    path: m.path().to_path_buf(),
                    offset: off,
                    len: len - done,
                    size: m.len(),
                }));
            }
            f(m, off, n, done)?;
            at += n as u64;
            done += n;
        }
        Ok(())
    }

    /// Bytes mapped.
    pub fn len(&self) -> u64 {
        self.maps.iter().map(|m| m.len()).sum()
    }

    /// Copies the shard's bytes at `offset` into `out` (through `pread`, see
    /// [`MappedFile::copy_out`]).
    pub fn copy_out(&self, offset: u64, out: &mut [u8]) -> Result<(), MapError> {
        self.pieces(
            offset,
            out.len(),
            |e| e,
            |m, off, n, to| m.copy_out(off, &mut out[to..to + n]),
        )
    }

    /// Has `device` copy the shard's `offset..offset + len` into `dst` at `dst_offset`: one copy per
    /// mapped file the range touches, each pushed onto `copies`.
    pub fn copy_to_device(
        &self,
        device: &dyn Device,
        offset: u64,
        len: usize,
        dst: &mut Lease,
        dst_offset: usize,
        copies: &mut Vec<CopyCompletion>,
    ) -> Result<(), DeviceError> {
        let range = |e| DeviceError::Mapped(Box::new(e));
        self.pieces(offset, len, range, |m, off, n, to| {
            copies.push(device.copy_mapped_to_device(m, off, n, dst, dst_offset + to)?);
            Ok(())
        })
    }

    /// Checks every mapped file is still what was mapped (one `fstat` each).
    pub fn check(&self) -> Result<(), MapError> {
        self.maps.iter().try_for_each(|m| m.check())
    }

    /// Chunk files only: whether one was evicted or replaced since it was mapped (its path no
    /// longer names the mapped inode). The mapping still holds the right bytes (a chunk is never
    /// written in place), but it keeps blocks the cache's bound no longer counts.
    pub fn evicted(&self) -> bool {
        self.is_chunked()
            && self
                .maps
                .iter()
                .any(|m| !names(m.path(), m.ident().dev, m.ident().ino))
    }
}

/// Whether `p` names the inode `ino` of device `dev`.
fn names(p: &Path, dev: u64, ino: u64) -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(p).is_ok_and(|m| m.dev() == dev && m.ino() == ino)
}
