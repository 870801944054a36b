//! A barrier's pushes: dirty runs copied into the registered push block and written one-sided
//! into the region's window, or sent as vectored write requests on the link straight out of the
//! mapping.

use super::*;
use crate::client::{Fail, LinkError};
use crate::smc::link::SmcLink;
use crate::smc::wire::{Request, send_request, take_reply};

/// A barrier's dirty runs (first page, pages) written one-sided: copied out of the mapping into the
/// registered `push` block as many as fit, written from it into the region's window (all in flight
/// at once), and again until every run went. Returns (transfers, transactions, bytes): one WRITE
/// per contiguous piece.
#[allow(clippy::too_many_arguments)]
fn push_one_sided(
    m: &UffdMapping,
    runs: &[(usize, usize)],
    page: usize,
    size: usize,
    push: &mut ubdirect_ub::Lease,
    os: &dyn crate::transport::OneSided,
    w: crate::proto::RemoteWindow,
    until: Instant,
) -> Result<(usize, usize, usize), crate::transport::OneSidedError> {
    let cap = push.capacity();
    let (mut transfers, mut bytes) = (0, 0);
    let mut parts: Vec<(usize, usize, u64)> = Vec::new();
    let mut used = 0;
    let flush = |parts: &mut Vec<(usize, usize, u64)>,
                 push: &mut ubdirect_ub::Lease|
     -> Result<(), crate::transport::OneSidedError> {
        if !parts.is_empty() {
            os.write(push, parts, w.rkey, until)?;
            parts.clear();
        }
        Ok(())
    };
    for &(s, n) in runs {
        let (a, b) = (s * page, ((s + n) * page).min(size));
        let mut o = a;
        while o < b {
            if used == cap {
                flush(&mut parts, push)?;
                used = 0;
            }
            let l = (b - o).min(cap - used);
            let dst = push
                .as_mut_slice()
                .map_err(|e| Arc::new(e) as crate::transport::OneSidedError)?;
            // The pages are write-protected again (or scanned and re-protected): what is copied
            // is what this barrier pushes; a later store is caught for the next one.
            m.load(o, &mut dst[used..used + l]).map_err(|e| {
                Arc::new(std::io::Error::other(e)) as crate::transport::OneSidedError
            })?;
            parts.push((used, l, w.addr + o as u64));
            used += l;
            bytes += l;
            transfers += 1;
            o += l;
        }
    }
    flush(&mut parts, push)?;
    Ok((transfers, transfers, bytes))
}

/// A barrier's push over the link's one-sided transport `os` into the region's window `w`: every
/// scan batch first (the copy into the push block is the overlap), then the dirty runs written from
/// `push`. Returns (transfers, transactions, bytes).
#[allow(clippy::too_many_arguments)]
pub(super) fn push_all_one_sided(
    p: &Push<'_>,
    link: &SmcLink,
    os: &dyn crate::transport::OneSided,
    w: crate::proto::RemoteWindow,
    push: &mut ubdirect_ub::Lease,
    scan: &mut Scanner,
    pages: &mut BTreeSet<usize>,
    first_send: &mut Option<Instant>,
    until: Instant,
) -> Result<(usize, usize, usize), Fail> {
    let Push {
        m,
        page,
        size,
        stats,
    } = *p;
    while !scan.done {
        scan.batch(m, page, pages);
    }
    let runs = runs_of(pages.iter().copied());
    first_send.get_or_insert_with(Instant::now);
    push_one_sided(m, &runs, page, size, push, os, w, until)
        .inspect(|v| {
            stats.transactions.fetch_add(v.1 as u64, Ordering::Relaxed);
        })
        .map_err(|source| {
            Fail::Retry(LinkError::OneSided {
                server: link.server(),
                what: "write",
                source,
            })
        })
}

/// What a barrier's push needs of its mapping, besides the link.
pub(super) struct Push<'a> {
    pub(super) m: &'a UffdMapping,
    /// SMC page size.
    pub(super) page: usize,
    /// The region's size (the last page may be cut).
    pub(super) size: usize,
    pub(super) stats: &'a crate::smc::SmcStats,
}

/// A barrier's dirty pages pushed as requests on the link (no one-sided path): what is known first
/// (`pages`: recorded, or found by an earlier attempt), then batch by batch as `scan` finds more.
/// Returns (transfers, transactions, bytes).
pub(super) fn push_requests(
    p: &Push<'_>,
    link: &mut SmcLink,
    rid: u32,
    pages: &mut BTreeSet<usize>,
    scan: &mut Scanner,
    first_send: &mut Option<Instant>,
    until: Instant,
) -> Result<(usize, usize, usize), Fail> {
    let Push {
        m,
        page,
        size,
        stats,
    } = *p;
    let max = (link.max_request() as usize).max(4096);
    // Pieces of at most max_request less a range header, in 4 KiB units: an SMC page
    // larger than max_request (2 MiB pages, 1 MiB requests) is pushed in several.
    let chunk = (max.saturating_sub(12) / 4096).max(1) * 4096;
    let (mut transfers, mut bytes) = (0usize, 0usize);
    let mut reqs: Vec<Request<'_>> = Vec::new();
    let (mut sent, mut taken) = (0, 0);
    // What is known first (recorded pages, or what an earlier attempt scanned), then
    // batch by batch. Each run (split at max_request) is one range; a batch's ranges
    // are packed into vectored writes of at most max_request bytes (one network
    // transaction each), sent straight out of the mapping, back to back; the
    // acknowledgements (a few bytes each) are taken at the end.
    let mut fresh: Vec<usize> = pages.iter().copied().collect();
    loop {
        if !fresh.is_empty() {
            let mut packed: Vec<(Vec<(usize, usize)>, usize)> = Vec::new();
            for (s, n) in runs_of(fresh.iter().copied()) {
                let (a, b) = (s * page, ((s + n) * page).min(size));
                let mut o = a;
                while o < b {
                    let e = (o + chunk).min(b);
                    match packed.last_mut() {
                        Some((r, d)) if *d + (r.len() + 1) * 12 + (e - o) <= max => {
                            r.push((o, e - o));
                            *d += e - o;
                        }
                        _ => packed.push((vec![(o, e - o)], e - o)),
                    }
                    transfers += 1;
                    bytes += e - o;
                    o = e;
                }
            }
            for (r, _) in packed {
                let id = link.next_id();
                reqs.push(Request::write_mapped(id, rid, m, r));
            }
            first_send.get_or_insert_with(Instant::now);
            while sent < reqs.len() {
                // Acknowledgements are a few bytes each, but unread ones add up: past
                // ACK_WINDOW the oldest is taken first, so the server never blocks
                // writing replies nobody reads.
                if sent - taken >= ACK_WINDOW {
                    take_reply(link, &mut reqs[taken], until, Duration::ZERO)?;
                    taken += 1;
                }
                send_request(link, &reqs[sent], until)?;
                sent += 1;
            }
        }
        if scan.done {
            break;
        }
        fresh = scan.batch(m, page, pages);
    }
    stats
        .transactions
        .fetch_add(reqs.len() as u64, Ordering::Relaxed);
    for r in reqs[taken..].iter_mut() {
        take_reply(link, r, until, Duration::ZERO)?;
    }
    Ok((transfers, reqs.len(), bytes))
}
