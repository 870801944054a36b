//! Fetching: a chunk made present once per node (the fetcher holds the chunk's lock, the others wait
//! and find it), checked by its sidecar or its CRC-32, prefetched ahead of the plan.

use super::*;

impl ChunkCache {
    /// Fetches the chunks of `src` covering `offset..offset + len` in the background (on the current
    /// tokio runtime), unless present, being fetched, or already prefetched. Never blocks.
    pub(crate) fn prefetch(self: &Arc<Self>, src: &ObjectSource, offset: u64, len: usize) {
        if self.prefetch == 0 || len == 0 || offset >= src.size() {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let end = (offset + len as u64).min(src.size());
        let key = Self::key_of(src);
        let pos = self.plan().advised(key, offset, len as u64);
        for idx in offset / self.chunk_size..=(end - 1) / self.chunk_size {
            let p = self.chunk_path(src, idx);
            let clen = self.chunk_len(src, idx);
            match self.presence(&p, clen) {
                Presence::Checked => {
                    self.open_ahead(&rt, p);
                    continue;
                }
                Presence::Unchecked(_) => {
                    // In place, not yet checked by this process (a restarted job's first epoch):
                    // its CRC check starts now, ahead of the read, which then finds it done (or
                    // joins it). Nothing to fetch, so no admission to weigh: deciding one scans
                    // the directory, and doing that per advised chunk cost a warm first epoch
                    // most of its time.
                    if !self
                        .checking
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .contains_key(&p)
                    {
                        let (cache, rt2) = (self.clone(), rt.clone());
                        rt.spawn(async move {
                            if cache.valid(&p, clen).await {
                                cache.open_ahead(&rt2, p);
                            }
                        });
                    }
                    continue;
                }
                Presence::Absent => {}
            }
            // With a plan: only chunks it would keep, at most `prefetch` of them ahead, and never
            // by evicting a chunk the plan reads again (the read at hand decides that, when it
            // comes: decided ahead, on a clock behind the advised read, it fetched chunks twice).
            let want = match pos {
                Some(at) => Want {
                    next: self.plan().next_use(key, idx, at),
                    from: at,
                    part: 0,
                },
                None => self.want(src, idx, None, 0),
            };
            if pos.is_some()
                && (lock_set(&self.prefetching).len() + lock_set(&self.prefetched).len()
                    >= self.prefetch as usize
                    || !self.admits(src, idx, &p, self.chunk_len(src, idx), want)
                    || self
                        .victims(self.chunk_len(src, idx) + 64, &p, want.next, false)
                        .is_none_or(|v| v.iter().any(|c| matches!(c.next, NextUse::At(_)))))
            {
                continue;
            }
            if lock_set(&self.prefetched).contains(&p)
                || !lock_set(&self.prefetching).insert(p.clone())
            {
                continue;
            }
            let (cache, src) = (self.clone(), src.clone());
            rt.spawn(async move {
                let until = Instant::now() + cache.prefetch_deadline;
                if let Err(e) = cache.ensure(&src, idx, until, true, want, &mut None).await {
                    add(&STATS.prefetch_failed, 1);
                    ubdirect_ub::fallback::record(
                        "object_store_prefetch_failed",
                        format!("cache prefetch: {e}; the read fetches the chunk itself"),
                    );
                }
                lock_set(&cache.prefetching).remove(&p);
            });
        }
    }

    /// Opens present chunk `p` and refreshes its mtime ahead of the read the plan has for it, on the
    /// blocking pool: a cache hit then finds its file open and its touch done, instead of waiting
    /// for the open's registration with every ring, the sidecar and the `utimensat` on its own path
    /// (a restarted job's first epoch opens every chunk).
    pub(super) fn open_ahead(self: &Arc<Self>, rt: &tokio::runtime::Handle, p: PathBuf) {
        let open = self.open.lock().map(|o| o.contains_key(&p)).unwrap_or(true);
        if open || !lock_set(&self.opening).insert(p.clone()) {
            return;
        }
        let cache = self.clone();
        drop(rt.spawn_blocking(move || {
            if cache.source_of(&p, None).is_ok() {
                cache.touch(&p);
            }
            lock_set(&cache.opening).remove(&p);
        }));
    }

    /// Whether `p` holds a whole, checked chunk of `len` bytes. The first check of a chunk in this
    /// process (its CRC against the sidecar: a read of the whole chunk) runs on the blocking pool,
    /// once however many reads wait for it: checks of different chunks run in parallel, and the
    /// runtime's threads keep serving reads meanwhile (a restarted job's first epoch from a warm
    /// cache checks every chunk).
    pub(super) async fn valid(&self, p: &Path, len: u64) -> bool {
        let ino = match self.presence(p, len) {
            Presence::Absent => return false,
            Presence::Checked => return true,
            Presence::Unchecked(ino) => ino,
        };
        // The sidecar names this very file: its writer computed the CRC from the bytes it fetched
        // and wrote them to this inode (synced before it was renamed into place).
        if !self.recheck && names_this_file(p, len, ino) {
            if let Ok(mut v) = self.verified.lock() {
                v.insert(p.to_path_buf(), ino);
            }
            return true;
        }
        let check = {
            use futures_util::FutureExt;
            let mut c = self.checking.lock().unwrap_or_else(|e| e.into_inner());
            c.entry(p.to_path_buf())
                .or_insert_with(|| {
                    let path = p.to_path_buf();
                    async move {
                        tokio::task::spawn_blocking(move || matches_sidecar(&path, len))
                            .await
                            .unwrap_or(None)
                    }
                    .boxed()
                    .shared()
                })
                .clone()
        };
        let ino = check.await;
        self.checking
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(p);
        let ok = ino.is_some();
        if let (Some(ino), Ok(mut v)) = (ino, self.verified.lock()) {
            v.insert(p.to_path_buf(), ino);
        }
        if !ok {
            tracing::warn!(target: "ubdirect_loader::objstore::cache",
                "cache: {} fails its checksum; fetching it again",
                p.display()
            );
        }
        ok
    }

    /// Makes chunk `idx` of `src` present; `Ok(None)` when it is not to be cached: used `next`
    /// never again, or later than every resident chunk it would evict (or it cannot fit in the
    /// bound). A `prefetch` that fetches the chunk counts it and marks it prefetched (before its
    /// lock is released, so a read waiting on the lock finds the mark). A chunk fetched whole that
    /// then cannot be kept (another process of the node took the room meanwhile) is put in `kept`,
    /// for the read at hand (fetching its bytes again would pay twice).
    pub(super) async fn ensure(
        &self,
        src: &ObjectSource,
        idx: u64,
        until: Instant,
        prefetch: bool,
        want: Want,
        kept: &mut Option<Vec<u8>>,
    ) -> Result<Option<PathBuf>, SourceError> {
        let p = self.chunk_path(src, idx);
        let len = self.chunk_len(src, idx);
        let start = idx * self.chunk_size;
        let err = |(k, e): (SourceErrorKind, Box<dyn std::error::Error + Send + Sync>)| {
            SourceError::new(k, src.shard(), start, len as usize).with_source(e)
        };
        if self.valid(&p, len).await {
            self.touch(&p);
            return Ok(Some(p));
        }
        let bypass = || {
            if !prefetch {
                add(&STATS.cache_bypassed, 1);
            }
            Ok(None)
        };
        let reserved = match self.admission(src, idx, &p, len, want) {
            Admission::Fetch(r) => Some(r),
            Admission::Wait => None, // admitted by another read of this process: wait for its fetch below
            Admission::Bypass => {
                if !prefetch
                    && self
                        .fetch_for_windows(src, idx, len, want, until, kept)
                        .await?
                {
                    return Ok(None);
                }
                return bypass();
            }
        };
        let late = "another process held the chunk's fetch lock past the deadline";
        let _held = held(&p.with_extension("lock"), until, late)
            .await
            .map_err(err)?;
        if self.valid(&p, len).await {
            self.touch(&p);
            return Ok(Some(p));
        }
        if reserved.is_none() {
            return bypass(); // the fetch waited on did not keep the chunk
        }
        let mut buf = vec![0u8; len as usize];
        src.fetch_into(start, &mut buf, until)
            .await
            .map_err(|e| err((crate::shards::object::source::kind_of(&e), Box::new(e))))?;
        add(&STATS.chunks_fetched, 1);
        add(&self.fetched, len);
        let late = "the cache lock was held past the deadline";
        let all = held(&self.dir.join(".cache.lock"), until, late)
            .await
            .map_err(err)?;
        if !self.store_fetched(&p, buf, want.next, prefetch, kept) {
            drop(all);
            return Ok(None);
        }
        drop(reserved);
        drop(all);
        if prefetch {
            add(&STATS.chunks_prefetched, 1);
            add(&STATS.bytes_prefetched, len);
            lock_set(&self.prefetched).insert(p.clone());
        }
        Ok(Some(p))
    }

    /// A chunk not to be cached (`len` bytes): fetched whole in one GET when the planned reads of
    /// this process that come next use enough of it (`windows::choose`), their parts kept as
    /// windows and the chunk's bytes put in `kept` for the read at hand; `false`: the read fetches
    /// its own bytes.
    async fn fetch_for_windows(
        &self,
        src: &ObjectSource,
        idx: u64,
        len: u64,
        want: Want,
        until: Instant,
        kept: &mut Option<Vec<u8>>,
    ) -> Result<bool, SourceError> {
        if want.next == NextUse::Unknown || want.from == 0 {
            return Ok(false);
        }
        let key = Self::key_of(src);
        let max = self.windows.lock().unwrap_or_else(|e| e.into_inner()).max();
        let ahead = self
            .plan()
            .parts_ahead(key, idx, self.now(), want.from - 1, max);
        let (chosen, pays) = {
            let w = self.windows.lock().unwrap_or_else(|e| e.into_inner());
            if !w.on() {
                return Ok(false);
            }
            // Parts kept already have their reads counted.
            let fresh = ahead.into_iter().filter(|&(a, b)| !w.has((key, a, b)));
            let run = (
                self.fetched.load(Ordering::Relaxed),
                self.delivered.load(Ordering::Relaxed),
            );
            windows::choose(len, want.part, fresh, w.room(), run)
        };
        if !pays {
            return Ok(false);
        }
        let start = idx * self.chunk_size;
        let mut buf = vec![0u8; len as usize];
        src.fetch_into(start, &mut buf, until).await.map_err(|e| {
            SourceError::new(
                crate::shards::object::source::kind_of(&e),
                src.shard(),
                start,
                len as usize,
            )
            .with_source(e)
        })?;
        add(&STATS.window_chunks, 1);
        add(&self.fetched, len);
        let mut w = self.windows.lock().unwrap_or_else(|e| e.into_inner());
        for ((a, b), n) in chosen {
            w.keep(
                (key, a, b),
                &buf[(a - start) as usize..(b - start) as usize],
                n,
            );
        }
        drop(w);
        *kept = Some(buf);
        Ok(true)
    }

    /// Whether chunk `p` (`len` bytes) is to be fetched here: admitted and reserved, admitted by
    /// another read of this process (wait for that fetch), or not to be cached.
    fn admission(
        &self,
        src: &ObjectSource,
        idx: u64,
        p: &Path,
        len: u64,
        want: Want,
    ) -> Admission<'_> {
        // Decided and reserved under one lock: reads at once do not all admit into the same room.
        let _one = self.admitting.lock().unwrap_or_else(|e| e.into_inner());
        if lock_set(&self.fetching).contains(p) {
            Admission::Wait
        } else if self.admits(src, idx, p, len, want) {
            Admission::Fetch(Reservation::new(self, p, len + 64))
        } else {
            Admission::Bypass
        }
    }

