//! `s3://` datasets against a real S3-compatible server on loopback (moto's `moto_server`, started
//! here): every format's epoch equals the local one by sample CRCs; a second epoch comes from the
//! cache; a cache bound smaller than the dataset holds; a killed server is a typed error within the
//! deadline; two processes on one cache fetch each chunk once.
//!
//! Without `moto_server` on PATH (`pip install 'moto[server]'`) the tests print `skip:` and pass,
//! except under `UBDIRECT_TEST_STRICT` (CI), where they fail.

#![cfg(feature = "object-store")]
#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

mod support;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use object_store::ObjectStore;
use support::objstore::{Server, counters};
use support::{COMMON, generate, local_config, read_dump, tmp};

use support::objstore::BUCKET;

/// Starts `moto_server` and creates the bucket; `None` (after a `skip:` line) when it is missing.
fn start_server() -> Option<Server> {
    support::objstore::moto()
}

fn store(port: u16) -> Arc<dyn ObjectStore> {
    support::objstore::moto_store(port)
}

/// Uploads every file of `dir` as `prefix/NAME`.
fn upload(port: u16, dir: &Path, prefix: &str) {
    support::objstore::upload(store(port), dir, prefix);
}

/// A started server holding a raw dataset of `samples` samples in 2 shards, generated in
/// `tmp(NAME)/data` and uploaded under `prefix`: (the server, the scratch directory, the data, the
/// `[dataset]` section of the object URL); `None` (after a `skip:` line) without `moto_server`.
fn raw_on_s3(name: &str, samples: u64, prefix: &str) -> Option<(Server, PathBuf, PathBuf, String)> {
    let server = start_server()?;
    let d = tmp(name);
    let data = d.join("data");
    generate(&data, "raw", samples, 2);
    upload(server.port, &data, prefix);
    let dataset = format!("[dataset]\nformat = \"raw\"\ndir = \"s3://{BUCKET}/{prefix}\"\n");
    Some((server, d, data, dataset))
}

/// Runs `ubdirect run --json` on `cfg`; (samples, the summary's `object_store` counters).
fn run(cfg: &Path, out: &Path) -> (Vec<(u64, u64)>, serde_json::Value) {
    let (samples, summary) = support::objstore::run_summary(cfg, out);
    (samples, summary["object_store"].clone())
}

fn n(v: &serde_json::Value, k: &str) -> u64 {
    v[k].as_u64().unwrap_or(0)
}

fn s3_config(port: u16, dataset: &str, cache: &str) -> String {
    format!(
        "{dataset}generate = false\n{COMMON}[remote]\ndeadline_ms = 30000\n[object_store]\nendpoint = \"http://127.0.0.1:{port}\"\nallow_http = true\nregion = \"us-east-1\"\naccess_key_id = \"test\"\nsecret_access_key = \"test\"\n{cache}"
    )
}

#[test]
fn every_format_from_s3_equals_local_then_comes_from_the_cache() {
    let Some(server) = start_server() else { return };
    let d = tmp("objstore-formats");
    for fmt in ["raw", "megatron", "npy", "arrow", "webdataset"] {
        let data = d.join(fmt);
        generate(&data, fmt, 1500, 3);
        upload(server.port, &data, &format!("ds/{fmt}"));
        // WebDataset: two parts per sample (the tar's headers are read through the store too).
        let parts = if fmt == "webdataset" {
            "columns = [\"jpg\", \"cls\"]\n"
        } else {
            ""
        };
        std::fs::write(
            d.join(format!("{fmt}-local.toml")),
            local_config(fmt, &data, &format!("{parts}{COMMON}")),
        )
        .unwrap();
        let dataset =
            format!("[dataset]\nformat = \"{fmt}\"\ndir = \"s3://{BUCKET}/ds/{fmt}\"\n{parts}");
        std::fs::write(
            d.join(format!("{fmt}-s3.toml")),
            s3_config(server.port, &dataset, ""),
        )
        .unwrap();
        // Chunks smaller than a read: reads span chunks.
        let cache = format!(
            "[cache]\ndir = \"{}\"\nchunk_size = \"256KiB\"\n",
            d.join(format!("{fmt}-cache")).display()
        );
        std::fs::write(
            d.join(format!("{fmt}-cached.toml")),
            s3_config(server.port, &dataset, &cache),
        )
        .unwrap();
        let (local, _) = run(
            &d.join(format!("{fmt}-local.toml")),
            &d.join(format!("{fmt}-local.jsonl")),
        );
        assert!(local.len() >= 1488, "{fmt}: {} samples", local.len());
        let (s3, st) = run(
            &d.join(format!("{fmt}-s3.toml")),
            &d.join(format!("{fmt}-s3.jsonl")),
        );
        assert_eq!(
            local, s3,
            "{fmt}: the s3:// epoch differs from the local one"
        );
        assert!(n(&st, "bytes_from_store") > 0, "{fmt}: {st}");
        let (first, st1) = run(
            &d.join(format!("{fmt}-cached.toml")),
            &d.join(format!("{fmt}-cached1.jsonl")),
        );
        assert_eq!(local, first, "{fmt}: the cached epoch differs");
        assert!(n(&st1, "chunks_fetched") > 0, "{fmt}: {st1}");
        let (second, st2) = run(
            &d.join(format!("{fmt}-cached.toml")),
            &d.join(format!("{fmt}-cached2.jsonl")),
        );
        assert_eq!(local, second, "{fmt}: the epoch from the cache differs");
        assert_eq!(n(&st2, "bytes_from_store"), 0, "{fmt}: {st2}");
        assert_eq!(n(&st2, "chunks_fetched"), 0, "{fmt}: {st2}");
        assert!(n(&st2, "bytes_from_cache") > 0, "{fmt}: {st2}");
        // Only the listing (and HEADs of Megatron's .bin files): no GET.
        assert!(n(&st2, "requests") <= 4, "{fmt}: {st2}");
        eprintln!("{fmt}: from s3 {st}\n  cached, first {st1}\n  cached, second {st2}");
    }
    // Explicit paths, and a missing object is a typed error naming it.
    let paths: Vec<String> = (0..3)
        .map(|i| format!("\"s3://{BUCKET}/ds/raw/shard-{i:05}.bin\""))
        .collect();
    let dataset = format!(
        "[dataset]\nformat = \"raw\"\npaths = [{}]\n",
        paths.join(", ")
    );
    std::fs::write(d.join("paths.toml"), s3_config(server.port, &dataset, "")).unwrap();
    let (by_paths, _) = run(&d.join("paths.toml"), &d.join("paths.jsonl"));
    assert_eq!(by_paths, read_dump(&d.join("raw-local.jsonl")));
    let dataset =
        format!("[dataset]\nformat = \"raw\"\npaths = [\"s3://{BUCKET}/ds/raw/nope.bin\"]\n");
    std::fs::write(d.join("missing.toml"), s3_config(server.port, &dataset, "")).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_ubdirect"))
        .args(["run", "--config"])
        .arg(d.join("missing.toml"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("nope.bin") && err.contains("not found"),
        "{err}"
    );
}

/// Bytes of the regular files in `dir`.
fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok()?.metadata().ok())
        .filter(|m| m.is_file())
        .map(|m| m.len())
        .sum()
}

