//! `ub://` shards as a [`Source`]: ranges of a file on storage servers, read by a [`Client`] straight
//! into the lease — on the TCP stream, or by the server's one-sided RDMA WRITE into a lease of a pool
//! registered with the client's transport ([`Source::registrars`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use ubdirect_ub::source::check_request;
use ubdirect_ub::{
    Lease, ReadDone, ReadFuture, ReadPath, Registrar, Source, SourceError, SourceErrorKind,
};

use crate::client::{Client, ClientError, RemoteFile};
use crate::proto::Code;

/// A file on storage servers, read through a [`Client`].
#[derive(Debug, Clone)]
pub struct RemoteSource {
    client: Client,
    file: RemoteFile,
    url: String,
}

impl RemoteSource {
    /// A source over `file` (opened with `client`), named `url` (`ub://host:port/root/path`) in
    /// errors and reports.
    pub fn new(client: Client, file: RemoteFile, url: impl Into<String>) -> Self {
        Self {
            client,
            file,
            url: url.into(),
        }
    }

    /// Opens `root/path` with `client`.
    pub async fn open(
        client: Client,
        root: &str,
        path: &str,
        url: impl Into<String>,
    ) -> Result<Self, ClientError> {
        let file = client.open(root, path).await?;
        Ok(Self::new(client, file, url))
    }

    /// The client.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The remote file.
    pub fn file(&self) -> &RemoteFile {
        &self.file
    }

    fn path(&self) -> ReadPath {
        if self.client.transport() == "rdma" {
            ReadPath::RemoteRdma
        } else {
            ReadPath::RemoteTcp
        }
    }
}

/// The kind of a client error, for callers that branch.
pub fn kind_of(e: &ClientError) -> SourceErrorKind {
    match e {
        ClientError::Refused { code, .. } => match code {
            Code::NotFound | Code::BadFile => SourceErrorKind::NotFound,
            Code::Range => SourceErrorKind::OutOfRange,
            Code::Busy => SourceErrorKind::Unavailable,
            Code::Io => SourceErrorKind::Io,
            Code::Auth | Code::Forbidden | Code::TooLarge | Code::Protocol | Code::Other(_) => {
                SourceErrorKind::Refused
            }
        },
        ClientError::Unavailable { .. } => SourceErrorKind::Unavailable,
        ClientError::Timeout { .. } => SourceErrorKind::Timeout,
        ClientError::TooLarge { .. } | ClientError::Lease(_) => SourceErrorKind::Lease,
    }
}

impl Source for RemoteSource {
    fn shard(&self) -> &str {
        &self.url
    }

    fn size(&self) -> u64 {
        self.file.size
    }

    fn describe(&self) -> String {
        let how = match self.path() {
            ReadPath::RemoteRdma => "payloads by RDMA WRITE into registered leases",
            _ => "payloads on the TCP stream, received into the lease",
        };
        format!(
            "ub:// over {} from {} ({how})",
            self.client.transport(),
            self.client.servers().join(", ")
        )
    }

    fn registrars(&self) -> Vec<Arc<dyn Registrar>> {
        self.client.registrar().into_iter().collect()
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
            let done = ReadDone {
                data: lease_offset..lease_offset + len,
                bytes_read: len,
                path: self.path(),
            };
            // Requests of at most the server's max_request, one after the other, within one deadline.
            let until = Instant::now() + deadline;
            let mut lease = lease;
            let mut at = 0usize;
            while at < len {
                let n = (len - at).min(self.client.max_request().max(4096) as usize);
                let left = until.saturating_duration_since(Instant::now());
                let (r, l) = self
                    .client
                    .read_within(
                        &self.file,
                        offset + at as u64,
                        n,
                        lease,
                        lease_offset + at,
                        left,
                    )
                    .await;
                lease = l;
                if matches!(
                    r,
                    Err(ClientError::Refused {
                        code: Code::TooLarge,
                        ..
                    })
                ) && n > self.client.max_request() as usize
                {
                    // The first connection told a smaller max_request than assumed: split again.
                    continue;
                }
                if let Err(e) = r {
                    let err = SourceError::new(kind_of(&e), &self.url, offset, len).with_source(e);
                    return (Err(err), lease);
                }
                at += n;
            }
            (Ok(done), lease)
        })
    }
}
