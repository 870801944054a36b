//! Opening an `s3://` dataset: a store client per bucket, an [`ObjectSource`] per object, a prefix
//! listed as the shard list, and the index built through the one format dispatch.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::TryStreamExt;
use object_store::ObjectStore;
use object_store::aws::AmazonS3Builder;
use object_store::path::Path as ObjPath;
use ubdirect_nvme::Engine;
use ubdirect_ub::{Source, SourceError, SourceErrorKind};

use super::cache::ChunkCache;
use super::source::{ObjectSource, kind_of, with_retries};
use crate::RunConfig;
use crate::formats::{FormatError, Opener, ShardFile};
use crate::pipeline::LoadError;
use crate::pipeline::sources::{Opened, SourceReader, block_on, dedupe};

/// `s3://bucket/key` → (bucket, key).
pub(crate) fn parse_url(u: &str) -> Result<(String, String), LoadError> {
    let rest = u
        .strip_prefix("s3://")
        .ok_or_else(|| LoadError::Config(format!("{u:?} is not an s3:// URL (s3://BUCKET/KEY)")))?;
    let (bucket, key) = rest.split_once('/').unwrap_or((rest, ""));
    if bucket.is_empty() {
        return Err(LoadError::Config(format!(
            "{u:?}: no bucket (s3://BUCKET/KEY)"
        )));
    }
    Ok((bucket.to_string(), key.trim_matches('/').to_string()))
}

/// Store clients (one per bucket) and opened objects.
struct Objects<'a> {
    rt: &'a tokio::runtime::Runtime,
    cfg: &'a RunConfig,
    deadline: Duration,
    cache: Option<Arc<ChunkCache>>,
    stores: Mutex<HashMap<String, Arc<dyn ObjectStore>>>,
    opened: Mutex<HashMap<String, Arc<ObjectSource>>>,
}

fn open_err(url: &str, e: object_store::Error) -> LoadError {
    LoadError::Read(SourceError::new(kind_of(&e), url, 0, 0).with_source(e))
}

impl Objects<'_> {
    fn store(&self, bucket: &str) -> Result<Arc<dyn ObjectStore>, LoadError> {
        let mut m = self.stores.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = m.get(bucket) {
            return Ok(s.clone());
        }
        let c = &self.cfg.object_store;
        let opts = object_store::ClientOptions::new()
            .with_timeout(self.deadline)
            .with_connect_timeout(self.deadline.min(Duration::from_secs(5)))
            .with_pool_max_idle_per_host(256);
        // The retry loop is ours (every retry and throttling response counted): object_store's off.
        let retry = object_store::RetryConfig {
            max_retries: 0,
            retry_timeout: self.deadline,
            ..object_store::RetryConfig::default()
        };
        let mut b = AmazonS3Builder::from_env()
            .with_bucket_name(bucket)
            .with_client_options(opts)
            .with_retry(retry);
        if !c.endpoint.is_empty() {
            b = b.with_endpoint(&c.endpoint);
        }
        if c.allow_http {
            b = b.with_allow_http(true);
        }
        if !c.region.is_empty() {
            b = b.with_region(&c.region);
        }
        if !c.access_key_id.is_empty() {
            b = b.with_access_key_id(&c.access_key_id);
        }
        if !c.secret_access_key.is_empty() {
            b = b.with_secret_access_key(&c.secret_access_key);
        }
        let s: Arc<dyn ObjectStore> = Arc::new(b.build().map_err(|e| {
            LoadError::Config(format!("[object_store] for bucket {bucket:?}: {e}"))
        })?);
        m.insert(bucket.to_string(), s.clone());
        Ok(s)
    }

    fn until(&self) -> Instant {
        Instant::now() + self.deadline
    }

    /// The object `url`, with its size and entity tag from `meta` (a listing) or a HEAD request.
    fn source(
        &self,
        url: &str,
        meta: Option<&object_store::ObjectMeta>,
    ) -> Result<Arc<ObjectSource>, LoadError> {
        if let Some(s) = self.opened.lock().ok().and_then(|m| m.get(url).cloned()) {
            return Ok(s);
        }
        let (bucket, key) = parse_url(url)?;
        let store = self.store(&bucket)?;
        let location = ObjPath::from(key.as_str());
        let meta = match meta {
            Some(m) => m.clone(),
            None => {
                let until = self.until();
                block_on(self.rt, with_retries(until, || store.head(&location)))?
                    .map_err(|e| open_err(url, e))?
            }
        };
        let s = Arc::new(ObjectSource::new(
            store,
            location,
            url.to_string(),
            meta.size,
            meta.e_tag.clone(),
            self.cfg.object_store.max_request.0 as usize,
            self.cache.clone(),
        ));
        if let Ok(mut m) = self.opened.lock() {
            m.insert(url.to_string(), s.clone());
        }
        Ok(s)
    }

    /// The objects under `s3://bucket/prefix` whose names end in `ext`, sorted (opened from the
    /// listing, no HEAD each).
    fn list(&self, dir: &str, ext: &str) -> Result<Vec<PathBuf>, LoadError> {
        let (bucket, prefix) = parse_url(dir)?;
        let store = self.store(&bucket)?;
        let p = ObjPath::from(prefix.as_str());
        let until = self.until();
        let metas: Vec<object_store::ObjectMeta> = block_on(
            self.rt,
            with_retries(until, || store.list(Some(&p)).try_collect::<Vec<_>>()),
        )?
        .map_err(|e| open_err(dir, e))?;
        let mut out = Vec::new();
        for m in metas {
            let name = m.location.as_ref();
            if !name.ends_with(ext) {
                continue;
            }
            let url = format!("s3://{bucket}/{name}");
            self.source(&url, Some(&m))?;
            out.push(PathBuf::from(url));
        }
        out.sort();
        if out.is_empty() {
            return Err(LoadError::Config(format!("no *{ext} objects under {dir}")));
        }
        Ok(out)
    }
}

