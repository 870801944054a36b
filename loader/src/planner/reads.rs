//! Each chunk's reads: its samples' pieces sorted by (shard, offset) and merged into aligned reads.
//!
//! A segment's chunks are planned into one list each of reads, samples and pieces, every chunk a
//! range of them ([`Planned`]), with working lists reused from one chunk to the next
//! ([`Scratch`]): a segment costs a few allocations (a few more per planning thread), not about ten
//! per chunk as until 2026-12-07, when they were a third of a steady epoch's allocations
//! (`loader/tests/steady_alloc.rs`).

use super::{
    DatasetIndex, PART_ALIGN, PlanConfig, PlanError, PlannedPiece, PlannedSample, ReadPlan,
    SampleLoc, SampleSpace,
};

/// A read shorter than `min_read` is widened to it only when that at most multiplies its bytes by
/// this.
const MAX_WIDEN: u64 = 4;

/// Epochs of at least this many samples (per rank) plan their chunks on several threads.
const PARALLEL_PLAN_SAMPLES: usize = 1 << 17;

/// A segment's chunks, planned: every chunk's reads, samples and pieces, in chunk order. A
/// sample's `read` and a piece's `read` count from its chunk's first read; a sample's
/// `first_piece` from its chunk's first piece.
#[derive(Debug, Default)]
pub(super) struct Planned {
    pub reads: Vec<ReadPlan>,
    pub samples: Vec<PlannedSample>,
    pub pieces: Vec<PlannedPiece>,
    /// Per chunk: where its reads, samples and pieces end in the lists.
    pub ends: Vec<(usize, usize, usize)>,
}

impl Planned {
    /// Empty, with room for `samples` samples of `chunks` chunks.
    fn with_capacity(samples: usize, chunks: usize) -> Self {
        Self {
            samples: Vec::with_capacity(samples),
            ends: Vec::with_capacity(chunks),
            ..Self::default()
        }
    }

    /// `other`'s chunks after these (ranges moved by what is here already).
    fn append(&mut self, other: Planned) {
        let (r, s, p) = (self.reads.len(), self.samples.len(), self.pieces.len());
        self.reads.extend(other.reads);
        self.samples.extend(other.samples);
        self.pieces.extend(other.pieces);
        self.ends
            .extend(other.ends.iter().map(|&(a, b, c)| (a + r, b + s, c + p)));
    }
}

/// Working lists of one chunk's planning, kept from one chunk to the next.
#[derive(Default)]
struct Scratch {
    /// The chunk's samples: (id, global position).
    ids: Vec<(u64, u64)>,
    /// Every piece of the chunk's samples; a sample's pieces are contiguous.
    locs: Vec<SampleLoc>,
    /// Where each sample's pieces start in `locs` (one more entry: the end).
    first_piece: Vec<u32>,
    /// Each piece's sample.
    owner: Vec<usize>,
    /// (shard, offset, end, piece) of every piece, sorted.
    items: Vec<(u32, u64, u64, usize)>,
    /// Each piece's read (from the chunk's first).
    read_of: Vec<u32>,
}

/// Each chunk's reads — independent of the others, so planned on several threads for large epochs
/// (millions of small samples took seconds of one core before the first batch). `bounds`: each
/// chunk's batches (first, end) of `batch_ids`. The first error in chunk order is returned.
pub(super) fn plan_chunks(
    space: &SampleSpace<'_>,
    cfg: &PlanConfig,
    batch_ids: &[&[(u64, u64)]],
    bounds: &[(usize, usize)],
    samples: usize,
) -> Result<Planned, PlanError> {
    let threads = if samples >= PARALLEL_PLAN_SAMPLES {
        std::thread::available_parallelism().map_or(1, |n| n.get().min(16))
    } else {
        1
    };
    let part = |bounds: &[(usize, usize)], samples: usize| -> Result<Planned, PlanError> {
        let mut out = Planned::with_capacity(samples, bounds.len());
        let mut sc = Scratch::default();
        for &(first, end) in bounds {
            sc.ids.clear();
            for b in &batch_ids[first..end] {
                sc.ids.extend_from_slice(b);
            }
            plan_reads(space, cfg, &mut sc, &mut out)?;
            out.ends
                .push((out.reads.len(), out.samples.len(), out.pieces.len()));
        }
        Ok(out)
    };
    if threads <= 1 || bounds.len() <= 1 {
        return part(bounds, samples);
    }
    let per = bounds.len().div_ceil(threads);
    let parts: Vec<Result<Planned, PlanError>> = std::thread::scope(|sc| {
        let handles: Vec<_> = bounds
            .chunks(per)
            .map(|b| {
                let n = b
                    .iter()
                    .map(|&(f, e)| batch_ids[f..e].iter().map(|x| x.len()).sum::<usize>())
                    .sum();
                sc.spawn(move || part(b, n))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(PlanError::Config("a planning thread panicked".into())))
            })
            .collect()
    });
    let mut out = Planned::with_capacity(samples, bounds.len());
    for p in parts {
        out.append(p?);
    }
    Ok(out)
}

