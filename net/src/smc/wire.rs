//! A link's requests: each one's head from the codec (`proto::smc_*`), its body (bytes, or ranges
//! sent straight out of a mapping), where its reply's payload lands, and the pipelined exchange.

use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use super::link::SmcLink;
use crate::client::{Fail, LinkError};
use crate::proto::{self, Kind, Msg};
use crate::smc_sys::UffdMapping;

/// What travels after a request's header.
enum Body<'a> {
    Empty,
    Bytes(&'a [u8]),
    /// Ranges (offset, len) of a mapping, sent straight out of it.
    Mapped(&'a UffdMapping, Vec<(usize, usize)>),
}

/// One request of a pipelined exchange: its frame header and fixed fields, its body, and where the
/// reply's payload goes (`None`: an acknowledgement).
pub(super) struct Request<'a> {
    id: u64,
    head: Vec<u8>,
    body: Body<'a>,
    into: Option<&'a mut [u8]>,
}

impl<'a> Request<'a> {
    /// `SmcRead` of `dst.len()` bytes at `offset`, the reply's payload into `dst`.
    pub(super) fn read(id: u64, region: u32, offset: u64, dst: &'a mut [u8]) -> Self {
        Self {
            id,
            head: proto::smc_read_frame(id, region, offset, dst.len() as u32),
            body: Body::Empty,
            into: Some(dst),
        }
    }

    /// `SmcWrite` of `src` at `offset`: the codec's head, then `src` itself.
    pub(super) fn write(id: u64, region: u32, offset: u64, src: &'a [u8]) -> Self {
        Self {
            id,
            head: proto::smc_write_head(id, region, offset, src.len()),
            body: Body::Bytes(src),
            into: None,
        }
    }

    /// `SmcWriteV` of `ranges` of the mapping `m` (region offsets = mapping offsets): the codec's
    /// head (with the range table), then the bytes straight out of the mapping.
    pub(super) fn write_mapped(
        id: u64,
        region: u32,
        m: &'a UffdMapping,
        ranges: Vec<(usize, usize)>,
    ) -> Self {
        let head = proto::smc_writev_head(
            id,
            region,
            ranges.iter().map(|&(o, l)| (o as u64, l as u32)),
        );
        Self {
            id,
            head,
            body: Body::Mapped(m, ranges),
            into: None,
        }
    }

    /// Bytes on the wire.
    fn wire_len(&self) -> usize {
        self.head.len()
            + match &self.body {
                Body::Empty => 0,
                Body::Bytes(b) => b.len(),
                Body::Mapped(_, r) => r.iter().map(|r| r.1).sum(),
            }
    }
}

/// Requests in flight at once on a link: enough to keep the server busy while the next is sent,
/// few enough that the replies of small requests never fill a socket buffer nobody reads yet.
const WINDOW: usize = 8;

/// Sends `reqs` on `link` (at most [`WINDOW`] unanswered) and takes their replies in order, each
/// payload straight into its destination; within `until`, spinning up to `spin` for each reply.
pub(super) fn exchange(
    link: &mut SmcLink,
    reqs: &mut [Request<'_>],
    until: Instant,
    spin: Duration,
) -> Result<(), Fail> {
    let (mut sent, mut done) = (0, 0);
    while done < reqs.len() {
        while sent < reqs.len() && sent - done < WINDOW {
            send_request(link, &reqs[sent], until)?;
            sent += 1;
        }
        take_reply(link, &mut reqs[done], until, spin)?;
        done += 1;
    }
    Ok(())
}

/// Writes one request (head and body) within `until`.
pub(super) fn send_request(link: &SmcLink, r: &Request<'_>, until: Instant) -> Result<(), Fail> {
    match &r.body {
        Body::Empty => link.send(&[&r.head], until),
        Body::Bytes(b) => link.send(&[&r.head, b], until),
        Body::Mapped(m, ranges) => link.send_with(r.wire_len(), until, |sock, at| {
            m.writev_from(sock.as_fd(), &r.head, ranges, at)
        }),
    }
    .map_err(Fail::Retry)
}

/// Takes the reply to `r` (the next one on the link), its payload straight into `r.into`.
pub(super) fn take_reply(
    link: &mut SmcLink,
    r: &mut Request<'_>,
    until: Instant,
    spin: Duration,
) -> Result<(), Fail> {
    let server = link.server();
    let h = link.read_header(until, spin).map_err(Fail::Retry)?;
    let unexpected = || {
        Fail::Retry(LinkError::Unexpected {
            server,
            kind: h.kind,
            len: h.len,
        })
    };
    match (h.kind, &mut r.into) {
        _ if h.id != r.id => Err(unexpected()),
        (Kind::ReadOk, Some(dst)) if h.len as usize == dst.len() => {
            link.read_payload(dst, until).map_err(Fail::Retry)
        }
        (Kind::SmcWriteOk, None) if h.len == 0 => Ok(()),
        (Kind::Error, _) => {
            // Bounded by the header check (MAX_CONTROL).
            let mut p = vec![0u8; h.len as usize];
            link.read_payload(&mut p, until).map_err(Fail::Retry)?;
            Err(match Msg::decode(Kind::Error, &p) {
                Ok(Msg::Error { code, message }) => Fail::Refused(server, code, message),
                _ => unexpected(),
            })
        }
        _ => Err(unexpected()),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

    use super::*;

    /// The codec's heads (so that bodies travel without a copy) and their bodies are the protocol's
    /// frames.
    #[test]
    fn request_heads_and_bodies_are_the_protocols_frames() {
        let mut dst = [0u8; 4096];
        let r = Request::read(7, 3, 8192, &mut dst);
        let want = Msg::SmcRead {
            region: 3,
            offset: 8192,
            len: 4096,
        }
        .frame(7);
        assert_eq!((r.head.clone(), r.wire_len()), (want.clone(), want.len()));
        let src = b"some bytes";
        let w = Request::write(9, 1, 100, src);
        let mut got = w.head.clone();
        got.extend_from_slice(src);
        assert_eq!(
            got,
            Msg::SmcWrite {
                region: 1,
                offset: 100,
                data: src.to_vec(),
            }
            .frame(9)
        );
        assert_eq!(w.wire_len(), got.len());
        // A vectored write of two ranges of a mapping: the head carries the table, the bytes
        // follow from the mapping.
        let m = UffdMapping::new(4 * 4096, true, false, false).unwrap();
        m.fill(0, &[5u8; 8192], false).unwrap();
        let v = Request::write_mapped(11, 2, &m, vec![(10, 20), (4096, 100)]);
        let want = Msg::SmcWriteV {
            region: 2,
            ranges: vec![(10, 20), (4096, 100)],
            data: vec![5u8; 120],
        }
        .frame(11);
        assert_eq!(v.wire_len(), want.len());
        assert_eq!(v.head[..], want[..want.len() - 120]);
    }
}
