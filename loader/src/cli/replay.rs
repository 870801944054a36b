//! `ubdirect replay`: one recorded step's samples again (`ubdirect run --record`).

use ubdirect_loader::RunConfig;
use ubdirect_loader::pipeline::{LoadError, Loader};

use super::dump::{create_dump, dump_batch, finish_dump};

/// `ubdirect replay`: step `step` of the record `record` delivered again at this config's world size;
/// returns the line to print.
pub fn replay(
    cfg: &RunConfig,
    record: &std::path::Path,
    epoch: Option<u64>,
    step: u64,
    dump_samples: Option<&std::path::Path>,
) -> Result<String, LoadError> {
    let want = ubdirect_loader::record::read_step(record, epoch, step)?;
    let loader = Loader::from_config(cfg)?;
    let (rank, world) = loader.rank_world();
    let mut dump = match dump_samples {
        Some(p) => Some(create_dump(p)?),
        None => None,
    };
    let (mut batches, mut samples) = (0u64, 0u64);
    for b in loader.replay(&want)? {
        let b = b?;
        if let Some(w) = dump.as_mut() {
            dump_batch(w, &loader, want.epoch, rank, &b)?;
        }
        batches += 1;
        samples += b.len() as u64;
    }
    if let Some(w) = dump.take() {
        finish_dump(w)?;
    }
    loader.device().0.synchronize()?;
    Ok(format!(
        "replayed step {} of epoch {} (recorded by {} rank(s), {} samples): rank {rank}/{world} delivered {samples} sample(s) in {batches} batch(es)",
        want.step,
        want.epoch,
        want.meta.world_size,
        want.samples.len()
    ))
}
