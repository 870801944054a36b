//! `ubdirect._native`: the Rust loader as a Python extension. The Python package (`ubdirect/`) wraps
//! it with numpy sample tables and a PyTorch `IterableDataset`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::exceptions::{PyRuntimeError, PyStopIteration, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use ubdirect_loader::pipeline::Next;
use ubdirect_loader::{LoaderState, RunConfig, RunMeter};

mod dlpack;

fn err(e: impl std::fmt::Display) -> PyErr {
    PyRuntimeError::new_err(e.to_string())
}

/// The dataset iterator. `Loader(config_path=None, config_json=None, rank=None, world_size=None)`;
/// the Python wrapper accepts a path or a dict.
#[pyclass(module = "ubdirect._native")]
struct Loader {
    inner: Arc<ubdirect_loader::Loader>,
    resume: Mutex<Option<LoaderState>>,
    batches: usize,
    /// What the iterators measure as they go, for `summary()` (the CLI's run report).
    meter: Arc<Mutex<RunMeter>>,
}

#[pymethods]
impl Loader {
    #[new]
    #[pyo3(signature = (config_path=None, config_json=None, rank=None, world_size=None, host=false))]
    fn new(
        py: Python<'_>,
        config_path: Option<String>,
        config_json: Option<String>,
        rank: Option<usize>,
        world_size: Option<usize>,
        host: bool,
    ) -> PyResult<Self> {
        let mut cfg = match (config_path, config_json) {
            (Some(p), None) => RunConfig::load(Some(std::path::Path::new(&p)))
                .map_err(|e| PyValueError::new_err(e.to_string()))?,
            (None, Some(j)) => RunConfig::from_json(&j, "dict")
                .map_err(|e| PyValueError::new_err(e.to_string()))?,
            (None, None) => {
                RunConfig::load(None).map_err(|e| PyValueError::new_err(e.to_string()))?
            }
            _ => {
                return Err(PyValueError::new_err(
                    "give a config path or a config dict, not both",
                ));
            }
        };
        if rank.is_some() {
            cfg.loader.rank = rank;
        }
        if world_size.is_some() {
            cfg.loader.world_size = world_size;
        }
        if host {
            // A DataLoader worker: its batches cross a process boundary, which host memory does.
            cfg.device.select = ubdirect_ub::DeviceSelection::Host;
        }
        // DLPack needs one buffer per batch; on a GPU batches are one block anyway.
        cfg.loader.contiguous_batches = true;
        let mut meter = RunMeter::new();
        let loader = py
            .allow_threads(|| ubdirect_loader::Loader::from_config(&cfg))
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        meter.built(&loader);
        let batches = loader.batches_in_epoch(0).map_err(err)? as usize;
        warn_as_the_cli_says(py, &loader)?;
        Ok(Self {
            inner: Arc::new(loader),
            resume: Mutex::new(None),
            batches,
            meter: Arc::new(Mutex::new(meter)),
        })
    }

    /// Batches per epoch on this rank.
    fn __len__(&self) -> usize {
        self.batches
    }

    /// Iterates the batches of `epoch`; after `load_state_dict`, the state's epoch resumes where it
    /// stopped (a state taken at an epoch's end: the next epoch from its start), and another epoch is
    /// an error (the state stays loaded).
    fn epoch(&self, epoch: u64) -> PyResult<EpochIterator> {
        let mut pending = self.resume.lock().map_err(err)?;
        self.meter.lock().map_err(err)?.epoch_begin(&self.inner);
        let it = match pending.as_ref() {
            Some(st) => {
                let (want, _) = self
                    .inner
                    .resume_point(st)
                    .map_err(|e| PyValueError::new_err(format!("state_dict: {e}")))?;
                if want != epoch {
                    return Err(PyValueError::new_err(format!(
                        "loader.epoch({epoch}): the loaded state_dict continues epoch {want} (saved at epoch {}, batch {}); call loader.epoch({want}), or make a new Loader to start elsewhere",
                        st.epoch, st.next_batch
                    )));
                }
                let it = self.inner.resume(st).map_err(err)?;
                *pending = None;
                it
            }
            None => self.inner.epoch(epoch).map_err(err)?,
        };
        self.meter.lock().map_err(err)?.epoch_ready();
        Ok(self.iterator(it))
    }