#[test]
fn a_cache_smaller_than_the_dataset_stays_in_its_bound() {
    let Some((server, d, data, dataset)) = raw_on_s3("objstore-bound", 2000, "bound") else {
        return;
    };
    let total: u64 = dir_bytes(&data);
    std::fs::write(d.join("local.toml"), local_config("raw", &data, COMMON)).unwrap();
    let cache_dir = d.join("cache");
    let max = 2u64 << 20;
    assert!(total > 3 * max, "dataset of {total} bytes");
    let cache = format!(
        "[cache]\ndir = \"{}\"\nmax_bytes = {max}\nchunk_size = \"256KiB\"\n",
        cache_dir.display()
    );
    std::fs::write(d.join("s3.toml"), s3_config(server.port, &dataset, &cache)).unwrap();
    let (local, _) = run(&d.join("local.toml"), &d.join("local.jsonl"));
    // Watch the directory while the epoch runs.
    let (s3, st, peak) = run_watching(&d.join("s3.toml"), &d.join("s3.jsonl"), &cache_dir);
    assert_eq!(local, s3, "the epoch through a small cache differs");
    assert!(peak <= max, "the cache reached {peak} bytes, bound {max}");
    assert!(dir_bytes(&cache_dir) <= max);
    // Chunks this single epoch does not read again are not fetched whole once the cache is full:
    // their reads are bypassed (the cache knows the plan), nothing needs evicting.
    assert!(n(&st, "cache_bypassed") > 0, "{st}");
    eprintln!("bound {max}, peak {peak}: {st}");
}

