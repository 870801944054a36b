//! Arrays of index files ubdirect writes beside a dataset (the GPT index cache, the samples cache)
//! read where they lie: the file is mapped (or, for tests and fuzzing, held as bytes) and each entry
//! is read by position, so a cached start costs one check pass over the file and no copy of its
//! arrays (Megatron-Core maps its `.npy` index files the same way). A mapping is read by atomic
//! copies, never lent out as a slice (`formats/sys.rs`); passes over a whole array use `pread`.

use std::sync::Arc;

use std::ops::Range;

use super::sys::ReadOnlyMap;

/// The bytes of a cache file: mapped, or held.
#[derive(Debug)]
pub(crate) enum CacheBytes {
    /// A read-only mapping of the whole file (entries read at random) and the file (arrays read in
    /// bulk with `pread`: a pass over the file leaves none of it resident in this process).
    Mapped(ReadOnlyMap, std::fs::File),
    /// The bytes (tests, fuzzing).
    Owned(Vec<u8>),
}

impl CacheBytes {
    /// Maps `file` of `size` bytes, for random access.
    pub fn map(file: std::fs::File, size: u64) -> std::io::Result<Self> {
        let m = ReadOnlyMap::map(&file, size)?;
        m.advise_random();
        Ok(CacheBytes::Mapped(m, file))
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        match self {
            CacheBytes::Mapped(m, _) => m.len(),
            CacheBytes::Owned(v) => v.len(),
        }
    }

    /// Copies the bytes at `at` into `dst`; `false` when they are not all there (a mapped file:
    /// read with `pread`, inside the size it was mapped at).
    pub fn read(&self, at: usize, dst: &mut [u8]) -> bool {
        match self {
            CacheBytes::Mapped(m, f) => {
                at.checked_add(dst.len()).is_some_and(|e| e <= m.len())
                    && std::os::unix::fs::FileExt::read_exact_at(f, dst, at as u64).is_ok()
            }
            CacheBytes::Owned(v) => match at.checked_add(dst.len()).and_then(|e| v.get(at..e)) {
                Some(s) => {
                    dst.copy_from_slice(s);
                    true
                }
                None => false,
            },
        }
    }

    /// Drops the mapped pages wholly inside bytes `range` from this process's page tables (they
    /// come back from the page cache when read again): a check that reads the file once does not
    /// leave it resident. Held bytes are kept.
    pub fn release(&self, range: std::ops::Range<usize>) {
        if let CacheBytes::Mapped(m, _) = self {
            m.release(range);
        }
    }

    #[inline]
    pub(crate) fn small<const N: usize>(&self, at: usize) -> Option<[u8; N]> {
        match self {
            CacheBytes::Mapped(m, _) => m.small::<N>(at),
            CacheBytes::Owned(v) => {
                let s = v.get(at..at.checked_add(N)?)?;
                let mut b = [0u8; N];
                b.copy_from_slice(s);
                Some(b)
            }
        }
    }
}

/// `len` little-endian integers of `width` (4 or 8) bytes at byte `at` of a cache file.
#[derive(Clone)]
pub struct Ints {
    bytes: Arc<CacheBytes>,
    at: usize,
    len: usize,
    width: usize,
}

impl std::fmt::Debug for Ints {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ints")
            .field("at", &self.at)
            .field("len", &self.len)
            .field("width", &self.width)
            .finish()
    }
}

impl Ints {
    /// The array, which must lie inside `bytes` (`None` otherwise, or for a width other than 4 or 8).
    pub(crate) fn new(bytes: Arc<CacheBytes>, at: usize, len: usize, width: usize) -> Option<Self> {
        let end = len.checked_mul(width)?.checked_add(at)?;
        (matches!(width, 4 | 8) && end <= bytes.len()).then_some(Ints {
            bytes,
            at,
            len,
            width,
        })
    }

    /// Entries.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes per entry.
    pub fn width(&self) -> usize {
        self.width
    }

    /// Releases the pages of entries `r` ([`CacheBytes::release`]).
    pub fn release(&self, r: std::ops::Range<usize>) {
        let (a, b) = (r.start.min(self.len), r.end.min(self.len));
        self.bytes
            .release(self.at + a * self.width..self.at + b * self.width);
    }

    /// Entry `i` (zero-extended to `u64`).
    #[inline]
    pub fn get(&self, i: usize) -> Option<u64> {
        if i >= self.len {
            return None;
        }
        let at = self.at + i * self.width;
        if self.width == 4 {
            self.bytes
                .small::<4>(at)
                .map(|b| u32::from_le_bytes(b) as u64)
        } else {
            self.bytes.small::<8>(at).map(u64::from_le_bytes)
        }
    }

