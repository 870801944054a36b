//! The client's errors: what a caller sees ([`ClientError`]), why one attempt on one connection
//! failed ([`LinkError`]), and how an attempt ends inside the client ([`Fail`]).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::proto::{Code, FrameError, Kind};
use crate::transport::AttachError;

/// Client errors.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The server refused the request (auth, path, range, size): retrying will not help.
    #[error("{server}: {what}: refused ({code}): {message}")]
    Refused {
        /// Server address.
        server: String,
        /// The request.
        what: String,
        /// Why, as the protocol says it.
        code: Code,
        /// The server's message.
        message: String,
    },
    /// No server answered within the deadline (connection refused, dropped, or unusable).
    #[error("{what}: no server of {servers:?} answered within {waited:?}")]
    Unavailable {
        /// The request.
        what: String,
        /// Servers tried.
        servers: Vec<String>,
        /// How long it tried.
        waited: Duration,
        /// The last failure.
        #[source]
        last: LinkError,
    },
    /// A connected server took the request but its reply did not arrive (whole) within the deadline.
    #[error("{what}: no reply within {waited:?}")]
    Timeout {
        /// The request.
        what: String,
        /// Servers tried.
        servers: Vec<String>,
        /// How long it waited.
        waited: Duration,
        /// The last failure.
        #[source]
        last: LinkError,
    },
    /// A read larger than one request can carry.
    #[error("{what}: {len} bytes exceed the largest request ({max})")]
    TooLarge {
        /// The request.
        what: String,
        /// Bytes asked for.
        len: usize,
        /// The most one request carries.
        max: u64,
    },
    /// The destination lease refused the bytes.
    #[error(transparent)]
    Lease(#[from] ubdirect_ub::UbError),
}

impl ClientError {
    /// The refusal's code, when the server refused.
    pub fn code(&self) -> Option<Code> {
        match self {
            ClientError::Refused { code, .. } => Some(*code),
            _ => None,
        }
    }
}

/// Why one attempt on one connection failed (the request is retried, on a new connection, until the
/// deadline). Cheap to clone: one connection's failure is handed to every request waiting on it.
#[derive(Debug, Clone, thiserror::Error)]
pub enum LinkError {
    /// The client has no servers.
    #[error("no servers configured")]
    NoServers,
    /// The TCP connection could not be made.
    #[error("{server}: connect")]
    Connect {
        /// Server address.
        server: SocketAddr,
        /// The socket's error.
        #[source]
        source: Arc<std::io::Error>,
    },
    /// Sending a request failed.
    #[error("{server}: send")]
    Send {
        /// Server address.
        server: SocketAddr,
        /// The socket's error.
        #[source]
        source: Arc<std::io::Error>,
    },
    /// Receiving a frame failed (connection lost, a frame's header or payload late, a bad frame).
    #[error("{server}: receive")]
    Receive {
        /// Server address.
        server: SocketAddr,
        /// The frame reader's error.
        #[source]
        source: FrameError,
    },
    /// Connecting, sending, or a reply, did not complete within the deadline.
    #[error("{server}: no {what} within {waited:?}")]
    Deadline {
        /// Server address.
        server: SocketAddr,
        /// `connection`, `hello reply`, `send`, `reply`.
        what: &'static str,
        /// The deadline.
        waited: Duration,
    },
    /// A reply of the wrong kind, or a payload of the wrong length.
    #[error("{server}: unexpected reply {kind:?} ({len} bytes)")]
    Unexpected {
        /// Server address.
        server: SocketAddr,
        /// The reply's kind.
        kind: Kind,
        /// Its payload length.
        len: u32,
    },
    /// The transport's data path (RDMA queue pair) could not be set up.
    #[error("{server}: data path")]
    Attach {
        /// Server address.
        server: SocketAddr,
        /// The transport's error.
        #[source]
        source: Arc<AttachError>,
    },
    /// A one-sided operation (RDMA READ of a fault, WRITE of a barrier) failed or got no
    /// completion in time; the link is dropped.
    #[error("{server}: one-sided {what}")]
    OneSided {
        /// Server address.
        server: SocketAddr,
        /// `read` or `write`.
        what: &'static str,
        /// The transport's error.
        #[source]
        source: crate::transport::OneSidedError,
    },
    /// The connection was closed under the request (by another request's failure).
    #[error("{server}: connection closed")]
    Closed {
        /// Server address.
        server: SocketAddr,
    },
}

impl LinkError {
    /// Whether the failure is a deadline (a request that timed out rather than a server that is gone).
    pub(super) fn is_deadline(&self) -> bool {
        matches!(
            self,
            LinkError::Deadline {
                what: "reply" | "send",
                ..
            } | LinkError::Receive {
                source: FrameError::Timeout { .. },
                ..
            }
        )
    }
}

/// How one attempt failed.
pub(crate) enum Fail {
    /// The server refused: not retried.
    Refused(SocketAddr, Code, String),
    /// The lease cannot take the payload: not retried.
    Lease(ubdirect_ub::UbError),
    /// Retried on another connection until the deadline.
    Retry(LinkError),
}
