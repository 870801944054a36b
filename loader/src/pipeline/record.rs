//! Step records: what every step trained on, one Arrow IPC record batch per step, and the samples
//! of one step read back for a replay at any world size.
//!
//! `ubdirect run --record FILE` (or [`StepRecorder`]) writes, for every delivered batch, one record
//! batch of its samples' [`Provenance`](crate::pipeline::Provenance) with the step (global batch
//! index), epoch, rank and global position of each sample. The schema's metadata holds the
//! loader's sample and planner fingerprints and the world size, so a replay refuses another
//! dataset. Ranks of one job write one file each (`FILE.rank{R}` when `WORLD_SIZE` > 1);
//! [`read_step`] reads them all.
//!
//! [`Loader::replay`](crate::Loader::replay) delivers a step's samples again, in their global order,
//! at this loader's world size: rank `r` of `W` gets its slice of the step's samples (which must
//! divide among the `W` ranks) — "what did step 41,322 train on" answered with the bytes.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::{ArrayRef, RecordBatch, UInt64Array};
use arrow_schema::{DataType, Field, Schema};

use super::{Batch, EpochIter, LoadError};
pub use crate::error::RecordError;

/// The columns of a step record, in order (all `uint64`).
pub const COLUMNS: [&str; 13] = [
    "epoch",
    "step",
    "rank",
    "position",
    "sample",
    "dataset",
    "window",
    "document",
    "token_offset",
    "documents",
    "length",
    "shard",
    "shard_offset",
];

/// The file of rank `rank` for `--record FILE`: `FILE` itself in a world of one, `FILE.rank{R}`
/// otherwise.
pub fn rank_path(path: &Path, rank: usize, world: usize) -> PathBuf {
    if world <= 1 {
        path.to_path_buf()
    } else {
        let mut s = path.as_os_str().to_os_string();
        s.push(format!(".rank{rank}"));
        PathBuf::from(s)
    }
}

/// The files a record of `path` consists of: `path` itself if it exists, else every
/// `path.rank{R}` beside it (sorted).
pub fn record_files(path: &Path) -> Result<Vec<PathBuf>, RecordError> {
    if path.is_file() {
        return Ok(vec![path.to_path_buf()]);
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let stem = path
        .file_name()
        .map(|n| format!("{}.rank", n.to_string_lossy()))
        .unwrap_or_default();
    let io = |source| RecordError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut out: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map_err(io)?
        .filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name().to_str().is_some_and(|n| {
                n.strip_prefix(&stem)
                    .is_some_and(|r| !r.is_empty() && r.bytes().all(|b| b.is_ascii_digit()))
            })
        })
        .map(|e| e.path())
        .collect();
    out.sort();
    if out.is_empty() {
        return Err(io(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            "no such file, and no FILE.rankN files beside it",
        )));
    }
    Ok(out)
}

fn schema(meta: &RecordMeta) -> Arc<Schema> {
    let fields: Vec<Field> = COLUMNS
        .iter()
        .map(|c| Field::new(*c, DataType::UInt64, false))
        .collect();
    Arc::new(
        Schema::new(fields).with_metadata(
            [
                ("ubdirect.samples_fingerprint", meta.samples_fingerprint),
                ("ubdirect.plan_fingerprint", meta.plan_fingerprint),
                ("ubdirect.world_size", meta.world_size as u64),
                ("ubdirect.batch_size", meta.batch_size as u64),
            ]
            .into_iter()
            .map(|(k, v)| (k, v.to_string()))
            .collect::<arrow_schema::Metadata>(),
        ),
    )
}

/// What a record says about the run that wrote it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordMeta {
    /// [`Loader::samples_fingerprint`](crate::Loader::samples_fingerprint) of the run: what its
    /// sample ids mean.
    pub samples_fingerprint: u64,
    /// [`LoaderState::plan_fingerprint`](crate::LoaderState) of the run.
    pub plan_fingerprint: u64,
    /// Ranks of the run.
    pub world_size: usize,
    /// Samples per batch and rank.
    pub batch_size: usize,
}

