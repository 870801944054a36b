//! Scale without growth: a dataset of more shards than the process may keep open is read with
//! shards opened on demand (a bounded, least-recently-used set), and delivers the samples a run
//! that keeps every shard open delivers; raw records of a huge sparse dataset index and plan their
//! first batch without a vector per sample.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

mod support;

use std::path::Path;
use std::process::Command;

use support::{read_dump, tmp};

const CFG: &str = "[loader]\nbatch_size = 16\nseed = 5\nmin_read = \"64KiB\"\nchunk_bytes = \"64KiB\"\n[device]\nselect = \"host\"\n";

/// `shards` raw shards of `records` records of 512 bytes, each record's bytes its global number.
fn raw_shards(dir: &Path, shards: usize, records: usize) {
    for s in 0..shards {
        let mut b = Vec::with_capacity(records * 512);
        for r in 0..records {
            let id = (s * records + r) as u32;
            for k in 0..128 {
                b.extend_from_slice(&(id ^ k).to_le_bytes());
            }
        }
        std::fs::write(dir.join(format!("s{s:05}.bin")), b).unwrap();
    }
}

fn config(dir: &Path, extra: &str) -> String {
    format!(
        "[dataset]\nformat = \"raw\"\ndir = \"{}\"\ngenerate = false\ndtype = \"u8\"\nrecord_len = 512\n{CFG}{extra}",
        dir.display()
    )
}

/// `ubdirect run` of `cfg` (under `prlimit --nofile=N:N` when given): its dump and summary.
fn run(cfg: &Path, out: &Path, nofile: Option<u64>) -> (Vec<(u64, u64)>, serde_json::Value) {
    let bin = env!("CARGO_BIN_EXE_ubdirect");
    let mut c = match nofile {
        Some(n) => {
            let mut c = Command::new("prlimit");
            c.arg(format!("--nofile={n}:{n}")).arg(bin);
            c
        }
        None => Command::new(bin),
    };
    let o = c
        .args(["run", "--json", "--config"])
        .arg(cfg)
        .arg("--dump-samples")
        .arg(out)
        .output()
        .expect("prlimit (util-linux) runs the loader under a descriptor limit");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    (read_dump(out), serde_json::from_slice(&o.stdout).unwrap())
}

