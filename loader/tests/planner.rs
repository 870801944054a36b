//! Property tests of the epoch planner.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::collections::HashMap;
use std::path::PathBuf;

use proptest::prelude::*;
use ubdirect_loader::planner::{
    PlanConfig, Remainder, SampleSpace, batches_per_rank, plan, plan_epoch,
};
use ubdirect_loader::{DatasetIndex, SampleLoc, Shard};

/// A random dataset: 1–4 shards of 0–300 samples of 1 B – 96 KiB, with random gaps between them.
fn dataset() -> impl Strategy<Value = DatasetIndex> {
    prop::collection::vec(
        prop::collection::vec((1u32..96 * 1024, 0u64..20_000), 0..300),
        1..4,
    )
    .prop_map(|shards| {
        let mut idx = DatasetIndex {
            format: "test".into(),
            ..Default::default()
        };
        for (si, samples) in shards.into_iter().enumerate() {
            let mut off = 0u64;
            for (len, gap) in samples {
                off += gap;
                idx.samples.push(SampleLoc {
                    shard: si as u32,
                    offset: off,
                    len,
                });
                off += len as u64;
            }
            idx.shards.push(Shard {
                path: PathBuf::from(format!("s{si}")),
                size: off + 1234,
            });
        }
        idx
    })
}

