//! The one index every format produces: shards and, for every sample, where its bytes are.

use std::path::PathBuf;
use std::sync::Arc;

use super::megatron_idx::MegatronIdx;

/// One file holding sample bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shard {
    /// The file the bytes are read from (`.bin` for Megatron datasets).
    pub path: PathBuf,
    /// Its size in bytes when the index was built.
    pub size: u64,
}

/// Where one sample's bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SampleLoc {
    /// Index into [`DatasetIndex::shards`].
    pub shard: u32,
    /// Byte offset in the shard.
    pub offset: u64,
    /// Byte length.
    pub len: u32,
}

/// Every sample's location: a vector (most formats), read in place from mapped Megatron `.idx`
/// files (no copy per sequence), or arithmetic over fixed-size records (raw: one entry per shard,
/// nothing per sample). Indexing is by value: `loc(i)` / `get(i)` / `iter()`.
#[derive(Clone, Default)]
pub struct Samples(Repr);

#[derive(Clone)]
enum Repr {
    Owned(Vec<SampleLoc>),
    Megatron(Arc<MegatronShards>),
    Fixed(Arc<FixedRuns>),
    Table(Arc<SampleTable>),
}

/// Samples read in place from a samples cache file ([`super::samples_cache`], checked when it was
/// mapped): entry `i` is 16 bytes (offset `u64`, length `u32`, 0) at byte `at + 16 i`.
pub struct SampleTable {
    pub(crate) bytes: Arc<super::mapped::CacheBytes>,
    pub(crate) at: usize,
    /// Each shard's first sample, and the total at the end.
    pub(crate) starts: Vec<u64>,
    /// The shard sizes the entries were checked against.
    pub(crate) sizes: Vec<u64>,
    /// The file's CRC-32 (the fingerprint's digest).
    pub(crate) crc: u32,
}

impl std::fmt::Debug for SampleTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SampleTable")
            .field("shards", &self.sizes.len())
            .field("samples", &self.starts.last())
            .finish()
    }
}

/// Fixed-size records, shard after shard: run `k` holds `count` records of `len` bytes of shard
/// `shard` from offset `bases[k]` (0 for raw records, the header's end for `.npy` rows); `starts[k]`
/// is its first sample id (and the total at the end).
#[derive(Debug)]
struct FixedRuns {
    runs: Vec<(u32, u32, u64)>,
    bases: Vec<u64>,
    starts: Vec<u64>,
}

impl FixedRuns {
    /// The run holding sample `i` (`i` below the total): a guess from the first run's length (runs
    /// of equal counts, the usual layout, are found at once), else a binary search.
    #[inline]
    fn run_of(&self, i: u64) -> usize {
        let per = self.starts.get(1).copied().unwrap_or(0);
        if let Some(q) = i.checked_div(per) {
            let k = (q as usize).min(self.runs.len().saturating_sub(1));
            if self.starts[k] <= i && i < self.starts[k + 1] {
                return k;
            }
        }
        self.starts.partition_point(|&b| b <= i) - 1
    }
}

impl Default for Repr {
    fn default() -> Self {
        Repr::Owned(Vec::new())
    }
}

/// Mapped `.idx` files, shard after shard.
#[derive(Debug)]
struct MegatronShards {
    files: Vec<Arc<MegatronIdx>>,
    /// First sample id of each shard, and the total at the end.
    starts: Vec<usize>,
}

impl Samples {
    /// The samples of Megatron shards (shard `i` = `files[i]`), read in place.
    pub fn megatron(files: Vec<Arc<MegatronIdx>>) -> Self {
        let mut starts = Vec::with_capacity(files.len() + 1);
        starts.push(0);
        for f in &files {
            starts.push(starts.last().copied().unwrap_or(0) + f.sequences());
        }
        Samples(Repr::Megatron(Arc::new(MegatronShards { files, starts })))
    }

