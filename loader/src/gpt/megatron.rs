//! Megatron-Core's GPT sample indices (`GPTDataset`, 0.16), rule for rule:
//!
//! - **split**: `parse_and_normalize_split` ("969,30,1" → ratios normalized by numpy's sum), the
//!   split matrix's book-ends, documents `round(lo·n)..round(hi·n)` (Python's `round`: ties to even).
//! - **epochs**: one, or as many as `num_samples · sequence_length + extra` tokens need.
//! - **document index**: `mgrid[0:epochs, 0:docs][1]` flattened and shuffled by
//!   `RandomState(seed).shuffle`; when the last epoch is short (fewer than `int(0.8 · samples per
//!   epoch)` of its samples are used) the first `epochs − 1` epochs are shuffled together and the last
//!   one separately, with the same generator.
//! - **sample index** (`helpers.cpp: build_sample_idx`): windows of `sequence_length + extra` tokens
//!   over the documents in document-index order, consecutive windows sharing `extra` tokens, the last
//!   partial window dropped.
//! - **shuffle index**: `arange(samples)` shuffled with the same generator (the samples of a separate
//!   last epoch shuffled on their own after the others).
//!
//! "Documents" are the dataset's sequences, as `GPTDataset` counts them (`numel_low_level_dataset`).

pub use super::documents::{DocumentIndex, Documents, Sizes};
use super::numpy_rng::RandomState;
pub use super::windows::build_sample_index;
use super::{GptError, SplitPart};

/// The settings `GPTDataset` takes that shape its indices.
#[derive(Debug, Clone, PartialEq)]
pub struct MegatronGptConfig {
    /// `random_seed`.
    pub seed: u32,
    /// `sequence_length`.
    pub sequence_length: u32,
    /// `add_extra_token_to_sequence`.
    pub add_extra_token: bool,
    /// Samples asked for (`None`: one epoch).
    pub num_samples: Option<u64>,
    /// The split string (`"969,30,1"`).
    pub split: String,
    /// Which part of the split.
    pub part: SplitPart,
}

/// The three indices of a `GPTDataset`, in Megatron's integer widths: `int32` documents and sample
/// positions, a `uint32` shuffle index (`int64` from 2³² − 1 samples on).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GptIndices {
    /// Document (sequence) ids, epoch after epoch, shuffled.
    pub document_index: DocumentIndex,
    /// `(position in document_index, token offset)` where each sample starts; one more entry than
    /// samples (the last marks the end).
    pub sample_index: SampleIndex,
    /// The order samples are delivered in (`None`: sample order). For a dataset that is not blended
    /// it is moved into [`GptSamples::order`](super::GptSamples::order), not copied.
    pub shuffle_index: Option<ShuffleIndex>,
    /// Epochs of documents the indices span.
    pub epochs: u32,
}

impl GptIndices {
    /// Samples.
    pub fn samples(&self) -> u64 {
        self.sample_index.len().saturating_sub(1) as u64
    }
}

/// `(document position, token offset)` per sample boundary (built, or read from a cached index).
#[derive(Debug, Clone)]
pub enum SampleIndex {
    /// The entries.
    Owned(Vec<(u32, u32)>),
    /// Computed by position over documents in file order (`order = "block"`): nothing per window.
    InOrder(std::sync::Arc<super::windows::InOrderWindows>),
    /// Read in place from a cache file (pairs of `u32`).
    Mapped(crate::formats::mapped::Ints),
}

impl Default for SampleIndex {
    fn default() -> Self {
        SampleIndex::Owned(Vec::new())
    }
}

impl PartialEq for SampleIndex {
    fn eq(&self, o: &Self) -> bool {
        self.len() == o.len() && self.iter().eq(o.iter())
    }
}

impl Eq for SampleIndex {}

impl From<Vec<(u32, u32)>> for SampleIndex {
    fn from(v: Vec<(u32, u32)>) -> Self {
        SampleIndex::Owned(v)
    }
}