#[test]
fn more_shards_than_descriptors_read_on_demand_give_the_same_samples() {
    if Command::new("prlimit").arg("--version").output().is_err() {
        support::skip("prlimit (util-linux) is not installed");
        return;
    }
    let d = tmp("scale-shards");
    let data = d.join("data");
    std::fs::create_dir_all(&data).unwrap();
    raw_shards(&data, 3000, 4);
    let cfg = d.join("c.toml");
    std::fs::write(&cfg, config(&data, "")).unwrap();
    // Every shard open (the machine's limit allows it), then under a hard limit of 512 descriptors:
    // 3,000 shards kept open need 3,000 or more, so the loader opens them on demand (at most 64).
    let (all_open, s1) = run(&cfg, &d.join("a.jsonl"), None);
    let (on_demand, s2) = run(&cfg, &d.join("b.jsonl"), Some(512));
    assert_eq!(all_open.len(), 12_000 / 16 * 16);
    assert_eq!(all_open, on_demand);
    let kinds = |s: &serde_json::Value| -> Vec<String> {
        s["fallbacks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f["kind"].as_str().unwrap_or("").to_string())
            .collect()
    };
    assert!(
        !kinds(&s1).contains(&"shards_on_demand".to_string()),
        "{s1}"
    );
    assert!(kinds(&s2).contains(&"shards_on_demand".to_string()), "{s2}");
    // A small set by hand, with a second epoch: each shard closed and opened again.
    std::fs::write(
        &cfg,
        config(&data, "[engine]\nmax_open_shards = 8\n")
            .replace("[loader]\n", "[loader]\nepochs = 2\n"),
    )
    .unwrap();
    let (two, _) = run(&cfg, &d.join("c.jsonl"), Some(512));
    assert_eq!(two.len(), 2 * all_open.len());
    assert_eq!(two[..all_open.len()], all_open[..]);
}

#[test]
fn a_shard_changed_under_an_on_demand_read_is_an_error() {
    let d = tmp("scale-changed");
    let data = d.join("data");
    std::fs::create_dir_all(&data).unwrap();
    raw_shards(&data, 40, 4);
    let cfg = d.join("c.toml");
    std::fs::write(&cfg, config(&data, "[engine]\nmax_open_shards = 4\n")).unwrap();
    let l = ubdirect_loader::Loader::from_config(
        &ubdirect_loader::RunConfig::from_toml(&std::fs::read_to_string(&cfg).unwrap(), "t")
            .unwrap(),
    )
    .unwrap();
    // Every shard but the first is opened at its first read: one made shorter now is refused then
    // (the error names it), not read as another file.
    std::fs::write(data.join("s00039.bin"), vec![0u8; 512]).unwrap();
    let err = l
        .epoch(0)
        .unwrap()
        .find_map(|b| b.err())
        .expect("a changed shard is an error");
    assert!(err.to_string().contains("s00039.bin"), "{err}");
}

/// An epoch of several plan segments (the iterator plans the next while one is read) delivers the
/// whole plan's batches, sample for sample, and resumes across a segment boundary.
#[test]
fn an_epoch_of_several_segments_is_the_whole_plan() {
    let d = tmp("scale-segments");
    let data = d.join("data");
    std::fs::create_dir_all(&data).unwrap();
    // 4 shards of 40,960 records of 16 bytes; batches of 4,096, one batch a chunk: the first
    // segment is max(2^12 / 4,096, 4 × 1) = 4 batches, each next one twice the one before up to
    // max(2^16 / 4,096, 4) = 16, so the epoch's 40 batches are segments of 4, 8, 16 and 12.
    for s in 0..4u32 {
        let b: Vec<u8> = (0..40_960u32)
            .flat_map(|r| [s, r, 0, 0].map(u32::to_le_bytes).concat())
            .collect();
        std::fs::write(data.join(format!("s{s}.bin")), b).unwrap();
    }
    let toml = format!(
        "[dataset]\nformat = \"raw\"\ndir = \"{}\"\ngenerate = false\ndtype = \"u8\"\nrecord_len = 16\n[loader]\nbatch_size = 4096\nmax_chunk_batches = 1\nmin_read = \"64KiB\"\nchunk_bytes = \"0\"\nwindow = 1000\n[device]\nselect = \"host\"\n",
        data.display()
    );
    let cfg = ubdirect_loader::RunConfig::from_toml(&toml, "t").unwrap();
    let l = ubdirect_loader::Loader::from_config(&cfg).unwrap();
    let first = l.first_plan(0).unwrap();
    assert_eq!(first.batches.len(), 4);
    assert_eq!(first.total_batches(), 40);
    let whole: Vec<Vec<(u64, u64)>> = l
        .plan(0)
        .unwrap()
        .batches
        .iter()
        .map(|b| b.samples.iter().map(|s| (s.id, s.position)).collect())
        .collect();
    assert_eq!(whole.len(), 40);
    let got: Vec<Vec<(u64, u64)>> = l
        .epoch(0)
        .unwrap()
        .map(|b| {
            b.unwrap()
                .samples()
                .iter()
                .map(|s| (s.id, s.position))
                .collect()
        })
        .collect();
    assert_eq!(got, whole);
    // Stopped inside the third segment, resumed in a fresh loader: the rest of the same epoch.
    let a = ubdirect_loader::Loader::from_config(&cfg).unwrap();
    let mut it = a.epoch(0).unwrap();
    for _ in 0..21 {
        it.next().unwrap().unwrap();
    }
    drop(it);
    let state = a.state();
    let b = ubdirect_loader::Loader::from_config(&cfg).unwrap();
    let rest: Vec<Vec<(u64, u64)>> = b
        .resume(&state)
        .unwrap()
        .map(|b| {
            b.unwrap()
                .samples()
                .iter()
                .map(|s| (s.id, s.position))
                .collect()
        })
        .collect();
    assert_eq!(rest, whole[21..]);
}