    /// Fixed-size records: `(shard, record bytes, records)` per run, shard after shard, each from
    /// its shard's offset 0. O(runs) memory, whatever the number of records.
    pub fn fixed(runs: Vec<(u32, u32, u64)>) -> Self {
        let bases = vec![0; runs.len()];
        Self::fixed_at(runs, bases)
    }

    /// Fixed-size records as [`Samples::fixed`], run `k` starting at byte `bases[k]` of its shard
    /// (`.npy` rows after the header). Missing bases are 0.
    pub fn fixed_at(runs: Vec<(u32, u32, u64)>, mut bases: Vec<u64>) -> Self {
        let mut starts = Vec::with_capacity(runs.len() + 1);
        starts.push(0u64);
        for r in &runs {
            starts.push(starts.last().copied().unwrap_or(0) + r.2);
        }
        bases.resize(runs.len(), 0);
        Samples(Repr::Fixed(Arc::new(FixedRuns {
            runs,
            bases,
            starts,
        })))
    }

    /// Samples read in place from a checked samples cache file.
    pub(crate) fn table(t: SampleTable) -> Self {
        Samples(Repr::Table(Arc::new(t)))
    }

    /// Whether the samples are read in place from a samples cache file (not held in memory).
    pub fn is_table(&self) -> bool {
        matches!(self.0, Repr::Table(_))
    }

    /// Runs of equal-size samples, as (first id, count, bytes per sample), when the samples are
    /// fixed-size records ([`Samples::fixed`]); `None` otherwise.
    pub fn fixed_runs(&self) -> Option<Vec<(u64, u64, u64)>> {
        match &self.0 {
            Repr::Fixed(f) => Some(
                f.runs
                    .iter()
                    .zip(&f.starts)
                    .map(|(&(_, len, count), &first)| (first, count, len as u64))
                    .collect(),
            ),
            _ => None,
        }
    }

    /// Total bytes of the samples, and the largest: O(runs) for fixed-size records.
    pub fn bytes_and_max(&self) -> (u64, u32) {
        match &self.0 {
            Repr::Fixed(f) => f.runs.iter().fold((0, 0), |(b, m), &(_, len, count)| {
                (
                    b + len as u64 * count,
                    if count > 0 { m.max(len) } else { m },
                )
            }),
            _ => self
                .iter()
                .fold((0, 0), |(b, m), s| (b + s.len as u64, m.max(s.len))),
        }
    }

