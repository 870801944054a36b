//! [`Source`](ubdirect_ub::Source) implementations for local storage: the io_uring file path
//! ([`FileSource`]) and NVMe passthrough of a file's extents ([`NvmeSource`], opened through an
//! [`NvmeOpener`] that shares namespaces between shards).

mod file;
mod nvme;

pub use file::{FileSource, kind_of};
pub use nvme::{NvmeOpener, NvmeSource, NvmeSourceError, nvme_kind};