/// A cache that cannot take its chunks (here a directory in each chunk's place, as a full disk or a
/// read-only directory would refuse them) does not fail the run: every read is served from the bytes
/// fetched, counted as bypassed, and the summary names the fallback.
#[test]
fn a_cache_that_cannot_write_its_chunks_serves_the_fetched_bytes() {
    let Some((server, d, data, dataset)) = raw_on_s3("objstore-unwritable", 1200, "unwritable")
    else {
        return;
    };
    std::fs::write(d.join("local.toml"), local_config("raw", &data, COMMON)).unwrap();
    let cache_dir = d.join("cache");
    let cache = format!(
        "[cache]\ndir = \"{}\"\nchunk_size = \"64KiB\"\n",
        cache_dir.display()
    );
    std::fs::write(d.join("s3.toml"), s3_config(server.port, &dataset, &cache)).unwrap();
    let (local, _) = run(&d.join("local.toml"), &d.join("local.jsonl"));
    // A first run names the chunks; each is then replaced by a directory of its name.
    let (first, _) = run(&d.join("s3.toml"), &d.join("s3-1.jsonl"));
    assert_eq!(local, first);
    let mut planted = 0;
    for e in std::fs::read_dir(&cache_dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "chunk") {
            std::fs::remove_file(&p).unwrap();
            let _ = std::fs::remove_file(p.with_extension("crc"));
            std::fs::create_dir(&p).unwrap();
            planted += 1;
        }
    }
    assert!(planted > 0);
    let o = support::run_dump(&d.join("s3.toml"), &d.join("s3-2.jsonl"));
    assert!(
        o.status.success(),
        "the run failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let summary: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(read_dump(&d.join("s3-2.jsonl")), local, "the same samples");
    let st = &summary["object_store"];
    assert!(n(st, "cache_bypassed") >= planted, "{st}");
    let failed = summary["fallbacks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["kind"] == "object_cache_write_failed")
        .unwrap_or_else(|| panic!("no write fallback: {}", summary["fallbacks"]));
    assert!(failed["count"].as_u64().unwrap() >= planted, "{failed}");
    assert!(
        failed["detail"].as_str().unwrap().contains(".chunk"),
        "{failed}"
    );
}

/// Runs `cfg` while watching `dir`: (samples, counters, the directory's peak bytes).
fn run_watching(cfg: &Path, out: &Path, dir: &Path) -> (Vec<(u64, u64)>, serde_json::Value, u64) {
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let peak = {
        let stop = stop.clone();
        let dir = dir.to_path_buf();
        std::thread::spawn(move || {
            let mut peak = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if dir.exists() {
                    peak = dir_bytes(&dir).max(peak);
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            peak
        })
    };
    let (samples, st) = run(cfg, out);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    (samples, st, peak.join().unwrap())
}

#[test]
fn prefetch_runs_ahead_of_the_plan_within_the_cache_bound() {
    let Some((server, d, data, dataset)) = raw_on_s3("objstore-prefetch", 12000, "pf") else {
        return;
    };
    let total = dir_bytes(&data);
    // A pipeline of few blocks (two reads in flight): the prefetch has room to run ahead of it.
    let small = "[pool]\nstaging_blocks = 2\n";
    std::fs::write(
        d.join("local.toml"),
        local_config("raw", &data, &format!("{COMMON}{small}")),
    )
    .unwrap();
    let (local, _) = run(&d.join("local.toml"), &d.join("local.jsonl"));
    // Two 4 MiB reads in flight (object_store.min_read) and the prefetch window (16 chunks) fit.
    let max = 16u64 << 20;
    assert!(total > 2 * max, "dataset of {total} bytes");
    for (name, prefetch) in [("on", 16), ("off", 0)] {
        let cache_dir = d.join(format!("cache-{name}"));
        let cache = format!(
            "{small}[cache]\ndir = \"{}\"\nmax_bytes = {max}\nchunk_size = \"256KiB\"\nprefetch = {prefetch}\n",
            cache_dir.display()
        );
        let cfg = d.join(format!("{name}.toml"));
        std::fs::write(&cfg, s3_config(server.port, &dataset, &cache)).unwrap();
        let (s3, st, peak) = run_watching(&cfg, &d.join(format!("{name}.jsonl")), &cache_dir);
        eprintln!("prefetch {name}: bound {max}, peak {peak}: {st}");
        assert_eq!(local, s3, "prefetch {name}: the epoch differs");
        assert!(
            peak <= max,
            "prefetch {name}: the cache reached {peak} bytes, bound {max}"
        );
        assert_eq!(n(&st, "prefetch_failed"), 0, "{st}");
        if prefetch == 0 {
            assert_eq!(n(&st, "chunks_prefetched"), 0, "{st}");
            assert_eq!(n(&st, "prefetch_hits"), 0, "{st}");
            continue;
        }
        let (pf, hits, fetched) = (
            n(&st, "chunks_prefetched"),
            n(&st, "prefetch_hits"),
            n(&st, "chunks_fetched"),
        );
        assert!(n(&st, "bytes_prefetched") <= pf * (256 << 10), "{st}");
        assert!(n(&st, "bytes_prefetched") > (pf - 2) * (256 << 10), "{st}");
        assert!(hits <= pf && pf <= fetched, "{st}");
        // Most chunks come from the prefetch, and reads find them.
        assert!(
            2 * pf > fetched,
            "prefetched {pf} of {fetched} chunks: {st}"
        );
        assert!(2 * hits > pf, "{hits} hits of {pf} prefetched chunks: {st}");
    }
}

#[test]
fn a_killed_server_is_a_typed_error_within_the_deadline() {
    let Some((mut server, d, _, dataset)) = raw_on_s3("objstore-killed", 1000, "killed") else {
        return;
    };
    let cfg =
        s3_config(server.port, &dataset, "").replace("deadline_ms = 30000", "deadline_ms = 2000");
    std::fs::write(d.join("s3.toml"), cfg).unwrap();
    let _ = server.child.kill();
    let _ = server.child.wait();
    let t = Instant::now();
    let o = Command::new(env!("CARGO_BIN_EXE_ubdirect"))
        .args(["run", "--config"])
        .arg(d.join("s3.toml"))
        .output()
        .unwrap();
    let took = t.elapsed();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(took < Duration::from_secs(15), "took {took:?}");
    assert!(
        err.contains("unavailable") || err.contains("deadline"),
        "{err}"
    );
    eprintln!("server gone: failed in {took:?}: {err}");
}

#[test]
fn two_processes_on_one_cache_fetch_each_chunk_once() {
    let Some((server, d, data, dataset)) = raw_on_s3("objstore-shared", 1500, "shared") else {
        return;
    };
    let sizes: Vec<u64> = {
        let mut v: Vec<_> = std::fs::read_dir(&data)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "bin"))
            .collect();
        v.sort();
        v.iter()
            .map(|p| std::fs::metadata(p).unwrap().len())
            .collect()
    };
    let chunk = 256u64 << 10;
    let chunks: u64 = sizes.iter().map(|s| s.div_ceil(chunk)).sum();
    let cache = format!(
        "[cache]\ndir = \"{}\"\nchunk_size = \"256KiB\"\n",
        d.join("cache").display()
    );
    std::fs::write(d.join("s3.toml"), s3_config(server.port, &dataset, &cache)).unwrap();
    let spawn = |i: usize| {
        Command::new(env!("CARGO_BIN_EXE_ubdirect"))
            .args(["run", "--json", "--config"])
            .arg(d.join("s3.toml"))
            .arg("--dump-samples")
            .arg(d.join(format!("p{i}.jsonl")))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (a, b) = (spawn(0), spawn(1));
    let mut fetched = 0;
    for c in [a, b] {
        let o = c.wait_with_output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        fetched += n(&counters(&o.stdout), "chunks_fetched");
    }
    assert_eq!(
        read_dump(&d.join("p0.jsonl")),
        read_dump(&d.join("p1.jsonl"))
    );
    assert_eq!(fetched, chunks, "chunks fetched by both processes together");
}

/// The `Source` conformance suite on an object, straight from the store and through the cache
/// (256 KiB chunks under 1 MiB blocks: reads span chunks).
#[test]
fn object_source_passes_the_conformance_suite() {
    use ubdirect_ub::source::conformance;
    use ubdirect_ub::{MemoryKind, PoolConfig, Source, UbPool};
    let Some(server) = start_server() else { return };
    let d = tmp("objstore-conformance");
    let len = 3 * (1 << 20) + 12_345;
    let data: Vec<u8> = (0..len as u64)
        .map(|i| (i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 56) as u8)
        .collect();
    std::fs::write(d.join("object.bin"), &data).unwrap();
    upload(server.port, &d, "conf");
    let engine = ubdirect_nvme::Engine::new(ubdirect_nvme::EngineConfig::default()).unwrap();
    let cache = Arc::new(
        ubdirect_loader::objstore::ChunkCache::new(&d.join("cache"), 64 << 20, 256 << 10, &engine)
            .unwrap(),
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut failed = Vec::new();
    for (label, cache) in [("s3", None), ("s3+cache", Some(cache))] {
        let src = ubdirect_loader::objstore::ObjectSource::new(
            store(server.port),
            object_store::path::Path::from("conf/object.bin"),
            format!("s3://{BUCKET}/conf/object.bin"),
            len as u64,
            None,
            256 << 10,
            cache,
        );
        let mut b = UbPool::builder(PoolConfig::new("conformance", 1 << 20, 8, MemoryKind::Host));
        for r in src.registrars() {
            b = b.register_with(r);
        }
        let pool = b.build().unwrap();
        println!("conformance [{label}]: {}", src.describe());
        let checks = rt.block_on(conformance::run(&src, &pool, &data));
        failed.extend(conformance::report(label, &checks));
    }
    assert!(failed.is_empty(), "{failed:#?}");
}

/// The server gone after the dataset was opened (mid-epoch: every read fails): the epoch ends in a
/// typed read error (`Unavailable`/`Timeout`) within the deadline, no hang.
#[test]
fn a_server_killed_after_open_fails_the_epoch_with_a_typed_error() {
    let Some((mut server, _, _, dataset)) = raw_on_s3("objstore-killed-mid", 1000, "mid") else {
        return;
    };
    let text =
        s3_config(server.port, &dataset, "").replace("deadline_ms = 30000", "deadline_ms = 2000");
    let cfg = ubdirect_loader::RunConfig::from_toml(&text, "test").unwrap();
    let loader = ubdirect_loader::Loader::from_config(&cfg).unwrap();
    let _ = server.child.kill();
    let _ = server.child.wait();
    let t = Instant::now();
    let mut err = None;
    let mut batches = 0;
    for b in loader.epoch(0).unwrap() {
        match b {
            Ok(_) => batches += 1,
            Err(e) => {
                err = Some(e);
                break;
            }
        }
    }
    let took = t.elapsed();
    let e = err.expect("the epoch succeeded without a server");
    assert!(took < Duration::from_secs(20), "took {took:?}");
    match &e {
        ubdirect_loader::LoadError::Read(r) => assert!(
            matches!(
                r.kind,
                ubdirect_ub::SourceErrorKind::Unavailable | ubdirect_ub::SourceErrorKind::Timeout
            ),
            "{r:?}"
        ),
        other => panic!("not a typed read error: {other}"),
    }
    eprintln!("server gone after open: {batches} batches, then in {took:?}: {e}");
}

/// A proxy in front of the server that answers the first `fail` connections with `503 SlowDown`
/// (S3's throttling response) and pipes the rest through.
fn throttling_proxy(upstream: u16, fail: usize) -> u16 {
    proxy(Arc::new(std::sync::atomic::AtomicU16::new(upstream)), fail)
}

/// The proxy, to the server on the port in `upstream` (0: connections are closed at once, as if
/// the server were gone).
fn proxy(upstream: Arc<std::sync::atomic::AtomicU16>, fail: usize) -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for (i, c) in l.incoming().enumerate() {
            let Ok(mut c) = c else { continue };
            if i < fail {
                let mut head = Vec::new();
                let mut b = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") && c.read(&mut b).unwrap_or(0) == 1 {
                    head.push(b[0]);
                }
                let body = "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>";
                let _ = write!(
                    c,
                    "HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                continue;
            }
            let up = upstream.load(std::sync::atomic::Ordering::SeqCst);
            if up == 0 {
                continue;
            }
            let Ok(u) = std::net::TcpStream::connect(("127.0.0.1", up)) else {
                continue;
            };
            let (mut c2, mut u2) = (c.try_clone().unwrap(), u.try_clone().unwrap());
            let (mut u, mut c) = (u, c);
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut c2, &mut u2);
                let _ = u2.shutdown(std::net::Shutdown::Write);
            });
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut u, &mut c);
                let _ = c.shutdown(std::net::Shutdown::Write);
            });
        }
    });
    port
}

