//! An error reply: why a request was not served (an `Error` frame's code and message). Its own room
//! so that the connection loop, the file reads, the limits and SMC each name it without naming each
//! other.

use crate::proto::{Code, Msg};

/// Why a request was not served: an `Error` frame's code and message.
pub(super) struct Reply(pub(super) Code, pub(super) String);

impl Reply {
    pub(super) fn frame(self, id: u64) -> Vec<u8> {
        Msg::Error {
            code: self.0,
            message: self.1,
        }
        .frame(id)
    }
}
