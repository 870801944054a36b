//! Local shards (paths, or a listed `dataset.dir`, generated when asked): each opened on the engine
//! through NVMe passthrough or the io_uring file path, as `engine.io` says.

use std::os::unix::fs::MetadataExt;
use std::sync::Arc;
use std::time::Duration;

use ubdirect_nvme::Engine;
use ubdirect_ub::Source;

use super::{Opened, ShardConfig};
use crate::config::IoMode;
use crate::error::LoadError;

/// Opens the local dataset of `c.dataset` on `engine`.
pub(super) fn open(c: &ShardConfig<'_>, engine: &Engine) -> Result<Opened, LoadError> {
    let (index, generated) = super::dataset::open_local(c.dataset)?;
    let cap = max_open_shards(c.engine.max_open_shards);
    if c.engine.io == IoMode::File && index.shards.len() > cap {
        return open_lazy(c, engine, index, generated, cap);
    }
    let mut sources: Vec<Arc<dyn Source>> = Vec::with_capacity(index.shards.len());
    let mut files = Vec::with_capacity(index.shards.len());
    let mut devices = Vec::with_capacity(index.shards.len());
    let mut nvme = ubdirect_nvme::source::NvmeOpener::new(engine);
    for s in &index.shards {
        let passthru =
            |files: &mut Vec<_>, n: ubdirect_nvme::source::NvmeSource| -> Arc<dyn Source> {
                files.push(None);
                Arc::new(n)
            };
        let file = |files: &mut Vec<_>| -> Result<Arc<dyn Source>, LoadError> {
            let f = Arc::new(ubdirect_nvme::FileSource::open(engine, &s.path)?);
            files.push(Some(f.clone()));
            Ok(f)
        };
        let src: Arc<dyn Source> = match c.engine.io {
            IoMode::File => file(&mut files)?,
            IoMode::Nvme => passthru(
                &mut files,
                nvme.open(&s.path).map_err(|e| LoadError::OpenNvme {
                    path: s.path.clone(),
                    source: Box::new(e),
                })?,
            ),
            IoMode::Auto => match nvme.open(&s.path) {
                Ok(n) => passthru(&mut files, n),
                Err(e) => {
                    ubdirect_ub::fallback::record(
                        "nvme_unavailable",
                        format!(
                            "engine.io = \"auto\": {}: {e}; reading through the file path",
                            s.path.display()
                        ),
                    );
                    file(&mut files)?
                }
            },
        };
        if src.size() != s.size {
            return Err(LoadError::ShardChanged {
                path: s.path.clone(),
                indexed: s.size,
                now: src.size(),
            });
        }
        sources.push(src);
        devices.push(std::fs::metadata(&s.path).ok().map(|m| m.dev()));
    }
    Ok(Opened {
        files,
        devices,
        generated,
        ..Opened::new(
            index,
            sources,
            Duration::from_millis(c.engine.op_timeout_ms),
        )
    })
}

/// Shards kept open at once: `engine.max_open_shards`.
fn max_open_shards(configured: usize) -> usize {
    resolved_open_shards(configured).value
}

/// `engine.max_open_shards`: set, or from the descriptor limit (two descriptors per open shard, half
/// the limit left for everything else), between 8 and 16,384.
pub(crate) fn resolved_open_shards(configured: usize) -> crate::config::Resolved {
    if configured > 0 {
        return crate::config::Resolved {
            key: "engine.max_open_shards",
            value: configured,
            why: "set".into(),
        };
    }
    let limit = ubdirect_ub::open_files_limit().min(1 << 20) as usize;
    crate::config::Resolved {
        key: "engine.max_open_shards",
        value: (limit.saturating_sub(256) / 4).clamp(8, 1 << 14),
        why: format!("a quarter of the descriptor limit ({limit}) less 256, between 8 and 16384"),
    }
}

/// A dataset of more shards than may stay open: each opened at its first read, at most `cap` at
/// once (`lazy::OpenFiles`). The first shard is opened once here, for the read path and alignment
/// every shard shares; no other is opened or probed before the first batch.
fn open_lazy(
    c: &ShardConfig<'_>,
    engine: &Engine,
    index: crate::formats::index::DatasetIndex,
    generated: Option<super::dataset::Generated>,
    cap: usize,
) -> Result<Opened, LoadError> {
    let n = index.shards.len();
    let Some(first) = index.shards.first() else {
        return Err(LoadError::Config("a dataset without shards".into()));
    };
    let probe = ubdirect_nvme::FileSource::open(engine, &first.path)?;
    let files = super::lazy::OpenFiles::new(engine.clone(), n, cap);
    ubdirect_ub::fallback::record(
        "shards_on_demand",
        format!(
            "{n} shards, more than the {cap} kept open at once (engine.max_open_shards, or a quarter of the descriptor limit): each is opened at its first read, the least recently used closed; the page-cache pool does not map them"
        ),
    );
    let mut sources: Vec<Arc<dyn Source>> = Vec::with_capacity(n);
    let mut devices = Vec::with_capacity(n);
    let dev = std::fs::metadata(&first.path).ok().map(|m| m.dev());
    for (k, s) in index.shards.iter().enumerate() {
        sources.push(Arc::new(super::lazy::LazyFile::new(
            files.clone(),
            k,
            s.path.clone(),
            s.size,
            &probe,
        )));
        // One device for all (not stat-ed per shard): reads are not balanced over devices.
        devices.push(dev);
    }
    drop(probe);
    Ok(Opened {
        devices,
        generated,
        ..Opened::new(
            index,
            sources,
            Duration::from_millis(c.engine.op_timeout_ms),
        )
    })
}
