//! Any shard's [`Source`] as `Read + Seek`, for what formats read at open (headers, footers, `.idx`
//! files) through the same source the batches are read through.

use std::sync::Arc;
use std::time::Duration;

use ubdirect_ub::{Lease, MemoryKind, PoolConfig, Source, UbPool};

use super::block_on;
use crate::error::LoadError;
use crate::formats::ShardFile;

/// Any [`Source`] as `Read + Seek`, for format headers and footers: reads go through the source in
/// aligned chunks into one block (registered with the source's consumers), the last chunk cached.
pub(crate) struct SourceReader<'a> {
    rt: &'a tokio::runtime::Runtime,
    src: Arc<dyn Source>,
    deadline: Duration,
    _pool: UbPool,
    lease: Option<Lease>,
    /// (chunk start, where its bytes are in the block, length).
    cached: Option<(u64, usize, usize)>,
    pos: u64,
}

const READER_CHUNK: u64 = 256 << 10;

impl<'a> SourceReader<'a> {
    pub(crate) fn new(
        rt: &'a tokio::runtime::Runtime,
        src: Arc<dyn Source>,
        deadline: Duration,
    ) -> Result<Self, LoadError> {
        let block = (READER_CHUNK as usize + 2 * src.slack()).div_ceil(4096) * 4096;
        let mut b = UbPool::builder(PoolConfig::new("shard-header", block, 1, MemoryKind::Host));
        for r in src.registrars() {
            b = b.register_with(r);
        }
        let pool = b.build()?;
        let lease = pool.try_acquire();
        Ok(Self {
            rt,
            src,
            deadline,
            _pool: pool,
            lease,
            cached: None,
            pos: 0,
        })
    }
}

impl std::io::Read for SourceReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let size = self.src.size();
        if self.pos >= size || buf.is_empty() {
            return Ok(0);
        }
        let start = self.pos / READER_CHUNK * READER_CHUNK;
        if self.cached.is_none_or(|(s, _, _)| s != start) {
            self.cached = None;
            let n = READER_CHUNK.min(size - start) as usize;
            let lease = self
                .lease
                .take()
                .ok_or_else(|| std::io::Error::other("shard header block lost"))?;
            let (r, l) = block_on(self.rt, self.src.read(start, n, lease, 0, self.deadline))
                .map_err(std::io::Error::other)?;
            self.lease = Some(l);
            let done = r.map_err(std::io::Error::other)?;
            self.cached = Some((start, done.data.start, n));
        }
        let (s, at0, n) = self.cached.unwrap_or((start, 0, 0));
        let at = (self.pos - s) as usize;
        let k = buf.len().min(n.saturating_sub(at));
        let data = self
            .lease
            .as_ref()
            .ok_or_else(|| std::io::Error::other("shard header block lost"))?
            .as_slice()
            .map_err(std::io::Error::other)?;
        buf[..k].copy_from_slice(&data[at0 + at..at0 + at + k]);
        self.pos += k as u64;
        Ok(k)
    }
}

impl std::io::Seek for SourceReader<'_> {
    fn seek(&mut self, to: std::io::SeekFrom) -> std::io::Result<u64> {
        let p = match to {
            std::io::SeekFrom::Start(o) => Some(o),
            std::io::SeekFrom::End(d) => self.src.size().checked_add_signed(d),
            std::io::SeekFrom::Current(d) => self.pos.checked_add_signed(d),
        };
        self.pos = p.ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::InvalidInput, "seek before the start")
        })?;
        Ok(self.pos)
    }
}

impl ShardFile for SourceReader<'_> {
    fn size(&self) -> u64 {
        self.src.size()
    }
}