fn format_err(path: &Path, e: LoadError) -> FormatError {
    FormatError::Io {
        path: path.to_path_buf(),
        source: std::io::Error::other(e),
    }
}

impl Opener for Objects<'_> {
    fn open(&self, path: &Path) -> Result<Box<dyn ShardFile + '_>, FormatError> {
        let src = self
            .source(&path.to_string_lossy(), None)
            .map_err(|e| format_err(path, e))?;
        let r = SourceReader::new(self.rt, src, self.deadline).map_err(|e| format_err(path, e))?;
        Ok(Box::new(r))
    }

    fn size(&self, path: &Path) -> Result<u64, FormatError> {
        self.source(&path.to_string_lossy(), None)
            .map(|s| s.size())
            .map_err(|e| format_err(path, e))
    }
}

/// Opens an `s3://` dataset (`dataset.paths`, or `dataset.dir` as a prefix to list) and indexes it
/// through the same format dispatch as local shards; with `cache.dir` set, reads go through the chunk
/// cache on `engine`.
pub(crate) fn open(
    rt: &tokio::runtime::Runtime,
    cfg: &RunConfig,
    engine: &Engine,
) -> Result<Opened, LoadError> {
    let cache = match &cfg.cache.dir {
        Some(d) => Some(Arc::new(
            ChunkCache::new(
                &crate::config::expand_home(d),
                cfg.cache.max_bytes.0,
                cfg.cache.chunk_size.0,
                engine,
            )
            .map_err(|e| LoadError::Config(format!("cache.dir {}: {e}", d.display())))?,
        )),
        None => None,
    };
    let objects = Objects {
        rt,
        cfg,
        deadline: Duration::from_millis(cfg.remote.deadline_ms.max(1)),
        cache,
        stores: Mutex::new(HashMap::new()),
        opened: Mutex::new(HashMap::new()),
    };
    let ds = &cfg.dataset;
    let paths = if !ds.paths.is_empty() {
        if let Some(p) = ds.paths.iter().find(|p| !super::is_object_url(p)) {
            return Err(LoadError::Config(format!(
                "dataset.paths mixes s3:// and other paths ({})",
                p.display()
            )));
        }
        // Every object opened first, so that a refusal is a typed error, not a parser's I/O error.
        for p in &ds.paths {
            if ds.format == crate::formats::Format::Megatron {
                let (i, b) =
                    crate::formats::megatron::idx_and_bin(&crate::formats::megatron::prefix_of(p));
                objects.source(&i.to_string_lossy(), None)?;
                objects.source(&b.to_string_lossy(), None)?;
            } else {
                objects.source(&p.to_string_lossy(), None)?;
            }
        }
        ds.paths.clone()
    } else {
        let dir = ds
            .dir
            .as_ref()
            .ok_or_else(|| LoadError::Config("set dataset.dir or dataset.paths".into()))?;
        objects.list(&dir.to_string_lossy(), ds.format.extension())?
    };
    let index = crate::dataset::index_with(ds, &paths, &objects)?;
    let mut sources: Vec<Arc<dyn Source>> = Vec::with_capacity(index.shards.len());
    for s in &index.shards {
        let src = objects.source(&s.path.to_string_lossy(), None)?;
        if src.size() != s.size {
            return Err(LoadError::Read(SourceError::new(
                SourceErrorKind::Changed,
                src.shard(),
                0,
                0,
            )));
        }
        sources.push(src);
    }
    Ok(Opened {
        registrars: dedupe(sources.iter().flat_map(|s| s.registrars()).collect()),
        files: vec![None; index.shards.len()],
        index,
        sources,
        deadline: objects.deadline,
    })
}