fn align_down(x: u64, a: u64) -> u64 {
    x / a * a
}

fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

/// Reads for the samples `sc.ids` (id, global position), merged; the samples and (GPT, several
/// columns) their pieces: one more chunk at the end of `out`.
fn plan_reads(
    space: &SampleSpace<'_>,
    cfg: &PlanConfig,
    sc: &mut Scratch,
    out: &mut Planned,
) -> Result<(), PlanError> {
    let index = space.index();
    let packed = !matches!(space, SampleSpace::Plain(..));
    // Parts of several-column samples start 8-byte aligned; GPT pieces are contiguous tokens.
    let part_align = if matches!(space, SampleSpace::Columns(..)) {
        PART_ALIGN as u32
    } else {
        1
    };
    sample_pieces(space, sc)?;
    let r0 = out.reads.len();
    merge_reads(index, cfg, sc, &mut out.reads)?;
    let reads = &out.reads[r0..];
    let p0 = out.pieces.len();
    let Scratch {
        ids,
        locs,
        first_piece,
        read_of,
        ..
    } = sc;
    for (k, &(id, position)) in ids.iter().enumerate() {
        let range = first_piece[k] as usize..first_piece[k + 1] as usize;
        let (read, offset_in_read) = match range.clone().next() {
            Some(j) => (
                read_of[j],
                locs[j].offset - reads[read_of[j] as usize].offset,
            ),
            None => (0, 0),
        };
        let mut s = PlannedSample {
            id,
            position,
            read,
            offset_in_read,
            len: locs[range.clone()].iter().map(|l| l.len).sum(),
            first_piece: 0,
            pieces: 0,
        };
        if packed {
            s.first_piece = (out.pieces.len() - p0) as u32;
            s.pieces = range.len() as u32;
            let mut dst = 0u32;
            for j in range {
                out.pieces.push(PlannedPiece {
                    read: read_of[j],
                    offset_in_read: locs[j].offset - reads[read_of[j] as usize].offset,
                    len: locs[j].len,
                    dst,
                });
                dst += locs[j].len.div_ceil(part_align) * part_align;
            }
            s.len = dst;
        }
        out.samples.push(s);
    }
    Ok(())
}

/// Every piece of the samples `sc.ids` (a sample's pieces contiguous), checked against its shard,
/// into `sc.locs`; and where each sample's pieces start, into `sc.first_piece` (one more entry: the
/// end).
fn sample_pieces(space: &SampleSpace<'_>, sc: &mut Scratch) -> Result<(), PlanError> {
    let index = space.index();
    let Scratch {
        ids,
        locs,
        first_piece,
        ..
    } = sc;
    locs.clear();
    first_piece.clear();
    let gpt_bytes = match space {
        SampleSpace::Gpt(_, g) => Some(g.sample_bytes()),
        _ => None,
    };
    for &(id, _) in ids.iter() {
        let from = locs.len();
        first_piece.push(from as u32);
        space.pieces(id, locs);
        for l in &locs[from..] {
            let size = index.shards.get(l.shard as usize).map_or(0, |s| s.size);
            if l.offset.checked_add(l.len as u64).is_none_or(|e| e > size) {
                return Err(PlanError::OutsideShard {
                    sample: id,
                    shard: l.shard,
                    offset: l.offset,
                    len: l.len,
                    size,
                });
            }
        }
        // GPT windows are read from indices and sequence lengths that may come from files (a cache,
        // a `.idx` read in place): a window that is not whole is an error, never a short sample.
        if let Some(expected) = gpt_bytes {
            let bytes: u64 = locs[from..].iter().map(|l| l.len as u64).sum();
            if bytes != expected {
                return Err(PlanError::GptSample {
                    sample: id,
                    bytes,
                    expected,
                });
            }
        }
    }
    first_piece.push(locs.len() as u32);
    Ok(())
}

