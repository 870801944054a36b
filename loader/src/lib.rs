//! ubdirect's loader: read training data from local files, `ub://` servers and object stores into
//! pinned buffers and GPU memory, batch after batch, resumable.
//!
//! The rooms, each importing only the ones before it (`.ci/modcycles` checks there is no circle):
//! - [`formats`] — raw, Megatron `.bin`/`.idx`, `.npy` and Arrow shards indexed into a
//!   [`DatasetIndex`]; [`hash`] — the planner's and GPT's hasher;
//! - [`gpt`] — Megatron-Core's GPT windows and blends, in Megatron's order, and the tensors a step
//!   needs beside the tokens ([`gpt::masks`]);
//! - [`planner`] — an epoch as chunks of ≥ `loader.min_read` (1 MiB) aligned reads;
//! - [`config`] — `RunConfig` and its sections; [`error`] — [`LoadError`];
//! - [`shards`] — one `ShardUrl` parsed once, opening local (io_uring, NVMe passthrough), `ub://`
//!   and object-store shards behind the `Source` seam;
//! - [`pipeline`] — the [`Loader`]: reads landing in leases or mapped page-cache ranges, assembled
//!   into batches on the host or the GPU, recycled on their completions.
//!
//! The `ubdirect` command (`run`, `gen`, `index`, `doctor`, `serve`) is the crate's binary, built on
//! this API.
//!
//! ```no_run
//! use ubdirect_loader::{Loader, RunConfig};
//! let cfg = RunConfig::load(Some(std::path::Path::new("configs/default.toml")))?;
//! let loader = Loader::from_config(&cfg)?;
//! for batch in loader.epoch(0)? {
//!     let batch = batch?;
//!     for (i, s) in batch.samples().iter().enumerate() {
//!         let _bytes = batch.sample_to_vec(i)?; // or batch.device_ptr(i) on a GPU
//!         let _ = s.id;
//!     }
//! }
//! let state = loader.state(); // save; later: loader.resume(&state)
//! # let _ = state;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod config;
pub mod error;
pub mod formats;
pub mod gpt;
pub mod hash;
pub mod pipeline;
pub mod planner;
pub mod report;
pub mod shards;
pub mod written;

pub use config::{ConfigError, RunConfig};
pub use error::LoadError;
/// The dataset index (`formats::index`), at the crate root as before: what every format builds.
pub use formats::index;
pub use formats::index::{DatasetIndex, SampleLoc, Shard};
/// Step records (`pipeline::record`), at the crate root: what every step trained on, and replays.
pub use pipeline::record;
pub use pipeline::{Batch, EpochIter, Loader, LoaderState, SampleEntry};
pub use report::{RunMeter, RunReport};
/// Local datasets and synthetic ones (`shards::dataset`), at the crate root as before.
pub use shards::dataset;
/// Object stores (`shards::object`), at the crate root as before.
pub use shards::object as objstore;

/// Every fallback taken in this process: (kind, count, first detail).
pub fn fallbacks() -> Vec<(String, u64, String)> {
    ubdirect_ub::fallback::snapshot()
        .into_iter()
        .map(|f| (f.kind.to_string(), f.count, f.first_detail))
        .collect()
}
