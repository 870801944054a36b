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
    /// One-sided access to the peer's memory (RDMA READ and WRITE), when this path has it.
    fn one_sided(&self) -> Option<&dyn OneSided> {
        None
    }
}

/// Why a one-sided operation failed (the transport's own error, e.g. `RdmaError`).
pub type OneSidedError = Arc<dyn std::error::Error + Send + Sync>;

/// One-sided access to memory the peer exposed (an SMC region's window: its address and key), from
/// and into leases of pools registered with the transport ([`Transport::registrar`]). Blocking: the
/// calling thread waits for the completions, within `until`. After an error the connection must be
/// dropped (its queue pair is in the error state).
pub trait OneSided: Send + Sync {
    /// Reads `len` bytes at the peer's `addr` (`key`) into `into[off..]`.
    fn read(
        &self,
        into: &mut Lease,
        off: usize,
        len: usize,
        addr: u64,
        key: u32,
        until: std::time::Instant,
    ) -> Result<(), OneSidedError>;
    /// Writes `from[off..off + len]` to the peer's `addr` (`key`) for each `(off, len, addr)` of
    /// `parts`, several in flight, and returns after every one completed (was acknowledged).
    fn write(
        &self,
        from: &Lease,
        parts: &[(usize, usize, u64)],
        key: u32,
        until: std::time::Instant,
    ) -> Result<(), OneSidedError>;
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
    use crate::rdma::{Endpoint, PeerAccess, QueuePair, Rdma};
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
        qp: QueuePair,
        max_wr: u32,
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

        fn one_sided(&self) -> Option<&dyn OneSided> {
            Some(self)
        }
    }

    impl OneSided for RdmaPath {
        fn read(
            &self,
            into: &mut Lease,
            off: usize,
            len: usize,
            addr: u64,
            key: u32,
            until: std::time::Instant,
        ) -> Result<(), OneSidedError> {
            self.qp
                .read_blocking(into, off, len, addr, key, until)
                .map_err(|e| Arc::new(e) as OneSidedError)
        }

        fn write(
            &self,
            from: &Lease,
            parts: &[(usize, usize, u64)],
            key: u32,
            until: std::time::Instant,
        ) -> Result<(), OneSidedError> {
            // As many in flight as the queue pair takes, less room for the path's other work.
            let window = (self.max_wr as usize / 2).clamp(1, 64);
            self.qp
                .write_blocking(from, parts, key, window, until)
                .map_err(|e| Arc::new(e) as OneSidedError)
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
                        qp.connect(&from_wire(ep), PeerAccess::Write).map_err(dev)?;
                        Ok(Box::new(RdmaPath {
                            rdma: self.rdma.clone(),
                            qp,
                            max_wr: self.max_wr,
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