    /// Step `step` of a record (`ubdirect run --record`, or `Loader.recorder`) delivered again at
    /// this loader's world size: this rank's slice of the step's samples, in their global order.
    #[pyo3(signature = (record, step, epoch=None))]
    fn replay(
        &self,
        record: std::path::PathBuf,
        step: u64,
        epoch: Option<u64>,
    ) -> PyResult<EpochIterator> {
        let s = ubdirect_loader::record::read_step(&record, epoch, step).map_err(err)?;
        self.meter.lock().map_err(err)?.epoch_begin(&self.inner);
        let it = self.inner.replay(&s).map_err(err)?;
        self.meter.lock().map_err(err)?.epoch_ready();
        Ok(self.iterator(it))
    }

    /// A step recorder over `path` (`path.rank{R}` with several ranks): `record(batch)` per step,
    /// then `close()` puts the file in place.
    fn recorder(&self, path: std::path::PathBuf) -> PyResult<Recorder> {
        let (rank, world) = self.inner.rank_world();
        let r = ubdirect_loader::record::StepRecorder::create(
            &ubdirect_loader::record::rank_path(&path, rank, world),
            self.inner.record_meta(),
        )
        .map_err(err)?;
        Ok(Recorder {
            inner: Mutex::new(Some(r)),
        })
    }

    /// Where the loader stands (epoch, next batch, global position, rank, world size,
    /// fingerprints): a plain dict. It resumes at any world size (the position is global).
    fn state_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.state();
        let d = PyDict::new(py);
        d.set_item("epoch", s.epoch)?;
        d.set_item("next_batch", s.next_batch)?;
        d.set_item("position", s.position)?;
        d.set_item("rank", s.rank)?;
        d.set_item("world_size", s.world_size)?;
        d.set_item("plan_fingerprint", s.plan_fingerprint)?;
        d.set_item("index_fingerprint", s.index_fingerprint)?;
        d.set_item("settings", s.settings.clone())?;
        Ok(d)
    }

    /// Restores a `state_dict()`; the next `epoch(state["epoch"])` continues exactly there.
    fn load_state_dict(&self, state: &Bound<'_, PyDict>) -> PyResult<()> {
        let get = |k: &str| -> PyResult<u64> {
            state
                .get_item(k)?
                .ok_or_else(|| PyValueError::new_err(format!("state_dict lacks {k:?}")))?
                .extract()
        };
        let position = match state.get_item("position")? {
            Some(v) if !v.is_none() => Some(v.extract::<u64>()?),
            _ => None,
        };
        let settings = match state.get_item("settings")? {
            Some(v) if !v.is_none() => v.extract()?,
            _ => Default::default(),
        };
        let st = LoaderState {
            epoch: get("epoch")?,
            next_batch: get("next_batch")?,
            position,
            rank: get("rank")? as usize,
            world_size: get("world_size")? as usize,
            plan_fingerprint: get("plan_fingerprint")?,
            index_fingerprint: get("index_fingerprint")?,
            settings,
        };
        // Checked now, so a wrong state fails here (naming the settings that differ) rather than at
        // the next epoch. Rank and world size may differ: the position is global.
        self.inner
            .resume_point(&st)
            .map_err(|e| PyValueError::new_err(format!("state_dict: {e}")))?;
        *self.resume.lock().map_err(err)? = Some(st);
        Ok(())
    }

    /// The run report as JSON (`ubdirect run --json`'s fields): device, paths, counters, start-up,
    /// per-epoch rates and every fallback.
    fn _summary_json(&self) -> PyResult<String> {
        let meter = self.meter.lock().map_err(err)?;
        let report = ubdirect_loader::RunReport::new(&self.inner, &meter);
        serde_json::to_string(&report).map_err(err)
    }

    /// Free and total blocks of the staging and batch pools.
    fn pool_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (staging, batch) = self.inner.pools();
        let d = PyDict::new(py);
        let s = staging.stats();
        d.set_item("staging_free", s.free)?;
        d.set_item("staging_total", s.total)?;
        d.set_item("registrations", s.registrations)?;
        if let Some(b) = batch {
            let b = b.stats();
            d.set_item("batch_free", b.free)?;
            d.set_item("batch_total", b.total)?;
        }
        Ok(d)
    }

    /// What one whole sample is: `(dtype name, shape or None, None)`, or `(None, None, why not)`.
    #[allow(clippy::type_complexity)] // a plain tuple for Python
    fn _sample_type(&self) -> (Option<&'static str>, Option<Vec<u64>>, Option<String>) {
        match self.inner.sample_type() {
            Ok(t) => (Some(t.dtype.name()), t.shape.clone(), None),
            Err(why) => (None, None, Some(why.to_string())),
        }
    }

    /// `"cuda"` or `"host"`.
    #[getter]
    fn device_kind(&self) -> String {
        self.inner.device().0.info().kind.to_string()
    }
}