fn config() -> impl Strategy<Value = PlanConfig> {
    (
        1usize..40,
        any::<u64>(),
        any::<bool>(),
        0usize..100,
        any::<bool>(),
        0u64..4,
        0u64..4,
        (0u64..3, 1usize..20),
    )
        .prop_map(
            |(
                batch_size,
                seed,
                shuffle,
                window,
                pad,
                min_read_k,
                gap_k,
                (block_k, max_chunk_batches),
            )| PlanConfig {
                batch_size,
                seed,
                shuffle,
                shuffle_block: [64 << 10, 1 << 20, 16 << 20][block_k as usize],
                window,
                remainder: if pad { Remainder::Pad } else { Remainder::Drop },
                min_read: [0, 64 << 10, 256 << 10, 1 << 20][min_read_k as usize],
                max_gap: [0, 4096, 64 << 10, 1 << 20][gap_k as usize],
                max_read: 4 << 20,
                align: 4096,
                max_chunk_batches,
                chunk_bytes: [0, 4 << 20][(block_k % 2) as usize],
                max_amplification: [0, 2][(gap_k % 2) as usize],
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn every_sample_once_per_epoch_equal_batches(idx in dataset(), cfg in config(), world in 1usize..6, epoch in 0u64..4) {
        let n = idx.samples.len() as u64;
        let mut seen: HashMap<u64, u64> = HashMap::new();
        let nb = batches_per_rank(n, world, &cfg);
        for rank in 0..world {
            let plan = plan_epoch(&idx, &cfg, epoch, rank, world).unwrap();
            prop_assert_eq!(plan.batches.len() as u64, nb, "rank {} batch count", rank);
            for b in &plan.batches {
                prop_assert_eq!(b.samples.len(), cfg.batch_size);
                for s in &b.samples {
                    *seen.entry(s.id).or_default() += 1;
                }
            }
        }
        let delivered: u64 = seen.values().sum();
        prop_assert_eq!(delivered, nb * world as u64 * cfg.batch_size as u64);
        match cfg.remainder {
            Remainder::Drop => {
                prop_assert!(seen.values().all(|&c| c == 1), "a sample delivered twice");
                prop_assert!(n - delivered < (world * cfg.batch_size) as u64, "dropped a whole batch per rank");
            }
            Remainder::Pad => {
                if n > 0 {
                    prop_assert_eq!(seen.len() as u64, n, "a sample never delivered");
                }
                prop_assert!(delivered - n < (world * cfg.batch_size) as u64, "padded more than needed");
                prop_assert!(seen.values().all(|&c| c <= delivered.div_ceil(n.max(1))), "uneven padding");
            }
        }
    }

    #[test]
    fn identical_inputs_identical_plans(idx in dataset(), cfg in config(), world in 1usize..4, epoch in 0u64..3) {
        let rank = world - 1;
        prop_assert_eq!(plan_epoch(&idx, &cfg, epoch, rank, world).unwrap(), plan_epoch(&idx, &cfg, epoch, rank, world).unwrap());
    }

    #[test]
    fn reads_cover_samples_and_respect_limits(idx in dataset(), cfg in config(), world in 1usize..3) {
        let plan = plan_epoch(&idx, &cfg, 1, 0, world).unwrap();
        let mut covered = 0usize;
        for (ci, c) in plan.chunks.iter().enumerate() {
            prop_assert_eq!(c.first_batch as usize, covered, "chunks must tile the batches");
            covered += c.batches as usize;
            prop_assert!(c.batches as usize <= cfg.max_chunk_batches);
            let chunk_bytes: u64 = c.batch_range().flat_map(|b| plan.batches[b].samples.iter().map(|s| s.len as u64)).sum();
            let last_bytes: u64 = plan.batches[c.batch_range().end - 1].samples.iter().map(|s| s.len as u64).sum();
            if ci + 1 < plan.chunks.len() && (c.batches as usize) < cfg.max_chunk_batches {
                prop_assert!(chunk_bytes >= cfg.min_read.max(cfg.chunk_bytes), "chunk {} closed early", ci);
            }
            // A chunk only grows while it is below min_read and chunk_bytes: without its last batch
            // it was.
            if c.batches > 1 {
                prop_assert!(chunk_bytes - last_bytes < cfg.min_read.max(cfg.chunk_bytes).max(1));
            }
            for (ri, r) in c.reads.iter().enumerate() {
                let size = idx.shards[r.shard as usize].size;
                prop_assert_eq!(r.offset % cfg.align, 0, "unaligned read");
                prop_assert!(r.offset + r.len <= size, "read past the shard");
                prop_assert!(r.len <= cfg.max_read + cfg.align, "read longer than max_read");
                // The span of the samples it serves.
                let (mut lo, mut hi) = (u64::MAX, 0u64);
                for b in c.batch_range() {
                    for s in plan.batches[b].samples.iter().filter(|s| s.read as usize == ri) {
                        let loc = idx.samples.loc(s.id as usize);
                        lo = lo.min(loc.offset);
                        hi = hi.max(loc.offset + loc.len as u64);
                    }
                }
                prop_assert!(lo < hi, "a read serving no sample");
                // Reads are at least min_read unless the shard is smaller (then: the whole shard),
                // or their samples span less than a quarter of it (then: just that span, aligned).
                // With max_amplification, widening stops at that bound: a read is its samples' span
                // aligned, or widened within the bound.
                if cfg.max_amplification > 0 {
                    prop_assert!(r.offset <= lo / cfg.align * cfg.align);
                    prop_assert!(r.offset + r.len >= (hi.div_ceil(cfg.align) * cfg.align).min(size));
                    if r.len > (hi.div_ceil(cfg.align) * cfg.align).min(size) - lo / cfg.align * cfg.align {
                        prop_assert!(r.len <= cfg.min_read + cfg.align, "widened past min_read");
                    }
                } else if cfg.min_read > 0 {
                    if (hi - lo) * 4 < cfg.min_read {
                        prop_assert_eq!(r.offset, lo / cfg.align * cfg.align);
                        prop_assert_eq!(r.offset + r.len, (hi.div_ceil(cfg.align) * cfg.align).min(size));
                    } else if size >= cfg.min_read {
                        prop_assert!(r.len >= cfg.min_read, "read {}+{} shorter than min_read {}", r.offset, r.len, cfg.min_read);
                    } else {
                        prop_assert_eq!((r.offset, r.len), (0, size));
                    }
                }
            }
            let samples: Vec<_> = c.batch_range().flat_map(|b| plan.batches[b].samples.iter().copied()).collect();
            for s in &samples {
                let loc = idx.samples.loc(s.id as usize);
                let r = &c.reads[s.read as usize];
                prop_assert_eq!(r.shard, loc.shard);
                prop_assert_eq!(r.offset + s.offset_in_read, loc.offset);
                prop_assert!(s.offset_in_read + s.len as u64 <= r.len);
            }
            // Waste from bridging gaps is at most max_gap per merge.
            for (ri, r) in c.reads.iter().enumerate() {
                let mut locs: Vec<(u64, u64)> = samples.iter().filter(|s| s.read as usize == ri)
                    .map(|s| { let l = idx.samples.loc(s.id as usize); (l.offset, l.offset + l.len as u64) }).collect();
                locs.sort_unstable();
                let mut end = locs[0].1;
                let mut bridged = 0;
                for &(a, e) in &locs[1..] {
                    let gap = a.saturating_sub(end);
                    prop_assert!(gap <= cfg.max_gap, "bridged a gap of {} > max_gap {}", gap, cfg.max_gap);
                    bridged += gap;
                    end = end.max(e);
                }
                prop_assert_eq!(bridged, r.gap_bytes);
            }
        }
        prop_assert_eq!(covered, plan.batches.len());
    }

    #[test]
    fn positions_are_the_stream_order(idx in dataset(), cfg in config()) {
        let plan = plan_epoch(&idx, &cfg, 0, 0, 1).unwrap();
        let pos: Vec<u64> = plan.batches.iter().flat_map(|b| b.samples.iter().map(|s| s.position)).collect();
        prop_assert_eq!(pos, (0..plan.stats.samples).collect::<Vec<_>>());
    }

    #[test]
    fn epochs_and_seeds_reshuffle(
        lens in prop::collection::vec(1u32..8192, 200..400),
        seed in any::<u64>(),
        batch_size in 2usize..20,
        pad in any::<bool>(),
    ) {
        let mut idx = DatasetIndex { format: "t".into(), ..Default::default() };
        let mut off = 0u64;
        for len in lens {
            idx.samples.push(SampleLoc { shard: 0, offset: off, len });
            off += len as u64;
        }
        idx.shards.push(Shard { path: "s".into(), size: off });
        let cfg = PlanConfig {
            batch_size,
            seed,
            remainder: if pad { Remainder::Pad } else { Remainder::Drop },
            ..PlanConfig::default()
        };
        let order = |e: u64| -> Vec<u64> {
            plan_epoch(&idx, &cfg, e, 0, 1).unwrap().batches.iter().flat_map(|b| b.samples.iter().map(|s| s.id)).collect()
        };
        // Windows of >= 2 samples over >= 200 samples: identical orders would take ~2^-100 luck.
        prop_assert_ne!(order(0), order(1));
    }
}

#[test]
fn oversized_sample_and_bad_rank_are_errors() {
    let idx = DatasetIndex {
        format: "t".into(),
        shards: vec![Shard {
            path: "s".into(),
            size: 10 << 20,
        }],
        samples: vec![SampleLoc {
            shard: 0,
            offset: 100,
            len: 5 << 20,
        }]
        .into(),
    };
    let cfg = PlanConfig {
        batch_size: 1,
        ..PlanConfig::default()
    };
    let e = plan_epoch(&idx, &cfg, 0, 0, 1).unwrap_err();
    assert!(e.to_string().contains("max_read"), "{e}");
    let e = plan_epoch(&idx, &cfg, 0, 2, 2).unwrap_err();
    assert!(e.to_string().contains("rank 2"), "{e}");
}

/// One plan's samples as (global position, id).
fn delivered(plan: &ubdirect_loader::planner::EpochPlan) -> Vec<(u64, u64)> {
    plan.batches
        .iter()
        .flat_map(|b| b.samples.iter().map(|s| (s.position, s.id)))
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 100, ..ProptestConfig::default() })]

    /// The global order does not depend on the world size: every world delivers position `p` as the
    /// same sample, and rank `r` takes the `r`-th slice of each global batch.
    #[test]
    fn global_order_is_independent_of_the_world_size(idx in dataset(), cfg in config(), epoch in 0u64..3) {
        let mut by_pos: HashMap<u64, u64> = HashMap::new();
        for world in 1usize..5 {
            for rank in 0..world {
                let plan = plan_epoch(&idx, &cfg, epoch, rank, world).unwrap();
                for (bi, b) in plan.batches.iter().enumerate() {
                    for (si, s) in b.samples.iter().enumerate() {
                        let want = (bi * world + rank) * cfg.batch_size + si;
                        prop_assert_eq!(s.position, want as u64);
                    }
                }
                for (p, id) in delivered(&plan) {
                    if p >= idx.samples.len() as u64 {
                        continue; // padding wraps around
                    }
                    prop_assert_eq!(*by_pos.entry(p).or_insert(id), id, "position {} differs at world {}", p, world);
                }
            }
        }
    }

    /// Resume at another world size: 4 ranks for a while, then 2, then 3 to the end of the epoch;
    /// nothing is delivered twice and nothing is skipped (all but fewer than a global batch).
    #[test]
    fn resume_across_world_sizes_delivers_each_sample_once(
        idx in dataset(), mut cfg in config(), k1 in 0u64..6, k2 in 0u64..6,
    ) {
        cfg.remainder = Remainder::Drop;
        let space = SampleSpace::Plain(&idx);
        let n = idx.samples.len() as u64;
        let mut seen: HashMap<u64, u32> = HashMap::new();
        let mut position = 0u64;
        for (world, stop) in [(4usize, Some(k1)), (2, Some(k2)), (3, None)] {
            let mut next = position;
            for rank in 0..world {
                let plan = plan(&space, &cfg, 1, rank, world, position).unwrap();
                let take = stop.unwrap_or(plan.batches.len() as u64).min(plan.batches.len() as u64);
                for b in &plan.batches[..take as usize] {
                    for s in &b.samples {
                        *seen.entry(s.id).or_default() += 1;
                    }
                }
                next = plan.position_after(take);
            }
            position = next;
        }
        prop_assert!(seen.values().all(|&c| c == 1), "a sample delivered twice");
        prop_assert!(n - (seen.len() as u64) < 3 * cfg.batch_size as u64, "skipped {} samples", n - seen.len() as u64);
        prop_assert_eq!(seen.len() as u64, position.min(n));
    }
}

