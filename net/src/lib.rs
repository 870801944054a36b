//! Remote storage for ubdirect: a versioned wire protocol ([`proto`]), the storage server behind
//! `ubdirect serve` ([`server`]) and a client that receives payloads straight into UB leases
//! ([`client`]), over TCP. (RDMA verbs are the next transport.)

pub mod client;
pub mod proto;
pub mod server;

pub use client::{Client, ClientError, RemoteFile};
pub use server::{Server, ServerConfig};