#[test]
fn throttling_responses_are_retried_and_counted() {
    let Some((server, d, data, dataset)) = raw_on_s3("objstore-throttled", 1000, "slow") else {
        return;
    };
    std::fs::write(d.join("local.toml"), local_config("raw", &data, COMMON)).unwrap();
    let proxy = throttling_proxy(server.port, 3);
    std::fs::write(d.join("s3.toml"), s3_config(proxy, &dataset, "")).unwrap();
    let (local, _) = run(&d.join("local.toml"), &d.join("local.jsonl"));
    let (s3, st) = run(&d.join("s3.toml"), &d.join("s3.jsonl"));
    assert_eq!(local, s3, "the throttled epoch differs");
    assert!(n(&st, "throttled") >= 3, "{st}");
    assert!(n(&st, "retries") >= 3, "{st}");
    eprintln!("throttled: {st}");
}

/// The server killed mid-epoch and back within the deadline (a fresh moto with the objects uploaded
/// again, behind a proxy that refuses connections meanwhile: moto keeps objects in memory): the reads
/// retry through the gap and the epoch delivers every sample exactly once.
#[test]
fn a_server_killed_mid_epoch_and_restarted_delivers_every_sample_once() {
    use std::sync::atomic::{AtomicU16, Ordering};
    let Some((mut server, _, data, dataset)) = raw_on_s3("objstore-restart", 4000, "restart")
    else {
        return;
    };
    let upstream = Arc::new(AtomicU16::new(server.port));
    let front = proxy(upstream.clone(), 0);
    let text = s3_config(front, &dataset, "")
        .replace("[loader]\n", "[loader]\nprefetch = 1\nshuffle = false\n");
    let cfg = ubdirect_loader::RunConfig::from_toml(&text, "test").unwrap();
    let loader = ubdirect_loader::Loader::from_config(&cfg).unwrap();
    let mut seen = std::collections::BTreeMap::<u64, u32>::new();
    let mut restarted = None;
    let mut batches = 0;
    for b in loader.epoch(0).unwrap() {
        let b = b.unwrap();
        for s in b.samples() {
            *seen.entry(s.id).or_default() += 1;
        }
        batches += 1;
        if batches == 20 {
            upstream.store(0, Ordering::SeqCst);
            let _ = server.child.kill();
            let _ = server.child.wait();
            let (data, upstream) = (data.clone(), upstream.clone());
            restarted = Some(std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(500));
                let s = start_server().unwrap();
                upload(s.port, &data, "restart");
                upstream.store(s.port, Ordering::SeqCst);
                s
            }));
        }
    }
    let _server = restarted
        .expect("the epoch had fewer than 20 batches")
        .join()
        .unwrap();
    let st = ubdirect_loader::objstore::stats();
    assert!(seen.values().all(|&n| n == 1), "a sample delivered twice");
    assert!(seen.len() >= 3968, "{} samples", seen.len());
    assert!(st.retries > 0, "no read met the gone server: {st:?}");
    eprintln!("restart: {batches} batches, {} samples, {st:?}", seen.len());
}

