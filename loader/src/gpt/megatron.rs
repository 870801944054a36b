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

use super::numpy_rng::RandomState;
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

/// The three indices of a `GPTDataset`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GptIndices {
    /// Document (sequence) ids, epoch after epoch, shuffled.
    pub document_index: Vec<u32>,
    /// `(position in document_index, token offset)` where each sample starts; one more entry than
    /// samples (the last marks the end).
    pub sample_index: Vec<(u32, u32)>,
    /// The order samples are delivered in (`None`: sample order).
    pub shuffle_index: Option<Vec<u64>>,
    /// Epochs of documents the indices span.
    pub epochs: u32,
}

impl GptIndices {
    /// Samples.
    pub fn samples(&self) -> u64 {
        self.sample_index.len().saturating_sub(1) as u64
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

fn document_index(docs: &[u32], epochs: u32, rng: &mut RandomState, separate: bool) -> Vec<u32> {
    if !separate || epochs == 1 {
        let mut v = Vec::with_capacity(docs.len() * epochs as usize);
        for _ in 0..epochs {
            v.extend_from_slice(docs);
        }
        rng.shuffle(&mut v);
        return v;
    }
    let mut first = document_index(docs, epochs - 1, rng, false);
    first.extend(document_index(docs, 1, rng, false));
    first
}

/// `helpers.cpp: build_sample_idx` (drop_last_partial_sequence = true).
pub fn build_sample_index(
    sizes: &[i32],
    document_index: &[u32],
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
    let mut out = Vec::with_capacity(num_samples as usize + 1);
    let (mut di, mut doc_offset) = (0usize, 0i64);
    out.push((0, 0));
    let size = |di: usize| -> Result<i64, GptError> {
        let d = *document_index
            .get(di)
            .ok_or_else(|| GptError::Config("sample index ran past the documents".into()))?;
        Ok(sizes[d as usize] as i64)
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
                if di == document_index.len() - 1 {
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

fn shuffle_index(num: u64, total: u64, rng: &mut RandomState) -> Vec<u64> {
    let mut first: Vec<u64> = (0..num).collect();
    rng.shuffle(&mut first);
    if num == total {
        return first;
    }
    let mut last: Vec<u64> = (num..total).collect();
    rng.shuffle(&mut last);
    first.extend(last);
    first
}

/// The documents of `part` of `split` among `n`.
pub fn split_documents(split: &str, part: SplitPart, n: u64) -> Result<Vec<u32>, GptError> {
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
    Ok((r.start as u32..r.end as u32).collect())
}

/// Builds `GPTDataset`'s indices over sequences of `sizes` tokens.
pub fn build(sizes: &[i32], cfg: &MegatronGptConfig) -> Result<GptIndices, GptError> {
    let docs = split_documents(&cfg.split, cfg.part, sizes.len() as u64)?;
    let extra = cfg.add_extra_token as i64;
    let seq = cfg.sequence_length as i64;
    let tokens_per_epoch: i64 = docs.iter().map(|&d| sizes[d as usize] as i64).sum();
    if tokens_per_epoch <= extra {
        return Err(GptError::Config(format!(
            "the {} split holds {tokens_per_epoch} tokens: not one sample",
            cfg.part.name()
        )));
    }
    let mut epochs: u32 = 1;
    if let Some(ns) = cfg.num_samples {
        let requested = (ns as i64)
            .checked_mul(seq)
            .and_then(|t| t.checked_add(extra))
            .ok_or_else(|| GptError::Config(format!("dataset.num_samples {ns} overflows")))?;
        let mut tokens = tokens_per_epoch;
        while tokens < requested {
            epochs += 1;
            tokens += tokens_per_epoch;
        }
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
    let document_index = document_index(&docs, epochs, &mut rng, separate);
    let sample_index = build_sample_index(
        sizes,
        &document_index,
        cfg.sequence_length,
        epochs,
        tokens_per_epoch,
        cfg.add_extra_token,
    )?;
    let total = sample_index.len() as u64 - 1;
    let shuffle = if separate {
        shuffle_index(sans_final as u64, total, &mut rng)
    } else {
        shuffle_index(total, total, &mut rng)
    };
    Ok(GptIndices {
        document_index,
        sample_index,
        shuffle_index: Some(shuffle),
        epochs,
    })
}

/// Windows over the documents of `part` in file order, one epoch, unshuffled (ubdirect's
/// `order = "block"`; the planner shuffles blocks of windows).
pub fn build_in_order(
    sizes: &[i32],
    split: &str,
    part: SplitPart,
    sequence_length: u32,
    add_extra_token: bool,
) -> Result<GptIndices, GptError> {
    let docs = split_documents(split, part, sizes.len() as u64)?;
    let tokens: i64 = docs.iter().map(|&d| sizes[d as usize] as i64).sum();
    let sample_index =
        build_sample_index(sizes, &docs, sequence_length, 1, tokens, add_extra_token)?;
    Ok(GptIndices {
        document_index: docs,
        sample_index,
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
        let idx = build_sample_index(&[5, 3, 4], &[0, 1, 2], 4, 1, 12, true)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(idx, vec![(0, 0), (0, 4), (2, 0)]);
    }
}
