//! GPT windows over documents in file order, computed by position (`order = "block"`): window `k`'s
//! start is found from a sparse prefix of the documents' token counts, not read from a sample index
//! of every window. Memory: one `u64` per [`STRIDE`] documents in file order ([`SHUFFLED_STRIDE`]
//! in a shuffled order, where each length is a random read); a lookup: one binary search and at
//! most that many sequence lengths.
//!
//! The boundaries are exactly those of `helpers.cpp: build_sample_idx` over the documents in order
//! ([`super::megatron::build_sample_index`], which the tests compare against): with the windows
//! `sequence_length` tokens apart and `extra` tokens of overlap, boundary `k ≥ 1` lies at the token
//! `t = k · sequence_length + extra − 1` that ends window `k − 1`, as `(document holding t, offset of
//! t + 1 − extra)`; boundary 0 is `(0, 0)`.

use std::ops::Range;

use super::documents::{DocumentIndex, Documents, Sizes, TokenSizes, read_sizes};
use super::{GptError, GptSamples};
use crate::formats::index::{DatasetIndex, SampleLoc};
use crate::formats::mapped::Ints;

/// Documents per prefix entry.
pub const STRIDE: usize = 64;
/// Documents per prefix entry over a shuffled document order (Megatron's).
pub const SHUFFLED_STRIDE: usize = 16;

/// Window boundaries over the documents of `order` (file order for `order = "block"`, Megatron's
/// shuffled document index for `order = "megatron"`).
#[derive(Debug, Clone)]
pub struct InOrderWindows {
    sizes: TokenSizes,
    order: DocumentIndex,
    seq: u64,
    extra: u64,
    samples: u64,
    /// Documents per prefix entry.
    stride: usize,
    /// `prefix[k]`: tokens in the documents at positions `0 .. k · stride` of `order`.
    prefix: Prefix,
}

/// The prefix of token counts: computed, or read in place from a sealed GPT index cache file.
#[derive(Debug, Clone)]
enum Prefix {
    Owned(Vec<u64>),
    Mapped(Ints),
}

impl Prefix {
    fn len(&self) -> usize {
        match self {
            Prefix::Owned(v) => v.len(),
            Prefix::Mapped(m) => m.len(),
        }
    }

    #[inline]
    fn get(&self, k: usize) -> Option<u64> {
        match self {
            Prefix::Owned(v) => v.get(k).copied(),
            Prefix::Mapped(m) => m.get(k),
        }
    }

    /// The last `k` with `prefix[k] <= t` (a binary search; over entries that do not rise, still
    /// an answer, never a panic).
    fn last_at_most(&self, t: u64) -> Option<usize> {
        if let Prefix::Owned(v) = self {
            return v.partition_point(|&p| p <= t).checked_sub(1);
        }
        let (mut lo, mut hi) = (0usize, self.len());
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if self.get(mid)? <= t {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo.checked_sub(1)
    }
}

/// Tokens of the documents at positions `0 .. k · stride` of `order`, for every `k` up to and
/// including the last (partial) stride: one pass over `order` and the lengths it names, on every
/// core.
pub fn prefix_sums(
    sizes: &TokenSizes,
    order: &DocumentIndex,
    stride: usize,
) -> Result<Vec<u64>, GptError> {
    let n = order.len();
    let stride = stride.clamp(1, STRIDE);
    let blocks = n.div_ceil(stride);
    // Each stride's tokens, then their prefix sums.
    let sums = crate::formats::mapped::par_ranges(blocks, |r| {
        let mut buf = [0i32; STRIDE];
        let mut out = Vec::with_capacity(r.len());
        for b in r {
            let first = b * stride;
            let m = (n - first).min(stride);
            if !sizes_at(sizes, order, first, &mut buf[..m]) {
                return Err(GptError::Config(format!(
                    "document positions {first}..{} name sequences past the index",
                    first + m
                )));
            }
            out.push(buf[..m].iter().map(|&x| x.max(0) as u64).sum::<u64>());
        }
        Ok(out)
    })?;
    let mut prefix = Vec::with_capacity(blocks + 1);
    let mut tokens = 0u64;
    for s in sums.iter().flatten() {
        prefix.push(tokens);
        tokens += s;
    }
    prefix.push(tokens);
    Ok(prefix)
}

/// Documents per prefix entry over `order`.
pub fn stride_of(order: &DocumentIndex) -> usize {
    if matches!(order, DocumentIndex::InOrder(_)) {
        STRIDE
    } else {
        SHUFFLED_STRIDE
    }
}

impl InOrderWindows {
    /// The windows of `sequence_length` (+ the extra token) over documents `docs` of `sizes` in
    /// file order: one pass over the documents' lengths.
    pub fn new(
        sizes: &TokenSizes,
        docs: Range<u32>,
        sequence_length: u32,
        extra: bool,
    ) -> Result<Self, GptError> {
        if docs.end as usize > sizes.count() {
            return Err(GptError::Config(format!(
                "documents {}..{} of {} sequences",
                docs.start,
                docs.end,
                sizes.count()
            )));
        }
        Self::over(sizes, DocumentIndex::InOrder(docs), sequence_length, extra)
    }