    /// Samples.
    pub fn len(&self) -> usize {
        match &self.0 {
            Repr::Owned(v) => v.len(),
            Repr::Megatron(m) => m.starts.last().copied().unwrap_or(0),
            Repr::Fixed(f) => f.starts.last().copied().unwrap_or(0) as usize,
            Repr::Table(t) => t.starts.last().copied().unwrap_or(0) as usize,
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Sample `i`, if there is one.
    #[inline]
    pub fn get(&self, i: usize) -> Option<SampleLoc> {
        match &self.0 {
            Repr::Owned(v) => v.get(i).copied(),
            Repr::Megatron(m) => {
                if i >= self.len() {
                    return None;
                }
                let s = if m.files.len() == 1 {
                    0
                } else {
                    m.starts.partition_point(|&b| b <= i) - 1
                };
                Some(m.files[s].loc(s as u32, i - m.starts[s]))
            }
            Repr::Fixed(f) => {
                let i = i as u64;
                if i >= f.starts.last().copied().unwrap_or(0) {
                    return None;
                }
                let k = f.run_of(i);
                let (shard, len, _) = f.runs[k];
                Some(SampleLoc {
                    shard,
                    offset: f.bases[k] + (i - f.starts[k]) * len as u64,
                    len,
                })
            }
            Repr::Table(t) => {
                let i = i as u64;
                if i >= t.starts.last().copied().unwrap_or(0) {
                    return None;
                }
                let s = t.starts.partition_point(|&b| b <= i) - 1;
                let at = t.at + 16 * i as usize;
                Some(SampleLoc {
                    shard: s as u32,
                    offset: u64::from_le_bytes(t.bytes.small::<8>(at)?),
                    len: u32::from_le_bytes(t.bytes.small::<4>(at + 8)?),
                })
            }
        }
    }

    /// Sample `i`.
    ///
    /// # Panics
    /// If `i >= len()`, as slice indexing does (ids come from the planner, which draws them below
    /// `len()`).
    #[inline]
    pub fn loc(&self, i: usize) -> SampleLoc {
        match self.get(i) {
            Some(l) => l,
            None => panic!("sample {i} of {}", self.len()),
        }
    }

    /// The samples in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = SampleLoc> + '_ {
        (0..self.len()).map(move |i| self.loc(i))
    }

    /// The mapped `.idx` holding samples `range` when it is exactly one Megatron shard.
    pub fn megatron_file(&self, range: std::ops::Range<usize>) -> Option<&Arc<MegatronIdx>> {
        let Repr::Megatron(m) = &self.0 else {
            return None;
        };
        let s = m.starts.iter().position(|&b| b == range.start)?;
        (m.starts.get(s + 1) == Some(&range.end)).then(|| &m.files[s])
    }

    /// The `.idx` files these samples are read from, shard by shard (Megatron shards), whether
    /// mapped (local) or read through the shard's opener (`ub://`, object stores).
    pub fn megatron_files(&self) -> Option<&[Arc<MegatronIdx>]> {
        match &self.0 {
            Repr::Megatron(m) => Some(&m.files),
            Repr::Owned(_) | Repr::Fixed(_) | Repr::Table(_) => None,
        }
    }

    /// A vector of the samples (copied from a mapping).
    pub fn to_vec(&self) -> Vec<SampleLoc> {
        match &self.0 {
            Repr::Owned(v) => v.clone(),
            Repr::Megatron(_) | Repr::Fixed(_) | Repr::Table(_) => self.iter().collect(),
        }
    }

    /// The vector, copied out of mapped files first.
    fn owned(&mut self) -> &mut Vec<SampleLoc> {
        if !matches!(self.0, Repr::Owned(_)) {
            self.0 = Repr::Owned(self.to_vec());
        }
        match &mut self.0 {
            Repr::Owned(v) => v,
            Repr::Megatron(_) | Repr::Fixed(_) | Repr::Table(_) => unreachable!("converted above"),
        }
    }

    /// Appends a sample.
    pub fn push(&mut self, s: SampleLoc) {
        self.owned().push(s);
    }

    /// Reserves room for `n` more (see `Vec::try_reserve`).
    pub fn try_reserve(&mut self, n: usize) -> Result<(), std::collections::TryReserveError> {
        self.owned().try_reserve(n)
    }
}

impl Extend<SampleLoc> for Samples {
    fn extend<T: IntoIterator<Item = SampleLoc>>(&mut self, iter: T) {
        self.owned().extend(iter);
    }
}

impl From<Vec<SampleLoc>> for Samples {
    fn from(v: Vec<SampleLoc>) -> Self {
        Samples(Repr::Owned(v))
    }
}

impl PartialEq for Samples {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}

impl Eq for Samples {}

impl std::fmt::Debug for Samples {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Repr::Owned(v) => f.debug_list().entries(v.iter().take(16)).finish(),
            Repr::Megatron(m) => f
                .debug_struct("Samples")
                .field("megatron_idx_files", &m.files.len())
                .field("len", &self.len())
                .finish(),
            Repr::Fixed(x) => f
                .debug_struct("Samples")
                .field("fixed_runs", &x.runs.len())
                .field("len", &self.len())
                .finish(),
            Repr::Table(t) => t.fmt(f),
        }
    }
}

impl<'a> IntoIterator for &'a Samples {
    type Item = SampleLoc;
    type IntoIter = Box<dyn Iterator<Item = SampleLoc> + 'a>;
    fn into_iter(self) -> Self::IntoIter {
        Box::new(self.iter())
    }
}

/// A dataset: shards and samples. Sample ids are positions in `samples`, which is in file order
/// (shard by shard, offsets ascending within a shard).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DatasetIndex {
    /// Format name (`raw`, `megatron`, `npy`, `arrow`).
    pub format: String,
    /// Shards, in configuration order.
    pub shards: Vec<Shard>,
    /// Samples, in file order.
    pub samples: Samples,
}