impl Loader {
    /// An iterator over `it` that feeds this loader's meter.
    fn iterator(&self, it: ubdirect_loader::EpochIter) -> EpochIterator {
        EpochIterator {
            it: Mutex::new(Some(it)),
            loader: self.inner.clone(),
            meter: self.meter.clone(),
        }
    }
}

/// The batches of one epoch. Waiting releases the GIL and wakes every 100 ms to honour Ctrl-C.
#[pyclass(module = "ubdirect._native")]
struct EpochIterator {
    it: Mutex<Option<ubdirect_loader::EpochIter>>,
    loader: Arc<ubdirect_loader::Loader>,
    meter: Arc<Mutex<RunMeter>>,
}

impl EpochIterator {
    /// The epoch is over for the report (delivered, stopped or interrupted).
    fn ended(&self) {
        if let Ok(mut m) = self.meter.lock() {
            m.epoch_end(&self.loader);
        }
    }
}

#[pymethods]
impl EpochIterator {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Batch> {
        loop {
            let next = py.allow_threads(|| {
                let mut g = self.it.lock().map_err(|e| e.to_string())?;
                Ok::<_, String>(match g.as_mut() {
                    Some(it) => it.next_within(Duration::from_millis(100)),
                    None => Next::End,
                })
            });
            match next.map_err(err)? {
                Next::Batch(Ok(b)) => {
                    if let Ok(mut m) = self.meter.lock() {
                        m.batch(&self.loader, &b);
                    }
                    return Ok(Batch { inner: Arc::new(b) });
                }
                Next::Batch(Err(e)) => return Err(err(e)),
                Next::End => {
                    if self.it.lock().map_err(err)?.take().is_some() {
                        self.ended();
                    }
                    return Err(PyStopIteration::new_err(()));
                }
                Next::Pending => {
                    if let Err(e) = py.check_signals() {
                        // Interrupted: stop the epoch (its blocks return as their I/O completes).
                        self.it.lock().map_err(err)?.take();
                        self.ended();
                        return Err(e);
                    }
                }
            }
        }
    }

    /// Batches this iterator has yet to deliver (after a resume: what remains of the epoch).
    fn __len__(&self) -> PyResult<usize> {
        Ok(self
            .it
            .lock()
            .map_err(err)?
            .as_ref()
            .map_or(0, |i| i.remaining() as usize))
    }

    /// Stops the epoch now.
    fn close(&self) -> PyResult<()> {
        if self.it.lock().map_err(err)?.take().is_some() {
            self.ended();
        }
        Ok(())
    }
}

/// One batch: one buffer (host or GPU memory) and a sample table. Exposes the DLPack protocol.
#[pyclass(module = "ubdirect._native")]
struct Batch {
    inner: Arc<ubdirect_loader::Batch>,
}