    /// Writes chunk `p` fetched whole (`buf`), under the cache lock the caller holds, after making
    /// room for it; `false` (its bytes put in `kept`, the cache bypassed) when it cannot be kept.
    fn store_fetched(
        &self,
        p: &Path,
        buf: Vec<u8>,
        next: NextUse,
        prefetch: bool,
        kept: &mut Option<Vec<u8>>,
    ) -> bool {
        // The reservation (`len + 64`, counted as used) stands for the chunk until it is written:
        // room is made for nothing more, and no admission meanwhile sees the room free.
        if !self.make_room(0, p, next) {
            add(&STATS.cache_bypassed, 1);
            *kept = Some(buf);
            return false;
        }
        if let Err(e) = self.write_chunk(p, &buf) {
            // A cache that cannot take the chunk (its disk full, a directory in the chunk's
            // place, the directory made read-only): the read is served from the bytes fetched,
            // the cache bypassed, and the run goes on, recorded.
            if !prefetch {
                add(&STATS.cache_bypassed, 1);
            }
            // Its sidecar, if written, names no chunk: not left to count against the bound.
            let _ = std::fs::remove_file(p.with_extension("crc"));
            ubdirect_ub::fallback::record(
                "object_cache_write_failed",
                format!(
                    "{}: {e}: served from the bytes fetched, not cached",
                    p.display()
                ),
            );
            *kept = Some(buf);
            return false;
        }
        true
    }
}

/// What a read of a chunk not present does ([`ChunkCache::admission`]).
enum Admission<'a> {
    /// Fetches it, its room reserved.
    Fetch(Reservation<'a>),
    /// Waits for the fetch another read of this process admitted.
    Wait,
    /// Reads its bytes straight from the store.
    Bypass,
}

/// An exclusive `flock` on `path` ([`lock`]) taken by `until`; the error to fail with (a timeout
/// saying `late`, or the lock's I/O error) when not.
async fn held(
    path: &Path,
    until: Instant,
    late: &'static str,
) -> Result<File, (SourceErrorKind, Box<dyn std::error::Error + Send + Sync>)> {
    match lock(path, until).await {
        Ok(Some(f)) => Ok(f),
        Ok(None) => Err((SourceErrorKind::Timeout, late.into())),
        Err(e) => Err((SourceErrorKind::Io, Box::new(e))),
    }
}