/// Writes one Arrow IPC record batch per delivered batch. The file appears whole at
/// [`finish`](Self::finish) (written beside it and renamed; never through a planted link).
pub struct StepRecorder {
    path: PathBuf,
    writer: arrow_ipc::writer::FileWriter<std::io::BufWriter<ubdirect_ub::NewFile>>,
    schema: Arc<Schema>,
}

impl std::fmt::Debug for StepRecorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepRecorder")
            .field("path", &self.path)
            .finish()
    }
}

impl StepRecorder {
    /// Creates the record `path` of a run described by `meta`.
    pub fn create(path: &Path, meta: RecordMeta) -> Result<Self, RecordError> {
        let file = ubdirect_ub::NewFile::create(path).map_err(|source| RecordError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let schema = schema(&meta);
        let writer = arrow_ipc::writer::FileWriter::try_new(std::io::BufWriter::new(file), &schema)
            .map_err(|source| RecordError::Arrow {
                path: path.to_path_buf(),
                source,
            })?;
        Ok(Self {
            path: path.to_path_buf(),
            writer,
            schema,
        })
    }

    /// Records `batch` (a step of this rank).
    pub fn record(&mut self, batch: &Batch) -> Result<(), RecordError> {
        let p = batch.provenance();
        let n = p.sample.len();
        let col = |f: &dyn Fn(usize) -> u64| -> ArrayRef {
            Arc::new(UInt64Array::from_iter_values((0..n).map(f)))
        };
        let s = batch.samples();
        let cols: Vec<ArrayRef> = vec![
            col(&|_| batch.epoch),
            col(&|_| batch.index),
            col(&|_| batch.rank as u64),
            col(&|i| s[i].position),
            col(&|i| p.sample[i]),
            col(&|i| p.dataset[i] as u64),
            col(&|i| p.window[i]),
            col(&|i| p.document[i]),
            col(&|i| p.token_offset[i]),
            col(&|i| p.documents[i] as u64),
            col(&|i| p.length[i] as u64),
            col(&|i| p.shard[i] as u64),
            col(&|i| p.shard_offset[i]),
        ];
        let rb = RecordBatch::try_new(self.schema.clone(), cols).map_err(|source| {
            RecordError::Arrow {
                path: self.path.clone(),
                source,
            }
        })?;
        self.writer.write(&rb).map_err(|source| RecordError::Arrow {
            path: self.path.clone(),
            source,
        })
    }

    /// Ends the file and puts it in place.
    pub fn finish(mut self) -> Result<(), RecordError> {
        let path = self.path.clone();
        self.writer.finish().map_err(|source| RecordError::Arrow {
            path: path.clone(),
            source,
        })?;
        let io = |source| RecordError::Io {
            path: path.clone(),
            source,
        };
        self.writer
            .into_inner()
            .map_err(|source| RecordError::Arrow {
                path: path.clone(),
                source,
            })?
            .into_inner()
            .map_err(|e| io(e.into_error()))?
            .commit()
            .map_err(io)
    }
}

/// The samples of one recorded step, in their global order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepSamples {
    /// The run that recorded them.
    pub meta: RecordMeta,
    /// The epoch.
    pub epoch: u64,
    /// The step (global batch index).
    pub step: u64,
    /// Sample ids, by global position.
    pub samples: Vec<u64>,
    /// Their global positions in the recorded epoch.
    pub positions: Vec<u64>,
}