/// No credentials anywhere (config or environment): a failed open names the variables to set, not a
/// metadata service's refusal (issue 24). The store is a closed loopback port: nothing to start.
#[test]
fn missing_s3_credentials_name_the_variables() {
    if let Some(v) = [
        "AWS_ACCESS_KEY_ID",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    ]
    .into_iter()
    .find(|v| std::env::var_os(v).is_some())
    {
        support::skip(&format!("{v} is set in this environment"));
        return;
    }
    let port = support::free_port();
    let cfg = ubdirect_loader::RunConfig::from_toml(
        &format!(
            "[dataset]\nformat = \"raw\"\ndir = \"s3://{BUCKET}/raw\"\n{COMMON}[remote]\ndeadline_ms = 3000\n[object_store]\nendpoint = \"http://127.0.0.1:{port}\"\nallow_http = true\nregion = \"us-east-1\"\n"
        ),
        "t",
    )
    .unwrap();
    let t = Instant::now();
    let e = ubdirect_loader::Loader::from_config(&cfg).unwrap_err();
    assert!(
        matches!(e, ubdirect_loader::LoadError::Credentials { .. }),
        "{e:?}"
    );
    let m = e.to_string();
    assert!(
        m.contains("AWS_ACCESS_KEY_ID") && m.contains("AWS_SECRET_ACCESS_KEY"),
        "{m}"
    );
    assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
}

/// (sample id, CRC) of every sample of `epoch`, in delivery order.
fn epoch_crcs(loader: &ubdirect_loader::Loader, epoch: u64) -> Vec<(u64, u32)> {
    let mut v = Vec::new();
    for b in loader.epoch(epoch).unwrap() {
        let b = b.unwrap();
        for (i, s) in b.samples().iter().enumerate() {
            v.push((s.id, crc32fast::hash(&b.sample_to_vec(i).unwrap())));
        }
    }
    v
}

fn mapped_bytes(loader: &ubdirect_loader::Loader) -> u64 {
    let i = ubdirect_ub::ReadPath::Mapped.index();
    loader.stats().path_bytes[i].load(std::sync::atomic::Ordering::Relaxed)
}

