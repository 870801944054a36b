//! [`ObjectSource`]: one object of an S3-compatible store as a [`Source`].
//!
//! Without a cache, a read is one or more ranged GETs (at most `object_store.max_request` each,
//! issued at once) whose bodies are copied into the lease as they stream in. With a cache, a read is
//! served from the chunks covering it, each fetched once into the cache and read back through the
//! io_uring [`FileSource`](ubdirect_nvme::FileSource).
//!
//! Retries: object_store's own retry loop is off (`RetryConfig::max_retries = 0`) and the loop here
//! retries connection failures, timeouts, 5xx and throttling responses with exponential backoff
//! until the read's deadline, so that every retry and every throttling response is counted.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use object_store::path::Path as ObjPath;
use object_store::{GetOptions, GetRange, ObjectStore};
use ubdirect_ub::source::check_request;
use ubdirect_ub::{
    Lease, ReadDone, ReadFuture, ReadPath, Registrar, Source, SourceError, SourceErrorKind,
};

use super::cache::ChunkCache;
use super::{STATS, add};

/// One object (`s3://bucket/key`) read through a store client, optionally through a [`ChunkCache`].
#[derive(Clone)]
pub struct ObjectSource {
    store: Arc<dyn ObjectStore>,
    location: ObjPath,
    url: String,
    size: u64,
    /// Entity tag when opened (part of the cache key: a changed object is a different entry).
    etag: Option<String>,
    max_request: usize,
    cache: Option<Arc<ChunkCache>>,
    /// The object's key in a chunk cache (its name, size and entity tag), made once: every read
    /// looks it up.
    cache_key: u64,
    /// Bound on GETs in flight (reads without a cache), shared by a dataset's objects.
    in_flight: Option<Arc<tokio::sync::Semaphore>>,
}

impl std::fmt::Debug for ObjectSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjectSource")
            .field("url", &self.url)
            .field("size", &self.size)
            .field("cached", &self.cache.is_some())
            .finish()
    }
}

/// The kind of an object_store error, for callers that branch.
pub fn kind_of(e: &object_store::Error) -> SourceErrorKind {
    use object_store::Error as E;
    match e {
        E::NotFound { .. } => SourceErrorKind::NotFound,
        E::PermissionDenied { .. } | E::Unauthenticated { .. } => SourceErrorKind::Refused,
        E::Precondition { .. } | E::NotModified { .. } => SourceErrorKind::Changed,
        E::Generic { source, .. } => {
            if throttled(e) {
                return SourceErrorKind::Unavailable;
            }
            // The crate's retry and HTTP error types are private or transparent: walk to the
            // socket's error, else read the message.
            let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(source.as_ref());
            while let Some(x) = cur {
                if let Some(io) = x.downcast_ref::<std::io::Error>() {
                    use std::io::ErrorKind as K;
                    match io.kind() {
                        K::TimedOut => return SourceErrorKind::Timeout,
                        K::ConnectionRefused
                        | K::ConnectionReset
                        | K::ConnectionAborted
                        | K::NotConnected
                        | K::BrokenPipe
                        | K::UnexpectedEof
                        | K::AddrNotAvailable
                        | K::HostUnreachable
                        | K::NetworkUnreachable => return SourceErrorKind::Unavailable,
                        _ => {}
                    }
                }
                cur = x.source();
            }
            let text = e.to_string();
            if text.contains("timed out") {
                return SourceErrorKind::Timeout;
            }
            if text.contains("HTTP error") {
                return SourceErrorKind::Unavailable;
            }
            match status_of(e) {
                Some(s) if (500..600).contains(&s) => SourceErrorKind::Unavailable,
                // 401/403: Azure's and GCS's denials come as a status, not as PermissionDenied.
                Some(400) | Some(401) | Some(403) | Some(405) | Some(411) => {
                    SourceErrorKind::Refused
                }
                Some(416) => SourceErrorKind::OutOfRange,
                _ => SourceErrorKind::Io,
            }
        }
        _ => SourceErrorKind::Io,
    }
}

/// The HTTP status in an object_store error's message (its retry error type is not public).
fn status_of(e: &object_store::Error) -> Option<u16> {
    let text = e.to_string();
    let at = text.find("status code: ")? + "status code: ".len();
    text.get(at..at + 3)?.parse().ok()
}

/// A throttling response: 429, or 503 (S3's SlowDown).
fn throttled(e: &object_store::Error) -> bool {
    matches!(status_of(e), Some(429) | Some(503)) || e.to_string().contains("SlowDown")
}

fn retryable(e: &object_store::Error) -> bool {
    matches!(
        kind_of(e),
        SourceErrorKind::Unavailable | SourceErrorKind::Timeout | SourceErrorKind::Io
    ) && !matches!(e, object_store::Error::NotFound { .. })
}

/// The retry loop's state: backoff 20 ms doubling to 1 s, until the deadline.
pub(crate) struct Retrier {
    until: Instant,
    backoff: Duration,
}