fn meta_of(path: &Path, schema: &Schema) -> Result<RecordMeta, RecordError> {
    let get = |k: &str| -> Result<u64, RecordError> {
        schema
            .metadata()
            .get(k)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| RecordError::NotARecord {
                path: path.to_path_buf(),
                why: format!("no {k} in the schema's metadata"),
            })
    };
    for c in COLUMNS {
        match schema.field_with_name(c) {
            Ok(f) if f.data_type() == &DataType::UInt64 => {}
            _ => {
                return Err(RecordError::NotARecord {
                    path: path.to_path_buf(),
                    why: format!("no uint64 column {c:?}"),
                });
            }
        }
    }
    Ok(RecordMeta {
        samples_fingerprint: get("ubdirect.samples_fingerprint")?,
        plan_fingerprint: get("ubdirect.plan_fingerprint")?,
        world_size: get("ubdirect.world_size")? as usize,
        batch_size: get("ubdirect.batch_size")? as usize,
    })
}

/// The most ranks a record may claim (a `world_size` past it is a damaged or forged file).
const MOST_RANKS: u64 = 1 << 20;

/// Rows of the record batches read at a time (per column: 512 KiB).
const ROWS_AT_ONCE: u64 = 1 << 16;

/// The rank a record file's name gives (`FILE.rank{R}`), `None` for `FILE` itself.
fn rank_of_name(f: &Path, path: &Path) -> Option<u64> {
    let stem = format!("{}.rank", path.file_name()?.to_string_lossy());
    f.file_name()?.to_str()?.strip_prefix(&stem)?.parse().ok()
}

/// Reads step `step` (of `epoch`, or of the only epoch that recorded it) from the record `path`
/// ([`record_files`]: one file, or one per rank). Every file is untrusted: read through
/// [`crate::formats::arrow::file_batches`] (checked offsets, nothing decoded — no byte can make it
/// panic), its metadata bounded, its ranks the files present (a missing or foreign `.rank` file is
/// an error, not a partial step), and what it holds of a step bounded by the file's size.
pub fn read_step(path: &Path, epoch: Option<u64>, step: u64) -> Result<StepSamples, RecordError> {
    let files = record_files(path)?;
    let names = files
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ");
    let mut meta: Option<(RecordMeta, PathBuf)> = None;
    let mut rows: Vec<(u64, u64, u64)> = Vec::new(); // (epoch, position, sample)
    let mut ranks = Vec::with_capacity(files.len());
    for f in &files {
        let file_rank = rank_of_name(f, path);
        ranks.push(file_rank);
        let m = read_file(f, file_rank, epoch, step, &mut rows)?;
        match &meta {
            Some((was, first))
                if was.samples_fingerprint != m.samples_fingerprint
                    || was.plan_fingerprint != m.plan_fingerprint
                    || was.world_size != m.world_size =>
            {
                return Err(RecordError::Mixed {
                    a: first.clone(),
                    b: f.clone(),
                });
            }
            Some(_) => {}
            None => meta = Some((m, f.clone())),
        }
    }
    // The files are the run's ranks, each once: `FILE` alone for a world of one, else
    // `FILE.rank0` .. `FILE.rank{W-1}`.
    if let Some((m, first)) = &meta {
        let world = m.world_size as u64;
        let want: Vec<Option<u64>> = if world == 1 && ranks == [None] {
            vec![None]
        } else {
            (0..world).map(Some).collect()
        };
        let mut have = ranks.clone();
        have.sort_unstable();
        if have != want {
            let missing: Vec<u64> = (0..world).filter(|r| !have.contains(&Some(*r))).collect();
            return Err(RecordError::NotARecord {
                path: first.clone(),
                why: format!(
                    "written by {world} rank(s), but the files present are {names}{}",
                    if missing.is_empty() || world > 64 {
                        String::new()
                    } else {
                        format!(" (missing ranks {missing:?})")
                    }
                ),
            });
        }
    }
    let mut epochs: Vec<u64> = rows.iter().map(|r| r.0).collect();
    epochs.sort_unstable();
    epochs.dedup();
    let epoch = match epochs[..] {
        [] => {
            return Err(RecordError::NoStep {
                files: names,
                step,
                epoch,
            });
        }
        [e] => e,
        _ => {
            return Err(RecordError::AmbiguousEpoch {
                files: names,
                step,
                epochs,
            });
        }
    };
    rows.sort_unstable_by_key(|r| r.1);
    rows.dedup_by_key(|r| r.1);
    let Some((meta, _)) = meta else {
        return Err(RecordError::NoStep {
            files: names,
            step,
            epoch: Some(epoch),
        });
    };
    Ok(StepSamples {
        meta,
        epoch,
        step,
        positions: rows.iter().map(|r| r.1).collect(),
        samples: rows.iter().map(|r| r.2).collect(),
    })
}