#[test]
fn a_cache_holding_the_dataset_is_mapped_like_local_shards_and_unmapped_when_evicted() {
    let Some((server, d, data, dataset)) = raw_on_s3("objstore-mapped", 2000, "mapped") else {
        return;
    };
    // Contiguous batches in a block the device copies into (the host device copies with the CPU;
    // the GPU by DMA out of the registered chunks), every resident object registered at each
    // epoch's start, chunks smaller than a read so that copies span chunks.
    let loader_keys = "[loader]\nbatch_size = 16\nseed = 3\ncontiguous_batches = true\n[device]\nselect = \"host\"\n[pool]\npage_cache_register = \"eager\"\nbatch_block_size = \"32MiB\"\n";
    let cfg = |cache: &str| {
        let c = s3_config(server.port, &dataset, cache).replace(COMMON, loader_keys);
        ubdirect_loader::RunConfig::from_toml(&c, "test").unwrap()
    };
    let local = ubdirect_loader::RunConfig::from_toml(
        &local_config("raw", &data, loader_keys).replace(
            "[pool]\npage_cache_register = \"eager\"\n",
            "[pool]\npage_cache_budget = 0\n",
        ),
        "test",
    )
    .unwrap();
    let local = ubdirect_loader::Loader::from_config(&local).unwrap();
    let want: Vec<_> = (0..4).map(|e| epoch_crcs(&local, e)).collect();
    drop(local);
    let cache_dir = d.join("cache");
    let holding = cfg(&format!(
        "[cache]\ndir = \"{}\"\nchunk_size = \"64KiB\"\nmax_bytes = \"64MiB\"\n",
        cache_dir.display()
    ));
    let loader = ubdirect_loader::Loader::from_config(&holding).unwrap();
    // Epoch 0 fills the cache (and checks every chunk); from epoch 1 both objects are mapped.
    assert_eq!(epoch_crcs(&loader, 0), want[0]);
    assert_eq!(
        mapped_bytes(&loader),
        0,
        "nothing is mapped before the chunks are present"
    );
    // The chunk files and their inodes: a chunk fetched again would be a new file.
    let inodes = |dir: &Path| -> Vec<(PathBuf, u64)> {
        use std::os::unix::fs::MetadataExt;
        let mut v: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.path().extension().is_some_and(|x| x == "chunk"))
            .map(|e| (e.path(), e.metadata().unwrap().ino()))
            .collect();
        v.sort();
        v
    };
    let before = inodes(&cache_dir);
    // Mapping needs the chunk files wholly in the page cache at the epoch's start: held there, so
    // that memory pressure on a busy machine cannot evict them (`drop_caches` showed it could).
    let chunk_paths =
        |v: &[(PathBuf, u64)]| -> Vec<PathBuf> { v.iter().map(|(p, _)| p.clone()).collect() };
    let held = ubdirect_testkit::hold_resident(&chunk_paths(&before));
    assert_eq!(
        epoch_crcs(&loader, 1),
        want[1],
        "epoch 1 from the mapped chunks"
    );
    let m1 = mapped_bytes(&loader);
    let sample_bytes: u64 = std::fs::read_dir(&data)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().extension().is_some_and(|x| x == "bin"))
        .map(|e| e.metadata().unwrap().len())
        .sum();
    assert!(
        m1 * 10 >= sample_bytes * 9,
        "epoch 1 copied {m1} bytes out of the mapped chunks of a {sample_bytes}-byte dataset"
    );
    assert_eq!(
        loader.page_cache_chunk_maps(),
        (2, 0),
        "both objects mapped"
    );
    let (mapped, pinned, budget, registrations, ..) = loader.page_cache().unwrap();
    assert_eq!(mapped, 2);
    assert_eq!(
        registrations, 2,
        "one registration per object, its chunk files mapped end to end"
    );
    assert!(
        pinned >= sample_bytes && pinned <= budget,
        "{pinned} pinned"
    );
    assert_eq!(inodes(&cache_dir), before, "a mapped epoch fetches nothing");
    // Another process evicts a chunk (here: removed by hand): the next epoch notices, reads that
    // object through the cache again (fetching the chunk), and delivers the same samples.
    let chunk = std::fs::read_dir(&cache_dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "chunk"))
        .unwrap();
    std::fs::remove_file(&chunk).unwrap();
    assert_eq!(
        epoch_crcs(&loader, 2),
        want[2],
        "epoch 2 after the eviction"
    );
    assert_eq!(
        loader.page_cache_chunk_maps(),
        (2, 1),
        "one object unmapped"
    );
    assert!(
        chunk.exists(),
        "the evicted chunk was fetched and cached again"
    );
    // Its chunks are all back and checked: mapped again at the next epoch's start.
    let m2 = mapped_bytes(&loader);
    drop(held);
    let held = ubdirect_testkit::hold_resident(&chunk_paths(&inodes(&cache_dir)));
    assert_eq!(epoch_crcs(&loader, 3), want[3], "epoch 3");
    assert_eq!(loader.page_cache_chunk_maps(), (3, 1), "mapped again");
    assert!(mapped_bytes(&loader) - m2 >= m1 * 9 / 10);
    drop(loader);
    // A restarted job on the warm cache: every chunk's sidecar names it, so its objects are mapped
    // from its first epoch, as its local shards would be.
    drop(held);
    let held = ubdirect_testkit::hold_resident(&chunk_paths(&inodes(&cache_dir)));
    let restarted = ubdirect_loader::Loader::from_config(&holding).unwrap();
    assert_eq!(epoch_crcs(&restarted, 0), want[0]);
    assert!(
        mapped_bytes(&restarted) * 10 >= sample_bytes * 9,
        "a restarted job's first epoch copied {} bytes out of the mapping",
        mapped_bytes(&restarted)
    );
    drop(restarted);
    let chunk_files =
        || -> Vec<PathBuf> { inodes(&cache_dir).into_iter().map(|(p, _)| p).collect() };
    // The same with `auto` over two epochs (no registration: too few epochs to pay it back): the
    // objects' reads copy out of the check's unregistered mapping of their chunk files (staged), so
    // nothing is mapped in place and no chunk file is opened through the cache. A chunk evicted
    // between the epochs: that object is read through the cache again (the chunk fetched), the
    // other still staged.
    let path_bytes = |l: &ubdirect_loader::Loader, p: ubdirect_ub::ReadPath| {
        l.stats().path_bytes[p.index()].load(std::sync::atomic::Ordering::Relaxed)
    };
    let mut two = holding.clone();
    two.pool.page_cache_register = ubdirect_loader::config::RegisterPolicy::Auto;
    two.loader.epochs = 2;
    let staged = ubdirect_loader::Loader::from_config(&two).unwrap();
    assert_eq!(epoch_crcs(&staged, 0), want[0], "staged epoch 0");
    assert_eq!(staged.page_cache_chunks_staged(), 2, "both objects staged");
    assert_eq!(mapped_bytes(&staged), 0, "nothing registered");
    let buffered = path_bytes(&staged, ubdirect_ub::ReadPath::Buffered);
    assert!(
        buffered >= sample_bytes,
        "{buffered} bytes copied out of the staged mappings, of {sample_bytes}"
    );
    assert_eq!(
        path_bytes(&staged, ubdirect_ub::ReadPath::Direct),
        0,
        "resident chunks read through the page cache"
    );
    let victim = chunk_files()[0].clone();
    std::fs::remove_file(&victim).unwrap();
    assert_eq!(
        epoch_crcs(&staged, 1),
        want[1],
        "staged epoch 1, a chunk gone"
    );
    assert_eq!(
        staged.page_cache_chunks_staged(),
        3,
        "one object staged again"
    );
    assert_eq!(
        staged.page_cache_chunks_staged_kept(),
        1,
        "the other object read its mapping of epoch 0 again, checked; the one with a chunk gone did not"
    );
    assert!(victim.exists(), "the evicted chunk was fetched again");
    drop((staged, held));

    // A cache the kernel evicted from RAM (another job's memory, a reboot): its chunk files are
    // present but cold. A mapping now would fault every page in from the disk inside the
    // registration, so they are not mapped; a run that reads them again fills the page cache with
    // its first epoch's reads, as it does a cold local shard, and maps them from the next; a single
    // pass reads them with O_DIRECT and leaves the page cache alone.
    let evict = || {
        for p in chunk_files() {
            let f = std::fs::File::open(&p).unwrap();
            // SAFETY: posix_fadvise on an open descriptor only changes the kernel's caching of it.
            let r = unsafe {
                libc::posix_fadvise(
                    std::os::fd::AsRawFd::as_raw_fd(&f),
                    0,
                    0,
                    libc::POSIX_FADV_DONTNEED,
                )
            };
            assert_eq!(r, 0);
        }
    };
    let all_resident = || {
        chunk_files().iter().all(|p| {
            let f = std::fs::File::open(p).unwrap();
            let len = f.metadata().unwrap().len();
            ubdirect_nvme::page_cache_resident(&f, 0, len).unwrap_or(true)
        })
    };
    let none_resident = || {
        chunk_files().iter().all(|p| {
            let f = std::fs::File::open(p).unwrap();
            let len = f.metadata().unwrap().len();
            !ubdirect_nvme::page_cache_resident(&f, 0, len).unwrap_or(false)
        })
    };
    evict();
    if none_resident() {
        let cold = ubdirect_loader::Loader::from_config(&holding).unwrap();
        assert_eq!(epoch_crcs(&cold, 0), want[0], "a cold cache's first epoch");
        assert_eq!(mapped_bytes(&cold), 0, "cold chunk files are not mapped");
        assert_eq!(
            cold.page_cache_cold_paths().0,
            2,
            "both objects filled by the epoch's reads"
        );
        assert!(
            all_resident(),
            "the first epoch's reads left the chunks in the page cache"
        );
        assert_eq!(epoch_crcs(&cold, 1), want[1]);
        assert!(
            mapped_bytes(&cold) * 10 >= sample_bytes * 9,
            "the next epoch copied {} bytes out of the mapping",
            mapped_bytes(&cold)
        );
        drop(cold);
        // A single pass (`auto`, one epoch): O_DIRECT, the page cache left alone.
        evict();
        let mut once = holding.clone();
        once.pool.page_cache_register = ubdirect_loader::config::RegisterPolicy::Auto;
        once.loader.epochs = 1;
        let once = ubdirect_loader::Loader::from_config(&once).unwrap();
        assert_eq!(
            epoch_crcs(&once, 0),
            want[0],
            "a single pass over a cold cache"
        );
        assert_eq!(once.page_cache_cold_paths(), (0, 2), "read with O_DIRECT");
        assert!(none_resident(), "a single pass leaves the page cache alone");
    } else {
        support::skip(
            "a_cache_holding_the_dataset…, its cold part: POSIX_FADV_DONTNEED left the chunk files in the page cache, or no cachestat (Linux ≥ 6.5) to tell",
        );
    }

    // A cache smaller than the dataset: its hits stay reads (a mapping would hold chunks the cache
    // evicts), and the summary says why.
    let small = ubdirect_loader::Loader::from_config(&cfg(&format!(
        "[cache]\ndir = \"{}\"\nchunk_size = \"64KiB\"\nmax_bytes = \"{}\"\n",
        d.join("small-cache").display(),
        sample_bytes / 2
    )))
    .unwrap();
    for e in 0..3 {
        assert_eq!(
            epoch_crcs(&small, e),
            want[e as usize],
            "small cache, epoch {e}"
        );
    }
    assert_eq!(mapped_bytes(&small), 0);
    assert_eq!(small.page_cache_chunk_maps(), (0, 0));
    // Said as a fallback (the summary's fallback lines).
    assert!(
        ubdirect_ub::fallback::snapshot()
            .iter()
            .any(|f| f.kind == "object_cache_not_mapped"),
        "{:?}",
        ubdirect_ub::fallback::snapshot()
    );
}

