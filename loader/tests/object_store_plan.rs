//! Object stores in Megatron order (GPT windows in a random order over the whole dataset): bytes
//! from the store against bytes delivered, without a cache, with a plan-aware cache of half the
//! dataset (against Belady's minimum computed offline from the same plan), and with a quarter of
//! the dataset in block order, alone and as two ranks of a node sharing the cache; samples equal to
//! the local run.
//!
//! Against `moto_server` on loopback, as `object_store_e2e.rs`; without it the tests print `skip:`
//! (a failure under `UBDIRECT_TEST_STRICT`).

#![cfg(feature = "object-store")]
#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

mod support;

use std::path::Path;

use support::objstore::{BUCKET, moto, moto_sections, moto_store, upload};
use support::{generate, local_config, tmp};

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
    support::objstore::run_summary(cfg, out)
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
    let server = moto()?;
    let port = server.port;
    let d = tmp(name);
    let data = d.join("data");
    generate(&data, "megatron", docs, 2);
    upload(moto_store(port), &data, "mg");
    // The dataset: its .bin and .idx objects (not a GPT index cache written beside them).
    let bytes = std::fs::read_dir(&data)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| {
            e.path()
                .extension()
                .is_some_and(|x| x == "bin" || x == "idx")
        })
        .map(|e| e.metadata().unwrap().len())
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
        // HOME here: a default object cache lands in the test's directory, not the user's.
        support::objstore::run_summary_home(
            &p,
            &self.dir.join(format!("{name}.jsonl")),
            Some(&self.dir.join("home")),
        )
    }

    fn cached(&self, name: &str, max_bytes: u64, chunk: &str) -> String {
        format!(
            "{}[cache]\ndir = \"{}\"\nmax_bytes = {max_bytes}\nchunk_size = \"{chunk}\"\n",
            self.s3,
            self.dir.join(format!("{name}-cache")).display()
        )
    }
}

/// The summary's predicted requests and bytes (made before each epoch, `store_cost`) are within
/// `tolerance` of the realised ones (issue 47: 10 %), every epoch replayed.
fn predicted_within(v: &serde_json::Value, tolerance: f64) {
    let c = &v["store_cost"];
    assert_eq!(n(c, "pending"), 0, "an epoch not replayed: {c}");
    let p = &c["predicted"];
    for (pred, real) in [
        (n(p, "requests"), n(c, "realised_requests")),
        (n(p, "bytes"), n(c, "realised_bytes")),
    ] {
        let off = (real as f64 / pred.max(1) as f64 - 1.0).abs();
        eprintln!("estimate: predicted {pred}, realised {real}");
        assert!(
            off <= tolerance,
            "predicted {pred}, realised {real}: {c}; {}",
            v["object_store"]
        );
    }
}

/// (store bytes, delivered bytes, ratio) of a run's summary.
fn ratio(v: &serde_json::Value) -> (u64, u64, f64) {
    let st = &v["object_store"];
    let delivered = n(v, "sample_bytes");
    let store = n(st, "bytes_from_store");
    (store, delivered, store as f64 / delivered.max(1) as f64)
}

/// Belady's minimum for `cfg`'s plan (epochs 0..epochs), offline: bytes a cache of `max_bytes` in
/// `chunk`-byte chunks fetches at least (plus the `.idx` objects read at open).
fn belady(s: &Setup, cfg: &str, epochs: u64, max_bytes: u64, chunk: u64) -> u64 {
    let _one = in_process();
    let p = s.dir.join("belady.toml");
    std::fs::write(&p, cfg).unwrap();
    let c = ubdirect_loader::config::RunConfig::load(Some(&p)).unwrap();
    let l = ubdirect_loader::Loader::from_config(&c).unwrap();
    let sizes: Vec<u64> = l.sources().iter().map(|s| s.size()).collect();
    let mut reads = Vec::new();
    for e in 0..epochs {
        let plan = l.plan(e).unwrap();
        for r in plan.chunks.iter().flat_map(|c| c.reads.iter()) {
            reads.push((r.shard as usize, r.offset, r.len));
        }
    }
    let idx: u64 = std::fs::read_dir(s.dir.join("data"))
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().extension().is_some_and(|x| x == "idx"))
        .map(|e| e.metadata().unwrap().len())
        .sum();
    ubdirect_loader::objstore::belady_bytes(&reads, &sizes, chunk, max_bytes, 64) + idx
}

