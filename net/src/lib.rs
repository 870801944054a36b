//! Remote storage for ubdirect: a versioned wire protocol ([`proto`]), the storage server behind
//! `ubdirect serve` ([`server`]) and a client that receives payloads straight into UB leases
//! ([`client`]). Payloads travel over the TCP connection, or — feature `rdma` — by one-sided RDMA WRITE
//! from the server's registered staging blocks into the client's registered leases (`rdma`); the
//! [`transport::Transport`] trait is the seam between the two. [`RemoteSource`] is a `ub://` shard as
//! an `ubdirect_ub::Source`.

pub mod client;
mod gpu_region;
pub mod proto;
#[cfg(feature = "rdma")]
pub mod rdma;
#[cfg(feature = "rdma")]
mod rdma_sys;
pub mod server;
pub mod smc;
mod smc_sys;
pub mod source;
mod sys;
pub mod transport;
mod zerocopy;

pub use client::{Client, ClientError, LinkError, RemoteFile};
pub use proto::{Code, FrameError};
pub use server::{RegionConfig, Server, ServerConfig};
pub use smc::{MapOptions, SmcClient, SmcError, SmcOptions, SyncMode};
pub use source::RemoteSource;
pub use transport::{AttachError, Tcp, Transport};
