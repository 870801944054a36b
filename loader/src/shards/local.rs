//! Local shards (paths, or a listed `dataset.dir`, generated when asked): each opened on the engine
//! through NVMe passthrough or the io_uring file path, as `engine.io` says.

use std::os::unix::fs::MetadataExt;
use std::sync::Arc;
use std::time::Duration;

use ubdirect_nvme::Engine;
use ubdirect_ub::Source;

use super::{Opened, ShardConfig, dedupe};
use crate::config::IoMode;
use crate::error::LoadError;

/// Opens the local dataset of `c.dataset` on `engine`.
pub(super) fn open(c: &ShardConfig<'_>, engine: &Engine) -> Result<Opened, LoadError> {
    let (index, generated) = super::dataset::open_local(c.dataset)?;
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
        registrars: dedupe(sources.iter().flat_map(|s| s.registrars()).collect()),
        index,
        sources,
        deadline: Duration::from_millis(c.engine.op_timeout_ms),
        files,
        devices,
        min_read: 0,
        max_amplification: 0,
        read_ahead: 0,
        generated,
        columns: None,
    })
}