/// A warm cache of more chunks than the io_uring engine had registered-file slots for (two per open
/// chunk, 1,024 slots, up to 1,024 chunks kept open): every hit is read from the cache. With 512
/// open chunks the slots ran out, the next chunk could not be opened, and its hits were fetched from
/// the store again.
#[test]
fn a_warm_cache_of_more_chunks_than_ring_slots_serves_every_hit() {
    let Some((server, d, data, dataset)) = raw_on_s3("objstore-slots", 9000, "slots") else {
        return;
    };
    let total = dir_bytes(&data);
    let chunk = 64u64 << 10;
    assert!(total / chunk > 520, "{} chunks", total / chunk);
    if ubdirect_ub::open_files_limit() / 8 < 520 {
        support::skip(&format!(
            "a_warm_cache_of_more_chunks_than_ring_slots…: RLIMIT_NOFILE {} keeps fewer than 520 chunks open",
            ubdirect_ub::open_files_limit()
        ));
        return;
    }
    std::fs::write(d.join("local.toml"), local_config("raw", &data, COMMON)).unwrap();
    let (local, _) = run(&d.join("local.toml"), &d.join("local.jsonl"));
    // Hits read through the cache (no page-cache pool: neither mapped nor staged), so that each one
    // opens its chunk file.
    let cache = format!(
        "[pool]\npage_cache_budget = 0\n[cache]\ndir = \"{}\"\nmax_bytes = \"64MiB\"\nchunk_size = \"64KiB\"\n",
        d.join("cache").display()
    );
    let cfg = d.join("slots.toml");
    std::fs::write(&cfg, s3_config(server.port, &dataset, &cache)).unwrap();
    let (fill, st) = run(&cfg, &d.join("fill.jsonl"));
    assert_eq!(local, fill);
    assert!(n(&st, "chunks_fetched") > 520, "{st}");
    let (warm, st) = run(&cfg, &d.join("warm.jsonl"));
    assert_eq!(local, warm);
    assert_eq!(
        n(&st, "bytes_from_store"),
        0,
        "a warm cache fetched from the store: {st}"
    );
    assert_eq!(n(&st, "cache_bypassed"), 0, "{st}");
}

