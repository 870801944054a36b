//! Opening an object-store dataset (`s3://`, `gs://`, `az://`, `https://`): a store client per bucket, an [`ObjectSource`] per object, a prefix
//! listed as the shard list, and the index built through the one format dispatch.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::TryStreamExt;
use object_store::ObjectStore;
use object_store::aws::AmazonS3Builder;
use object_store::azure::MicrosoftAzureBuilder;
use object_store::gcp::GoogleCloudStorageBuilder;
use object_store::http::HttpBuilder;
use object_store::path::Path as ObjPath;
use ubdirect_nvme::Engine;
use ubdirect_ub::{Source, SourceError, SourceErrorKind};

use super::cache::ChunkCache;
use super::source::{ObjectSource, kind_of, with_retries};
use crate::config::{DatasetSection, ObjectStoreSection};
use crate::error::LoadError;
use crate::formats::index::DatasetIndex;
use crate::formats::{FormatError, Opener, ShardFile};
use crate::shards::{
    ObjectUrl, Opened, Scheme, ShardConfig, ShardKind, ShardUrl, SourceReader, block_on,
};

/// Bound on a planned read's bytes ÷ its samples' bytes for object stores (`PlanConfig::max_amplification`).
const OBJECT_AMPLIFICATION: u64 = 2;

/// The parsed object URL `u` (an error when it names no object store).
fn object_url_of(u: &str) -> Result<ObjectUrl, LoadError> {
    match ShardUrl::parse(Path::new(u))? {
        ShardUrl::Object(o) => Ok(o),
        _ => Err(LoadError::BadUrl {
            url: u.to_string(),
            why: format!(
                "{u:?}: not an object-store scheme (expected s3://BUCKET/KEY, gs://BUCKET/KEY, az://CONTAINER/KEY or https://HOST/PATH)"
            ),
        }),
    }
}

/// Store clients (one per bucket, container or HTTP origin) and opened objects.
struct Objects<'a> {
    rt: &'a tokio::runtime::Runtime,
    cfg: &'a ObjectStoreSection,
    deadline: Duration,
    cache: Option<Arc<ChunkCache>>,
    stores: Mutex<HashMap<String, Arc<dyn ObjectStore>>>,
    opened: Mutex<HashMap<String, Arc<ObjectSource>>>,
    /// Bound on GETs in flight without a cache (`object_store.max_in_flight`), shared by the objects.
    in_flight: Option<Arc<tokio::sync::Semaphore>>,
}

fn open_err(url: &str, e: object_store::Error) -> LoadError {
    LoadError::Read(SourceError::new(kind_of(&e), url, 0, 0).with_source(e))
}

/// The credential variables of a store whose config and environment give none (the client then
/// asks a metadata service, whose refusal says nothing about what to set); `None` when some are set.
pub(crate) fn missing_credentials(
    scheme: Scheme,
    cfg: &ObjectStoreSection,
    env: impl Fn(&str) -> Option<std::ffi::OsString>,
) -> Option<&'static str> {
    let any = |vars: &[&str]| vars.iter().any(|v| env(v).is_some_and(|x| !x.is_empty()));
    match scheme {
        Scheme::S3
            if cfg.access_key_id.is_empty()
                && !any(&[
                    "AWS_ACCESS_KEY_ID",
                    "AWS_WEB_IDENTITY_TOKEN_FILE",
                    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                ]) =>
        {
            Some(
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (plus AWS_SESSION_TOKEN for temporary keys), or object_store.access_key_id and object_store.secret_access_key",
            )
        }
        Scheme::Gcs
            if cfg.google_service_account.is_empty()
                && !any(&[
                    "GOOGLE_SERVICE_ACCOUNT",
                    "GOOGLE_SERVICE_ACCOUNT_PATH",
                    "GOOGLE_SERVICE_ACCOUNT_KEY",
                    "GOOGLE_APPLICATION_CREDENTIALS",
                ]) =>
        {
            Some(
                "GOOGLE_APPLICATION_CREDENTIALS (a service-account JSON file), or object_store.google_service_account",
            )
        }
        _ => None,
    }
}

