//! GPT samples: fixed windows of `sequence_length + 1` tokens packed across documents, as
//! Megatron-Core's `GPTDataset` makes them, and weighted blends of such datasets (`BlendedDataset`).
//!
//! A window is made of *pieces* — byte ranges of the sequences it crosses — which the pipeline copies
//! back to back into the batch block, so a batch is a `(batch, sequence_length + 1)` array of the
//! dataset's token type.
//!
//! Two orders (`loader.order`):
//! - `"megatron"`: exactly `GPTDataset`'s sample order for the same seed, sequence length, number of
//!   samples and split ([`megatron`], with numpy's `RandomState` in [`numpy_rng`]); blends follow
//!   `BlendedDataset` (the next sample comes from the dataset furthest behind its weight).
//! - `"block"`: windows over the documents in file order; the planner shuffles blocks of consecutive
//!   windows (reads stay large) and then within windows, like plain samples.

pub mod blend;
pub mod cache;
pub mod check;
pub mod documents;
pub use documents::TokenSizes;
pub mod masks;
pub mod megatron;
pub mod numpy_rng;
pub mod windows;

use std::path::Path;

use crate::formats::Dtype;
use crate::formats::index::{DatasetIndex, SampleLoc};
use crate::formats::megatron::MegatronIdx;

/// Errors building GPT indices.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GptError {
    /// The settings and the dataset do not make samples.
    #[error("gpt: {0}")]
    Config(String),
}

/// `dataset.split_part`: which part of `dataset.split` this loader reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SplitPart {
    /// The first part (training).
    #[default]
    Train = 0,
    /// The second part (validation).
    Valid = 1,
    /// The third part (test).
    Test = 2,
}

impl SplitPart {
    /// `train`, `valid` or `test`.
    pub fn name(self) -> &'static str {
        match self {
            SplitPart::Train => "train",
            SplitPart::Valid => "valid",
            SplitPart::Test => "test",
        }
    }
}

/// `loader.order`: how samples are ordered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Order {
    /// ubdirect's block + window shuffle (reads stay large).
    #[default]
    Block,
    /// Megatron-Core's `GPTDataset` / `BlendedDataset` order (GPT mode only).
    Megatron,
}

/// One GPT dataset: its sequences in the shared index and its windows.
#[derive(Debug, Clone)]
pub struct GptPart {
    /// Its first sequence in the [`DatasetIndex`].
    pub first_sequence: u64,
    /// Its sequences' lengths in tokens.
    pub sizes: TokenSizes,
    /// Its indices.
    pub indices: megatron::GptIndices,
    /// Whether its indices came from the on-disk cache ([`cache`]).
    pub cache: cache::CacheUse,
}

/// Where one GPT sample comes from ([`GptSamples::origin`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GptOrigin {
    /// Dataset of the blend (0 when not blended).
    pub dataset: u32,
    /// The window's row in its dataset's sample index — Megatron's
    /// `shuffle_index[dataset_sample_index]` of that dataset (windows in document order).
    pub window: u64,
    /// First document read: a sequence id in that dataset's index.
    pub document: u64,
    /// Token offset in that document.
    pub token_offset: u64,
    /// Documents the window spans.
    pub documents: u32,
}

/// The GPT samples of a (possibly blended) dataset.
#[derive(Debug, Clone)]
pub struct GptSamples {
    /// Token type.
    pub dtype: Dtype,
    /// Tokens per sample (`sequence_length + 1` with the extra token).
    pub tokens: u32,
    /// The datasets (one unless blended); sample ids are numbered dataset after dataset.
    pub parts: Vec<GptPart>,
    /// First sample id of each part, and the total at the end.
    pub bases: Vec<u64>,
    /// Blend weights (normalized), one per part; empty when not blended.
    pub weights: Vec<f64>,
    /// Megatron order: the fixed sample order (`GPTDataset`'s shuffle index, moved here, or the
    /// blend's); `None` for the block order, which the planner makes per epoch.
    pub order: Option<megatron::ShuffleIndex>,
}

impl GptSamples {
    /// Bytes per sample.
    pub fn sample_bytes(&self) -> u64 {
        self.tokens as u64 * self.dtype.size() as u64
    }