impl DatasetIndex {
    /// Total sample bytes.
    pub fn sample_bytes(&self) -> u64 {
        self.samples.bytes_and_max().0
    }

    /// The largest sample.
    pub fn max_sample_len(&self) -> u32 {
        self.samples.bytes_and_max().1
    }

    /// Checks that every sample lies inside its shard and that samples are in file order.
    pub fn validate(&self) -> Result<(), super::FormatError> {
        self.check().map_err(super::FormatError::Config)
    }

    fn check(&self) -> Result<(), String> {
        if let Repr::Fixed(f) = &self.samples.0 {
            // Records from offset 0, shard after shard: each run within its shard.
            let mut prev = None;
            for (&(shard, len, count), &base) in f.runs.iter().zip(&f.bases) {
                let s = self
                    .shards
                    .get(shard as usize)
                    .ok_or_else(|| format!("a run names shard {shard} of {}", self.shards.len()))?;
                if (len as u64)
                    .checked_mul(count)
                    .and_then(|e| e.checked_add(base))
                    .is_none_or(|e| e > s.size)
                {
                    return Err(format!(
                        "{count} records of {len} bytes from offset {base} point past the end of {} ({} bytes)",
                        s.path.display(),
                        s.size
                    ));
                }
                if prev.is_some_and(|p| p >= shard) {
                    return Err(format!("the run of shard {shard} is out of file order"));
                }
                prev = Some(shard);
            }
            return Ok(());
        }
        if let Repr::Megatron(m) = &self.samples.0
            && m.files.len() == self.shards.len()
            && m.files
                .iter()
                .zip(&self.shards)
                .all(|(f, s)| f.checked().is_some_and(|c| c.bin_size == s.size))
        {
            // Every `.idx` was checked against its `.bin` at this size, sequence by sequence
            // (inside the file, in file order, no overlap), and shards follow each other.
            return Ok(());
        }
        if let Repr::Table(t) = &self.samples.0
            && t.sizes.len() == self.shards.len()
            && t.sizes.iter().zip(&self.shards).all(|(&a, s)| a == s.size)
        {
            // Every entry was checked against these shard sizes when the file was mapped.
            return Ok(());
        }
        let mut prev: Option<SampleLoc> = None;
        for (i, s) in self.samples.iter().enumerate() {
            let shard = self.shards.get(s.shard as usize).ok_or_else(|| {
                format!(
                    "sample {i} names shard {} of {}",
                    s.shard,
                    self.shards.len()
                )
            })?;
            let end = s.offset.checked_add(s.len as u64);
            if end.is_none_or(|e| e > shard.size) {
                return Err(format!(
                    "sample {i} at {}+{} points past the end of {} ({} bytes)",
                    s.offset,
                    s.len,
                    shard.path.display(),
                    shard.size
                ));
            }
            if let Some(p) = prev
                && (p.shard > s.shard || (p.shard == s.shard && p.offset > s.offset))
            {
                return Err(format!("sample {i} is out of file order"));
            }
            prev = Some(s);
        }
        Ok(())
    }