    /// The windows over the documents of `order`, in that order (Megatron's `build_sample_idx` over
    /// its document index): one pass over `order` and the lengths it names, on every core.
    pub fn over(
        sizes: &TokenSizes,
        order: DocumentIndex,
        sequence_length: u32,
        extra: bool,
    ) -> Result<Self, GptError> {
        let stride = stride_of(&order);
        let prefix = prefix_sums(sizes, &order, stride)?;
        Self::with_prefix(sizes, order, Prefix::Owned(prefix), sequence_length, extra)
    }

    /// The windows over the documents of a shuffled `order` whose prefix ([`prefix_sums`] at
    /// [`SHUFFLED_STRIDE`]) was stored beside it and is read in place: no pass over the documents.
    /// The prefix is trusted as far as its size and ends (a sealed cache file's: ubdirect wrote it);
    /// entries that were not made from `order` give wrong windows or none, never a panic.
    pub fn mapped(
        sizes: &TokenSizes,
        order: DocumentIndex,
        prefix: Ints,
        sequence_length: u32,
        extra: bool,
    ) -> Result<Self, GptError> {
        let want = order.len().div_ceil(SHUFFLED_STRIDE) + 1;
        if matches!(order, DocumentIndex::InOrder(_)) || prefix.len() != want {
            return Err(GptError::Config(format!(
                "a stored prefix of {} entries for {} shuffled documents ({want} expected)",
                prefix.len(),
                order.len()
            )));
        }
        if prefix.get(0) != Some(0) {
            return Err(GptError::Config("a stored prefix not starting at 0".into()));
        }
        Self::with_prefix(sizes, order, Prefix::Mapped(prefix), sequence_length, extra)
    }

    fn with_prefix(
        sizes: &TokenSizes,
        order: DocumentIndex,
        prefix: Prefix,
        sequence_length: u32,
        extra: bool,
    ) -> Result<Self, GptError> {
        let stride = stride_of(&order);
        let tokens = prefix.get(prefix.len().wrapping_sub(1)).unwrap_or(0);
        let (seq, extra) = (sequence_length as u64, extra as u64);
        if seq < 1 || tokens <= extra {
            return Err(GptError::Config(format!(
                "{tokens} tokens per epoch cannot make a sample of {} tokens",
                seq + extra
            )));
        }
        Ok(Self {
            sizes: sizes.clone(),
            order,
            stride,
            seq,
            extra,
            samples: (tokens - extra) / seq,
            prefix,
        })
    }

    /// Entries (windows + 1).
    pub fn len(&self) -> usize {
        self.samples as usize + 1
    }

    /// Whether there are none (never: there is always the first boundary).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Boundary `i`: (position in the documents, token offset), as `build_sample_idx` makes it.
    pub fn get(&self, i: usize) -> Option<(u32, u32)> {
        let i = i as u64;
        if i > self.samples {
            return None;
        }
        if i == 0 {
            return Some((0, 0));
        }
        let t = i * self.seq + self.extra - 1;
        let (d, off) = self.locate(t)?;
        Some((d, u32::try_from(off + 1 - self.extra).ok()?))
    }

    /// The document (a position in `docs`) holding token `t` of the concatenation, and `t`'s offset
    /// in it.
    fn locate(&self, t: u64) -> Option<(u32, u64)> {
        let k = self.prefix.last_at_most(t)?;
        let mut at = self.prefix.get(k)?;
        let first = k * self.stride;
        let n = (self.order.len().checked_sub(first)?).min(self.stride);
        let mut buf = [0i32; STRIDE];
        if !sizes_at(&self.sizes, &self.order, first, &mut buf[..n]) {
            return None;
        }
        for (j, &size) in buf[..n].iter().enumerate() {
            let size = size.max(0) as u64;
            if t < at.saturating_add(size) {
                return Some(((first + j) as u32, t.checked_sub(at)?));
            }
            at = at.saturating_add(size);
        }
        None
    }

    /// Bytes of memory held (a computed prefix; the sizes are shared, a stored prefix mapped).
    pub fn heap_bytes(&self) -> usize {
        match &self.prefix {
            Prefix::Owned(v) => v.capacity() * 8,
            Prefix::Mapped(_) => 0,
        }
    }

    /// Documents per prefix entry.
    pub fn stride(&self) -> usize {
        self.stride
    }

    /// The document order the windows run over.
    pub fn order(&self) -> &DocumentIndex {
        &self.order
    }

