//! GPT mode through the whole loader (host device): batches are `(batch, sequence_length + 1)` token
//! arrays; `order = "megatron"` delivers Megatron-Core's samples in Megatron's order (fixtures made by
//! Megatron-Core, see `fixtures/gpt/`), ranks taking their slice of each global batch; blends; the
//! block order delivers every window once; a resume moves between world sizes.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

mod support;

use std::collections::HashMap;

use support::gpt::{expected, fixture};
use ubdirect_loader::gpt::{BlendEntry, Order};
use ubdirect_loader::{Loader, RunConfig};

fn config(seq: u32, seed: u64, order: Order, batch: usize) -> RunConfig {
    let mut c = support::gpt::config(seq, seed, order, batch);
    c.dataset.paths = vec![fixture("u16a")];
    c
}

/// Every batch's rows, as u16 tokens.
fn rows(
    l: &Loader,
    it: impl Iterator<Item = Result<ubdirect_loader::Batch, ubdirect_loader::LoadError>>,
) -> Vec<Vec<Vec<i64>>> {
    let _ = l;
    it.map(|b| {
        let b = b.unwrap();
        let t = b.tokens().expect("GPT batches are token arrays");
        assert_eq!(t.rows, b.len());
        assert!(b.block().is_some(), "GPT batches are one block");
        (0..b.len())
            .map(|i| {
                let v = b.sample_to_vec(i).unwrap();
                assert_eq!(v.len(), t.cols * 2);
                assert_eq!(
                    b.samples()[i].offset,
                    t.offset + i * t.cols * 2,
                    "rows are packed"
                );
                v.chunks_exact(2)
                    .map(|c| u16::from_le_bytes([c[0], c[1]]) as i64)
                    .collect()
            })
            .collect()
    })
    .collect()
}

#[test]
fn megatron_order_through_the_loader_equals_megatron_core() {
    let want = expected("one_epoch_s1234_n32");
    let cfg = config(32, 1234, Order::Megatron, 8);
    let l = Loader::from_config(&cfg).unwrap();
    let got = rows(&l, l.epoch(0).unwrap());
    assert_eq!(got.len(), want.len() / 8);
    for (k, b) in got.iter().enumerate() {
        assert_eq!(b[..], want[k * 8..k * 8 + 8], "batch {k}");
    }
    // Two ranks: rank r takes the r-th 8 samples of each global batch of 16.
    for r in 0..2 {
        let mut c = cfg.clone();
        c.loader.rank = Some(r);
        c.loader.world_size = Some(2);
        let l = Loader::from_config(&c).unwrap();
        let got = rows(&l, l.epoch(0).unwrap());
        assert_eq!(got.len(), want.len() / 16);
        for (k, b) in got.iter().enumerate() {
            let at = (2 * k + r) * 8;
            assert_eq!(b[..], want[at..at + 8], "rank {r} batch {k}");
        }
    }
}

/// Megatron-Core's `blend_s99_n24` fixture: `u16a` and `u16b` weighted 0.3 / 0.7, 24-token windows,
/// seed 99, 400 samples, batches of 10.
fn blend_config() -> RunConfig {
    let mut cfg = config(24, 99, Order::Megatron, 10);
    cfg.dataset.paths = Vec::new();
    cfg.dataset.num_samples = 400;
    cfg.dataset.blend = vec![
        BlendEntry {
            paths: vec![fixture("u16a")],
            weight: 0.3,
        },
        BlendEntry {
            paths: vec![fixture("u16b")],
            weight: 0.7,
        },
    ];
    cfg
}

#[test]
fn megatron_blend_through_the_loader_equals_megatron_core() {
    let want = expected("blend_s99_n24");
    let cfg = blend_config();
    let l = Loader::from_config(&cfg).unwrap();
    let got: Vec<Vec<i64>> = rows(&l, l.epoch(0).unwrap())
        .into_iter()
        .flatten()
        .collect();
    assert_eq!(got, want);
    let plan = l.plan(0).unwrap();
    assert_eq!(plan.stats.per_dataset, vec![120, 280]);
}

/// The token stream of `u16a` in file order and its windows (stride 20, 21 tokens).
fn windows(seq: usize) -> Vec<Vec<i64>> {
    let idx = ubdirect_loader::formats::megatron::read_idx(&fixture("u16a.idx")).unwrap();
    let bin = std::fs::read(fixture("u16a.bin")).unwrap();
    let stream: Vec<i64> = bin
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]) as i64)
        .collect();
    assert_eq!(
        stream.len() as i64,
        idx.lengths().map(|l| l as i64).sum::<i64>()
    );
    (0..(stream.len() - 1) / seq)
        .map(|k| stream[k * seq..k * seq + seq + 1].to_vec())
        .collect()
}

