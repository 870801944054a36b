//! Indices read from an untrusted file (a GPT index cache) checked against the sequences they index
//! and the settings they claim, as [`super::megatron::build`] makes them — on every core, since a
//! cached start at 10⁸ windows is this pass and little else.
//!
//! What is checked: the document index holds `epochs` × the split's documents, each inside the
//! split; the sample index starts at `(0, 0)`, its boundaries are in order, inside their documents
//! and `sequence_length` tokens apart (every window whole), and there are exactly as many as the
//! split's tokens make (none dropped, none added); the shuffle index is a permutation of the
//! samples. A CRC proves a file whole, not right; this proves the indices describe this dataset.
//! (Whether the permutations are the ones the seed draws is what only a rebuild could tell.)

use crate::formats::mapped::{par_ranges, threads};
use crate::gpt::megatron::SampleIndex;

use super::megatron::{GptIndices, MegatronGptConfig, Sizes, split_documents};

/// Why indices read from a file are not ones [`super::megatron::build`] makes: `array[entry]` and
/// what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{array}[{entry}]: {why}")]
pub struct IndexCheckError {
    /// `document_index`, `sample_index` or `shuffle_index`.
    pub array: &'static str,
    /// The entry.
    pub entry: u64,
    /// What is wrong with it.
    pub why: &'static str,
}

fn bad(array: &'static str, entry: usize, why: &'static str) -> IndexCheckError {
    IndexCheckError {
        array,
        entry: entry as u64,
        why,
    }
}

/// Checks `ix` (read from an untrusted file) against `sizes` and `cfg`: see the module's list. One
/// pass over each array, split across the cores.
pub fn check_indices<S: Sizes + Sync + ?Sized>(
    ix: &GptIndices,
    sizes: &S,
    cfg: &MegatronGptConfig,
) -> Result<(), IndexCheckError> {
    let docs = split_documents(&cfg.split, cfg.part, sizes.count() as u64).map_err(|_| {
        bad(
            "document_index",
            0,
            "the split gives this part no documents",
        )
    })?;
    let n_docs = ix.document_index.len();
    if ix.epochs == 0 || (docs.len() as u64).checked_mul(ix.epochs as u64) != Some(n_docs as u64) {
        return Err(bad(
            "document_index",
            n_docs,
            "not epochs × the split's documents long",
        ));
    }
    // Every document in the split; the split's tokens (the sequences, read in order).
    par_ranges(n_docs, |r| {
        let mut buf = vec![0u64; 1 << 14];
        let mut i = r.start;
        while i < r.end {
            let m = buf.len().min(r.end - i);
            if !ix.document_index.fill(i, &mut buf[..m]) {
                return Err(bad("document_index", i, "past the end of the file"));
            }
            if let Some(k) = buf[..m]
                .iter()
                .position(|&d| d < docs.start as u64 || d >= docs.end as u64)
            {
                return Err(bad("document_index", i + k, "a document outside the split"));
            }
            i += m;
        }
        Ok(())
    })?;
    let tokens_per_epoch: u64 = par_ranges(docs.len(), |r| {
        Ok::<_, IndexCheckError>(
            sizes.tokens(docs.start as usize + r.start..docs.start as usize + r.end),
        )
    })?
    .into_iter()
    .sum();
    check_samples(ix, sizes, cfg)?;
    let (extra, seq) = (cfg.add_extra_token as u64, cfg.sequence_length as u64);
    let windows = (tokens_per_epoch * ix.epochs as u64).saturating_sub(extra) / seq.max(1);
    if ix.samples() != windows {
        return Err(bad(
            "sample_index",
            ix.sample_index.len(),
            "not as many windows as the documents' tokens make",
        ));
    }
    check_shuffle(ix)
}

