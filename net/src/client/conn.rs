//! One connection of the client: its pending map (a data request's lease inside a `Delivery`, which
//! hands it back exactly once) and the reader task that receives every reply, payloads straight into
//! the destination lease.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::oneshot;
use ubdirect_ub::Lease;

use super::{Fail, LinkError};
use crate::proto::{self, FrameError, Kind, Msg};
use crate::transport::DataPath;

/// A data request's lease while the request is out, and where it goes back. It answers exactly once:
/// [`Delivery::finish`], or — if it is dropped first (connection gone, reader stopped) — its `Drop`,
/// which hands the lease back with [`LinkError::Closed`]. So the lease always comes back (or, when
/// the requester is gone, returns to its pool).
pub(super) struct Delivery {
    pub(super) lease: Option<Lease>,
    pub(super) off: usize,
    pub(super) len: usize,
    pub(super) server: SocketAddr,
    pub(super) tx: Option<oneshot::Sender<(Result<(), Fail>, Lease)>>,
}

impl Delivery {
    fn finish(mut self, r: Result<(), Fail>) {
        if let (Some(lease), Some(tx)) = (self.lease.take(), self.tx.take()) {
            let _ = tx.send((r, lease));
        }
    }
}

impl Drop for Delivery {
    fn drop(&mut self) {
        if let (Some(lease), Some(tx)) = (self.lease.take(), self.tx.take()) {
            let closed = LinkError::Closed {
                server: self.server,
            };
            let _ = tx.send((Err(Fail::Retry(closed)), lease));
        }
    }
}

pub(super) enum Pending {
    Control(oneshot::Sender<Result<Msg, LinkError>>),
    Data(Delivery),
}

pub(super) type PendingMap = Arc<Mutex<HashMap<u64, Pending>>>;

pub(crate) struct Conn {
    pub(super) server: SocketAddr,
    pub(super) writer: tokio::sync::Mutex<OwnedWriteHalf>,
    pub(super) pending: PendingMap,
    pub(super) dead: Arc<AtomicBool>,
    pub(super) reader: tokio::task::JoinHandle<()>,
    pub(super) generation: u64,
    /// Taken (destroying an RDMA queue pair) before pending leases are handed back, so that no late
    /// remote write can land in a block that is already reused.
    pub(super) path: Arc<Mutex<Option<Box<dyn DataPath>>>>,
}

impl Conn {
    /// Destroys the data path (an RDMA queue pair: no WRITE of the server lands after this returns).
    pub(super) fn close_path(&self) {
        close_path(&self.path);
    }
}

pub(super) fn close_path(path: &Mutex<Option<Box<dyn DataPath>>>) {
    let p = path.lock().unwrap_or_else(|p| p.into_inner()).take();
    drop(p);
}

impl Drop for Conn {
    fn drop(&mut self) {
        // Path first: every lease still pending goes back only after its queue pair is destroyed.
        self.close_path();
        self.reader.abort();
        fail_all(
            &self.pending,
            &LinkError::Closed {
                server: self.server,
            },
        );
    }
}

pub(super) fn take_pending(pending: &Mutex<HashMap<u64, Pending>>, id: u64) -> Option<Pending> {
    pending
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(&id)
}

pub(super) fn fail_all(pending: &Mutex<HashMap<u64, Pending>>, why: &LinkError) {
    let drained: Vec<Pending> = pending
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .drain()
        .map(|(_, v)| v)
        .collect();
    for p in drained {
        match p {
            Pending::Control(tx) => {
                let _ = tx.send(Err(why.clone()));
            }
            Pending::Data(d) => d.finish(Err(Fail::Retry(why.clone()))),
        }
    }
}

/// Receives replies until the connection fails; returns why. A payload is received within
/// `deadline` of its header. A request whose reply failed half-way is put back in the pending map,
/// so that its lease is handed back by [`fail_all`] after the data path is closed.
pub(super) async fn reader_loop(
    mut rd: OwnedReadHalf,
    pending: &Mutex<HashMap<u64, Pending>>,
    max_data: u32,
    server: SocketAddr,
    deadline: Duration,
) -> LinkError {
    let recv = |source| LinkError::Receive { server, source };
    let put_back = |id, p| {
        pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, p);
    };
    loop {
        // Quiet for as long as the server likes between frames; a frame, once begun, arrives whole
        // within the deadline (a server sending halves cannot hold the connection).
        let hdr = match proto::read_header_within(&mut rd, max_data, proto::IDLE, deadline).await {
            Ok(h) => h,
            Err(e) => return recv(e),
        };
        let unexpected = LinkError::Unexpected {
            server,
            kind: hdr.kind,
            len: hdr.len,
        };
        match (hdr.kind, take_pending(pending, hdr.id)) {
            (Kind::ReadOk, Some(Pending::Data(mut d))) => {
                if hdr.len as usize != d.len {
                    put_back(hdr.id, Pending::Data(d));
                    return unexpected;
                }
                // Straight into the lease: no intermediate buffer.
                let (off, len) = (d.off, d.len);
                let got = match d.lease.as_mut().map(|l| l.as_mut_slice()) {
                    Some(Ok(b)) => proto::read_payload(&mut rd, &mut b[off..off + len], deadline)
                        .await
                        .map_err(recv),
                    Some(Err(e)) => {
                        // Not host memory: the payload is on the stream and nowhere to go.
                        d.finish(Err(Fail::Lease(e)));
                        return unexpected;
                    }
                    None => Err(LinkError::Closed { server }),
                };
                match got {
                    Ok(()) => d.finish(Ok(())),
                    Err(e) => {
                        put_back(hdr.id, Pending::Data(d));
                        return e;
                    }
                }
            }
            (Kind::ReadDone, Some(Pending::Data(d))) if hdr.len == 0 => {
                // The server wrote the bytes into the lease by RDMA before answering.
                d.finish(Ok(()));
            }
            (_, None) => {
                // A reply to a request that gave up, or to no request at all (an id the server made
                // up): drained through a small buffer, whatever length it declares.
                if let Err(e) = proto::discard_payload(&mut rd, hdr.len, deadline).await {
                    return recv(e);
                }
            }
            (kind, p) => {
                // Bounded by the header check (MAX_CONTROL, or max_data for a data frame), and the
                // buffer grows only as the bytes arrive.
                let buf = match proto::read_payload_vec(&mut rd, hdr.len, deadline).await {
                    Ok(b) => b,
                    Err(e) => {
                        if let Some(p) = p {
                            put_back(hdr.id, p);
                        }
                        return recv(e);
                    }
                };
                match p {
                    Some(Pending::Control(tx)) => {
                        let _ = tx
                            .send(Msg::decode(kind, &buf).map_err(|e| recv(FrameError::Proto(e))));
                    }
                    Some(Pending::Data(d)) => match Msg::decode(kind, &buf) {
                        // A refusal comes before any byte moved (no RDMA WRITE was posted).
                        Ok(Msg::Error { code, message }) => {
                            d.finish(Err(Fail::Refused(server, code, message)))
                        }
                        // Anything else: the server is confused; the lease goes back only after
                        // the data path is closed.
                        _ => {
                            put_back(hdr.id, Pending::Data(d));
                            return unexpected;
                        }
                    },
                    None => {}
                }
            }
        }
    }
}

/// A `Delivery` holds its lease until it answers, and answers exactly once (from `finish` or its
/// `Drop`, which runs also when the reader task is aborted); ids are never reused. So a request's
/// entry always holds its lease and its channel always delivers it: this is not reachable.
#[cold]
pub(super) fn unreachable_lease() -> ! {
    unreachable!("a Delivery answered without its lease")
}