#[test]
fn block_order_delivers_every_window_once_and_resumes_across_world_sizes() {
    let all = windows(20);
    let mut cfg = config(20, 5, Order::Block, 6);
    cfg.loader.shuffle_block = ubdirect_loader::config::ByteSize(4096);
    let count = |seen: &[Vec<i64>]| {
        let mut m: HashMap<&[i64], i64> = HashMap::new();
        for w in &all {
            *m.entry(w).or_default() += 1;
        }
        for r in seen {
            *m.get_mut(&r[..])
                .expect("a delivered row is a window of the stream") -= 1;
        }
        m
    };
    // One rank, one epoch: all windows but fewer than a batch, each once.
    let l = Loader::from_config(&cfg).unwrap();
    let seen: Vec<Vec<i64>> = rows(&l, l.epoch(0).unwrap())
        .into_iter()
        .flatten()
        .collect();
    let m = count(&seen);
    assert!(m.values().all(|&c| c == 0 || c == 1), "a window twice");
    assert!(all.len() - seen.len() < 6);
    // 4 ranks for 5 batches, then 2 ranks for 7, then 3 to the end: still each window once.
    let mut seen = Vec::new();
    let mut state = None;
    for (world, stop) in [(4usize, Some(5usize)), (2, Some(7)), (3, None)] {
        let mut states = Vec::new();
        for r in 0..world {
            let mut c = cfg.clone();
            c.loader.rank = Some(r);
            c.loader.world_size = Some(world);
            let l = Loader::from_config(&c).unwrap();
            let it = match &state {
                Some(s) => l.resume(s).unwrap(),
                None => l.epoch(0).unwrap(),
            };
            let it = it.take(stop.unwrap_or(usize::MAX));
            seen.extend(rows(&l, it).into_iter().flatten());
            states.push(l.state());
        }
        assert!(states.iter().all(|s| s.position == states[0].position));
        state = Some(states[0].clone());
    }
    let m = count(&seen);
    assert!(
        m.values().all(|&c| c == 0 || c == 1),
        "a window twice across the resume"
    );
    assert!(
        all.len() - seen.len() < 3 * 6,
        "{} of {} windows",
        seen.len(),
        all.len()
    );
}

#[test]
fn gpt_settings_are_checked() {
    let mut cfg = config(0, 0, Order::Megatron, 8);
    let e = Loader::from_config(&cfg).unwrap_err();
    assert!(e.to_string().contains("sequence_length"), "{e}");
    cfg.dataset.sequence_length = 16;
    cfg.loader.seed = 1 << 40;
    let e = Loader::from_config(&cfg).unwrap_err();
    assert!(e.to_string().contains("2³²"), "{e}");
    // Mixed token types in a blend.
    let mut cfg = config(16, 1, Order::Block, 8);
    cfg.dataset.paths = Vec::new();
    cfg.dataset.blend = vec![
        BlendEntry {
            paths: vec![fixture("u16a")],
            weight: 1.0,
        },
        BlendEntry {
            paths: vec![fixture("i32a")],
            weight: 1.0,
        },
    ];
    let e = Loader::from_config(&cfg).unwrap_err();
    assert!(e.to_string().contains("mixed token types"), "{e}");
}

#[test]
fn megatron_order_from_the_mapped_page_cache_equals_megatron_core() {
    // Epoch 0 reads through the page cache; epoch 1 copies straight from the mapped shard (the
    // page cache as a pool): both are Megatron's samples (its order is the same every epoch).
    let want = expected("one_epoch_s1234_n32");
    let mut cfg = config(32, 1234, Order::Megatron, 8);
    cfg.pool.page_cache_budget = ubdirect_loader::config::PageCacheBudget::Bytes(64 << 20);
    let l = Loader::from_config(&cfg).unwrap();
    for epoch in 0..2 {
        let got: Vec<Vec<i64>> = rows(&l, l.epoch(epoch).unwrap())
            .into_iter()
            .flatten()
            .collect();
        assert_eq!(got[..], want[..got.len()], "epoch {epoch}");
        assert_eq!(got.len(), want.len() / 8 * 8);
    }
    let mapped = l.page_cache().map_or(0, |p| p.0);
    eprintln!("mapped shards after two epochs: {mapped}");
}

/// `Batch::provenance` of a blend names, for every sample in Megatron's order, the dataset that
/// Megatron-Core's own `BlendedDataset` index names; each sample's first tokens are those of the
/// document and offset it names.
#[test]
fn provenance_of_a_blend_equals_megatron_core_blend_index() {
    use support::gpt::npy;
    let (di, _) = npy("blend_s99_n24.dataset_index.npy");
    let cfg = blend_config();
    let l = Loader::from_config(&cfg).unwrap();
    let g = l.gpt().unwrap();
    let idx: Vec<_> = ["u16a", "u16b"]
        .iter()
        .map(|n| {
            ubdirect_loader::formats::megatron::MegatronIdx::map(&fixture(&format!("{n}.idx")))
                .unwrap()
        })
        .collect();
    let bins: Vec<Vec<u8>> = ["u16a", "u16b"]
        .iter()
        .map(|n| std::fs::read(fixture(&format!("{n}.bin"))).unwrap())
        .collect();
    let mut i = 0usize;
    for b in l.epoch(0).unwrap() {
        let b = b.unwrap();
        let p = b.provenance();
        assert_eq!(p.sample.len(), b.len());
        for j in 0..b.len() {
            assert_eq!(p.dataset[j] as i64, di[i], "sample {i}: dataset");
            assert_eq!(
                p.sample[j],
                g.bases[p.dataset[j] as usize] + p.window[j],
                "sample {i}: ids are windows numbered dataset after dataset"
            );
            assert_eq!(p.length[j], g.tokens);
            assert!(p.documents[j] >= 1);
            // The first tokens are the named document's, from the named offset.
            let m = &idx[p.dataset[j] as usize];
            let doc = p.document[j] as usize;
            let start = m.pointer(doc) as usize + 2 * p.token_offset[j] as usize;
            let avail = (m.length(doc) as u64 - p.token_offset[j]).min(g.tokens as u64) as usize;
            let row = b.sample_to_vec(j).unwrap();
            assert_eq!(
                row[..2 * avail],
                bins[p.dataset[j] as usize][start..start + 2 * avail],
                "sample {i}: first document's tokens"
            );
            i += 1;
        }
    }
    assert_eq!(i, 400);
}