/// An object's chunk files cut short by another process of the node in the middle of an epoch that
/// reads them out of its staged mapping (checked at the epoch's start): the reads past the cut go
/// through the object's source, whose cache fetches the chunks again, and the epoch delivers the
/// same samples. Before, the first such read ended the epoch with `UnexpectedEof`.
#[test]
fn chunk_files_cut_short_mid_epoch_are_fetched_again_not_the_end_of_the_epoch() {
    let Some((server, d, data, dataset)) = raw_on_s3("objstore-cut", 2000, "cut") else {
        return;
    };
    // One batch a chunk, one chunk ahead: most of the epoch's reads are issued after the cut.
    // Contiguous batches: the host device copies each chunk's reads into a block, as a GPU would.
    let loader_keys = "[loader]\nbatch_size = 16\nseed = 3\nprefetch = 1\nmax_chunk_batches = 1\ncontiguous_batches = true\n[device]\nselect = \"host\"\n";
    let local = ubdirect_loader::RunConfig::from_toml(
        &format!(
            "{}[pool]\npage_cache_budget = 0\n",
            local_config("raw", &data, loader_keys)
        ),
        "test",
    )
    .unwrap();
    let local = ubdirect_loader::Loader::from_config(&local).unwrap();
    let want: Vec<_> = (0..2).map(|e| epoch_crcs(&local, e)).collect();
    drop(local);
    let cache_dir = d.join("cache");
    let mut cfg = ubdirect_loader::RunConfig::from_toml(
        &s3_config(
            server.port,
            &dataset,
            &format!(
                "[cache]\ndir = \"{}\"\nchunk_size = \"64KiB\"\nmax_bytes = \"64MiB\"\n",
                cache_dir.display()
            ),
        )
        .replace(COMMON, loader_keys),
        "test",
    )
    .unwrap();
    // A first job fills the cache.
    let filling = ubdirect_loader::Loader::from_config(&cfg).unwrap();
    assert_eq!(epoch_crcs(&filling, 0), want[0]);
    drop(filling);
    let chunks = || -> Vec<(PathBuf, u64)> {
        let mut v: Vec<_> = std::fs::read_dir(&cache_dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.path().extension().is_some_and(|x| x == "chunk"))
            .map(|e| (e.path(), e.metadata().unwrap().len()))
            .collect();
        v.sort();
        v
    };
    let whole = chunks();
    assert!(whole.len() >= 4, "{whole:?}");
    // A second job of two epochs stages both objects' chunk files (no registration). Staging needs
    // them wholly in the page cache at the epoch's start: they are held there until the cut
    // (`hold_resident`), and a job that found one evicted anyway (not root: read, not locked) is
    // started again, not judged.
    cfg.pool.page_cache_register = ubdirect_loader::config::RegisterPolicy::Auto;
    cfg.loader.epochs = 2;
    let mut attempts = 0;
    let (staged, got, failed) = loop {
        attempts += 1;
        let paths: Vec<PathBuf> = whole.iter().map(|(p, _)| p.clone()).collect();
        let mut held = Some(ubdirect_testkit::hold_resident(&paths));
        let staged = ubdirect_loader::Loader::from_config(&cfg).unwrap();
        let recorded = ubdirect_ub::fallback::count("object_cache_staged_read_failed");
        let mut got = Vec::new();
        let mut cut = false;
        let mut evicted = false;
        for b in staged.epoch(0).unwrap() {
            let b = b.unwrap_or_else(|e| panic!("epoch 0, after the cut: {e}"));
            for (i, s) in b.samples().iter().enumerate() {
                got.push((s.id, crc32fast::hash(&b.sample_to_vec(i).unwrap())));
            }
            if !cut {
                if staged.page_cache_chunks_staged() < 2 && attempts < 5 {
                    evicted = true;
                    break;
                }
                // After the first batch: every chunk file cut to half its length, in place.
                held.take();
                for (p, len) in &whole {
                    std::fs::OpenOptions::new()
                        .write(true)
                        .open(p)
                        .unwrap()
                        .set_len(len / 2)
                        .unwrap();
                }
                cut = true;
            }
        }
        if !evicted {
            let failed = ubdirect_ub::fallback::count("object_cache_staged_read_failed") - recorded;
            break (staged, got, failed);
        }
    };
    assert_eq!(got, want[0], "the epoch cut under its reads");
    assert_eq!(
        staged.page_cache_chunks_staged(),
        2,
        "both objects staged ({attempts} jobs)"
    );
    // Each object's staged mapping is left after its first failed read (the reads in flight then
    // may fail too): not one failure per read of the rest of the epoch.
    assert!(
        (1..=8).contains(&failed),
        "{failed} staged reads failed after the cut"
    );
    // The chunks read after the cut were fetched again, whole; the next epoch is right too.
    assert_eq!(epoch_crcs(&staged, 1), want[1], "the epoch after");
    assert_eq!(chunks(), whole, "every chunk fetched again, whole");
}