/// A read being merged: its shard, first and last byte of its pieces, bridged gap bytes and the
/// pieces' own bytes.
#[derive(Clone, Copy)]
struct Open {
    shard: u32,
    start: u64,
    end: u64,
    gap: u64,
    useful: u64,
}

/// Whether adding a piece of `len` bytes ending at `end` to `c` keeps the aligned read within
/// `max_amplification` × its pieces' bytes (always, without a bound).
fn within_amplification(cfg: &PlanConfig, c: &Open, end: u64, len: u64) -> bool {
    let a = cfg.align;
    cfg.max_amplification == 0
        || align_up(end.max(c.end), a) - align_down(c.start, a)
            <= cfg.max_amplification * (c.useful + len)
}

/// The aligned read of `c`, widened toward `min_read` where that at most multiplies its bytes by
/// `MAX_WIDEN` (and stays within `max_amplification` of its pieces' bytes).
fn flush(index: &DatasetIndex, cfg: &PlanConfig, c: Open) -> ReadPlan {
    let a = cfg.align;
    let size = index.shards[c.shard as usize].size;
    let mut s = align_down(c.start, a);
    let mut e = align_up(c.end, a).min(size);
    // Widened toward min_read only while the read's own bytes are at least a quarter of it: a
    // lone small read (a GPT window in Megatron's order, scattered samples) is read as itself,
    // not 100× larger (every widened byte of it would be thrown away).
    let widen = cfg.min_read > 0
        && e - s < cfg.min_read
        && (c.end - c.start) * MAX_WIDEN >= cfg.min_read
        && (cfg.max_amplification == 0 || cfg.min_read <= cfg.max_amplification * c.useful);
    if widen {
        e = align_up(s + cfg.min_read, a).min(size);
        if e - s < cfg.min_read {
            s = align_down(e.saturating_sub(cfg.min_read), a);
        }
    }
    ReadPlan {
        shard: c.shard,
        offset: s,
        len: e - s,
        gap_bytes: c.gap,
    }
}

/// The pieces `sc.locs` sorted by (shard, offset) and merged into aligned reads (gaps of at most
/// `max_gap`, reads of at most `max_read`, widened toward `min_read`), pushed to `reads`; and the
/// read of each piece (from the first read pushed), in `sc.read_of`.
fn merge_reads(
    index: &DatasetIndex,
    cfg: &PlanConfig,
    sc: &mut Scratch,
    reads: &mut Vec<ReadPlan>,
) -> Result<(), PlanError> {
    let a = cfg.align;
    let Scratch {
        ids,
        locs,
        first_piece,
        owner,
        items,
        read_of,
    } = sc;
    owner.clear();
    for k in 0..ids.len() {
        for _ in first_piece[k]..first_piece[k + 1] {
            owner.push(k);
        }
    }
    items.clear();
    items.extend(
        locs.iter()
            .enumerate()
            .map(|(j, l)| (l.shard, l.offset, l.offset + l.len as u64, j)),
    );
    items.sort_unstable();
    let r0 = reads.len();
    read_of.clear();
    read_of.resize(locs.len(), 0);
    let mut cur: Option<Open> = None;
    for &(shard, off, end, j) in items.iter() {
        let span = align_up(end, a) - align_down(off, a);
        if span > cfg.max_read {
            return Err(PlanError::SampleTooLarge {
                sample: ids[owner[j]].0,
                shard: index.shards[shard as usize].path.display().to_string(),
                offset: off,
                len: (end - off) as u32,
                span,
                max_read: cfg.max_read,
            });
        }
        match cur {
            Some(c)
                if c.shard == shard
                    && off <= c.end + cfg.max_gap
                    && align_up(end.max(c.end), a) - align_down(c.start, a) <= cfg.max_read
                    && within_amplification(cfg, &c, end, end - off) =>
            {
                cur = Some(Open {
                    end: c.end.max(end),
                    gap: c.gap + off.saturating_sub(c.end),
                    useful: c.useful + (end - off),
                    ..c
                });
            }
            _ => {
                if let Some(c) = cur {
                    reads.push(flush(index, cfg, c));
                }
                cur = Some(Open {
                    shard,
                    start: off,
                    end,
                    gap: 0,
                    useful: end - off,
                });
            }
        }
        read_of[j] = (reads.len() - r0) as u32;
    }
    if let Some(c) = cur {
        reads.push(flush(index, cfg, c));
    }
    Ok(())
}