impl Objects<'_> {
    fn store(&self, u: &ObjectUrl) -> Result<Arc<dyn ObjectStore>, LoadError> {
        let mut m = self.stores.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = m.get(&u.store) {
            return Ok(s.clone());
        }
        let s = build_store(self.cfg, self.deadline, u)?;
        m.insert(u.store.clone(), s.clone());
        Ok(s)
    }

    /// A failed HEAD or LIST; where no credentials were given, the error names what to set.
    fn open_err(&self, u: &ObjectUrl, url: &str, e: object_store::Error) -> LoadError {
        match missing_credentials(u.scheme, self.cfg, |v| std::env::var_os(v)) {
            Some(vars) => LoadError::Credentials {
                url: url.to_string(),
                vars,
                source: Box::new(e),
            },
            None => open_err(url, e),
        }
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
        let u = object_url_of(url)?;
        let store = self.store(&u)?;
        let location = ObjPath::from(u.key.as_str());
        let meta = match meta {
            Some(m) => m.clone(),
            None => {
                let until = self.until();
                block_on(self.rt, with_retries(until, || store.head(&location)))?
                    .map_err(|e| self.open_err(&u, url, e))?
            }
        };
        let s = Arc::new(
            ObjectSource::new(
                store,
                location,
                url.to_string(),
                meta.size,
                meta.e_tag.clone(),
                self.cfg.max_request.0 as usize,
                self.cache.clone(),
            )
            .with_in_flight(self.in_flight.clone()),
        );
        if let Ok(mut m) = self.opened.lock() {
            m.insert(url.to_string(), s.clone());
        }
        Ok(s)
    }

    /// The objects under the prefix `dir` whose names end in `ext`, sorted (opened from the
    /// listing, no HEAD each).
    fn list(&self, dir: &str, ext: &str) -> Result<Vec<PathBuf>, LoadError> {
        let u = object_url_of(dir)?;
        let store = self.store(&u)?;
        let p = ObjPath::from(u.key.as_str());
        let until = self.until();
        let metas: Vec<object_store::ObjectMeta> = block_on(
            self.rt,
            with_retries(until, || store.list(Some(&p)).try_collect::<Vec<_>>()),
        )?
        .map_err(|e| self.open_err(&u, dir, e))?;
        let mut out = Vec::new();
        for m in metas {
            let name = m.location.as_ref();
            if !name.ends_with(ext) {
                continue;
            }
            let url = u.url_of(name);
            self.source(&url, Some(&m))?;
            out.push(PathBuf::from(url));
        }
        out.sort();
        if out.is_empty() {
            return Err(LoadError::NoObjects {
                dir: dir.to_string(),
                ext: ext.to_string(),
            });
        }
        Ok(out)
    }
}