#[test]
fn resume_four_two_three_covers_the_epoch_exactly() {
    // 1200 samples in batches of 5: 4 ranks × 15 batches, 2 × 30, then 3 ranks to the end (40 each).
    let mut idx = DatasetIndex {
        format: "t".into(),
        ..Default::default()
    };
    for i in 0..1200u64 {
        idx.samples.push(SampleLoc {
            shard: 0,
            offset: i * 1000,
            len: 1000,
        });
    }
    idx.shards.push(Shard {
        path: "s".into(),
        size: 1_200_000,
    });
    let cfg = PlanConfig {
        batch_size: 5,
        seed: 3,
        ..PlanConfig::default()
    };
    let space = SampleSpace::Plain(&idx);
    let mut seen = vec![0u32; 1200];
    let mut position = 0;
    for (world, stop) in [(4usize, Some(15u64)), (2, Some(30)), (3, None)] {
        let mut next = 0;
        for rank in 0..world {
            let p = plan(&space, &cfg, 0, rank, world, position).unwrap();
            let take = stop.unwrap_or(p.batches.len() as u64);
            for b in &p.batches[..take as usize] {
                for s in &b.samples {
                    seen[s.id as usize] += 1;
                }
            }
            next = p.position_after(take);
        }
        position = next;
    }
    assert_eq!(position, 1200);
    assert!(seen.iter().all(|&c| c == 1), "every sample exactly once");
}