/// Writes one Arrow IPC record batch per step (`Loader.recorder`).
#[pyclass(module = "ubdirect._native")]
struct Recorder {
    inner: Mutex<Option<ubdirect_loader::record::StepRecorder>>,
}

#[pymethods]
impl Recorder {
    /// Records `batch` (one step of this rank).
    fn record(&self, batch: &Batch) -> PyResult<()> {
        let mut g = self.inner.lock().map_err(err)?;
        let r = g.as_mut().ok_or_else(|| err("the recorder is closed"))?;
        r.record(&batch.inner).map_err(err)
    }

    /// Ends the file and puts it in place (a second call does nothing).
    fn close(&self) -> PyResult<()> {
        let r = self.inner.lock().map_err(err)?.take();
        match r {
            Some(r) => r.finish().map_err(err),
            None => Ok(()),
        }
    }
}

impl Batch {
    fn extent(&self) -> usize {
        self.inner
            .samples()
            .iter()
            .map(|s| s.offset + s.len as usize)
            .max()
            .unwrap_or(0)
    }

    fn table(&self, f: impl Fn(&ubdirect_loader::SampleEntry) -> u64) -> Vec<u8> {
        self.inner
            .samples()
            .iter()
            .flat_map(|s| f(s).to_le_bytes())
            .collect()
    }
}

#[pymethods]
impl Batch {
    fn __len__(&self) -> usize {
        self.inner.len()
    }

    #[getter]
    fn epoch(&self) -> u64 {
        self.inner.epoch
    }

    #[getter]
    fn index(&self) -> u64 {
        self.inner.index
    }

    /// Bytes covered by the DLPack tensor (up to the end of the last sample).
    #[getter]
    fn nbytes(&self) -> usize {
        self.extent()
    }

    /// Sample ids, offsets and lengths as little-endian u64 bytes (the package wraps them in numpy).
    fn _ids(&self) -> Vec<u8> {
        self.table(|s| s.id)
    }
    fn _offsets(&self) -> Vec<u8> {
        self.table(|s| s.offset as u64)
    }
    fn _lengths(&self) -> Vec<u8> {
        self.table(|s| s.len as u64)
    }
    fn _positions(&self) -> Vec<u8> {
        self.table(|s| s.position)
    }