/// One record file's metadata, with the rows of `step` (of `epoch`, when given) appended to `rows`.
fn read_file(
    f: &Path,
    file_rank: Option<u64>,
    epoch: Option<u64>,
    step: u64,
    rows: &mut Vec<(u64, u64, u64)>,
) -> Result<RecordMeta, RecordError> {
    // A regular file only: a FIFO (or a device) planted under a record's name is refused at once,
    // never waited on (`formats::open_regular`: O_NONBLOCK, then fstat on the descriptor).
    let (file, size) = crate::formats::open_regular(f).map_err(|source| RecordError::Io {
        path: f.to_path_buf(),
        source,
    })?;
    read_from(
        &mut std::io::BufReader::new(file),
        size,
        f,
        file_rank,
        epoch,
        step,
        rows,
    )
}

/// A recorded row of a step: (epoch, global position, sample id).
pub type StepRow = (u64, u64, u64);

/// The metadata of the record file `bytes` and its rows of `step` (any epoch): what a replay reads
/// of a file, from memory (for fuzzing; no file is opened).
pub fn parse(bytes: &[u8], step: u64) -> Result<(RecordMeta, Vec<StepRow>), RecordError> {
    let mut rows = Vec::new();
    let m = read_from(
        &mut std::io::Cursor::new(bytes),
        bytes.len() as u64,
        Path::new("(bytes)"),
        None,
        None,
        step,
        &mut rows,
    )?;
    Ok((m, rows))
}