impl SampleIndex {
    /// Entries (samples + 1).
    pub fn len(&self) -> usize {
        match self {
            SampleIndex::Owned(v) => v.len(),
            SampleIndex::InOrder(w) => w.len(),
            SampleIndex::Mapped(m) => m.len(),
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Entry `i`, if there is one.
    #[inline]
    pub fn get(&self, i: usize) -> Option<(u32, u32)> {
        match self {
            SampleIndex::Owned(v) => v.get(i).copied(),
            SampleIndex::InOrder(w) => w.get(i),
            SampleIndex::Mapped(m) => m.pair(i),
        }
    }

    /// Entries `first..first + out.len()` into `out`, read in bulk where they are mapped; `false`
    /// when they are not all there.
    pub fn fill(&self, first: usize, out: &mut [(u32, u32)]) -> bool {
        if first.checked_add(out.len()).is_none_or(|e| e > self.len()) {
            return false;
        }
        if let SampleIndex::Mapped(m) = self {
            let mut w = vec![0u64; out.len()];
            if !m.fill(first, &mut w) {
                return false;
            }
            for (o, x) in out.iter_mut().zip(w) {
                *o = (x as u32, (x >> 32) as u32);
            }
            return true;
        }
        for (k, o) in out.iter_mut().enumerate() {
            match self.get(first + k) {
                Some(e) => *o = e,
                None => return false,
            }
        }
        true
    }

    /// The entries in order.
    pub fn iter(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        (0..self.len()).filter_map(|i| self.get(i))
    }
}

/// Megatron's shuffle index: `uint32` when the samples fit, else `int64` (kept as `u64`).
#[derive(Debug, Clone)]
pub enum ShuffleIndex {
    /// Fewer than 2³² − 1 samples.
    U32(Vec<u32>),
    /// More.
    U64(Vec<u64>),
    /// Read in place from a cache file (`u32`s or `u64`s, as written).
    Mapped(crate::formats::mapped::Ints),
}

impl PartialEq for ShuffleIndex {
    fn eq(&self, o: &Self) -> bool {
        self.len() == o.len() && self.iter().eq(o.iter())
    }
}

impl Eq for ShuffleIndex {}

impl ShuffleIndex {
    /// Entries.
    pub fn len(&self) -> usize {
        match self {
            ShuffleIndex::U32(v) => v.len(),
            ShuffleIndex::U64(v) => v.len(),
            ShuffleIndex::Mapped(m) => m.len(),
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Entry `i`, if there is one.
    #[inline]
    pub fn get(&self, i: usize) -> Option<u64> {
        match self {
            ShuffleIndex::U32(v) => v.get(i).map(|&x| x as u64),
            ShuffleIndex::U64(v) => v.get(i).copied(),
            ShuffleIndex::Mapped(m) => m.get(i),
        }
    }

    /// The entries in order.
    pub fn iter(&self) -> Box<dyn Iterator<Item = u64> + '_> {
        match self {
            ShuffleIndex::U32(v) => Box::new(v.iter().map(|&x| x as u64)),
            ShuffleIndex::U64(v) => Box::new(v.iter().copied()),
            ShuffleIndex::Mapped(m) => Box::new((0..m.len()).filter_map(move |i| m.get(i))),
        }
    }

    /// Entries `first..first + out.len()` into `out`; `false` when they are not all there.
    pub fn fill(&self, first: usize, out: &mut [u64]) -> bool {
        let Some(end) = first.checked_add(out.len()).filter(|e| *e <= self.len()) else {
            return false;
        };
        match self {
            ShuffleIndex::U32(v) => {
                for (o, &x) in out.iter_mut().zip(&v[first..end]) {
                    *o = x as u64;
                }
                true
            }
            ShuffleIndex::U64(v) => {
                out.copy_from_slice(&v[first..end]);
                true
            }
            ShuffleIndex::Mapped(m) => m.fill(first, out),
        }
    }

    /// The entries as `u64`s.
    pub fn to_vec(&self) -> Vec<u64> {
        match self {
            ShuffleIndex::U32(v) => v.iter().map(|&x| x as u64).collect(),
            ShuffleIndex::U64(v) => v.clone(),
            ShuffleIndex::Mapped(_) => self.iter().collect(),
        }
    }
}

/// numpy's `sum` of a float64 array (pairwise summation, 8 accumulators, blocks of 128).
pub fn numpy_sum(a: &[f64]) -> f64 {
    let n = a.len();
    if n < 8 {
        let mut r = 0.0;
        for x in a {
            r += x;
        }
        r
    } else if n <= 128 {
        let mut r = [0.0f64; 8];
        r.copy_from_slice(&a[..8]);
        let mut i = 8;
        while i < n - n % 8 {
            for j in 0..8 {
                r[j] += a[i + j];
            }
            i += 8;
        }
        let mut res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        while i < n {
            res += a[i];
            i += 1;
        }
        res
    } else {
        let mut n2 = n / 2;
        n2 -= n2 % 8;
        numpy_sum(&a[..n2]) + numpy_sum(&a[n2..])
    }
}

/// Megatron's `normalize`: `w / numpy.sum(w)`.
pub fn normalize(w: &[f64]) -> Vec<f64> {
    let s = numpy_sum(w);
    w.iter().map(|x| x / s).collect()
}

/// `parse_and_normalize_split`: the numbers in `s` (`[.0-9]+` runs), padded to three, normalized.
pub fn parse_split(s: &str) -> Result<[f64; 3], GptError> {
    let mut v = Vec::new();
    let mut cur = String::new();
    for c in s.chars().chain(std::iter::once(' ')) {
        if c.is_ascii_digit() || c == '.' {
            cur.push(c);
        } else if !cur.is_empty() {
            let x: f64 = cur.parse().map_err(|_| {
                GptError::Config(format!("dataset.split {s:?}: {cur:?} is not a number"))
            })?;
            v.push(x);
            cur.clear();
        }
    }
    if v.len() > 3 || v.is_empty() {
        return Err(GptError::Config(format!(
            "dataset.split {s:?}: expected 1 to 3 numbers (train, valid, test)"
        )));
    }
    v.resize(3, 0.0);
    if numpy_sum(&v) <= 0.0 {
        return Err(GptError::Config(format!(
            "dataset.split {s:?} sums to zero"
        )));
    }
    let n = normalize(&v);
    Ok([n[0], n[1], n[2]])
}

/// The documents `lo..hi` of `part` among `n` (`None`: the part is empty in the split matrix).
pub fn split_range(split: &[f64; 3], part: SplitPart, n: u64) -> Option<std::ops::Range<u64>> {
    let mut ends = [0.0f64; 4];
    for i in 0..3 {
        ends[i + 1] = ends[i] + split[i];
    }
    let i = part as usize;
    let (lo, hi) = (ends[i], ends[i + 1]);
    if hi <= lo {
        return None;
    }
    let r = |x: f64| (x * n as f64).round_ties_even() as u64;
    Some(r(lo)..r(hi))
}

/// `mgrid[0:epochs, docs][1]` flattened, shuffled (the last epoch apart when `separate`), built in
/// place in one vector.
fn document_index(
    docs: std::ops::Range<u32>,
    epochs: u32,
    rng: &mut RandomState,
    separate: bool,
) -> Result<Vec<u32>, GptError> {
    let total = docs.len() as u64 * epochs as u64;
    if total > u32::MAX as u64 {
        return Err(GptError::Config(format!(
            "{epochs} epochs of {} documents: more than 2³² − 1 (Megatron's int32 sample index)",
            docs.len()
        )));
    }
    let mut v = Vec::new();
    v.try_reserve_exact(total as usize)
        .map_err(|e| GptError::Config(format!("a document index of {total} entries: {e}")))?;
    for _ in 0..epochs {
        v.extend(docs.clone());
    }
    if !separate || epochs == 1 {
        rng.shuffle(&mut v);
    } else {
        let (first, last) = v.split_at_mut(docs.len() * (epochs as usize - 1));
        rng.shuffle(first);
        rng.shuffle(last);
    }
    Ok(v)
}

/// `arange(total)` with its first `num` entries shuffled, then the rest; `uint32` as Megatron's when
/// `total < 2³² − 1`.
fn shuffle_index(num: u64, total: u64, rng: &mut RandomState) -> Result<ShuffleIndex, GptError> {
    fn fill<T: TryFrom<u64>>(
        num: u64,
        total: u64,
        rng: &mut RandomState,
    ) -> Result<Vec<T>, GptError> {
        let mut v = Vec::new();
        v.try_reserve_exact(total as usize)
            .map_err(|e| GptError::Config(format!("a shuffle index of {total} entries: {e}")))?;
        v.extend((0..total).filter_map(|x| T::try_from(x).ok()));
        let (first, last) = v.split_at_mut(num.min(total) as usize);
        rng.shuffle(first);
        if !last.is_empty() {
            rng.shuffle(last);
        }
        Ok(v)
    }
    Ok(if total < u32::MAX as u64 - 1 {
        ShuffleIndex::U32(fill(num, total, rng)?)
    } else {
        ShuffleIndex::U64(fill(num, total, rng)?)
    })
}

/// The documents of `part` of `split` among `n`.
pub fn split_documents(
    split: &str,
    part: SplitPart,
    n: u64,
) -> Result<std::ops::Range<u32>, GptError> {
    let s = parse_split(split)?;
    let r = split_range(&s, part, n).ok_or_else(|| {
        GptError::Config(format!(
            "dataset.split {split:?} gives the {} part no documents",
            part.name()
        ))
    })?;
    if n > u32::MAX as u64 {
        return Err(GptError::Config(format!(
            "{n} sequences: more than 2³² − 1"
        )));
    }
    Ok(r.start as u32..r.end as u32)
}

/// Builds `GPTDataset`'s indices over sequences of `sizes` tokens, the sample index as Megatron's
/// array (8 bytes a window).
pub fn build<S: Sizes + ?Sized>(
    sizes: &S,
    cfg: &MegatronGptConfig,
) -> Result<GptIndices, GptError> {
    build_with(sizes, cfg, |doc_index, epochs, tokens_per_epoch| {
        let si = build_sample_index(
            sizes,
            &doc_index[..],
            cfg.sequence_length,
            epochs,
            tokens_per_epoch,
            cfg.add_extra_token,
        )?;
        Ok((si.into(), DocumentIndex::Shuffled(doc_index.into())))
    })
}

/// Builds `GPTDataset`'s indices with the sample index computed by position through the document
/// index ([`super::windows`]: the same entries, 8 bytes per 64 documents instead of 8 a window).
pub fn build_computed(
    sizes: &super::TokenSizes,
    cfg: &MegatronGptConfig,
) -> Result<GptIndices, GptError> {
    build_with(sizes, cfg, |doc_index, _, _| {
        let d = DocumentIndex::Shuffled(doc_index.into());
        let w = super::windows::InOrderWindows::over(
            sizes,
            d.clone(),
            cfg.sequence_length,
            cfg.add_extra_token,
        )?;
        Ok((SampleIndex::InOrder(std::sync::Arc::new(w)), d))
    })
}

/// `build` with the sample index made by `make` from the document index, the epochs and the tokens
/// per epoch.
fn build_with<S: Sizes + ?Sized>(
    sizes: &S,
    cfg: &MegatronGptConfig,
    make: impl FnOnce(Vec<u32>, u32, i64) -> Result<(SampleIndex, DocumentIndex), GptError>,
) -> Result<GptIndices, GptError> {
    let docs = split_documents(&cfg.split, cfg.part, sizes.count() as u64)?;
    let extra = cfg.add_extra_token as i64;
    let seq = cfg.sequence_length as i64;
    let tokens_per_epoch: i64 = docs.clone().map(|d| sizes.size(d as usize) as i64).sum();
    if tokens_per_epoch <= extra {
        return Err(GptError::Config(format!(
            "the {} split holds {tokens_per_epoch} tokens: not one sample",
            cfg.part.name()
        )));
    }
    let mut epochs: u32 = 1;
    if let Some(ns) = cfg.num_samples {
        let requested = i64::try_from(ns)
            .ok()
            .and_then(|ns| ns.checked_mul(seq))
            .and_then(|t| t.checked_add(extra))
            .ok_or_else(|| GptError::Config(format!("dataset.num_samples {ns} overflows")))?;
        // The fewest epochs whose tokens reach `requested` (Megatron adds one epoch at a time).
        let need = (requested.max(1) as u64).div_ceil(tokens_per_epoch as u64);
        epochs = u32::try_from(need.max(1))
            .ok()
            .filter(|&e| (e as u64) * (docs.len() as u64) <= u32::MAX as u64)
            .ok_or_else(|| {
                GptError::Config(format!(
                    "dataset.num_samples {ns} needs {need} epochs of {} documents: more than Megatron's 2³² − 1 document index entries",
                    docs.len()
                ))
            })?;
    }
    let mut separate = false;
    let mut sans_final = 0i64;
    if epochs > 1 {
        sans_final = ((epochs as i64 - 1) * tokens_per_epoch - extra) / seq;
        let from_final = cfg.num_samples.unwrap_or(0) as i64 - sans_final;
        let per_epoch = (tokens_per_epoch - extra) / seq;
        if from_final < 0 || from_final > per_epoch + 1 {
            return Err(GptError::Config(format!(
                "samples from the final epoch {from_final} outside 0..={}",
                per_epoch + 1
            )));
        }
        separate = from_final < (0.80 * per_epoch as f64) as i64;
    }
    let mut rng = RandomState::new(cfg.seed);
    let document_index = document_index(docs, epochs, &mut rng, separate)?;
    let (sample_index, document_index) = make(document_index, epochs, tokens_per_epoch)?;
    let total = sample_index.len() as u64 - 1;
    let shuffle = if separate {
        shuffle_index(sans_final as u64, total, &mut rng)?
    } else {
        shuffle_index(total, total, &mut rng)?
    };
    Ok(GptIndices {
        document_index,
        sample_index,
        shuffle_index: Some(shuffle),
        epochs,
    })
}

/// Windows over the documents of `part` in file order, one epoch, unshuffled (ubdirect's
/// `order = "block"`; the planner shuffles blocks of windows). The sample index is computed by
/// position ([`super::windows`]): one pass over the lengths, one word per 64 documents.
pub fn build_in_order(
    sizes: &super::TokenSizes,
    split: &str,
    part: SplitPart,
    sequence_length: u32,
    add_extra_token: bool,
) -> Result<GptIndices, GptError> {
    let docs = split_documents(split, part, sizes.count() as u64)?;
    let windows =
        super::windows::InOrderWindows::new(sizes, docs.clone(), sequence_length, add_extra_token)?;
    Ok(GptIndices {
        document_index: DocumentIndex::InOrder(docs),
        sample_index: SampleIndex::InOrder(std::sync::Arc::new(windows)),
        shuffle_index: None,
        epochs: 1,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_like_megatron() {
        let s = parse_split("969,30,1").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(split_range(&s, SplitPart::Train, 1000), Some(0..969));
        assert_eq!(split_range(&s, SplitPart::Valid, 1000), Some(969..999));
        let s = parse_split("100,0,0").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(split_range(&s, SplitPart::Valid, 10), None);
        // Python's round: 0.5 → 0, 2.5 → 2.
        let s = parse_split("1,1").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(split_range(&s, SplitPart::Train, 1), Some(0..0));
        assert_eq!(split_range(&s, SplitPart::Train, 5), Some(0..2));
        assert!(parse_split("1,2,3,4").is_err());
    }

    #[test]
    fn numpy_sum_is_pairwise() {
        // numpy.sum([0.1, 0.2, 0.3]) == 0.6000000000000001 (left to right below 8 elements).
        assert_eq!(numpy_sum(&[0.1, 0.2, 0.3]), 0.6000000000000001);
    }

    #[test]
    fn windows_overlap_by_the_extra_token() {
        // Documents of 5, 3, 4 tokens; windows of 4 + 1.
        let idx = build_sample_index(&[5, 3, 4][..], &[0, 1, 2][..], 4, 1, 12, true)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(idx, vec![(0, 0), (0, 4), (2, 0)]);
    }
}
