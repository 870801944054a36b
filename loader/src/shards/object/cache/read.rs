//! Reading: a read's parts, chunk after chunk, from the chunk files this process checked (the hit
//! path) or straight from the store (the miss path), each landing right after the previous one in
//! the lease.

use std::ops::Range;

use super::*;

/// A read at hand: `len` bytes of `src` at `offset` (up to `end`), into the lease at
/// `lease_offset`, within `until`; its chunks are `first..=last`.
struct ReadAt<'a> {
    src: &'a ObjectSource,
    offset: u64,
    len: usize,
    end: u64,
    first: u64,
    last: u64,
    lease_offset: usize,
    until: Instant,
}

/// A read's part in one chunk: the chunk starts at `cs` in the object, the part is the object's
/// bytes `a..b` (`n` of them); `first`: the read's first chunk.
#[derive(Debug, Clone, Copy)]
struct Part {
    first: bool,
    cs: u64,
    a: u64,
    b: u64,
    n: usize,
}

/// Where a read's parts land in its lease, as they come.
struct Landing {
    /// Where the read's first byte is.
    data_start: usize,
    /// Where the next part lands.
    cursor: usize,
    /// Bytes read from chunk files and from the store.
    bytes_read: usize,
    /// How the latest part from a chunk file was read (the object store until one is).
    path: ubdirect_ub::ReadPath,
}

/// Bytes of a read's part at hand without a chunk file: the whole chunk (fetched whole but not
/// kept), or the part itself (a window kept of an earlier fetch).
enum Kept {
    Chunk(Vec<u8>),
    Part(Arc<[u8]>),
}

/// What [`ChunkCache::ensure`] made of a read's chunk: its path when present, and its bytes when
/// fetched whole but not kept, or kept as a window.
type Ensured = (Result<Option<PathBuf>, SourceError>, Option<Kept>);

/// A present chunk opened for a read: its source, its path, and the inode this process checked.
type OpenedChunk = (Arc<FileSource>, PathBuf, u64);

impl ReadAt<'_> {
    /// The read's error of kind `k`, caused by `e`.
    fn fail(&self, k: SourceErrorKind, e: Box<dyn std::error::Error + Send + Sync>) -> SourceError {
        SourceError::new(k, self.src.shard(), self.offset, self.len).with_source(e)
    }

    /// The read's part in chunk `idx` of `chunk_size` bytes.
    fn part(&self, idx: u64, chunk_size: u64) -> Part {
        let cs = idx * chunk_size;
        let a = self.offset.max(cs);
        let b = self.end.min(cs + chunk_size);
        Part {
            first: idx == self.first,
            cs,
            a,
            b,
            n: (b - a) as usize,
        }
    }
}

impl ChunkCache {
    /// Reads `len` bytes of `src` at `offset` into the lease from the chunks covering them, chunk
    /// after chunk. A part lands right after the previous one; with O_DIRECT the parts after the
    /// first start at a chunk boundary, so they stay aligned. A chunk that cannot be cached (the bound,
    /// or evicted by another process before it was opened) is fetched straight into its place.
    pub(crate) async fn read(
        &self,
        src: &ObjectSource,
        offset: u64,
        len: usize,
        mut lease: Lease,
        lease_offset: usize,
        until: Instant,
    ) -> SourceResult {
        let end = offset + len as u64;
        let at = ReadAt {
            src,
            offset,
            len,
            end,
            first: offset / self.chunk_size,
            last: (end - 1) / self.chunk_size,
            lease_offset,
            until,
        };
        // Where the plan has this read: the clock moves to it.
        let key = Self::key_of(src);
        let pos = self.plan().start(key, offset, len as u64);
        let fill = lock_set(&self.fill).contains(&key);
        let _in_flight = pos.map(|p| self.started(p));
        let ensured = self.ensure_parts(&at, pos).await;
        let mut land = Landing {
            data_start: lease_offset,
            cursor: lease_offset,
            bytes_read: 0,
            path: ubdirect_ub::ReadPath::ObjectStore,
        };
        for (idx, (present, kept)) in (at.first..=at.last).zip(ensured) {
            let part = at.part(idx, self.chunk_size);
            let file = match present {
                Ok(p) => p.and_then(|p| self.open_hit(p)),
                Err(e) => return (Err(e), lease),
            };
            let mut from_store = true;
            if let Some(file) = file {
                let (r, l) = self
                    .read_from_chunk(&at, part, file, fill, lease, &mut land)
                    .await;
                lease = l;
                match r {
                    Ok(served) => from_store = !served,
                    Err(e) => return (Err(e), lease),
                }
            }
            if from_store
                && let Err(e) = self
                    .read_from_store(&at, part, kept.as_ref(), &mut lease, &mut land)
                    .await
            {
                return (Err(e), lease);
            }
            land.cursor = land.data_start + (part.b - offset) as usize;
        }
        self.delivered.fetch_add(len as u64, Ordering::Relaxed);
        let done = ReadDone {
            data: land.data_start..land.data_start + len,
            bytes_read: land.bytes_read,
            path: land.path,
        };
        (Ok(done), lease)
    }