/// [`read_file`] over the `size` bytes of `file`, named `f` in errors.
fn read_from<R: std::io::Read + std::io::Seek>(
    file: &mut R,
    size: u64,
    f: &Path,
    file_rank: Option<u64>,
    epoch: Option<u64>,
    step: u64,
    rows: &mut Vec<(u64, u64, u64)>,
) -> Result<RecordMeta, RecordError> {
    use std::io::{Read, SeekFrom};
    let not = |why: String| RecordError::NotARecord {
        path: f.to_path_buf(),
        why,
    };
    let (schema, batches) =
        crate::formats::arrow::file_batches(file, f, size).map_err(|e| not(e.to_string()))?;
    let m = meta_of(f, &schema)?;
    if !(1..=MOST_RANKS).contains(&(m.world_size as u64)) || m.batch_size == 0 {
        return Err(not(format!(
            "world size {} and batch size {} (a world of 1 to {MOST_RANKS} ranks, batches of at least one sample)",
            m.world_size, m.batch_size
        )));
    }
    let col = |name: &str| COLUMNS.iter().position(|c| *c == name).unwrap_or(0);
    let wanted = [
        col("epoch"),
        col("step"),
        col("rank"),
        col("position"),
        col("sample"),
    ];
    let mut vals: [Vec<u8>; 5] = Default::default();
    for (bi, b) in batches.iter().enumerate() {
        // Each column: a node and two buffers (validity, values), uint64, no nulls.
        if b.nodes.len() != COLUMNS.len() || b.buffers.len() != 2 * COLUMNS.len() {
            return Err(not(format!(
                "record batch {bi}: {} field nodes and {} buffers for {} columns",
                b.nodes.len(),
                b.buffers.len(),
                COLUMNS.len()
            )));
        }
        let mut done = 0u64;
        while done < b.rows {
            let n = (b.rows - done).min(ROWS_AT_ONCE);
            for (k, &c) in wanted.iter().enumerate() {
                let (node_len, nulls) = b.nodes[c];
                let (at, len) = b.buffers[2 * c + 1];
                if node_len as u64 != b.rows || nulls != 0 || len < b.rows.saturating_mul(8) {
                    return Err(not(format!(
                        "record batch {bi}: column {:?} holds {node_len} rows ({nulls} null) in {len} bytes, not {} uint64s",
                        COLUMNS[c], b.rows
                    )));
                }
                let v = &mut vals[k];
                v.clear();
                file.seek(SeekFrom::Start(at + 8 * done))
                    .and_then(|_| (&mut *file).take(8 * n).read_to_end(v))
                    .map_err(|source| RecordError::Io {
                        path: f.to_path_buf(),
                        source,
                    })?;
                if v.len() as u64 != 8 * n {
                    return Err(not(format!("record batch {bi}: cut short at offset {at}")));
                }
            }
            let get = |k: usize, i: usize| {
                u64::from_le_bytes(vals[k][8 * i..8 * i + 8].try_into().unwrap_or([0; 8]))
            };
            for i in 0..n as usize {
                let (ep, st, rank) = (get(0, i), get(1, i), get(2, i));
                if file_rank.is_some_and(|r| r != rank) {
                    return Err(not(format!(
                        "record batch {bi}: a row of rank {rank} in the file of rank {}",
                        file_rank.unwrap_or(0)
                    )));
                }
                if st == step && epoch.is_none_or(|e| e == ep) {
                    rows.push((ep, get(3, i), get(4, i)));
                }
            }
            done += n;
        }
    }
    Ok(m)
}

impl super::Loader {
    /// The description of this run that a step record carries ([`crate::record`]).
    pub fn record_meta(&self) -> RecordMeta {
        let s = self.state();
        RecordMeta {
            samples_fingerprint: self.inner.samples_fingerprint,
            plan_fingerprint: s.plan_fingerprint,
            world_size: self.inner.world,
            batch_size: self.inner.plan_cfg.batch_size,
        }
    }

    /// Delivers a recorded step's samples again, in their global order, at this loader's world size:
    /// this rank gets its slice (the step's samples must divide among the ranks; each batch then
    /// holds `samples / world_size` of them). Refused for a record of other samples (another
    /// dataset, or other GPT settings). The loader's resume state is left as it was.
    pub fn replay(&self, step: &StepSamples) -> Result<EpochIter, LoadError> {
        if step.meta.samples_fingerprint != self.inner.samples_fingerprint {
            return Err(LoadError::Resume(format!(
                "step {} was recorded over other samples (the dataset or the GPT settings differ)",
                step.step
            )));
        }
        let (n, w) = (step.samples.len(), self.inner.world);
        if n == 0 || !n.is_multiple_of(w) {
            return Err(LoadError::Config(format!(
                "step {} holds {n} samples: they do not divide among {w} ranks",
                step.step
            )));
        }
        // Ids from a file: each must name a sample of this dataset (the fingerprint says which
        // dataset, not that the file is whole).
        let total = self.samples().len();
        if let Some((i, id)) = step
            .samples
            .iter()
            .enumerate()
            .find(|(_, id)| **id >= total)
        {
            return Err(LoadError::Resume(format!(
                "step {}: sample {id} (the step's {i}th) is past the dataset's {total} samples",
                step.step
            )));
        }
        let mut cfg = self.inner.plan_cfg.clone();
        cfg.batch_size = n / w;
        let plan = crate::planner::plan_with_order(
            &self.samples(),
            &step.samples,
            &cfg,
            step.epoch,
            self.inner.rank,
            w,
            0,
        )?;
        self.run_plan(step.epoch, Arc::new(plan), false)
    }
}