/// The sample index: `(0, 0)` first, every boundary inside its document, in order, and
/// `sequence_length` tokens after the one before.
fn check_samples<S: Sizes + Sync + ?Sized>(
    ix: &GptIndices,
    sizes: &S,
    cfg: &MegatronGptConfig,
) -> Result<(), IndexCheckError> {
    if matches!(ix.sample_index, SampleIndex::InOrder(_)) {
        // Computed by position from the document index just checked: whole windows in order by
        // construction (`gpt::windows`).
        return Ok(());
    }
    let extra = cfg.add_extra_token as i64;
    let seq = cfg.sequence_length as i64;
    let size_at = |pos: u32, entry: usize| -> Result<i64, IndexCheckError> {
        let d = ix.document_index.get(pos as usize).ok_or_else(|| {
            bad(
                "sample_index",
                entry,
                "a document position past the document index",
            )
        })?;
        if d as usize >= sizes.count() {
            return Err(bad("sample_index", entry, "a document past the sequences"));
        }
        let n = sizes.size(d as usize) as i64;
        if n < 0 {
            return Err(bad("sample_index", entry, "a negative sequence length"));
        }
        Ok(n)
    };
    if ix.sample_index.get(0) != Some((0, 0)) {
        return Err(bad(
            "sample_index",
            0,
            "the first window does not start at (0, 0)",
        ));
    }
    let n = ix.sample_index.len();
    par_ranges(n.saturating_sub(1), |r| {
        // Entries 1 + r: each range starts from the boundary before it, checked by its own range.
        let (a, b) = (r.start + 1, r.end + 1);
        let mut prev = ix.sample_index.get(a - 1).unwrap_or((0, 0));
        // The size of the document the last boundary was in (windows in one document share it).
        let mut last: Option<(u32, i64)> = None;
        let mut buf = vec![(0u32, 0u32); 1 << 14];
        let mut base = a;
        for i in a..b {
            if i == a || i >= base + buf.len() {
                base = i;
                let m = buf.len().min(b - i);
                if !ix.sample_index.fill(i, &mut buf[..m]) {
                    return Err(bad("sample_index", i, "past the end of the file"));
                }
            }
            let (pos, off) = buf[i - base];
            let size = match last {
                Some((p, n)) if p == pos => n,
                _ => size_at(pos, i)?,
            };
            last = Some((pos, size));
            if off as i64 + extra > size {
                return Err(bad(
                    "sample_index",
                    i,
                    "an offset past its document's tokens",
                ));
            }
            if (pos, off) < prev {
                return Err(bad(
                    "sample_index",
                    i,
                    "a window starting before the previous one",
                ));
            }
            // Tokens from the previous boundary to this one.
            let mut tokens = off as i64 - prev.1 as i64;
            for p in prev.0..pos {
                tokens += size_at(p, i)?;
                if tokens > seq {
                    break;
                }
            }
            if tokens != seq {
                return Err(bad(
                    "sample_index",
                    i,
                    "windows not sequence_length tokens apart",
                ));
            }
            prev = (pos, off);
        }
        Ok(())
    })?;
    Ok(())
}

/// The shuffle index: one entry per sample, each sample once. Each thread owns a range of sample
/// ids and a bitset of them only (small enough to stay in its core's cache, no atomics) and reads
/// the index in order keeping the ids in its range — `threads` sequential reads of the array
/// instead of one pass of random atomic updates (several times slower at 10⁸ samples). The index
/// is read a block at a time by every thread (with `pread` when it is a file: nothing stays resident).
fn check_shuffle(ix: &GptIndices) -> Result<(), IndexCheckError> {
    const BLOCK: usize = 1 << 24;
    let Some(sh) = &ix.shuffle_index else {
        return Ok(());
    };
    let n = ix.samples();
    if sh.len() as u64 != n {
        return Err(bad("shuffle_index", sh.len(), "not one entry per sample"));
    }
    let t = threads(n as usize).max(1) as u64;
    let per = n.div_ceil(t).div_ceil(64).max(1) * 64;
    let mut seen: Vec<Vec<u64>> = (0..t)
        .map(|o| {
            let (lo, hi) = ((o * per).min(n), ((o + 1) * per).min(n));
            vec![0u64; ((hi - lo) as usize).div_ceil(64)]
        })
        .collect();
    let mut start = 0usize;
    while start < sh.len() {
        let end = (start + BLOCK).min(sh.len());
        let errors: Vec<Option<IndexCheckError>> = std::thread::scope(|s| {
            let hs: Vec<_> = seen
                .iter_mut()
                .enumerate()
                .map(|(o, bits)| {
                    s.spawn(move || {
                        let lo = o as u64 * per;
                        let mut buf = vec![0u64; 1 << 14];
                        let mut i = start;
                        while i < end {
                            let m = buf.len().min(end - i);
                            if !sh.fill(i, &mut buf[..m]) {
                                return Some(bad("shuffle_index", i, "past the end of the file"));
                            }
                            for (k, &v) in buf[..m].iter().enumerate() {
                                if v >= n {
                                    return Some(bad(
                                        "shuffle_index",
                                        i + k,
                                        "a sample id past the samples",
                                    ));
                                }
                                let Some(r) = v.checked_sub(lo).filter(|r| *r < per) else {
                                    continue;
                                };
                                let (w, bit) = ((r / 64) as usize, 1u64 << (r % 64));
                                if bits[w] & bit != 0 {
                                    return Some(bad("shuffle_index", i + k, "a sample id twice"));
                                }
                                bits[w] |= bit;
                            }
                            i += m;
                        }
                        None
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                .collect()
        });
        if let Some(e) = errors.into_iter().flatten().min_by_key(|e| e.entry) {
            return Err(e);
        }
        start = end;
    }
    Ok(())
}