    /// The read of `len` bytes at `offset` of `src` when its bytes are one kept window (a read within
    /// one chunk): taken, the plan's clock moved to the read and the read counted, as
    /// [`ChunkCache::read`] would; `None`, with nothing taken, otherwise. The pipeline lands such a
    /// read without a staging block or a task (its bytes are in memory already).
    pub(crate) fn read_at_hand(
        &self,
        src: &ObjectSource,
        offset: u64,
        len: usize,
    ) -> Option<Arc<[u8]>> {
        let end = offset + len as u64;
        if offset / self.chunk_size != (end - 1) / self.chunk_size {
            return None;
        }
        let key = Self::key_of(src);
        let w = self.window((key, offset, end))?;
        let pos = self.plan().start(key, offset, len as u64);
        drop(pos.map(|p| self.started(p)));
        self.delivered.fetch_add(len as u64, Ordering::Relaxed);
        add(&STATS.reads_at_hand, 1);
        Some(w)
    }

    /// The chunks of the read made present at once (a read of several chunks waits for the slowest
    /// GET, not for their sum), in order.
    async fn ensure_parts(&self, at: &ReadAt<'_>, pos: Option<u64>) -> Vec<Ensured> {
        futures_util::future::join_all((at.first..=at.last).map(|idx| async move {
            let p = at.part(idx, self.chunk_size);
            let part = (Self::key_of(at.src), p.a, p.b);
            if let Some(w) = self.window(part) {
                return (Ok(None), Some(Kept::Part(w)));
            }
            // One read of a chunk at a time decides (and fetches) it for its windows: the others
            // then find their parts kept.
            let _one = match self.windows_on() {
                true => Some(self.window_lock(part.0, idx).lock_owned().await),
                false => None,
            };
            if let Some(w) = self.window(part) {
                return (Ok(None), Some(Kept::Part(w)));
            }
            let mut kept = None;
            let want = self.want(at.src, idx, pos, p.b - p.a);
            let r = self
                .ensure(at.src, idx, at.until, false, want, &mut kept)
                .await;
            (r, kept.map(Kept::Chunk))
        }))
        .await
    }

    /// Kept window `part` (object key, bytes), taken for one read (counted).
    fn window(&self, part: (u64, u64, u64)) -> Option<Arc<[u8]>> {
        let w = self
            .windows
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take(part)?;
        add(&STATS.bytes_from_windows, w.len() as u64);
        Some(w)
    }

    fn windows_on(&self) -> bool {
        self.windows.lock().unwrap_or_else(|e| e.into_inner()).on()
    }

    fn window_lock(&self, key: u64, idx: u64) -> Arc<tokio::sync::Mutex<()>> {
        self.window_locks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry((key, idx))
            .or_default()
            .clone()
    }

    /// Opens present chunk `p` on the inode this process checked, counting a prefetched one as a
    /// prefetch hit; `None` (counted as bypassed: the part comes from the store) if it cannot.
    fn open_hit(&self, p: PathBuf) -> Option<OpenedChunk> {
        if lock_set(&self.prefetched).remove(&p) {
            add(&STATS.prefetch_hits, 1);
        }
        let ino = self.checked_ino(&p);
        match self.source_of(&p, Some(ino)) {
            Ok(f) => Some((f, p, ino)),
            Err(e) => {
                tracing::debug!(target: "ubdirect_loader::objstore::cache", "cache: {e}; reading the chunk from the store");
                add(&STATS.cache_bypassed, 1);
                None
            }
        }
    }

    /// Reads `part` from its open chunk file into the lease at the cursor (the hit path): `true`
    /// when served, `false` when the chunk turned out damaged and the part is to come from the store.
    async fn read_from_chunk(
        &self,
        at: &ReadAt<'_>,
        part: Part,
        (f, p, ino): OpenedChunk,
        fill: bool,
        lease: Lease,
        land: &mut Landing,
    ) -> (Result<bool, SourceError>, Lease) {
        #[cfg(test)]
        if let Some(hook) = &*self
            .between_check_and_read
            .lock()
            .unwrap_or_else(|e| e.into_inner())
        {
            hook(&p);
        }
        let left = at.until.saturating_duration_since(Instant::now());
        f.set_populate(fill);
        let (r, mut lease) = f
            .read(part.a - part.cs, part.n, lease, land.cursor, left)
            .await;
        match r {
            Ok(d) => {
                if let Err(e) = self.land_chunk_part(at, part, d.data.clone(), &mut lease, land) {
                    return (Err(e), lease);
                }
                land.bytes_read += d.bytes_read;
                land.path = d.path;
                add(&STATS.bytes_from_cache, part.n as u64);
                (Ok(true), lease)
            }
            // A chunk cut short or unreadable since it was checked (another process of the
            // node, a damaged disk): this part comes from the store, and the chunk is
            // checked again at its next use (and so fetched again). The cache is a copy;
            // the store has the bytes.
            Err(e)
                if e.source_as::<ubdirect_nvme::IoError>()
                    .is_some_and(|e| e.means_damaged_file()) =>
            {
                self.forget(&p, ino);
                add(&STATS.cache_bypassed, 1);
                ubdirect_ub::fallback::record(
                    "object_cache_chunk_read_failed",
                    format!("{e}: read from the store instead"),
                );
                (Ok(false), lease)
            }
            // An engine that cannot read at all, a lease that cannot take the bytes, a
            // deadline passed: the read ends, as any read of a local file would.
            Err(e) => (Err(at.fail(e.kind, Box::new(e))), lease),
        }
    }