#[test]
fn without_a_cache_megatron_order_fetches_what_it_delivers() {
    let Some(s) = setup("objplan-nocache", 300, "megatron", 1) else {
        return;
    };
    let (local, _) = s.run("local", &s.local);
    let t = std::time::Instant::now();
    // `cache.dir = ""`: no cache, asked for (unset, the run gets the default cache).
    let (plain, pv) = s.run("plain", &format!("{}[cache]\ndir = \"\"\n", s.s3));
    let (st, del, r) = ratio(&pv);
    let requests = n(&pv["object_store"], "requests");
    eprintln!(
        "no cache: {st} from the store for {del} delivered ({r:.2}×), {requests} requests, {:.1} s",
        t.elapsed().as_secs_f64()
    );
    assert_eq!(local, plain, "the s3:// epoch differs from the local one");
    assert!(r <= 4.0, "{st} bytes from the store for {del} delivered");
    // The run said before its first batch what the epoch costs: a GET per window.
    let warned = pv["fallbacks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["kind"] == "object_store_megatron_without_cache")
        .unwrap_or_else(|| panic!("no warning of the GETs an epoch costs: {pv}"));
    let said: u64 = warned["detail"]
        .as_str()
        .unwrap()
        .split_whitespace()
        .find_map(|w| w.parse().ok())
        .unwrap();
    // Windows of an epoch (the last part batch included): within 10 % of the GETs made (windows
    // that share a GET make fewer).
    assert!(
        said >= local.len() as u64 && said.abs_diff(requests) * 10 <= requests,
        "{requests} requests, {said} announced, {} windows delivered",
        local.len()
    );
    let hint = pv["store_hint"].as_str().unwrap_or("");
    assert!(
        hint.contains("a cache"),
        "the summary says no cache would help: {pv}"
    );
    predicted_within(&pv, 0.10);
}

/// Megatron order from the store with no `[cache]` at all: the run gets a default cache (in
/// `~/.cache/ubdirect/objects`, at most half the free disk), says so in its `resolved` lines, and
/// costs what a configured cache does — not a GET per window (on 2026-12-06, without a cache, 16,544
/// GETs for 16,000 windows).
#[test]
fn megatron_order_without_a_cache_configured_gets_the_default_cache() {
    let Some(s) = setup("objplan-default", 600, "megatron", 2) else {
        return;
    };
    let (local, _) = s.run("local", &s.local);
    let t = std::time::Instant::now();
    let (got, v) = s.run("default", &s.s3);
    let requests = n(&v["object_store"], "requests");
    let per_sample = requests as f64 / local.len() as f64;
    let (st, del, r) = ratio(&v);
    eprintln!(
        "default cache: {requests} requests for {} samples ({per_sample:.4} per sample), {r:.2}× the bytes, {:.1} s",
        local.len(),
        t.elapsed().as_secs_f64()
    );
    assert_eq!(local, got, "the s3:// epochs differ from the local ones");
    let resolved = v["resolved"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["key"] == "cache.max_bytes")
        .unwrap_or_else(|| panic!("no default cache in the summary: {v}"));
    assert!(
        resolved["why"]
            .as_str()
            .unwrap()
            .contains("~/.cache/ubdirect/objects"),
        "{resolved}"
    );
    // Megatron order keeps windows in memory (`cache.window_fraction` 1); the directory is made.
    let dir = s.dir.join("home/.cache/ubdirect/objects");
    assert!(dir.is_dir(), "no {}", dir.display());
    assert!(
        per_sample <= 0.01,
        "{requests} requests for {} samples",
        local.len()
    );
    assert!(r <= 4.0, "{st} bytes from the store for {del} delivered");
    predicted_within(&v, 0.10);
}

/// Megatron order with a cache of half the dataset: the cache holds windows of the plan's near
/// future (`cache.window_fraction`, 1 in this order), each chunk fetched whole in one GET when its
/// windows pay for it. Issue 47's goal: at most 0.01 requests per sample and 4 × the delivered
/// bytes from the store (on 2026-12-06 this run made 19,580 requests — one per window — for 0.77 ×
/// the bytes, in 81.5 s).
#[test]
fn a_cache_of_half_the_dataset_in_megatron_order_costs_few_requests() {
    let Some(s) = setup("objplan-half", 600, "megatron", 2) else {
        return;
    };
    let (local, _) = s.run("local", &s.local);
    let max = s.bytes / 2;
    let min = belady(&s, &s.s3, 2, max, 256 << 10);
    let t = std::time::Instant::now();
    let (cached, cv) = s.run("half", &s.cached("half", max, "256KiB"));
    let (st, del, r) = ratio(&cv);
    let requests = n(&cv["object_store"], "requests");
    let per_sample = requests as f64 / local.len() as f64;
    eprintln!(
        "cache of half ({max} bytes): {requests} requests for {} samples ({per_sample:.4} per sample), {st} from the store for {del} delivered ({r:.2}×; the byte minimum, Belady's, {min}), {:.1} s: {}",
        local.len(),
        t.elapsed().as_secs_f64(),
        cv["object_store"],
    );
    assert_eq!(
        local, cached,
        "the cached epochs differ from the local ones"
    );
    assert!(
        per_sample <= 0.01,
        "{requests} requests for {} samples",
        local.len()
    );
    assert!(r <= 4.0, "{st} bytes from the store for {del} delivered");
    predicted_within(&cv, 0.10);
    // Reads whose window is kept land with no staging block or task of their own (a task and a
    // block per 130-byte window made the epoch twice the local one on 2026-12-07).
    let at_hand = n(&cv["object_store"], "reads_at_hand");
    assert!(
        at_hand as usize * 2 >= local.len(),
        "{at_hand} reads at hand for {} samples",
        local.len()
    );
}

#[test]
fn a_quarter_of_the_dataset_in_block_order_fetches_it_about_once_per_epoch() {
    let Some(s) = setup("objplan-block", 600, "block", 2) else {
        return;
    };
    let (local, _) = s.run("local", &s.local);
    let max = s.bytes / 4;
    let min = belady(&s, &s.s3, 2, max, 128 << 10);
    let (cached, cv) = s.run("quarter", &s.cached("quarter", max, "128KiB"));
    let (st, del, r) = ratio(&cv);
    let per_epoch = st as f64 / 2.0 / s.bytes as f64;
    eprintln!(
        "block order, cache of a quarter ({max} bytes): {st} from the store for {del} delivered ({r:.2}×), {per_epoch:.3}× the dataset per epoch, Belady's minimum {min}: {}",
        cv["object_store"]
    );
    assert_eq!(
        local, cached,
        "the cached epochs differ from the local ones"
    );
    assert!(per_epoch <= 1.1, "{st} bytes from the store over 2 epochs");
    // The bytes as predicted. Not the requests: this cache holds 4.7 chunks, fewer than the reads
    // in flight, whose reservations then leave a read no room — a part fetched on its own, which
    // the estimate (one read at a time) does not see: 72 and 79 realised for 38 predicted on
    // 2026-12-07 (docs/object-store.md, "What an epoch will cost").
    let c = &cv["store_cost"];
    let (pred, real) = (n(&c["predicted"], "bytes"), n(c, "realised_bytes"));
    eprintln!("estimate: {c}");
    assert!(pred.abs_diff(real) * 10 <= pred, "bytes: {c}");
}

/// Held while loaders run in this process: the object-store counters are the process's, so a
/// measurement of them runs alone.
fn in_process() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Loaders of `cfg` as ranks 0 and 1 of a node of 2, in this process.
fn rank_loaders(s: &Setup, name: &str, cfg: &str) -> Vec<ubdirect_loader::Loader> {
    (0..2)
        .map(|r| {
            let p = s.dir.join(format!("{name}-{r}.toml"));
            std::fs::write(&p, as_rank(cfg, r)).unwrap();
            let c = ubdirect_loader::config::RunConfig::load(Some(&p)).unwrap();
            ubdirect_loader::Loader::from_config(&c).unwrap()
        })
        .collect()
}

/// Both ranks of `cfg` in this process, in step: a batch of each in turn, as the ranks of a
/// training job move a step at a time. Each rank's (sample, CRC) and the node's store bytes (the
/// index files read at open left out).
fn run_in_step(s: &Setup, name: &str, cfg: &str, epochs: u64) -> (Vec<Vec<(u64, u64)>>, u64) {
    let _one = in_process();
    let loaders = rank_loaders(s, name, cfg);
    let before = ubdirect_loader::objstore::stats().bytes_from_store;
    let mut samples = vec![Vec::new(); loaders.len()];
    for e in 0..epochs {
        let mut its: Vec<_> = loaders.iter().map(|l| l.epoch(e).unwrap()).collect();
        let mut any = true;
        while any {
            any = false;
            for (r, it) in its.iter_mut().enumerate() {
                let Some(b) = it.next() else { continue };
                let b = b.unwrap();
                for (i, smp) in b.samples().iter().enumerate() {
                    let crc = crc32fast::hash(&b.sample_to_vec(i).unwrap());
                    samples[r].push((smp.id, u64::from(crc)));
                }
                any = true;
            }
        }
    }
    let store = ubdirect_loader::objstore::stats().bytes_from_store - before;
    (samples, store)
}

/// `cfg` as rank `rank` of a node of 2 ranks (world 2).
fn as_rank(cfg: &str, rank: usize) -> String {
    cfg.replace(
        "[loader]\n",
        &format!("[loader]\nrank = {rank}\nworld_size = 2\nlocal_world_size = 2\n"),
    )
}

/// Belady's minimum for the node: the reads of both ranks' plans in the node's order, one cache.
fn node_belady(s: &Setup, cfg: &str, epochs: u64, max_bytes: u64, chunk: u64) -> u64 {
    let _one = in_process();
    let loaders = rank_loaders(s, "belady", cfg);
    let sizes: Vec<u64> = loaders[0].sources().iter().map(|s| s.size()).collect();
    let mut reads = Vec::new();
    for e in 0..epochs {
        let plans: Vec<_> = loaders.iter().map(|l| l.plan(e).unwrap()).collect();
        let refs: Vec<_> = plans.iter().map(|p| p.as_ref()).collect();
        for (_, r) in ubdirect_loader::planner::node_order(&refs) {
            reads.push((r.shard as usize, r.offset, r.len));
        }
    }
    ubdirect_loader::objstore::belady_bytes(&reads, &sizes, chunk, max_bytes, 64)
}

/// Both ranks of `cfg` at once (one process each): each rank's samples, and the node's store bytes.
fn run_node(s: &Setup, name: &str, cfg: &str) -> (Vec<Vec<(u64, u64)>>, u64) {
    let runs: Vec<_> = (0..2)
        .map(|r| {
            let p = s.dir.join(format!("{name}-{r}.toml"));
            std::fs::write(&p, as_rank(cfg, r)).unwrap();
            let out = s.dir.join(format!("{name}-{r}.jsonl"));
            std::thread::spawn(move || run(&p, &out))
        })
        .collect();
    let (mut samples, mut store) = (Vec::new(), 0);
    for h in runs {
        let (smp, v) = h.join().unwrap();
        store += n(&v["object_store"], "bytes_from_store");
        samples.push(smp);
    }
    (samples, store)
}

/// Two ranks of a node share a cache of a quarter of the dataset in block order, where both read the
/// same chunks at about the same time (a global batch's two slices are neighbours): as two
/// processes not in step (`ubdirect run` each), and in step (one process, a batch of each in turn,
/// as a training job's ranks move). Deciding with the node's plan (`cache.node_plan`, the default)
/// must keep each rank's samples equal to its local run, and in step fetch clearly less than each
/// rank deciding with its own plan, where a chunk another rank is about to read looks unused. Not in
/// step the figure depends on how far apart the processes run: printed, and bounded only against a
/// collapse (the least-recently-used cache this replaced fetched 46× the bytes).
#[test]
fn two_ranks_sharing_a_cache_decide_with_the_node_plan() {
    let Some(s) = setup("objplan-node", 3000, "block", 2) else {
        return;
    };
    let local: Vec<_> = (0..2)
        .map(|r| s.run(&format!("local-{r}"), &as_rank(&s.local, r)).0)
        .collect();
    let max = s.bytes / 4;
    let min = node_belady(&s, &s.s3, 2, max, 128 << 10);
    let node_cfg = s.cached("node", max, "128KiB");
    let alone_cfg = format!("{}node_plan = false\n", s.cached("alone", max, "128KiB"));
    let (node, node_store) = run_node(&s, "node", &node_cfg);
    let (alone, alone_store) = run_node(&s, "alone", &alone_cfg);
    let (step, step_store) = run_in_step(&s, "step", &s.cached("step", max, "128KiB"), 2);
    let (step_alone, step_alone_store) = run_in_step(
        &s,
        "step-alone",
        &format!(
            "{}node_plan = false\n",
            s.cached("step-alone", max, "128KiB")
        ),
        2,
    );
    let x = |b: u64| b as f64 / min as f64;
    eprintln!(
        "2 ranks, block order, cache of a quarter ({max} bytes), bytes from the store ÷ Belady's {min} for the node: processes not in step: node plan {node_store} ({:.3}×), each rank's own plan {alone_store} ({:.3}×); in step: node plan {step_store} ({:.3}×), own plan {step_alone_store} ({:.3}×)",
        x(node_store),
        x(alone_store),
        x(step_store),
        x(step_alone_store)
    );
    for got in [&node, &alone, &step, &step_alone] {
        assert_eq!(
            &local, got,
            "a rank's cached epochs differ from its local ones"
        );
    }
    // Processes not in step: only a collapse is a failure (how far apart they run decides).
    assert!(
        x(node_store) < 2.5,
        "the node's ranks fetched {node_store} bytes, Belady's minimum {min}"
    );
    // In step, the node's plan decides as one cache would: within 10 % of the node's minimum
    // (1.009–1.063× in 9 runs, against 1.65–1.73× with each rank's own plan), bounded here with a
    // margin for a loaded machine.
    assert!(
        x(step_store) < 1.12 && (step_store as f64) < 0.85 * step_alone_store as f64,
        "in step the node's ranks fetched {step_store} bytes with the node's plan, {step_alone_store} with their own, Belady's minimum {min}"
    );
}
