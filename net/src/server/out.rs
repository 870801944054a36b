//! What the connection's writer task sends: control frames, a read's payload in its staging block, a
//! resident range by `sendfile`, or a close. The hold on each read's permits and staging share travels
//! with its reply and is released once the reply is written (or given up).

use std::sync::Arc;

use ubdirect_ub::Lease;

use super::limits::Hold;
use super::reply::Reply;

/// A reply for the connection's writer task.
pub(super) enum Out {
    Control(Vec<u8>),
    Data {
        id: u64,
        lease: Lease,
        range: std::ops::Range<usize>,
        /// The read's in-flight permit and its share of the peer's staging blocks: released once
        /// the reply is written (or given up), with the block.
        _hold: Hold,
    },
    /// A resident range of a file, sent from the page cache by `sendfile`. The reply still holds a
    /// staging block (the payload goes through it only where `sendfile` is refused), so the limits
    /// on blocks count it like any read.
    File {
        id: u64,
        file: Arc<std::fs::File>,
        offset: u64,
        len: u32,
        block: Lease,
        _hold: Hold,
    },
    /// Close the connection (its data path failed).
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    Close,
}

impl Reply {
    pub(super) fn into_frame(self, id: u64) -> Out {
        Out::Control(self.frame(id))
    }
}