/// A GPT sample space over random documents (u16 tokens, one shard, gaps between sequences).
fn gpt_space(lens: &[u32], seq: u32) -> (DatasetIndex, ubdirect_loader::gpt::GptSamples) {
    let mut idx = DatasetIndex {
        format: "megatron".into(),
        ..Default::default()
    };
    let mut off = 0u64;
    for &l in lens {
        off += 6; // a gap no sample covers
        idx.samples.push(SampleLoc {
            shard: 0,
            offset: off,
            len: l * 2,
        });
        off += l as u64 * 2;
    }
    idx.shards.push(Shard {
        path: "g".into(),
        size: off + 100,
    });
    let s = ubdirect_loader::gpt::GptSettings {
        sequence_length: seq,
        add_extra_token: true,
        seed: 9,
        num_samples: 0,
        split: "100,0,0".into(),
        part: ubdirect_loader::gpt::SplitPart::Train,
        order: ubdirect_loader::gpt::Order::Block,
        blend: Vec::new(),
    };
    let g = ubdirect_loader::gpt::build(&idx, ubdirect_loader::formats::Dtype::U16, &s).unwrap();
    (idx, g)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 60, ..ProptestConfig::default() })]

    /// GPT windows: each planned piece lies inside its read and inside a sequence; a sample's pieces
    /// add up to `sequence_length + 1` tokens and are the token range `[k·N, k·N + N + 1)` of the
    /// documents' stream; every window is delivered once per epoch across ranks.
    #[test]
    fn gpt_pieces_are_the_windows(
        lens in prop::collection::vec(0u32..300, 2..80),
        seq in 1u32..64,
        cfg in config(),
        world in 1usize..4,
    ) {
        let total: u64 = lens.iter().map(|&l| l as u64).sum();
        prop_assume!(total > seq as u64 + 1);
        let (idx, g) = gpt_space(&lens, seq);
        // Token position → byte offset, for checking pieces against the stream.
        let mut at = Vec::new();
        for s in &idx.samples {
            for t in 0..s.len as u64 / 2 {
                at.push(s.offset + 2 * t);
            }
        }
        let space = SampleSpace::Gpt(&idx, &g);
        let mut seen: HashMap<u64, u32> = HashMap::new();
        for rank in 0..world {
            let p = plan(&space, &cfg, 0, rank, world, 0).unwrap();
            for b in &p.batches {
                for s in &b.samples {
                    *seen.entry(s.id).or_default() += 1;
                    prop_assert_eq!(s.len, (seq + 1) * 2);
                    let c = &p.chunks[b.chunk as usize];
                    let mut k = s.id * seq as u64; // first token of window `id`
                    let mut dst = 0;
                    for piece in &b.pieces[s.first_piece as usize..(s.first_piece + s.pieces) as usize] {
                        let r = &c.reads[piece.read as usize];
                        prop_assert!(piece.offset_in_read + piece.len as u64 <= r.len, "piece past its read");
                        prop_assert_eq!(piece.dst, dst);
                        dst += piece.len;
                        for t in 0..piece.len as u64 / 2 {
                            prop_assert_eq!(r.offset + piece.offset_in_read + 2 * t, at[k as usize], "token {} of window {}", k, s.id);
                            k += 1;
                        }
                    }
                    prop_assert_eq!(dst, s.len);
                }
            }
        }
        if cfg.remainder == Remainder::Drop {
            prop_assert!(seen.values().all(|&c| c == 1), "a window twice");
        }
    }
}