/// A client for the store of `u`: `[object_store]` keys where set, else the usual environment of its
/// kind. Its own retries are off: the loop in `source.rs` retries and counts.
fn build_store(
    c: &ObjectStoreSection,
    deadline: Duration,
    u: &ObjectUrl,
) -> Result<Arc<dyn ObjectStore>, LoadError> {
    let mut opts = object_store::ClientOptions::new()
        .with_timeout(deadline)
        .with_connect_timeout(deadline.min(Duration::from_secs(5)))
        .with_pool_max_idle_per_host(256);
    if c.allow_http {
        opts = opts.with_allow_http(true);
    }
    let retry = object_store::RetryConfig {
        max_retries: 0,
        retry_timeout: deadline,
        ..object_store::RetryConfig::default()
    };
    let built = |r: Result<Arc<dyn ObjectStore>, object_store::Error>| {
        r.map_err(|e| LoadError::ObjectStore {
            store: u.store.to_string(),
            source: Box::new(e),
        })
    };
    let set = |v: &str| (!v.is_empty()).then(|| v.to_string());
    match u.scheme {
        Scheme::S3 => {
            let mut b = AmazonS3Builder::from_env()
                .with_bucket_name(&u.bucket)
                .with_client_options(opts)
                .with_retry(retry);
            if let Some(v) = set(&c.endpoint) {
                b = b.with_endpoint(v);
            }
            if c.allow_http {
                b = b.with_allow_http(true);
            }
            if let Some(v) = set(&c.region) {
                b = b.with_region(v);
            }
            if let Some(v) = set(&c.access_key_id) {
                b = b.with_access_key_id(v);
            }
            if let Some(v) = set(&c.secret_access_key) {
                b = b.with_secret_access_key(v);
            }
            built(b.build().map(|s| Arc::new(s) as Arc<dyn ObjectStore>))
        }
        Scheme::Gcs => {
            let mut b = GoogleCloudStorageBuilder::from_env()
                .with_bucket_name(&u.bucket)
                .with_client_options(opts)
                .with_retry(retry);
            if let Some(v) = set(&c.google_service_account) {
                b = b.with_service_account_path(v);
            }
            built(b.build().map(|s| Arc::new(s) as Arc<dyn ObjectStore>))
        }
        Scheme::Azure => {
            let mut b = MicrosoftAzureBuilder::from_env()
                .with_container_name(&u.bucket)
                .with_client_options(opts)
                .with_retry(retry);
            if let Some(v) = set(&c.endpoint) {
                b = b.with_endpoint(v);
            }
            if let Some(v) = set(&c.azure_account) {
                b = b.with_account(v);
            }
            if let Some(v) = set(&c.azure_key) {
                b = b.with_access_key(v);
            }
            built(b.build().map(|s| Arc::new(s) as Arc<dyn ObjectStore>))
        }
        Scheme::Http => {
            if u.store.starts_with("http://") && !c.allow_http {
                return Err(LoadError::Config(format!(
                    "{}: an http:// dataset needs object_store.allow_http = true",
                    u.store
                )));
            }
            let b = HttpBuilder::new()
                .with_url(&u.store)
                .with_client_options(opts)
                .with_retry(retry);
            built(b.build().map(|s| Arc::new(s) as Arc<dyn ObjectStore>))
        }
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

/// Opens an object-store dataset (`dataset.paths`, or `dataset.dir` as a prefix to list) and indexes it
/// through the same format dispatch as local shards; with `cache.dir` set, reads go through the chunk
/// cache on `engine`.
pub(crate) fn open(
    rt: &tokio::runtime::Runtime,
    c: &ShardConfig<'_>,
    engine: &Engine,
) -> Result<Opened, LoadError> {
    let cache = open_cache(c, engine)?;
    let (in_flight, read_ahead) = in_flight_bound(c.object_store, cache.is_some());
    let objects = Objects {
        rt,
        cfg: c.object_store,
        deadline: Duration::from_millis(c.remote.deadline_ms.max(1)),
        in_flight,
        cache,
        stores: Mutex::new(HashMap::new()),
        opened: Mutex::new(HashMap::new()),
    };
    let ds = c.dataset;
    let paths = objects.shard_list(ds)?;
    // `dataset.columns`' other columns too, while the stores are open.
    let (index, columns) = crate::shards::dataset::index_with_columns(ds, &paths, &objects)?;
    let sources = objects.sources_of(&index)?;
    Ok(Opened {
        min_read: c.object_store.min_read.0,
        max_amplification: OBJECT_AMPLIFICATION,
        read_ahead,
        columns,
        ..Opened::new(index, sources, objects.deadline)
    })
}

/// The chunk cache in `cache.dir` on `engine` (`None` without one).
fn open_cache(c: &ShardConfig<'_>, engine: &Engine) -> Result<Option<Arc<ChunkCache>>, LoadError> {
    let cache = match &c.cache.dir {
        Some(d) => Some(Arc::new(
            ChunkCache::new(
                &crate::config::expand_home(d),
                c.cache.max_bytes.0,
                c.cache.chunk_size.0,
                engine,
            )
            .map_err(|source| LoadError::CacheDir {
                dir: d.to_path_buf(),
                source,
            })?
            .with_windows(c.cache.window_fraction.unwrap_or(0.0))
            .with_prefetch(
                c.cache.prefetch,
                Duration::from_millis(c.remote.deadline_ms.max(1)),
            )
            .with_recheck(c.cache.recheck_chunks),
        )),
        None => None,
    };
    Ok(cache)
}

/// The bound on GETs in flight the objects share, and the pipeline's read-ahead (0: its own).
fn in_flight_bound(
    cfg: &ObjectStoreSection,
    cached: bool,
) -> (Option<Arc<tokio::sync::Semaphore>>, usize) {
    // Without a cache, a bound on GETs in flight and a pipeline twice as deep: the plain client's
    // shape (N GETs always in flight), which a window of chunks finished out of order does not keep.
    let bounded = !cached && cfg.max_in_flight > 0;
    let in_flight = bounded.then(|| {
        Arc::new(tokio::sync::Semaphore::new(
            cfg.max_in_flight.min(tokio::sync::Semaphore::MAX_PERMITS),
        ))
    });
    let read_ahead = if bounded {
        cfg.max_in_flight.saturating_mul(2)
    } else {
        0
    };
    (in_flight, read_ahead)
}

impl Objects<'_> {
    /// The dataset's objects: `dataset.paths` (each opened), or the listing of `dataset.dir`.
    fn shard_list(&self, ds: &DatasetSection) -> Result<Vec<PathBuf>, LoadError> {
        if ds.paths.is_empty() {
            let dir = ds
                .dir
                .as_ref()
                .ok_or_else(|| LoadError::Config("set dataset.dir or dataset.paths".into()))?;
            return self.list(&dir.to_string_lossy(), ds.format.extension());
        }
        if let Some(p) = ds
            .paths
            .iter()
            .find(|p| ShardUrl::kind_of(p) != ShardKind::Object)
        {
            return Err(LoadError::Config(format!(
                "dataset.paths mixes object URLs and other paths ({})",
                p.display()
            )));
        }
        // Every object opened first, so that a refusal is a typed error, not a parser's I/O error.
        for p in &ds.paths {
            if ds.format == crate::formats::Format::Megatron {
                let (i, b) =
                    crate::formats::megatron::idx_and_bin(&crate::formats::megatron::prefix_of(p));
                self.source(&i.to_string_lossy(), None)?;
                self.source(&b.to_string_lossy(), None)?;
            } else {
                self.source(&p.to_string_lossy(), None)?;
            }
        }
        Ok(ds.paths.clone())
    }

    /// One source per shard of `index`, each still of the size it was indexed at.
    fn sources_of(&self, index: &DatasetIndex) -> Result<Vec<Arc<dyn Source>>, LoadError> {
        let mut sources: Vec<Arc<dyn Source>> = Vec::with_capacity(index.shards.len());
        for s in &index.shards {
            let src = self.source(&s.path.to_string_lossy(), None)?;
            if src.size() != s.size {
                return Err(LoadError::Read(
                    SourceError::new(SourceErrorKind::Changed, src.shard(), 0, 0).with_source(
                        std::io::Error::other(format!(
                            "{} bytes when indexed, {} bytes now",
                            s.size,
                            src.size()
                        )),
                    ),
                ));
            }
            sources.push(src);
        }
        Ok(sources)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_http_dataset_without_allow_http_is_refused_before_any_request() {
        let cfg = ObjectStoreSection::default();
        let u = object_url_of("http://127.0.0.1:9/p").unwrap_or_else(|e| panic!("{e}"));
        match build_store(&cfg, Duration::from_secs(1), &u) {
            Err(LoadError::Config(m)) => assert!(m.contains("allow_http"), "{m}"),
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("built"),
        }
    }
}