    /// Samples (all parts).
    pub fn len(&self) -> u64 {
        *self.bases.last().unwrap_or(&0)
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The part holding sample `id`.
    pub fn part_of(&self, id: u64) -> usize {
        self.bases.partition_point(|&b| b <= id).saturating_sub(1)
    }

    /// The byte ranges of sample `id`, in token order (empty pieces left out). Ids, documents and
    /// sequences that do not exist end the pieces early: the planner refuses a sample whose pieces
    /// do not add up to [`sample_bytes`](Self::sample_bytes).
    pub fn pieces(&self, index: &DatasetIndex, id: u64, out: &mut Vec<SampleLoc>) {
        let p = self.part_of(id);
        let (Some(part), Some(&base)) = (self.parts.get(p), self.bases.get(p)) else {
            return;
        };
        let Some(s) = id.checked_sub(base).and_then(|s| usize::try_from(s).ok()) else {
            return;
        };
        let es = self.dtype.size() as u64;
        // Megatron reads from (document b, offset bo) to (document e, offset eo + extra): with the
        // last partial sample dropped that is always `tokens` tokens, the first document from `bo`,
        // the ones between whole.
        let (Some((b, bo)), Some((e, _))) = (
            part.indices.sample_index.get(s),
            part.indices.sample_index.get(s + 1),
        ) else {
            return;
        };
        let mut left = self.tokens as u64;
        for i in b..=e {
            let Some(doc) = part.indices.document_index.get(i as usize) else {
                break;
            };
            let doc = doc as u64;
            if doc as usize >= megatron::Sizes::count(&part.sizes) {
                break;
            }
            let Some(loc) = index.samples.get((part.first_sequence + doc) as usize) else {
                break;
            };
            let size = megatron::Sizes::size(&part.sizes, doc as usize).max(0) as u64;
            let off = if i == b { bo as u64 } else { 0 };
            let len = (size.saturating_sub(off)).min(left);
            if len == 0 {
                continue;
            }
            out.push(SampleLoc {
                shard: loc.shard,
                offset: loc.offset.saturating_add(off * es),
                len: u32::try_from(len * es).unwrap_or(u32::MAX),
            });
            left -= len;
            if left == 0 {
                break;
            }
        }
    }

    /// Where sample `id` comes from: its dataset (of a blend), its window in that dataset (the row of
    /// Megatron's sample index), the first document it reads (a sequence id of that dataset's `.idx`,
    /// as Megatron's `document_index` names it), the token offset in that document, and how many
    /// documents it spans. `None` for an id past the samples.
    pub fn origin(&self, id: u64) -> Option<GptOrigin> {
        let p = self.part_of(id);
        let (part, &base) = (self.parts.get(p)?, self.bases.get(p)?);
        let s = usize::try_from(id.checked_sub(base)?).ok()?;
        let (b, bo) = part.indices.sample_index.get(s)?;
        let (e, _) = part.indices.sample_index.get(s + 1)?;
        // The documents that give the window tokens, counted as `pieces` walks them.
        let mut left = self.tokens as u64;
        let mut documents = 0u32;
        let mut first = None;
        for i in b..=e {
            let Some(doc) = part.indices.document_index.get(i as usize) else {
                break;
            };
            if doc as usize >= megatron::Sizes::count(&part.sizes) {
                break;
            }
            let size = megatron::Sizes::size(&part.sizes, doc as usize).max(0) as u64;
            let off = if i == b { bo as u64 } else { 0 };
            let len = size.saturating_sub(off).min(left);
            if len == 0 {
                continue;
            }
            documents += 1;
            first.get_or_insert((doc as u64, off));
            left -= len;
            if left == 0 {
                break;
            }
        }
        let (document, token_offset) = first?;
        Some(GptOrigin {
            dataset: p as u32,
            window: s as u64,
            document,
            token_offset,
            documents,
        })
    }

    /// Samples in an epoch of the fixed (Megatron) order; `None` for the block order.
    pub fn epoch_samples(&self) -> Option<u64> {
        self.order.as_ref().map(|o| o.len() as u64)
    }

    /// Why an epoch in Megatron order holds other than the `dataset.num_samples` asked (`asked`):
    /// Megatron builds whole epochs of documents (`GPTDataset`'s length is every sample of them), and
    /// a blend's size is its datasets' `ceil(num_samples × weight)` summed. `None` when `asked` is 0
    /// (one epoch) or the epoch holds exactly `asked`.
    pub fn num_samples_note(&self, asked: u64) -> Option<String> {
        let have = self.epoch_samples()?;
        if asked == 0 || have == asked {
            return None;
        }
        let stop = "a trainer stops after the samples it needs (CLI: --max-batches; Python: leave the loop)";
        if self.weights.is_empty() || self.parts.len() == 1 {
            let epochs = self.parts.first().map_or(0, |p| p.indices.epochs);
            Some(format!(
                "dataset.num_samples = {asked}: Megatron's GPTDataset builds whole epochs of documents \
                 ({epochs} here, the fewest that hold {asked} samples) and its length is every \
                 sample of them, so the epoch holds {have}, as Megatron-Core's does; {stop}"
            ))
        } else {
            Some(format!(
                "dataset.num_samples = {asked}: a Megatron blend's size is each dataset's \
                 ceil(num_samples × weight) summed, {have} samples, as Megatron-Core's BlendedDataset; \
                 {stop}"
            ))
        }
    }

    /// Samples of each part in `ids`.
    pub fn count_parts(&self, ids: impl Iterator<Item = u64>) -> Vec<u64> {
        let mut c = vec![0u64; self.parts.len()];
        for id in ids {
            c[self.part_of(id)] += 1;
        }
        c
    }
}

/// What GPT mode needs from the configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct GptSettings {
    /// Tokens per sample before the extra one.
    pub sequence_length: u32,
    /// `add_extra_token_to_sequence`.
    pub add_extra_token: bool,
    /// Megatron's `random_seed`.
    pub seed: u64,
    /// `dataset.num_samples` (0: one epoch; with a blend, the blend's size).
    pub num_samples: u64,
    /// `dataset.split`.
    pub split: String,
    /// `dataset.split_part`.
    pub part: SplitPart,
    /// `loader.order`.
    pub order: Order,
    /// Blend weights (empty: no blend) and the number of shards of each blended dataset.
    pub blend: Vec<(f64, usize)>,
}