fn deadline_error() -> object_store::Error {
    object_store::Error::Generic {
        store: "S3",
        source: Box::new(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "no response within the deadline",
        )),
    }
}

impl Retrier {
    pub(crate) fn new(until: Instant) -> Self {
        Self {
            until,
            backoff: Duration::from_millis(20),
        }
    }

    /// Runs one attempt within what is left of the deadline (a request counted).
    pub(crate) async fn attempt<T>(
        &self,
        f: impl std::future::Future<Output = Result<T, object_store::Error>>,
    ) -> Result<T, object_store::Error> {
        add(&STATS.requests, 1);
        let left = self.until.saturating_duration_since(Instant::now());
        tokio::time::timeout(left, f)
            .await
            .unwrap_or_else(|_| Err(deadline_error()))
    }

    /// After a failed attempt: `Ok` once the backoff has passed when the error is retryable and the
    /// deadline allows another attempt, else the error.
    pub(crate) async fn failed(
        &mut self,
        e: object_store::Error,
    ) -> Result<(), object_store::Error> {
        if throttled(&e) {
            add(&STATS.throttled, 1);
        }
        if !retryable(&e) || Instant::now() + self.backoff >= self.until {
            return Err(e);
        }
        add(&STATS.retries, 1);
        tracing::debug!(target: "ubdirect_loader::objstore::source", "object store: retrying in {:?} after: {e}", self.backoff);
        tokio::time::sleep(self.backoff).await;
        self.backoff = (self.backoff * 2).min(Duration::from_secs(1));
        Ok(())
    }
}

/// Runs `op` until it succeeds, fails for good, or `until` passes.
pub(crate) async fn with_retries<T, F, Fut>(
    until: Instant,
    mut op: F,
) -> Result<T, object_store::Error>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, object_store::Error>>,
{
    let mut r = Retrier::new(until);
    loop {
        match r.attempt(op()).await {
            Ok(v) => return Ok(v),
            Err(e) => r.failed(e).await?,
        }
    }
}

/// A timeout of the loop itself is a [`SourceErrorKind::Timeout`].
fn error_kind(e: &object_store::Error) -> SourceErrorKind {
    if let object_store::Error::Generic { source, .. } = e
        && let Some(io) = source.downcast_ref::<std::io::Error>()
        && io.kind() == std::io::ErrorKind::TimedOut
    {
        return SourceErrorKind::Timeout;
    }
    kind_of(e)
}

impl ObjectSource {
    /// A source over `location` in `store` (`size` bytes, entity tag `etag`), named `url`; reads of at
    /// most `max_request` bytes a GET, through `cache` if given.
    pub fn new(
        store: Arc<dyn ObjectStore>,
        location: ObjPath,
        url: String,
        size: u64,
        etag: Option<String>,
        max_request: usize,
        cache: Option<Arc<ChunkCache>>,
    ) -> Self {
        let cache_key = super::cache::cache_key(&url, size, etag.as_deref());
        Self {
            store,
            location,
            url,
            size,
            etag,
            max_request: max_request.max(64 << 10),
            cache,
            cache_key,
            in_flight: None,
        }
    }

    /// The object's key in a chunk cache.
    pub(crate) fn cache_key(&self) -> u64 {
        self.cache_key
    }

    /// Reads straight from the store hold one of `permits` per GET (`None`: no bound).
    pub fn with_in_flight(mut self, permits: Option<Arc<tokio::sync::Semaphore>>) -> Self {
        self.in_flight = permits;
        self
    }

    /// The object's entity tag when opened.
    pub fn etag(&self) -> Option<&str> {
        self.etag.as_deref()
    }

    /// Fetches `range` of the object into `dst` (exactly its length), the body copied as it streams.
    pub(crate) async fn fetch_into(
        &self,
        start: u64,
        dst: &mut [u8],
        until: Instant,
    ) -> Result<(), object_store::Error> {
        let end = start + dst.len() as u64;
        let mut retry = Retrier::new(until);
        loop {
            match retry.attempt(self.get_into(start, end, &mut *dst)).await {
                Ok(()) => return Ok(()),
                Err(e) => retry.failed(e).await?,
            }
        }
    }

    /// One ranged GET of `start..end`, its body copied into `dst` as it streams in.
    async fn get_into(
        &self,
        start: u64,
        end: u64,
        dst: &mut [u8],
    ) -> Result<(), object_store::Error> {
        let opts = GetOptions {
            range: Some(GetRange::Bounded(start..end)),
            ..GetOptions::default()
        };
        let r = self.store.get_opts(&self.location, opts).await?;
        let mut body = r.into_stream();
        let mut at = 0usize;
        while let Some(chunk) = body.next().await {
            let chunk = chunk?;
            let n = chunk.len().min(dst.len() - at);
            dst[at..at + n].copy_from_slice(&chunk[..n]);
            at += n;
            add(&STATS.bytes_from_store, chunk.len() as u64);
        }
        if at != dst.len() {
            return Err(object_store::Error::Generic {
                store: "S3",
                source: format!(
                    "short body: {at} of {} bytes at {start} (object changed?)",
                    dst.len()
                )
                .into(),
            });
        }
        Ok(())
    }

