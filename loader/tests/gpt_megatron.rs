//! GPT mode against Megatron-Core itself: `loader.order = "megatron"` builds the same document,
//! sample and shuffle indices as Megatron-Core 0.16's `GPTDataset` (and `BlendedDataset`), and the
//! same tokens for every sample, on fixtures Megatron made (`fixtures/gpt/make_fixtures.py`).

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

mod support;

use std::path::PathBuf;

use support::gpt::{fixtures, npy};
use ubdirect_loader::gpt::{self, GptSettings, Order, SplitPart};
use ubdirect_loader::index::SampleLoc;

struct Case {
    name: String,
    datasets: Vec<String>,
    weights: Option<Vec<f64>>,
    seed: u64,
    seq: u32,
    num_samples: u64,
    split: String,
    part: SplitPart,
    extra: bool,
    samples: u64,
}

fn cases() -> Vec<Case> {
    let j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("cases.json")).unwrap())
            .unwrap();
    j["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            name: c["name"].as_str().unwrap().into(),
            datasets: c["datasets"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_str().unwrap().to_string())
                .collect(),
            weights: c["weights"]
                .as_array()
                .map(|w| w.iter().map(|x| x.as_f64().unwrap()).collect()),
            seed: c["seed"].as_u64().unwrap(),
            seq: c["sequence_length"].as_u64().unwrap() as u32,
            num_samples: c["num_samples"].as_u64().unwrap_or(0),
            split: c["split"].as_str().unwrap().into(),
            part: match c["split_part"].as_str().unwrap() {
                "train" => SplitPart::Train,
                "valid" => SplitPart::Valid,
                _ => SplitPart::Test,
            },
            extra: c["add_extra_token"].as_bool().unwrap(),
            samples: c["samples"].as_u64().unwrap(),
        })
        .collect()
}

fn tokens_of(bins: &[Vec<u8>], es: usize, pieces: &[SampleLoc]) -> Vec<i64> {
    let mut out = Vec::new();
    for p in pieces {
        let b = &bins[p.shard as usize][p.offset as usize..p.offset as usize + p.len as usize];
        for c in b.chunks_exact(es) {
            out.push(match es {
                2 => u16::from_le_bytes([c[0], c[1]]) as i64,
                _ => i32::from_le_bytes(c.try_into().unwrap()) as i64,
            });
        }
    }
    out
}

#[test]
fn megatron_order_equals_megatron_core_token_for_token() {
    let cases = cases();
    assert!(cases.len() >= 9, "fixtures: {} cases", cases.len());
    for c in cases {
        let paths: Vec<PathBuf> = c.datasets.iter().map(|d| fixtures().join(d)).collect();
        let index = ubdirect_loader::formats::megatron::open(&paths).unwrap();
        let dtype = gpt::megatron_dtype(&paths[0]).unwrap();
        let settings = GptSettings {
            sequence_length: c.seq,
            add_extra_token: c.extra,
            seed: c.seed,
            num_samples: c.num_samples,
            split: c.split.clone(),
            part: c.part,
            order: Order::Megatron,
            blend: c
                .weights
                .as_ref()
                .map(|w| w.iter().map(|&x| (x, 1)).collect())
                .unwrap_or_default(),
        };
        let g = gpt::build(&index, dtype, &settings).unwrap_or_else(|e| panic!("{}: {e}", c.name));
        let order = g.order.as_ref().unwrap().to_vec();
        assert_eq!(order.len() as u64, c.samples, "{}: samples", c.name);
        if c.weights.is_none() {
            let ix = &g.parts[0].indices;
            let (d, _) = npy(&format!("{}.document_index.npy", c.name));
            let ours: Vec<i64> = ix.document_index.iter().map(|x| x as i64).collect();
            assert_eq!(ours, d, "{}: document index", c.name);
            let (s, shape) = npy(&format!("{}.sample_index.npy", c.name));
            assert_eq!(shape, [ix.sample_index.len(), 2], "{}", c.name);
            let ours: Vec<i64> = ix
                .sample_index
                .iter()
                .flat_map(|(a, b)| [a as i64, b as i64])
                .collect();
            assert_eq!(ours, s, "{}: sample index", c.name);
            let (sh, _) = npy(&format!("{}.shuffle_index.npy", c.name));
            let ours: Vec<i64> = order.iter().map(|&x| x as i64).collect();
            assert_eq!(ours, sh, "{}: shuffle index", c.name);
        } else {
            let (di, _) = npy(&format!("{}.dataset_index.npy", c.name));
            let ours: Vec<i64> = order.iter().map(|&id| g.part_of(id) as i64).collect();
            assert_eq!(ours, di, "{}: dataset index", c.name);
        }
        // Tokens, sample by sample.
        let bins: Vec<Vec<u8>> = index
            .shards
            .iter()
            .map(|s| std::fs::read(&s.path).unwrap())
            .collect();
        let (want, shape) = npy(&format!("{}.tokens.npy", c.name));
        let width = (c.seq + c.extra as u32) as usize;
        assert_eq!(shape, [c.samples as usize, width]);
        let mut pieces = Vec::new();
        for (i, &id) in order.iter().enumerate() {
            pieces.clear();
            g.pieces(&index, id, &mut pieces);
            let got = tokens_of(&bins, dtype.size(), &pieces);
            // Provenance: the window's dataset, its row of the sample index (single datasets:
            // Megatron's shuffle index at this position) and the documents it spans.
            let o = g.origin(id).unwrap();
            assert_eq!(o.dataset as usize, g.part_of(id), "{}: sample {i}", c.name);
            assert_eq!(o.documents as usize, pieces.len(), "{}: sample {i}", c.name);
            if c.weights.is_none() {
                assert_eq!(o.window, id, "{}: sample {i}", c.name);
            }
            assert_eq!(
                got,
                want[i * width..(i + 1) * width],
                "{}: sample {i} (id {id}) differs",
                c.name
            );
        }
        eprintln!("{}: {} samples equal Megatron-Core's", c.name, c.samples);
    }
}