    /// Where each sample comes from (`Batch::provenance`), every field as little-endian u64 bytes
    /// (the package wraps them in numpy).
    fn _provenance(&self) -> Vec<(&'static str, Vec<u8>)> {
        let p = self.inner.provenance();
        let le = |v: &[u64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let le32 = |v: &[u32]| {
            v.iter()
                .flat_map(|x| (*x as u64).to_le_bytes())
                .collect::<Vec<u8>>()
        };
        vec![
            ("sample", le(&p.sample)),
            ("dataset", le32(&p.dataset)),
            ("window", le(&p.window)),
            ("document", le(&p.document)),
            ("token_offset", le(&p.token_offset)),
            ("documents", le32(&p.documents)),
            ("length", le32(&p.length)),
            ("shard", le32(&p.shard)),
            ("shard_offset", le(&p.shard_offset)),
        ]
    }

    /// Several-column samples (`dataset.columns`): sample `i`'s parts as (offset in the batch
    /// buffer, length), one per column; `None` otherwise.
    fn parts(&self, i: usize) -> Option<Vec<(usize, u32)>> {
        let s = self.inner.samples().get(i)?;
        self.inner
            .parts(i)
            .map(|p| p.iter().map(|&(o, l)| (s.offset + o as usize, l)).collect())
    }

    /// GPT batches: `(rows, tokens per row, dtype name)`; `None` for whole samples.
    #[getter]
    fn token_shape(&self) -> Option<(usize, usize, &'static str)> {
        self.inner
            .tokens()
            .map(|t| (t.rows, t.cols, t.dtype.name()))
    }

    /// GPT batches with `[dataset.tensors]`: Megatron's tensor `name` (`position_ids`,
    /// `loss_mask`, `cu_seqlens`, `attention_mask`) as a DLPack view on the batch's device
    /// (`None` when the batch has no such tensor).
    fn _tensor(&self, name: &str) -> PyResult<Option<Tensor>> {
        let (Some(t), Some(b)) = (self.inner.tensors(), self.inner.block()) else {
            return Ok(None);
        };
        let l = &t.layout;
        let (rows, s) = (l.rows as i64, l.seq_len as i64);
        let (at, shape, dtype) = match name {
            "position_ids" => (
                l.position_ids,
                vec![rows, s],
                dlpack::scalar(dlpack::INT, 64),
            ),
            "loss_mask" => (
                l.loss_mask,
                vec![rows, s],
                dlpack::scalar(dlpack::FLOAT, 32),
            ),
            "cu_seqlens" => (
                l.cu_seqlens,
                vec![t.cu_seqlens.len() as i64],
                dlpack::scalar(dlpack::INT, 32),
            ),
            "attention_mask" => match l.attention_mask {
                Some(a) => (a, vec![rows, 1, s, s], dlpack::scalar(dlpack::DL_BOOL, 8)),
                None => return Ok(None),
            },
            _ => return Err(err(format!("no GPT tensor named {name:?}"))),
        };
        Ok(Some(Tensor {
            owner: self.inner.clone(),
            addr: b.addr + at as u64,
            shape,
            dtype: (dtype.code, dtype.bits),
            device: dl_device_of(&b),
        }))
    }

    /// GPT batches with `[dataset.tensors]`: the longest segment of `cu_seqlens` (a host integer,
    /// as FlashAttention's varlen call takes it) and `cu_seqlens` on the host.
    fn _seqlens(&self) -> Option<(i32, Vec<i32>)> {
        self.inner
            .tensors()
            .map(|t| (t.max_seqlen, t.cu_seqlens.clone()))
    }

    /// A copy of sample `i`'s bytes (from host or device memory).
    fn sample_bytes(&self, py: Python<'_>, i: usize) -> PyResult<Py<pyo3::types::PyBytes>> {
        let v = py
            .allow_threads(|| self.inner.sample_to_vec(i))
            .map_err(err)?;
        Ok(pyo3::types::PyBytes::new(py, &v).unbind())
    }

    fn __dlpack_device__(&self) -> PyResult<(i32, i32)> {
        let b = self
            .inner
            .block()
            .ok_or_else(|| err("batch is not a single block"))?;
        Ok(dl_device_of(&b))
    }

    /// The DLPack capsule. Batches are delivered only after their copies' CUDA events have fired, so
    /// the data is complete for any consumer stream: `stream` needs no extra synchronization.
    #[pyo3(signature = (stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__(
        &self,
        py: Python<'_>,
        stream: Option<PyObject>,
        max_version: Option<PyObject>,
        dl_device: Option<PyObject>,
        copy: Option<bool>,
    ) -> PyResult<PyObject> {
        let _ = stream;
        let versioned = dlpack::wants_versioned(py, max_version)?;
        let b = self
            .inner
            .block()
            .ok_or_else(|| err("batch is not a single block"))?;
        let (device_type, device_id) = dl_device_of(&b);
        check_handover(py, copy, dl_device, (device_type, device_id))?;
        let device = dlpack::DLDevice {
            device_type,
            device_id,
        };
        match self.inner.tokens() {
            // GPT batches: a (batch, sequence_length + 1) array of the dataset's token type.
            Some(t) => {
                let dt = dlpack::dtype(t.dtype)
                    .ok_or_else(|| err(format!("no DLPack type for {}", t.dtype.name())))?;
                dlpack::capsule_nd(
                    py,
                    self.inner.clone(),
                    b.addr + t.offset as u64,
                    &[t.rows as i64, t.cols as i64],
                    dt,
                    device,
                    versioned,
                )
            }
            None => dlpack::capsule(
                py,
                self.inner.clone(),
                b.addr,
                self.extent(),
                device,
                versioned,
            ),
        }
    }
}

