//! The cache's directory: chunk names, chunk files and their sidecars (written whole, renamed into
//! place, naming the chunk's length, inode and ctime), use marked on the sidecar, and the choice
//! of what to evict (by the plan's next use, then the least recently used).

use super::*;

/// The cache key and chunk index of a chunk file's name (`{key:016x}-{idx:08}.chunk`).
pub(super) fn parse_chunk_name(name: &str) -> Option<(u64, u64)> {
    let stem = name.strip_suffix(".chunk")?;
    let (k, i) = stem.split_once('-')?;
    Some((u64::from_str_radix(k, 16).ok()?, i.parse().ok()?))
}

/// The cache key of an object named `shard`, of `size` bytes and entity tag `etag` (its chunk files'
/// names begin with it): a changed object is another entry.
pub(crate) fn cache_key(shard: &str, size: u64, etag: Option<&str>) -> u64 {
    fnv64(&[shard, &size.to_string(), etag.unwrap_or("")])
}

pub(super) fn fnv64(parts: &[&str]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for b in p.bytes().chain([0u8]) {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// Sets a chunk's access and modification times to now, on the path itself (`utimensat` with
/// `AT_SYMLINK_NOFOLLOW` and `UTIME_NOW`): nothing is opened, so a FIFO in the chunk's place is not
/// waited on, a link is not followed, and another user's chunk on a shared node is touched where
/// write permission allows (explicit times would need its owner). A failure only leaves the chunk
/// looking older to the eviction.
pub(super) fn touch_now(p: &Path) {
    use nix::sys::stat::{UtimensatFlags, utimensat};
    use nix::sys::time::TimeSpec;
    let _ = utimensat(
        nix::fcntl::AT_FDCWD,
        p,
        &TimeSpec::UTIME_NOW,
        &TimeSpec::UTIME_NOW,
        UtimensatFlags::NoFollowSymlink,
    );
}

/// A chunk file of the directory, as eviction sees it.
pub(super) struct Resident {
    pub(super) path: PathBuf,
    /// Its bytes and its sidecar's.
    pub(super) bytes: u64,
    pub(super) mtime: SystemTime,
    pub(super) next: NextUse,
}

/// Whether chunk `p`'s sidecar names it: its length `len` and its inode `ino` (written by a writer
/// that computed the CRC from the bytes it wrote to that inode). A sidecar of an older writer (no
/// inode) names nothing.
///
/// And its ctime (since 2026-12-05): a chunk rewritten in place keeps its inode and length — and
/// its mtime, if put back — but not its ctime, which the sidecar records after the chunk was renamed
/// into place (the use a chunk's eviction order needs is marked on the sidecar, so nothing of
/// ubdirect's changes a chunk's ctime). A sidecar without it names nothing: the chunk's CRC is
/// checked.
pub(super) fn names_this_file(p: &Path, len: u64, ino: u64) -> bool {
    use std::os::unix::fs::MetadataExt;
    let Ok(side) = crate::formats::read_regular(&p.with_extension("crc"), 96) else {
        return false;
    };
    let Ok(m) = std::fs::symlink_metadata(p) else {
        return false;
    };
    let side = String::from_utf8_lossy(&side);
    let f: Vec<&str> = side.split_whitespace().collect();
    let [l, _crc, i, cs, cns] = f[..] else {
        return false;
    };
    l.parse::<u64>().ok() == Some(len)
        && i.parse::<u64>().ok() == Some(ino)
        && m.ino() == ino
        && cs.parse::<i64>().ok() == Some(m.ctime())
        && cns.parse::<i64>().ok() == Some(m.ctime_nsec())
}

/// The inode of chunk `p` when it holds `len` bytes whose CRC-32 its `.crc` sidecar names
/// (`"{len} {crc:08x}"`); `None` otherwise. Both are read as regular files only, within their sizes:
/// the cache directory is shared, and a FIFO or device in a sidecar's or chunk's place must not block
/// or flood a read. The chunk is read in 1 MiB pieces (no buffer of its size).
pub(super) fn matches_sidecar(p: &Path, len: u64) -> Option<u64> {
    use std::io::Read;
    let side = crate::formats::read_regular(&p.with_extension("crc"), 64).ok()?;
    let side = String::from_utf8_lossy(&side);
    let mut it = side.split_whitespace();
    let (l, c) = (it.next()?, it.next()?);
    if l.parse::<u64>().ok() != Some(len) {
        return None;
    }
    let want = u32::from_str_radix(c, 16).ok()?;
    let (f, size) = crate::formats::open_regular(p).ok()?;
    if size != len {
        return None;
    }
    let ino = f.metadata().ok()?.ino();
    let mut h = crc32fast::Hasher::new();
    let mut buf = vec![0u8; (1 << 20).min(len as usize)];
    let mut f = f.take(len);
    let mut got = 0u64;
    loop {
        match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                h.update(&buf[..n]);
                got += n as u64;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return None,
        }
    }
    (got == len && h.finalize() == want).then_some(ino)
}

impl ChunkCache {
    pub(super) fn key_of(src: &ObjectSource) -> u64 {
        src.cache_key()
    }

    pub(super) fn chunk_path(&self, src: &ObjectSource, idx: u64) -> PathBuf {
        let key = Self::key_of(src);
        self.dir.join(format!("{key:016x}-{idx:08}.chunk"))
    }

    pub(super) fn chunk_len(&self, src: &ObjectSource, idx: u64) -> u64 {
        let start = idx * self.chunk_size;
        self.chunk_size.min(src.size() - start)
    }

    /// Writes `data` as the chunk `p`: the data to a new file (not visible yet) and synced, then the
    /// sidecar naming its length, CRC and inode, then the data renamed into place — a reader never
    /// sees a partial chunk, and a sidecar names only the file whose bytes its CRC was computed from.
    pub(super) fn write_chunk(&self, p: &Path, data: &[u8]) -> std::io::Result<()> {
        let mut f = ubdirect_ub::NewFile::create(p)?;
        f.write_all(data)?;
        f.file().sync_data()?;
        let ino = f.file().metadata()?.ino();
        let (side, crc) = (p.with_extension("crc"), crc32fast::hash(data));
        ubdirect_ub::write_new(
            &side,
            format!("{} {crc:08x} {ino}\n", data.len()).as_bytes(),
        )?;
        f.commit()?;
        // The ctime after the rename (which sets it): with it, the sidecar names this very file to
        // other processes ([`names_this_file`]); until then they check the chunk's CRC.
        if let Ok(m) = std::fs::symlink_metadata(p)
            && m.ino() == ino
        {
            let line = format!(
                "{} {crc:08x} {ino} {} {}\n",
                data.len(),
                m.ctime(),
                m.ctime_nsec()
            );
            ubdirect_ub::write_new(&side, line.as_bytes())?;
        }
        // The inode written, not whatever the path names a moment later.
        if let Ok(mut v) = self.verified.lock() {
            v.insert(p.to_path_buf(), ino);
        }
        Ok(())
    }

    /// The chunks to evict so that `need` more bytes fit, for a chunk used next at `next`: never
    /// used again first, then unknown to the plan (least recently used first), then the farthest
    /// next use first, each only while it is used later than `next` (any, for an unplanned chunk);
    /// never `keep`. `None`: they cannot be made to fit. `sweep` removes leftovers of writers that
    /// died (under the directory lock only).
    pub(super) fn victims(
        &self,
        need: u64,
        keep: &Path,
        next: NextUse,
        sweep: bool,
    ) -> Option<Vec<Resident>> {
        let rd = std::fs::read_dir(&self.dir).ok()?;
        let now = self.now();
        let mut used = self.reserved.load(Ordering::Relaxed);
        let mut chunks = Vec::new();
        for e in rd.flatten() {
            let Ok(m) = e.metadata() else { continue };
            if !m.is_file() {
                continue;
            }
            let p = e.path();
            let name = e.file_name();
            let name = name.to_string_lossy();
            // Leftovers of a process that died while writing (older than a minute).
            if sweep
                && name.starts_with(".tmp-")
                && m.modified()
                    .ok()
                    .and_then(|t| t.elapsed().ok())
                    .is_some_and(|a| a > Duration::from_secs(60))
            {
                let _ = std::fs::remove_file(&p);
                continue;
            }
            used += m.len();
            if let Some((key, idx)) = parse_chunk_name(&name)
                && p != keep
            {
                // Last used: the sidecar's mtime (what `touch` marks), else the chunk's.
                let side = std::fs::metadata(p.with_extension("crc")).ok();
                let used_at = side
                    .as_ref()
                    .and_then(|s| s.modified().ok())
                    .or_else(|| m.modified().ok());
                let side = side.map_or(0, |s| s.len());
                chunks.push(Resident {
                    next: self.plan().next_use(key, idx, now),
                    mtime: used_at.unwrap_or(SystemTime::UNIX_EPOCH),
                    path: p,
                    bytes: m.len() + side,
                });
            }
        }
        let keys: Vec<(NextUse, SystemTime, u64)> =
            chunks.iter().map(|c| (c.next, c.mtime, c.bytes)).collect();
        let picked = super::super::plan::choose_victims(&keys, used, need, self.max_bytes, next)?;
        let mut chunks: Vec<Option<Resident>> = chunks.into_iter().map(Some).collect();
        Some(
            picked
                .into_iter()
                .filter_map(|i| chunks[i].take())
                .collect(),
        )
    }

    /// Evicts [`Self::victims`] so that `need` more bytes fit; false if they cannot. Called under
    /// the directory lock.
    pub(super) fn make_room(&self, need: u64, keep: &Path, next: NextUse) -> bool {
        let Some(out) = self.victims(need, keep, next, true) else {
            return false;
        };
        for c in out {
            // Its descriptor would keep the evicted blocks.
            self.open
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&c.path);
            let _ = std::fs::remove_file(&c.path);
            let _ = std::fs::remove_file(c.path.with_extension("crc"));
            add(&STATS.chunks_evicted, 1);
        }
        true
    }
}
