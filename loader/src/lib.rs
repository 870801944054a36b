//! ubdirect's loader: dataset formats, the epoch planner, the async pipeline and the resumable
//! iterator, plus the `ubdirect` command's run logic.
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
pub mod shards;

pub use config::{ConfigError, RunConfig};
pub use error::LoadError;
/// The dataset index (`formats::index`), at the crate root as before: what every format builds.
pub use formats::index;
pub use formats::index::{DatasetIndex, SampleLoc, Shard};
pub use pipeline::{Batch, EpochIter, Loader, LoaderState, SampleEntry};
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