    /// Entries `first..first + out.len()` into `out`, read in bulk (a mapping's aligned words at
    /// a time, not an atomic load per entry); `false` when they are not all there.
    pub fn fill(&self, first: usize, out: &mut [u64]) -> bool {
        const PIECE: usize = 1 << 12;
        if first.checked_add(out.len()).is_none_or(|e| e > self.len) {
            return false;
        }
        // A few entries (a stride of a document order) on a small buffer: zeroing 32 KiB for each
        // of 10⁶ calls was most of a start.
        let mut small = [0u8; 512];
        let mut large = Vec::new();
        let buf: &mut [u8] = if out.len() * self.width <= small.len() {
            &mut small
        } else {
            large.resize(8 * PIECE.min(out.len()), 0);
            &mut large
        };
        for (k, chunk) in out.chunks_mut(PIECE).enumerate() {
            let b = &mut buf[..chunk.len() * self.width];
            if !self
                .bytes
                .read(self.at + (first + k * PIECE) * self.width, b)
            {
                return false;
            }
            if self.width == 4 {
                for (o, c) in chunk.iter_mut().zip(b.chunks_exact(4)) {
                    *o = u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as u64;
                }
            } else {
                for (o, c) in chunk.iter_mut().zip(b.chunks_exact(8)) {
                    *o = u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
                }
            }
        }
        true
    }

    /// Entry `i` of an 8-byte array read as two little-endian `u32`s (a sample index's pair).
    #[inline]
    pub fn pair(&self, i: usize) -> Option<(u32, u32)> {
        if i >= self.len || self.width != 8 {
            return None;
        }
        let b = self.bytes.small::<8>(self.at + i * 8)?;
        Some((
            u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
        ))
    }
}

/// Threads a pass over `n` entries uses: one per 2²⁰ entries, at most the cores (and 16).
pub(crate) fn threads(n: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    cores.min(16).min(n.div_ceil(1 << 20)).max(1)
}

/// Runs `f` over `0..n` cut into one range per thread; the results in range order, or the error of
/// the lowest range that failed (each range reports its first), so the error is the one a single
/// pass would meet first.
pub(crate) fn par_ranges<T: Send, E: Send>(
    n: usize,
    f: impl Fn(Range<usize>) -> Result<T, E> + Sync,
) -> Result<Vec<T>, E> {
    par_ranges_on(threads(n), n, f)
}

/// [`par_ranges`] on `t` threads.
pub(crate) fn par_ranges_on<T: Send, E: Send>(
    t: usize,
    n: usize,
    f: impl Fn(Range<usize>) -> Result<T, E> + Sync,
) -> Result<Vec<T>, E> {
    let t = t.clamp(1, n.max(1));
    if t == 1 {
        return Ok(vec![f(0..n)?]);
    }
    let per = n.div_ceil(t);
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..t)
            .map(|k| s.spawn(move || f(k * per..((k + 1) * per).min(n))))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}

/// CRC-32 of bytes `range` of `b`, read in 1 MiB pieces (with `pread` when `b` is a file) on
/// every core and combined in order; `None` when the range is not all there.
pub(crate) fn crc32_of(b: &CacheBytes, range: Range<usize>) -> Option<crc32fast::Hasher> {
    const PIECE: usize = 1 << 20;
    let pieces = range.end.saturating_sub(range.start).div_ceil(PIECE);
    let parts = par_ranges(pieces, |r| {
        let mut h = crc32fast::Hasher::new();
        let mut buf = vec![0u8; PIECE];
        for k in r {
            let at = range.start + k * PIECE;
            let n = PIECE.min(range.end - at);
            if !b.read(at, &mut buf[..n]) {
                return Err(());
            }
            h.update(&buf[..n]);
        }
        Ok(h)
    })
    .ok()?;
    let mut all = crc32fast::Hasher::new();
    for p in &parts {
        all.combine(p);
    }
    Some(all)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_read_at_their_offsets_and_nothing_past_the_end() {
        let mut b = vec![0u8; 4];
        for i in 0..10u32 {
            b.extend_from_slice(&(i * 3).to_le_bytes());
            b.extend_from_slice(&(i + 100).to_le_bytes());
        }
        let bytes = Arc::new(CacheBytes::Owned(b));
        let pairs = Ints::new(bytes.clone(), 4, 10, 8).unwrap_or_else(|| panic!("fits"));
        assert_eq!(pairs.pair(3), Some((9, 103)));
        assert_eq!(pairs.pair(10), None);
        let words = Ints::new(bytes.clone(), 4, 20, 4).unwrap_or_else(|| panic!("fits"));
        assert_eq!(words.get(19), Some(109));
        assert!(Ints::new(bytes.clone(), 4, 11, 8).is_none(), "past the end");
        assert!(Ints::new(bytes, 0, 1, 2).is_none(), "width 2");
    }
}
