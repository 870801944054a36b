//! A shard as the page-cache pool maps it: its file (a local shard), or the chunk files of an object
//! cache that holds the whole object, laid end to end in one mapping
//! ([`MappedFile::open_chunks`]: one registration, and a copy that spans chunks is one copy).
//! Batches copy a shard's byte range out of it without caring which.
//!
//! A mapping is either *in place* (registered with the device, or made for the CPU copies of packed
//! batches: reads land in it, with no staging block) or *staged*: an object's chunk files, resident
//! and checked, mapped but not registered yet. A staged mapping is read by the copy threads with
//! `pread` on its own descriptors into staging blocks, instead of through the object's cache (which
//! would open, check and register each chunk file again on its first touch in the process) — until
//! the registrar has registered it.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use ubdirect_ub::{CopyCompletion, Device, DeviceError, Lease, MapError, MappedFile};

/// One shard's mapping.
#[derive(Debug)]
pub(crate) struct ShardMap {
    map: Arc<MappedFile>,
    /// Chunk files of an object cache (not a shard's own file).
    chunked: bool,
    /// Read into staging blocks by `pread`, not landed in place.
    staged: bool,
    /// Staged only: a read out of it failed (a chunk file cut short, a failing disk); the reads
    /// after it go through the object's source.
    failed: AtomicBool,
}

impl ShardMap {
    /// A local shard mapped whole.
    pub fn whole(m: MappedFile) -> Self {
        Self {
            map: Arc::new(m),
            chunked: false,
            staged: false,
            failed: AtomicBool::new(false),
        }
    }

    /// An object's chunk files, mapped end to end.
    pub fn chunks(m: MappedFile) -> Self {
        Self {
            map: Arc::new(m),
            chunked: true,
            staged: false,
            failed: AtomicBool::new(false),
        }
    }

    /// An object's chunk files, mapped end to end and not registered: read into staging blocks.
    pub fn staged(m: MappedFile) -> Self {
        Self {
            map: Arc::new(m),
            chunked: true,
            staged: true,
            failed: AtomicBool::new(false),
        }
    }

    /// The mapping (for reads of a staged one: [`ubdirect_nvme::Engine::copy_mapped`]).
    pub fn file(&self) -> &Arc<MappedFile> {
        &self.map
    }

    /// Whether reads of it go through staging blocks ([`ShardMap::staged`]), not in place.
    pub fn is_staged(&self) -> bool {
        self.staged
    }

    /// Whether reads go out of it by `pread` into staging blocks now: staged, and no read out of it
    /// has failed.
    pub fn reads_staged(&self) -> bool {
        self.staged && !self.failed.load(Ordering::Acquire)
    }

    /// A read out of the staged mapping failed: the reads after it go through the object's source
    /// (each such read would otherwise meet the same damage first).
    pub fn read_failed(&self) {
        self.failed.store(true, Ordering::Release);
    }

    /// Whether it maps chunk files of an object cache (not a shard's own file).
    pub fn is_chunked(&self) -> bool {
        self.chunked
    }

    /// Copies the shard's bytes at `offset` into `out` (through `pread`, see
    /// [`MappedFile::copy_out`]).
    pub fn copy_out(&self, offset: u64, out: &mut [u8]) -> Result<(), MapError> {
        self.map.copy_out(offset, out)
    }

    /// Has `device` copy the shard's `offset..offset + len` into `dst` at `dst_offset`, pushed onto
    /// `copies`.
    pub fn copy_to_device(
        &self,
        device: &dyn Device,
        offset: u64,
        len: usize,
        dst: &mut Lease,
        dst_offset: usize,
        copies: &mut Vec<CopyCompletion>,
    ) -> Result<(), DeviceError> {
        copies.push(device.copy_mapped_to_device(&self.map, offset, len, dst, dst_offset)?);
        Ok(())
    }

    /// Checks every mapped file is still what was mapped (one `fstat` each).
    pub fn check(&self) -> Result<(), MapError> {
        self.map.check()
    }

    /// Chunk files only: whether one was evicted or replaced since it was mapped (its path no
    /// longer names the mapped inode). The mapping still holds the right bytes (a chunk is never
    /// written in place), but it keeps blocks the cache's bound no longer counts.
    pub fn evicted(&self) -> bool {
        self.chunked && self.map.files().any(|(p, id)| !names(p, id.dev, id.ino))
    }
}

/// Whether `p` names the inode `ino` of device `dev`.
fn names(p: &Path, dev: u64, ino: u64) -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(p).is_ok_and(|m| m.dev() == dev && m.ino() == ino)
}
