//! The seam between control and data: every connection starts on TCP (hello, token, opens); a
//! [`Transport`] then decides how read payloads travel. [`Tcp`] sends them on the same stream,
//! received straight into the lease; `Rdma` (feature `rdma`) has the server write them into the
//! client's registered lease by one-sided RDMA WRITE and answer `ReadDone` on the stream.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use ubdirect_ub::{Lease, Registrar};

use crate::proto::{Code, FrameError, Kind, Msg};

/// Why a connection's data path could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    /// The server refused (no RDMA offered, already connected): retrying will not help.
    #[error("server refused the data path ({code}): {message}")]
    Refused {
        /// Why, as the protocol says it.
        code: Code,
        /// The server's message.
        message: String,
    },
    /// Sending the request failed.
    #[error("data path request: send")]
    Send(#[source] std::io::Error),
    /// The reply did not arrive (in time, or whole).
    #[error("data path reply")]
    Receive(#[from] FrameError),
    /// A reply of the wrong kind.
    #[error("data path: unexpected reply {0:?}")]
    Unexpected(Kind),
    /// The local device failed (queue pair creation or connection).
    #[error("data path: local device")]
    Device(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// A boxed future borrowing the connection.
pub type Attach<'a> =
    Pin<Box<dyn Future<Output = Result<Box<dyn DataPath>, AttachError>> + Send + 'a>>;

/// How payloads travel on a client's connections.
pub trait Transport: Send + Sync + std::fmt::Debug {
    /// `tcp` or `rdma`.
    fn name(&self) -> &'static str;
    /// Sets up the data path of a freshly authenticated connection, before its reader starts.
    fn attach<'a>(
        &'a self,
        rd: &'a mut OwnedReadHalf,
        wr: &'a mut OwnedWriteHalf,
        deadline: Duration,
    ) -> Attach<'a>;
    /// What destination pools must be registered with (once, at creation) for this transport to
    /// land payloads in them; `None` when any host memory will do.
    fn registrar(&self) -> Option<Arc<dyn Registrar>>;
}

/// The data path of one connection.
pub trait DataPath: Send + Sync {
    /// The request that brings `len` bytes at `offset` of `file` into `lease[off..]`.
    fn request(&self, file: u32, offset: u64, len: u32, lease: &Lease, off: usize) -> Msg;
}

/// Payloads on the TCP stream, read straight into the lease.
#[derive(Debug, Clone, Copy, Default)]
pub struct Tcp;

struct TcpPath;

impl DataPath for TcpPath {
    fn request(&self, file: u32, offset: u64, len: u32, _: &Lease, _: usize) -> Msg {
        Msg::Read { file, offset, len }
    }
}

impl Transport for Tcp {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn attach<'a>(
        &'a self,
        _: &'a mut OwnedReadHalf,
        _: &'a mut OwnedWriteHalf,
        _: Duration,
    ) -> Attach<'a> {
        Box::pin(async { Ok(Box::new(TcpPath) as Box<dyn DataPath>) })
    }

    fn registrar(&self) -> Option<Arc<dyn Registrar>> {
        None
    }
}

#[cfg(feature = "rdma")]
pub use rdma_transport::RdmaTransport;
#[cfg(feature = "rdma")]
pub(crate) use rdma_transport::{from_wire as from_wire_ep, to_wire as to_wire_ep};

#[cfg(feature = "rdma")]
mod rdma_transport {
    use super::*;
    use crate::proto::{self, QpEndpoint};
    use crate::rdma::{Endpoint, QueuePair, Rdma};
    use tokio::io::AsyncWriteExt;

    /// Payloads by one-sided RDMA WRITE into leases of pools registered with `rdma`.
    #[derive(Debug, Clone)]
    pub struct RdmaTransport {
        rdma: Rdma,
        max_wr: u32,
    }

    impl RdmaTransport {
        /// Over an opened device.
        pub fn new(rdma: Rdma) -> Self {
            Self { rdma, max_wr: 256 }
        }

        /// The device.
        pub fn rdma(&self) -> &Rdma {
            &self.rdma
        }
    }

    pub(crate) fn to_wire(e: Endpoint) -> QpEndpoint {
        QpEndpoint {
            qpn: e.qpn,
            psn: e.psn,
            lid: e.lid,
            mtu: e.mtu,
            gid: e.gid,
        }
    }

    pub(crate) fn from_wire(e: QpEndpoint) -> Endpoint {
        Endpoint {
            qpn: e.qpn,
            psn: e.psn,
            lid: e.lid,
            mtu: e.mtu,
            gid: e.gid,
        }
    }

    struct RdmaPath {
        rdma: Rdma,
        // Held for the connection's life: dropping it destroys the queue pair.
        _qp: QueuePair,
    }

    impl DataPath for RdmaPath {
        fn request(&self, file: u32, offset: u64, len: u32, lease: &Lease, off: usize) -> Msg {
            match self.rdma.remote_target(lease, off, len as usize) {
                Some((addr, rkey)) => Msg::ReadTo {
                    file,
                    offset,
                    len,
                    addr,
                    rkey,
                },
                None => {
                    ubdirect_ub::fallback::record(
                        "rdma_unregistered_lease",
                        format!(
                            "pool {:?} is not registered with {}: payload sent over TCP",
                            lease.pool_name(),
                            self.rdma.device()
                        ),
                    );
                    Msg::Read { file, offset, len }
                }
            }
        }
    }

    impl Transport for RdmaTransport {
        fn name(&self) -> &'static str {
            "rdma"
        }

        fn attach<'a>(
            &'a self,
            rd: &'a mut OwnedReadHalf,
            wr: &'a mut OwnedWriteHalf,
            deadline: Duration,
        ) -> Attach<'a> {
            Box::pin(async move {
                let dev = |e| AttachError::Device(Box::new(e));
                let qp = self.rdma.queue_pair(self.max_wr).map_err(dev)?;
                tokio::time::timeout(
                    deadline,
                    wr.write_all(&Msg::RdmaConnect(to_wire(qp.endpoint())).frame(0)),
                )
                .await
                .map_err(|_| {
                    AttachError::Receive(FrameError::Timeout {
                        what: "send",
                        deadline,
                    })
                })?
                .map_err(AttachError::Send)?;
                let (hdr, p) = proto::read_frame(rd, 0, deadline, deadline).await?;
                match Msg::decode(hdr.kind, &p).map_err(FrameError::Proto)? {
                    Msg::RdmaAccept(ep) => {
                        qp.connect(&from_wire(ep), true).map_err(dev)?;
                        Ok(Box::new(RdmaPath {
                            rdma: self.rdma.clone(),
                            _qp: qp,
                        }) as Box<dyn DataPath>)
                    }
                    Msg::Error { code, message } => Err(AttachError::Refused { code, message }),
                    other => Err(AttachError::Unexpected(other.kind())),
                }
            })
        }

        fn registrar(&self) -> Option<Arc<dyn Registrar>> {
            Some(self.rdma.registrar(true))
        }
    }
}
