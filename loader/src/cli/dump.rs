//! Where `ubdirect run` and `ubdirect replay` write delivered batches besides the summary:
//! `--dump-samples` (one JSON line per sample) and `--record` (one Arrow IPC record batch per step).

use std::io::Write;

use ubdirect_loader::pipeline::{LoadError, Loader};

/// Where delivered batches are written besides the summary: `--dump-samples` and `--record`.
pub(super) struct Sinks {
    dump: Option<std::io::BufWriter<ubdirect_ub::NewFile>>,
    record: Option<ubdirect_loader::record::StepRecorder>,
}

impl Sinks {
    /// The sinks `--dump-samples` (`dump_samples`) and `--record` (`record`) ask for.
    pub(super) fn open(
        dump_samples: Option<&std::path::Path>,
        record: Option<&std::path::Path>,
        loader: &Loader,
    ) -> Result<Self, LoadError> {
        let (rank, world) = loader.rank_world();
        Ok(Self {
            dump: match dump_samples {
                Some(p) => Some(create_dump(p)?),
                None => None,
            },
            record: match record {
                Some(p) => Some(ubdirect_loader::record::StepRecorder::create(
                    &ubdirect_loader::record::rank_path(p, rank, world),
                    loader.record_meta(),
                )?),
                None => None,
            },
        })
    }

    pub(super) fn take(
        &mut self,
        loader: &Loader,
        epoch: u64,
        rank: usize,
        b: &ubdirect_loader::Batch,
    ) -> Result<(), LoadError> {
        if let Some(w) = self.dump.as_mut() {
            dump_batch(w, loader, epoch, rank, b)?;
        }
        if let Some(r) = self.record.as_mut() {
            r.record(b)?;
        }
        Ok(())
    }

    /// Puts the files in place (each appears whole, or not at all).
    pub(super) fn finish(self) -> Result<(), LoadError> {
        if let Some(w) = self.dump {
            finish_dump(w)?;
        }
        if let Some(r) = self.record {
            r.finish()?;
        }
        Ok(())
    }
}

/// The `--dump-samples` file, created (it appears whole when the run ends, or not at all).
pub(super) fn create_dump(
    p: &std::path::Path,
) -> Result<std::io::BufWriter<ubdirect_ub::NewFile>, LoadError> {
    Ok(std::io::BufWriter::new(
        ubdirect_ub::NewFile::create(p).map_err(|source| LoadError::DumpSamples {
            path: Some(p.to_path_buf()),
            source,
        })?,
    ))
}

/// One batch more on the progress bar, with the rates so far.
/// Writes the `--dump-samples` file out (it appears whole, or not at all).
pub(super) fn finish_dump(w: std::io::BufWriter<ubdirect_ub::NewFile>) -> Result<(), LoadError> {
    w.into_inner()
        .map_err(|e| e.into_error())
        .and_then(|f| f.commit())
        .map_err(|source| LoadError::DumpSamples { path: None, source })
}

/// The progress bar on stderr (`--progress`).
/// One `--dump-samples` line per sample of `b`: where it came from and the CRC of its bytes.
pub(super) fn dump_batch(
    w: &mut impl Write,
    loader: &Loader,
    epoch: u64,
    rank: usize,
    b: &ubdirect_loader::Batch,
) -> Result<(), LoadError> {
    for (i, s) in b.samples().iter().enumerate() {
        let bytes = b.sample_to_vec(i)?;
        let shard = loader.index().shards[s.shard as usize]
            .path
            .display()
            .to_string();
        let line = serde_json::json!({
            "epoch": epoch, "rank": rank, "position": s.position, "sample": s.id,
            "shard": shard, "len": s.len, "crc32": crc32fast::hash(&bytes),
        });
        writeln!(w, "{line}").map_err(|source| LoadError::DumpSamples { path: None, source })?;
    }
    Ok(())
}
