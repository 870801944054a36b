//! ubdirect's loader crate: run configuration and the `ubdirect run` pipeline.
//!
//! Until the dataset formats and planner land, `run` reads one shard file, block by block, through
//! the io_uring engine into a register-once staging pool and — on a GPU — copies every block into a
//! device pool, recycling each staging block when its copy's event fires. It reports throughput,
//! CPU cost and the path that actually ran.

pub mod config;
pub mod run;
mod sys;

pub use config::{ConfigError, RunConfig};
pub use run::{RunError, RunSummary, run};
