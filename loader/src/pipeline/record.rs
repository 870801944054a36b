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

use arrow_array::{Array, ArrayRef, RecordBatch, UInt64Array};
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

/// Reads step `step` (of `epoch`, or of the only epoch that recorded it) from the record `path`
/// ([`record_files`]: one file, or one per rank).
pub fn read_step(path: &Path, epoch: Option<u64>, step: u64) -> Result<StepSamples, RecordError> {
    let files = record_files(path)?;
    let names = files
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ");
    let mut meta: Option<(RecordMeta, PathBuf)> = None;
    let mut rows: Vec<(u64, u64, u64)> = Vec::new(); // (epoch, position, sample)
    for f in &files {
        // A regular file only: a FIFO (or a device) planted under a record's name is refused at
        // once, never waited on (`formats::open_regular`: O_NONBLOCK, then fstat on the descriptor).
        let (file, _) = crate::formats::open_regular(f).map_err(|source| RecordError::Io {
            path: f.clone(),
            source,
        })?;
        let arrow = |source| RecordError::Arrow {
            path: f.clone(),
            source,
        };
        let reader = arrow_ipc::reader::FileReader::try_new(std::io::BufReader::new(file), None)
            .map_err(arrow)?;
        let m = meta_of(f, &reader.schema())?;
        match &meta {
            Some((was, first))
                if was.samples_fingerprint != m.samples_fingerprint
                    || was.plan_fingerprint != m.plan_fingerprint =>
            {
                return Err(RecordError::Mixed {
                    a: first.clone(),
                    b: f.clone(),
                });
            }
            Some(_) => {}
            None => meta = Some((m, f.clone())),
        }
        for rb in reader {
            let rb = rb.map_err(arrow)?;
            let c = |name: &str| -> Result<&UInt64Array, RecordError> {
                rb.column_by_name(name)
                    .and_then(|a| a.as_any().downcast_ref::<UInt64Array>())
                    .ok_or_else(|| RecordError::NotARecord {
                        path: f.clone(),
                        why: format!("column {name:?} is not uint64"),
                    })
            };
            let (ep, st, pos, sm) = (c("epoch")?, c("step")?, c("position")?, c("sample")?);
            for i in 0..rb.num_rows() {
                if st.value(i) == step && epoch.is_none_or(|e| e == ep.value(i)) {
                    rows.push((ep.value(i), pos.value(i), sm.value(i)));
                }
            }
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