    /// A stable fingerprint of the index (shards, sizes, sample locations), for resume checks.
    pub fn fingerprint(&self) -> u64 {
        let mut h = crate::hash::Fnv::new();
        h.write(self.format.as_bytes());
        for s in &self.shards {
            h.write(s.path.as_os_str().as_encoded_bytes());
            h.write(&s.size.to_le_bytes());
        }
        if let Repr::Fixed(f) = &self.samples.0 {
            // Fixed-size records: the runs say where every sample is (O(shards), not O(samples)).
            h.write(b"fixed");
            for (&(shard, len, count), &base) in f.runs.iter().zip(&f.bases) {
                h.write(&shard.to_le_bytes());
                h.write(&len.to_le_bytes());
                h.write(&count.to_le_bytes());
                // Raw records start at 0 (their fingerprint as before bases existed).
                if base != 0 {
                    h.write(&base.to_le_bytes());
                }
            }
            return h.finish();
        }
        // Samples held or mapped from a samples cache: the CRC-32 of the table (its file's, O(shards)
        // when mapped) and the shard starts, so a state saved over either names the other.
        let table = match &self.samples.0 {
            Repr::Table(t) => Some((t.crc, t.starts.clone())),
            Repr::Owned(_) => digest(self.shards.len(), &self.samples),
            Repr::Megatron(_) | Repr::Fixed(_) => None,
        };
        if let Some((crc, starts)) = table {
            h.write(b"samples-table");
            h.write(&crc.to_le_bytes());
            for s in &starts {
                h.write(&s.to_le_bytes());
            }
            return h.finish();
        }
        if let Repr::Megatron(m) = &self.samples.0 {
            let checked: Option<Vec<_>> = m.files.iter().map(|f| f.checked()).collect();
            if let Some(checked) = checked {
                // The arrays' digests from the check's one pass (O(files), since plan version 3).
                h.write(b"megatron-idx");
                for (f, c) in m.files.iter().zip(checked) {
                    h.write(&(f.sequences() as u64).to_le_bytes());
                    h.write(&(f.dtype().size() as u64).to_le_bytes());
                    h.write(&c.lengths_crc32.to_le_bytes());
                    h.write(&c.pointers_crc32.to_le_bytes());
                }
                return h.finish();
            }
        }
        for s in self.samples.iter() {
            h.write(&s.shard.to_le_bytes());
            h.write(&s.offset.to_le_bytes());
            h.write(&s.len.to_le_bytes());
        }
        h.finish()
    }
}

impl MegatronIdx {
    /// The location of sequence `i` in its shard (`i < sequences()`, checked by [`Self::check`]).
    #[inline]
    pub fn loc(&self, shard: u32, i: usize) -> SampleLoc {
        SampleLoc {
            shard,
            offset: self.pointer(i) as u64,
            len: (self.length(i) as u64 * self.dtype().size() as u64) as u32,
        }
    }
}

// The byte form of a sample table (what a samples cache file holds after its header, and what a
// dataset's fingerprint digests, so that held and mapped tables fingerprint alike).

/// Each shard's first sample (and the total at the end) of `samples` over `shards` shards, in
/// shard order; `None` when a sample names a shard past them.
fn starts_of(shards: usize, samples: &Samples) -> Option<Vec<u64>> {
    let mut starts = vec![0u64; shards + 1];
    for s in samples.iter() {
        *starts.get_mut(s.shard as usize + 1)? += 1;
    }
    for k in 1..starts.len() {
        starts[k] += starts[k - 1];
    }
    Some(starts)
}

/// Feeds the body (`starts`, then every entry) to `out` in pieces.
pub(super) fn body(
    starts: &[u64],
    samples: &Samples,
    out: &mut dyn FnMut(&[u8]) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(1 << 16);
    for s in starts {
        buf.extend_from_slice(&s.to_le_bytes());
    }
    for s in samples.iter() {
        buf.extend_from_slice(&s.offset.to_le_bytes());
        buf.extend_from_slice(&s.len.to_le_bytes());
        buf.extend_from_slice(&[0; 4]);
        if buf.len() >= 1 << 16 {
            out(&buf)?;
            buf.clear();
        }
    }
    out(&buf)
}

/// The CRC-32 a cache file of `samples` over `shards` shards carries, and the shard starts: what a
/// dataset's fingerprint is made of whether its samples are held or mapped from a cache file.
pub fn digest(shards: usize, samples: &Samples) -> Option<(u32, Vec<u64>)> {
    let starts = starts_of(shards, samples)?;
    let mut crc = crc32fast::Hasher::new();
    crc.update(&(shards as u64).to_le_bytes());
    crc.update(&(samples.len() as u64).to_le_bytes());
    body(&starts, samples, &mut |b| {
        crc.update(b);
        Ok(())
    })
    .ok()?;
    Some((crc.finalize(), starts))
}