    /// Puts a part read from a chunk file (now at `data` in the lease) where the read has it: the
    /// first part starts the read's data, a later one is moved to the cursor if it is not there.
    fn land_chunk_part(
        &self,
        at: &ReadAt<'_>,
        part: Part,
        data: Range<usize>,
        lease: &mut Lease,
        land: &mut Landing,
    ) -> Result<(), SourceError> {
        if part.first {
            land.data_start = data.start;
            return self.align_first(at, part.n, lease, land);
        }
        if data.start != land.cursor {
            match lease.as_mut_slice() {
                Ok(s) => s.copy_within(data, land.cursor),
                Err(e) => return Err(at.fail(SourceErrorKind::Lease, Box::new(e))),
            }
        }
        Ok(())
    }

    /// Moves the first part (`n` bytes read from a chunk file) to where an aligned read would have
    /// put it, where the read goes on into another chunk that O_DIRECT may read.
    fn align_first(
        &self,
        at: &ReadAt<'_>,
        n: usize,
        lease: &mut Lease,
        land: &mut Landing,
    ) -> Result<(), SourceError> {
        // A part read through the page cache lands at `lease_offset`, which leaves
        // the next part at an offset O_DIRECT cannot read into, should its chunk be
        // cold: moved to where an aligned read would have put it (the lease holds
        // the slack), the next part then starts aligned at the chunk boundary.
        let to = at.lease_offset + (at.offset % self.slack.max(1) as u64) as usize;
        if at.last > at.first
            && self.slack > 0
            && !(land.data_start + n).is_multiple_of(self.slack)
            && to != land.data_start
        {
            match lease.as_mut_slice() {
                Ok(s) if to + n <= s.len() => {
                    s.copy_within(land.data_start..land.data_start + n, to);
                    land.data_start = to;
                }
                Ok(_) => {
                    let e = "the lease cannot hold the read with its alignment slack";
                    return Err(at.fail(SourceErrorKind::Lease, e.into()));
                }
                Err(e) => return Err(at.fail(SourceErrorKind::Lease, Box::new(e))),
            }
        }
        Ok(())
    }

    /// Reads `part` from the store into the lease at the cursor (the miss path), or copies it from
    /// `kept`, the chunk's bytes when it was fetched whole but not kept.
    async fn read_from_store(
        &self,
        at: &ReadAt<'_>,
        part: Part,
        kept: Option<&Kept>,
        lease: &mut Lease,
        land: &mut Landing,
    ) -> Result<(), SourceError> {
        if part.first && self.slack > 0 {
            // Where an aligned read would have put it, so later parts stay aligned.
            land.data_start = at.lease_offset + (at.offset % self.slack as u64) as usize;
            land.cursor = land.data_start;
        }
        let (cursor, n) = (land.cursor, part.n);
        let from_kept = match kept {
            Some(Kept::Chunk(k)) => k.get((part.a - part.cs) as usize..(part.b - part.cs) as usize),
            Some(Kept::Part(w)) => Some(&w[..]).filter(|w| w.len() == part.n),
            None => None,
        };
        match lease.as_mut_slice() {
            Ok(s) => match (s.get_mut(cursor..cursor + n), from_kept) {
                // The chunk was fetched whole but not kept: its bytes are here.
                (Some(dst), Some(k)) => dst.copy_from_slice(k),
                (Some(dst), None) => {
                    at.src
                        .fetch_into(part.a, dst, at.until)
                        .await
                        .map_err(|e| {
                            at.fail(crate::shards::object::source::kind_of(&e), Box::new(e))
                        })?;
                    add(&self.fetched, n as u64);
                }
                (None, _) => {
                    return Err(at.fail(
                        SourceErrorKind::Lease,
                        "the lease cannot hold the read with its alignment slack".into(),
                    ));
                }
            },
            Err(e) => return Err(at.fail(SourceErrorKind::Lease, Box::new(e))),
        }
        land.bytes_read += n;
        Ok(())
    }
}