    /// The prefix entries (what a GPT index cache file stores), in order.
    pub fn prefix(&self) -> impl Iterator<Item = u64> + '_ {
        (0..self.prefix.len()).filter_map(|k| self.prefix.get(k))
    }
}

/// Lengths of the documents at positions `first..first + out.len()` of `order` into `out`;
/// `false` when a position or a document is not there.
fn sizes_at(sizes: &TokenSizes, order: &DocumentIndex, first: usize, out: &mut [i32]) -> bool {
    if let DocumentIndex::InOrder(r) = order {
        return first + out.len() <= r.len() && read_sizes(sizes, r.start as usize + first, out);
    }
    let mut ids = [0u64; STRIDE];
    for (k, chunk) in out.chunks_mut(STRIDE).enumerate() {
        let ids = &mut ids[..chunk.len()];
        if !order.fill(first + k * STRIDE, ids) {
            return false;
        }
        for (o, &d) in chunk.iter_mut().zip(ids.iter()) {
            if d as usize >= sizes.count() {
                return false;
            }
            *o = sizes.size(d as usize);
        }
    }
    true
}

/// The shard the first bytes of window `id` lie in (`None`: the window has no bytes).
fn first_shard(
    g: &GptSamples,
    index: &DatasetIndex,
    id: u64,
    scratch: &mut Vec<SampleLoc>,
) -> Option<u32> {
    scratch.clear();
    g.pieces(index, id, scratch);
    scratch.first().map(|l| l.shard)
}

/// Runs of windows whose first bytes lie in one shard, as (first id, windows, bytes per window),
/// in id order, when every dataset's windows run over its documents in file order (the block
/// order): a window's first shard then never decreases with its id, and each run's end is found
/// by a binary search — O(shards · log windows) pieces, not one per window. `None` otherwise.
pub fn shard_runs(g: &GptSamples, index: &DatasetIndex) -> Option<Vec<(u64, u64, u64)>> {
    if g.order.is_some() {
        return None;
    }
    let bytes = g.sample_bytes();
    let mut scratch = Vec::new();
    let mut runs = Vec::new();
    for (p, part) in g.parts.iter().enumerate() {
        if !matches!(part.indices.document_index, DocumentIndex::InOrder(_)) {
            return None;
        }
        let (mut lo, end) = (g.bases[p], g.bases[p + 1]);
        while lo < end {
            let s = first_shard(g, index, lo, &mut scratch);
            let (mut a, mut b) = (lo + 1, end);
            while a < b {
                let m = a + (b - a) / 2;
                if first_shard(g, index, m, &mut scratch) == s {
                    a = m + 1;
                } else {
                    b = m;
                }
            }
            runs.push((lo, a - lo, bytes));
            lo = a;
        }
    }
    Some(runs)
}