/// The DLPack `(device_type, device_id)` of a batch's block.
fn dl_device_of(b: &ubdirect_loader::pipeline::BlockRef) -> (i32, i32) {
    if b.on_device {
        (dlpack::DL_CUDA, b.device_ordinal.unwrap_or(0) as i32)
    } else {
        (dlpack::DL_CPU, 0)
    }
}

/// DLPack's hand-over arguments checked: no copy is made, and a `dl_device` asked for must be the
/// data's own (no cross-device copies).
fn check_handover(
    py: Python<'_>,
    copy: Option<bool>,
    dl_device: Option<PyObject>,
    device: (i32, i32),
) -> PyResult<()> {
    if copy == Some(true) {
        return Err(pyo3::exceptions::PyBufferError::new_err(
            "ubdirect batches are handed over without a copy (copy=True unsupported)",
        ));
    }
    if let Some(d) = dl_device {
        let d: (i32, i32) = d.extract(py)?;
        if d != device {
            return Err(pyo3::exceptions::PyBufferError::new_err(
                "dl_device differs from the batch's device (no cross-device copies)",
            ));
        }
    }
    Ok(())
}

/// One tensor of a batch's block (a GPT batch's Megatron tensors), handed over by DLPack; it keeps
/// the batch alive.
#[pyclass(module = "ubdirect._native")]
struct Tensor {
    owner: Arc<ubdirect_loader::Batch>,
    addr: u64,
    shape: Vec<i64>,
    dtype: (u8, u8),
    device: (i32, i32),
}

#[pymethods]
impl Tensor {
    #[getter]
    fn shape(&self) -> Vec<i64> {
        self.shape.clone()
    }

    fn __dlpack_device__(&self) -> (i32, i32) {
        self.device
    }

    /// The DLPack capsule (no copy; the data is complete: see `Batch.__dlpack__`).
    #[pyo3(signature = (stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__(
        &self,
        py: Python<'_>,
        stream: Option<PyObject>,
        max_version: Option<PyObject>,
        dl_device: Option<PyObject>,
        copy: Option<bool>,
    ) -> PyResult<PyObject> {
        let _ = stream;
        let versioned = dlpack::wants_versioned(py, max_version)?;
        check_handover(py, copy, dl_device, self.device)?;
        dlpack::capsule_nd(
            py,
            self.owner.clone(),
            self.addr,
            &self.shape,
            dlpack::scalar(self.dtype.0, self.dtype.1),
            dlpack::DLDevice {
                device_type: self.device.0,
                device_id: self.device.1,
            },
            versioned,
        )
    }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Loader>()?;
    m.add_class::<EpochIterator>()?;
    m.add_class::<Batch>()?;
    m.add_class::<Tensor>()?;
    m.add_class::<Recorder>()?;
    Ok(())
}

/// What `ubdirect run` says loudly, said in Python too (a training script trained on generated
/// data without a word): the synthetic dataset written, and every fallback taken so far (no GPU,
/// buffered reads, ...), each a `UserWarning` (Python's filters show each once).
fn warn_as_the_cli_says(py: Python<'_>, loader: &ubdirect_loader::Loader) -> PyResult<()> {
    let category = py.get_type::<pyo3::exceptions::PyUserWarning>();
    let mut lines: Vec<String> = loader
        .generated()
        .map(|g| g.to_string())
        .into_iter()
        .collect();
    lines.extend(
        ubdirect_loader::fallbacks()
            .into_iter()
            .map(|(kind, count, detail)| format!("ubdirect fallback {kind} ×{count}: {detail}")),
    );
    for line in lines {
        let msg = std::ffi::CString::new(line.replace('\0', " ")).unwrap_or_default();
        PyErr::warn(py, &category, &msg, 1)?;
    }
    Ok(())
}