/// One `[[dataset.blend]]` entry: a dataset and its weight.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlendEntry {
    /// The dataset's shards (Megatron: prefixes; `order = "megatron"`: exactly one, as Megatron's
    /// blends name one prefix per dataset).
    pub paths: Vec<std::path::PathBuf>,
    /// Its weight (normalized over the entries).
    pub weight: f64,
}

/// The token type of the configured dataset: each Megatron shard's `.idx` (all must agree), the
/// element type of an Arrow list column (`input_ids`), or `dataset.dtype` (raw).
///
/// A Megatron shard's type is the one in the `.idx` the index was built from — mapped when local,
/// read through the shard's opener when remote (`ub://`, object stores) — so nothing is read again;
/// an Arrow shard's is read from its schema through `opener` (local files or `ub://`). `remote`: the
/// shards are not local files (the caller tells them apart: [`crate::shards::ShardUrl::kind_of`]).
pub fn dataset_dtype(
    remote: bool,
    format: crate::formats::Format,
    dtype: Dtype,
    column: &str,
    index: &DatasetIndex,
    opener: &dyn crate::formats::Opener,
) -> Result<Dtype, GptError> {
    use crate::formats::Format;
    match format {
        Format::Megatron => {}
        Format::Arrow => return arrow_dtype(column, index, opener),
        _ => return Ok(dtype),
    }
    let files = index.samples.megatron_files();
    let mut dtype: Option<(Dtype, &Path)> = None;
    for (i, s) in index.shards.iter().enumerate() {
        let t = match files.and_then(|f| f.get(i)) {
            Some(m) => m.dtype(),
            None if remote => {
                return Err(GptError::Config(format!(
                    "{}: the index holds no .idx for this remote shard to read its token type from",
                    s.path.display()
                )));
            }
            None => megatron_dtype(&s.path).map_err(|e| GptError::Config(e.to_string()))?,
        };
        match dtype {
            Some((d, p)) if d != t => {
                return Err(GptError::Config(format!(
                    "mixed token types: {} holds {} tokens, {} holds {}",
                    p.display(),
                    d.name(),
                    s.path.display(),
                    t.name()
                )));
            }
            Some(_) => {}
            None => dtype = Some((t, &s.path)),
        }
    }
    dtype
        .map(|d| d.0)
        .ok_or_else(|| GptError::Config("the dataset has no shards".into()))
}

