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

use crate::proto::Msg;

/// A boxed future borrowing the connection.
pub type Attach<'a> = Pin<Box<dyn Future<Output = Result<Box<dyn DataPath>, String>> + Send + 'a>>;

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
    use crate::proto::{HEADER, Header, QpEndpoint};
    use crate::rdma::{Endpoint, QueuePair, Rdma};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

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
                let qp = self.rdma.queue_pair(self.max_wr)?;
                wr.write_all(&Msg::RdmaConnect(to_wire(qp.endpoint())).frame(0))
                    .await
                    .map_err(|e| format!("rdma connect: {e}"))?;
                let mut h = [0u8; HEADER];
                tokio::time::timeout(deadline, rd.read_exact(&mut h))
                    .await
                    .map_err(|_| "rdma connect: no reply within the deadline".to_string())?
                    .map_err(|e| format!("rdma connect: {e}"))?;
                let hdr = Header::decode(&h, 0).map_err(|e| format!("rdma connect: {e}"))?;
                let mut p = vec![0u8; hdr.len as usize];
                rd.read_exact(&mut p)
                    .await
                    .map_err(|e| format!("rdma connect: {e}"))?;
                match Msg::decode(hdr.kind, &p) {
                    Ok(Msg::RdmaAccept(ep)) => {
                        qp.connect(&from_wire(ep), true)?;
                        Ok(Box::new(RdmaPath {
                            rdma: self.rdma.clone(),
                            _qp: qp,
                        }) as Box<dyn DataPath>)
                    }
                    Ok(Msg::Error { code, message }) => {
                        Err(format!("server refused RDMA ({code}): {message}"))
                    }
                    other => Err(format!("rdma connect: unexpected reply {other:?}")),
                }
            })
        }

        fn registrar(&self) -> Option<Arc<dyn Registrar>> {
            Some(self.rdma.registrar(true))
        }
    }
}