    /// A read straight from the store: GETs of at most `max_request`, all in flight at once.
    async fn read_store(
        &self,
        offset: u64,
        len: usize,
        mut lease: Lease,
        lease_offset: usize,
        until: Instant,
    ) -> (Result<(), SourceError>, Lease) {
        let err = |e: object_store::Error| {
            SourceError::new(error_kind(&e), &self.url, offset, len).with_source(e)
        };
        let buf = match lease.as_mut_slice() {
            Ok(b) => &mut b[lease_offset..lease_offset + len],
            Err(e) => {
                let e =
                    SourceError::new(SourceErrorKind::Lease, &self.url, offset, len).with_source(e);
                return (Err(e), lease);
            }
        };
        let parts = buf.chunks_mut(self.max_request).enumerate().map(|(i, b)| {
            let at = offset + (i * self.max_request) as u64;
            async move {
                // A permit per GET, waited for within the read's deadline.
                let _permit = match &self.in_flight {
                    Some(s) => Some(
                        tokio::time::timeout_at(until.into(), s.acquire())
                            .await
                            .map_err(|_| deadline_error())?
                            .map_err(|e| object_store::Error::Generic {
                                store: "S3",
                                source: Box::new(e),
                            })?,
                    ),
                    None => None,
                };
                self.fetch_into(at, b, until).await
            }
        });
        let results = futures_util::future::join_all(parts).await;
        let r = results.into_iter().collect::<Result<Vec<()>, _>>();
        (r.map(|_| ()).map_err(err), lease)
    }
}

impl Source for ObjectSource {
    fn shard(&self) -> &str {
        &self.url
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn describe(&self) -> String {
        match &self.cache {
            Some(c) => format!(
                "object store: ranged GETs into {}-byte chunks of the cache {}, read through io_uring",
                c.chunk_size(),
                c.dir().display()
            ),
            None => format!(
                "object store: ranged GETs of ≤ {} bytes in flight at once, bodies copied into the lease as they stream",
                self.max_request
            ),
        }
    }

    fn slack(&self) -> usize {
        match &self.cache {
            Some(c) => c.slack(),
            None => 0,
        }
    }

    fn registrars(&self) -> Vec<Arc<dyn Registrar>> {
        match &self.cache {
            Some(c) => vec![c.engine().registrar()],
            None => Vec::new(),
        }
    }

    fn advise_window(&self) -> u64 {
        self.cache.as_ref().map_or(0, |c| c.advise_window())
    }

    fn wants_schedule(&self) -> bool {
        self.cache.is_some()
    }

    fn schedule(&self, planned: &ubdirect_ub::PlannedReads<'_>) {
        if let Some(c) = &self.cache {
            c.schedule(self, planned);
        }
    }

    fn advise(&self, offset: u64, len: usize) {
        if let Some(c) = &self.cache {
            c.prefetch(self, offset, len);
        }
    }

    fn chunk_cache(&self) -> Option<(std::path::PathBuf, u64, u64)> {
        let c = self.cache.as_ref()?;
        Some((c.dir().to_path_buf(), c.max_bytes(), c.chunk_size()))
    }

    fn chunk_files(&self) -> Option<ubdirect_ub::ChunkFiles> {
        self.cache.as_ref()?.chunk_files(self)
    }

    fn fill_page_cache(&self, on: bool) {
        if let Some(c) = &self.cache {
            c.fill_page_cache(self, on);
        }
    }

    fn read_at_hand(&self, offset: u64, len: usize) -> Option<(Arc<[u8]>, ReadPath)> {
        let cache = self.cache.as_ref()?;
        let end = offset.checked_add(len as u64)?;
        if len == 0 || end > self.size {
            return None;
        }
        Some((
            cache.read_at_hand(self, offset, len)?,
            ReadPath::ObjectStore,
        ))
    }

    fn read(
        &self,
        offset: u64,
        len: usize,
        lease: Lease,
        lease_offset: usize,
        deadline: Duration,
    ) -> ReadFuture<'_> {
        Box::pin(async move {
            if let Err(e) = check_request(self, offset, len, &lease, lease_offset) {
                return (Err(e), lease);
            }
            let until = Instant::now() + deadline;
            if let Some(cache) = &self.cache {
                if len == 0 {
                    let done = ReadDone {
                        data: lease_offset..lease_offset,
                        bytes_read: 0,
                        path: ReadPath::ObjectStore,
                    };
                    return (Ok(done), lease);
                }
                return cache
                    .read(self, offset, len, lease, lease_offset, until)
                    .await;
            }
            let (r, lease) = self
                .read_store(offset, len, lease, lease_offset, until)
                .await;
            let r = r.map(|()| ReadDone {
                data: lease_offset..lease_offset + len,
                bytes_read: len,
                path: ReadPath::ObjectStore,
            });
            (r, lease)
        })
    }
}