fn arrow_dtype(
    column: &str,
    index: &DatasetIndex,
    opener: &dyn crate::formats::Opener,
) -> Result<Dtype, GptError> {
    let mut dtype: Option<Dtype> = None;
    for s in &index.shards {
        let mut f = opener
            .open(&s.path)
            .map_err(|e| GptError::Config(e.to_string()))?;
        let size = f.size();
        let t = crate::formats::arrow::column_dtype_in(&mut f, &s.path, size, column)
            .map_err(|e| GptError::Config(e.to_string()))?
            .ok_or_else(|| {
                GptError::Config(format!(
                    "{}: column {column:?} is not a list of integers (token ids)",
                    s.path.display()
                ))
            })?;
        if dtype.is_some_and(|d| d != t) {
            return Err(GptError::Config(format!(
                "mixed token types in column {column:?}: {} holds {}",
                s.path.display(),
                t.name()
            )));
        }
        dtype = Some(t);
    }
    dtype.ok_or_else(|| GptError::Config("the dataset has no shards".into()))
}

/// The other columns of a several-column dataset (`dataset.columns[1..]`: Arrow columns, WebDataset
/// extensions), row for row with the index (built for the first): each column's location in every
/// row, indexed through `opener` (local files, `ub://`, object stores).
pub fn extra_columns(
    format: crate::formats::Format,
    cols: &[String],
    dtype: Dtype,
    record_len: u64,
    index: &DatasetIndex,
    opener: &dyn crate::formats::Opener,
) -> Result<Option<Vec<Vec<SampleLoc>>>, GptError> {
    if cols.len() < 2 {
        return Ok(None);
    }
    let paths: Vec<std::path::PathBuf> = index.shards.iter().map(|s| s.path.clone()).collect();
    let mut out = Vec::with_capacity(cols.len() - 1);
    for c in &cols[1..] {
        let other = crate::formats::index(format, &paths, opener, dtype, record_len, c)
            .map_err(|e| GptError::Config(e.to_string()))?;
        if other.samples.len() != index.samples.len()
            || other
                .samples
                .iter()
                .zip(index.samples.iter())
                .any(|(a, b)| a.shard != b.shard)
        {
            return Err(GptError::Config(format!(
                "column {c:?} has {} rows, column {:?} {}",
                other.samples.len(),
                cols[0],
                index.samples.len()
            )));
        }
        out.push(other.samples.to_vec());
    }
    Ok(Some(out))
}

/// A stable fingerprint of GPT mode's settings (for resume checks).
pub fn fingerprint(s: &GptSettings) -> u64 {
    let mut h = crate::hash::Fnv::new();
    h.write(b"gpt");
    h.write(&s.sequence_length.to_le_bytes());
    h.write(&[s.add_extra_token as u8, s.part as u8, s.order as u8]);
    h.write(&s.num_samples.to_le_bytes());
    h.write(s.split.as_bytes());
    for (w, n) in &s.blend {
        h.write(&w.to_bits().to_le_bytes());
        h.write(&(*n as u64).to_le_bytes());
    }
    h.finish()
}

/// Megatron's `mid_level_dataset_surplus` default.
pub const MID_LEVEL_SURPLUS: f64 = 0.005;

/// Builds the GPT samples of `index` (sequences of `dtype` tokens), without the on-disk cache.
pub fn build(index: &DatasetIndex, dtype: Dtype, s: &GptSettings) -> Result<GptSamples, GptError> {
    build_with_cache(index, dtype, s, false)
}

/// Builds the GPT samples of `index`; with `use_cache`, Megatron-order indices of local Megatron
/// datasets are mapped from (or stored to) the on-disk cache beside each `.idx` ([`cache`]).
pub fn build_with_cache(
    index: &DatasetIndex,
    dtype: Dtype,
    s: &GptSettings,
    use_cache: bool,
) -> Result<GptSamples, GptError> {
    if s.sequence_length == 0 {
        return Err(GptError::Config(
            "dataset.sequence_length must be at least 1".into(),
        ));
    }
    let (mut parts, cache_keys) = parts_of(index, dtype, s)?;
    let seed = u32::try_from(s.seed).map_err(|_| {
        GptError::Config(format!(
            "loader.seed {} : Megatron's seeds (numpy RandomState) are below 2³²",
            s.seed
        ))
    });
    let mut weights = Vec::new();
    let mut order = None;
    match s.order {
        Order::Block => {
            for p in &mut parts {
                p.indices = megatron::build_in_order(
                    &p.sizes,
                    &s.split,
                    s.part,
                    s.sequence_length,
                    s.add_extra_token,
                )?;
            }
            if !s.blend.is_empty() {
                weights = megatron::normalize(&s.blend.iter().map(|b| b.0).collect::<Vec<_>>());
            }
        }
        Order::Megatron if s.blend.is_empty() => {
            let seed = seed?;
            let p = &mut parts[0];
            (p.indices, p.cache) = cache::build_cached_files(
                &p.sizes,
                cache_files(&cache_keys, 0, use_cache),
                &megatron_config(s, seed, (s.num_samples > 0).then_some(s.num_samples)),
                use_cache,
            )?;
            order = p.indices.shuffle_index.take();
        }
        Order::Megatron => {
            let (w, o) = megatron_blend(&mut parts, s, seed?, &cache_keys, use_cache)?;
            (weights, order) = (w, Some(o));
        }
    }
    let mut bases = vec![0u64];
    for p in &parts {
        bases.push(bases.last().copied().unwrap_or(0) + p.indices.samples());
    }
    Ok(GptSamples {
        dtype,
        tokens: s.sequence_length + s.add_extra_token as u32,
        parts,
        bases,
        weights,
        order,
    })
}