/// `helpers.cpp: build_sample_idx` (drop_last_partial_sequence = true).
pub fn build_sample_index<S: Sizes + ?Sized, D: Documents + ?Sized>(
    sizes: &S,
    document_index: &D,
    sequence_length: u32,
    epochs: u32,
    tokens_per_epoch: i64,
    extra: bool,
) -> Result<Vec<(u32, u32)>, GptError> {
    let extra = extra as i64;
    let seq = sequence_length as i64;
    if seq < 1 || tokens_per_epoch <= extra {
        return Err(GptError::Config(format!(
            "{tokens_per_epoch} tokens per epoch cannot make a sample of {} tokens",
            seq + extra
        )));
    }
    let num_samples = (epochs as i64 * tokens_per_epoch - extra) / seq;
    let mut out = Vec::new();
    out.try_reserve_exact(num_samples as usize + 1)
        .map_err(|e| GptError::Config(format!("a sample index of {num_samples} entries: {e}")))?;
    let (mut di, mut doc_offset) = (0usize, 0i64);
    out.push((0, 0));
    let size = |di: usize| -> Result<i64, GptError> {
        let d = document_index
            .doc(di)
            .filter(|&d| (d as usize) < sizes.count())
            .ok_or_else(|| GptError::Config("sample index ran past the documents".into()))?;
        Ok(sizes.size(d as usize) as i64)
    };
    while (out.len() as i64) <= num_samples {
        let mut remaining = seq + extra;
        while remaining != 0 {
            let doc_len = size(di)? - doc_offset;
            remaining -= doc_len;
            if remaining <= 0 {
                doc_offset += remaining + doc_len - extra;
                remaining = 0;
            } else {
                if di + 1 >= document_index.count() {
                    doc_offset = size(di)? - extra;
                    break;
                }
                di += 1;
                doc_offset = 0;
            }
        }
        out.push((di as u32, doc_offset as u32));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sizes with empty documents, documents shorter and longer than a window, and runs of each.
    fn sizes(n: usize, seed: u64) -> Vec<i32> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                match x % 7 {
                    0 => 0,
                    1 => 1,
                    2 => ((x >> 8) % 5) as i32,
                    3 => ((x >> 8) % 300) as i32,
                    _ => ((x >> 8) % 40) as i32,
                }
            })
            .collect()
    }

    #[test]
    fn boundaries_equal_megatrons_sample_index() {
        for (seed, n) in [
            (1u64, 1usize),
            (2, 3),
            (3, 63),
            (4, 64),
            (5, 65),
            (6, 500),
            (7, 3000),
        ] {
            let v = sizes(n, seed);
            let ts = TokenSizes::Owned(v.clone().into());
            for docs in [
                0..n as u32,
                (n / 3) as u32..n as u32,
                0..(n as u32).div_ceil(2),
            ] {
                let tokens: i64 = docs.clone().map(|d| v[d as usize] as i64).sum();
                for seq in [1u32, 2, 7, 16, 33] {
                    for extra in [true, false] {
                        let di = DocumentIndex::InOrder(docs.clone());
                        let built = build_sample_index(&v[..], &di, seq, 1, tokens, extra);
                        let lazy = InOrderWindows::new(&ts, docs.clone(), seq, extra);
                        match (built, lazy) {
                            (Ok(b), Ok(l)) => {
                                assert_eq!(b.len(), l.len(), "seed {seed} seq {seq} {extra}");
                                for (i, e) in b.iter().enumerate() {
                                    assert_eq!(
                                        Some(*e),
                                        l.get(i),
                                        "seed {seed} docs {docs:?} seq {seq} extra {extra} entry {i}"
                                    );
                                }
                                assert_eq!(l.get(b.len()), None);
                            }
                            (Err(_), Err(_)) => {}
                            (b, l) => {
                                panic!("seed {seed} seq {seq}: {b:?} vs {:?}", l.map(|l| l.len()))
                            }
                        }
                    }
                }
            }
        }
    }

    /// Shards of sequences with empty ones among them, and GPT windows over them in block order
    /// (alone and as a blend of the shards): the runs found by binary search are the runs a scan of
    /// every window's first shard finds, so the shuffle blocks cut from them are the same.
    #[test]
    fn shard_runs_equal_a_scan_of_every_window() {
        use crate::formats::Dtype;
        use crate::formats::index::{Samples, Shard};
        use crate::gpt::{GptSettings, Order, SplitPart};
        let mut samples = Vec::new();
        let mut shards = Vec::new();
        for (sh, seed) in [11u64, 12, 13].into_iter().enumerate() {
            let mut off = 0u64;
            for n in sizes(400, seed) {
                samples.push(SampleLoc {
                    shard: sh as u32,
                    offset: off,
                    len: 2 * n as u32,
                });
                off += 2 * n as u64;
            }
            shards.push(Shard {
                path: format!("s{sh}.bin").into(),
                size: off,
            });
        }
        let index = DatasetIndex {
            format: "megatron".into(),
            shards,
            samples: Samples::from(samples),
        };
        for (seq, blend) in [(7u32, vec![]), (33, vec![]), (5, vec![(1.0, 1), (2.0, 2)])] {
            let s = GptSettings {
                sequence_length: seq,
                add_extra_token: true,
                seed: 1,
                num_samples: 0,
                split: "1".into(),
                part: SplitPart::Train,
                order: Order::Block,
                blend,
            };
            let g = crate::gpt::build(&index, Dtype::U16, &s).unwrap_or_else(|e| panic!("{e}"));
            let runs = shard_runs(&g, &index).unwrap_or_else(|| panic!("block order has runs"));
            let mut scratch = Vec::new();
            let mut scan: Vec<(u64, u64, u64)> = Vec::new();
            for p in 0..g.parts.len() {
                let mut prev = None;
                for id in g.bases[p]..g.bases[p + 1] {
                    let sh = first_shard(&g, &index, id, &mut scratch);
                    match scan.last_mut() {
                        Some(r) if prev == Some(sh) && id > g.bases[p] => r.1 += 1,
                        _ => scan.push((id, 1, g.sample_bytes())),
                    }
                    prev = Some(sh);
                }
            }
            assert!(scan.len() > 2, "seq {seq}: runs {scan:?}");
            assert_eq!(runs, scan, "seq {seq}");
        }
    }

    #[test]
    fn memory_is_one_word_per_stride() {
        let v: std::sync::Arc<[i32]> = vec![5; 1 << 16].into();
        let w = InOrderWindows::new(&TokenSizes::Owned(v), 0..1 << 16, 8, true)
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(
            w.heap_bytes() <= 8 * ((1 << 16) / STRIDE + 2),
            "{}",
            w.heap_bytes()
        );
        assert_eq!(w.len() as u64, ((5u64 << 16) - 1) / 8 + 1);
    }
}