/// Per part: the local `.idx` files its indices are cached under, or why there are none.
type CacheKeys = Vec<Result<Vec<std::sync::Arc<MegatronIdx>>, String>>;

/// The datasets' parts — one per blend entry (its shards), or the whole index — with their token
/// sizes (mapped from a Megatron `.idx` where the token type matches) and cache keys.
fn parts_of(
    index: &DatasetIndex,
    dtype: Dtype,
    s: &GptSettings,
) -> Result<(Vec<GptPart>, CacheKeys), GptError> {
    let es = dtype.size() as u64;
    // The datasets: one per blend entry (its shards), or the whole index.
    let shard_groups: Vec<usize> = if s.blend.is_empty() {
        vec![index.shards.len()]
    } else {
        s.blend.iter().map(|b| b.1).collect()
    };
    let mut parts = Vec::with_capacity(shard_groups.len());
    let mut cache_keys: CacheKeys = Vec::with_capacity(shard_groups.len());
    let (mut shard0, mut seq0) = (0usize, 0usize);
    for &nshards in &shard_groups {
        let shard_end = shard0 + nshards;
        // Samples are in shard order: the part ends at the first sample of a later shard.
        let (mut lo, mut hi) = (seq0, index.samples.len());
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if (index.samples.loc(mid).shard as usize) < shard_end {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        let seq_end = lo;
        let sizes = match index.samples.megatron_file(seq0..seq_end) {
            Some(m) if m.dtype().size() as u64 == es => TokenSizes::Mapped(m.clone()),
            _ => TokenSizes::Owned(token_sizes(index, seq0..seq_end, dtype)?.into()),
        };
        cache_keys.push(cache_files_of(index, shard0..shard_end, seq_end - seq0, es));
        parts.push(GptPart {
            first_sequence: seq0 as u64,
            sizes,
            indices: megatron::GptIndices::default(),
            cache: cache::CacheUse::Off,
        });
        shard0 = shard_end;
        seq0 = seq_end;
    }
    Ok((parts, cache_keys))
}

/// Megatron's GPT dataset settings for `num_samples` samples.
fn megatron_config(
    s: &GptSettings,
    seed: u32,
    num_samples: Option<u64>,
) -> megatron::MegatronGptConfig {
    megatron::MegatronGptConfig {
        seed,
        sequence_length: s.sequence_length,
        add_extra_token: s.add_extra_token,
        num_samples,
        split: s.split.clone(),
        part: s.part,
    }
}

/// The `.idx` files part `d`'s indices are cached under; none (said once, counted, in the run summary
/// when the user asked for the cache) where there are none.
fn cache_files(keys: &CacheKeys, d: usize, use_cache: bool) -> &[std::sync::Arc<MegatronIdx>] {
    match &keys[d] {
        Ok(f) => &f[..],
        Err(why) => {
            if use_cache {
                ubdirect_ub::fallback::record(
                    "gpt_index_cache_unavailable",
                    format!(
                        "dataset.gpt_index_cache: {why}; the GPT indices are built at every start"
                    ),
                );
            }
            &[]
        }
    }
}

/// A weighted blend in Megatron's order: every part's indices for its share of `num_samples`, the
/// normalized weights, and the blend's order (one (dataset, sample) pair per sample).
fn megatron_blend(
    parts: &mut [GptPart],
    s: &GptSettings,
    seed: u32,
    cache_keys: &CacheKeys,
    use_cache: bool,
) -> Result<(Vec<f64>, megatron::ShuffleIndex), GptError> {
    if s.num_samples == 0 {
        return Err(GptError::Config(
            "a weighted blend in Megatron order needs dataset.num_samples (Megatron: \
             client-specified weights need a client-specified size)"
                .into(),
        ));
    }
    // The blend's order is one (dataset, sample) pair per sample, built in memory.
    let picks = s.num_samples.saturating_mul(16);
    let limit = crate::formats::memory_total() / 4;
    if picks > limit {
        return Err(GptError::Config(format!(
            "dataset.num_samples {}: a blend's order of {picks} bytes is more than a quarter of this machine's memory ({limit} bytes)",
            s.num_samples
        )));
    }
    let raw: Vec<f64> = s.blend.iter().map(|b| b.0).collect();
    let w = megatron::normalize(&raw);
    if w.iter().any(|x| !(x.is_finite() && *x > 0.0)) {
        return Err(GptError::Config(format!(
            "dataset.blend weights {raw:?} do not normalize to positive shares"
        )));
    }
    let (targets, buffers) = blend::sizes_per_dataset(&w, s.num_samples);
    for (d, (p, &n)) in parts.iter_mut().zip(&buffers).enumerate() {
        (p.indices, p.cache) = cache::build_cached_files(
            &p.sizes,
            cache_files(cache_keys, d, use_cache),
            &megatron_config(s, seed, Some(n)),
            use_cache,
        )?;
    }
    let size: u64 = targets.iter().sum();
    let weights = megatron::normalize(&w);
    let picks = blend::blending_indices(&weights, size);
    let mut counts = vec![0u64; parts.len()];
    for &(d, _) in &picks {
        counts[d as usize] += 1;
    }
    for (d, (c, p)) in counts.iter().zip(parts.iter()).enumerate() {
        if *c > p.indices.samples() {
            return Err(GptError::Config(format!(
                "the blend asks {c} samples of dataset {d}, which has {}",
                p.indices.samples()
            )));
        }
    }
    let mut bases = vec![0u64];
    for p in parts.iter() {
        bases.push(bases.last().copied().unwrap_or(0) + p.indices.samples());
    }
    let order = megatron::ShuffleIndex::U64(
        picks
            .iter()
            .map(|&(d, k)| {
                let sh = parts[d as usize]
                    .indices
                    .shuffle_index
                    .as_ref()
                    .and_then(|v| v.get(k as usize))
                    .unwrap_or(k);
                bases[d as usize] + sh
            })
            .collect(),
    );
    Ok((weights, order))
}

/// The local, mapped Megatron `.idx` files of shards `shards` — holding `sequences` sequences of
/// `es`-byte tokens, in order — that a GPT index cache is keyed by; `Err` says why there are none.
fn cache_files_of(
    index: &DatasetIndex,
    shards: std::ops::Range<usize>,
    sequences: usize,
    es: u64,
) -> Result<Vec<std::sync::Arc<MegatronIdx>>, String> {
    let Some(files) = index.samples.megatron_files() else {
        return Err(format!(
            "the cache keys on local Megatron .idx files, and this {} dataset has none",
            index.format
        ));
    };
    let files = files
        .get(shards.clone())
        .ok_or_else(|| format!("the index holds no .idx for shards {shards:?}"))?;
    for m in files {
        if m.identity().is_none() {
            return Err(format!(
                "{} is not a local file (read through its opener, not mapped)",
                m.path().display()
            ));
        }
        if m.dtype().size() as u64 != es {
            return Err(format!(
                "{} holds {} tokens, not the dataset's",
                m.path().display(),
                m.dtype().name()
            ));
        }
    }
    if files.iter().map(|m| m.sequences()).sum::<usize>() != sequences {
        return Err("the shards' .idx files do not hold the dataset's sequences".into());
    }
    Ok(files.to_vec())
}

/// Token counts of samples `range` (byte lengths that are whole tokens, below 2³¹ tokens).
fn token_sizes(
    index: &DatasetIndex,
    range: std::ops::Range<usize>,
    dtype: Dtype,
) -> Result<Vec<i32>, GptError> {
    let es = dtype.size() as u64;
    range
        .map(|i| {
            let l = index.samples.loc(i);
            if !(l.len as u64).is_multiple_of(es) {
                return Err(GptError::Config(format!(
                    "a sequence of {} bytes is not a whole number of {} tokens",
                    l.len,
                    dtype.name()
                )));
            }
            i32::try_from(l.len as u64 / es)
                .map_err(|_| GptError::Config("a sequence of more than 2³¹ tokens".into()))
        })
        .collect()
}

pub use crate::formats::megatron::megatron_dtype;
