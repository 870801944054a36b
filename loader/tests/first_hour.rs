//! A newcomer's first hour (issue 24): no silent synthetic data, batches held past the pools fail
//! fast naming the key, checkpoints behave like torchdata's `StatefulDataLoader`, errors name the
//! next step, and the summary is honest (read-ahead apart from waste, no colour codes in pipes,
//! each reason once).

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

mod support;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use support::{generate, tmp};
use ubdirect_loader::{LoadError, Loader, RunConfig};

fn host_config(dir: &Path) -> RunConfig {
    let mut c = RunConfig::default();
    c.dataset.dir = Some(dir.to_path_buf());
    c.dataset.record_len = 1000;
    c.device.select = ubdirect_ub::DeviceSelection::Host;
    c.loader.batch_size = 8;
    c.loader.seed = 3;
    c
}

#[test]
fn a_typo_in_dataset_dir_is_an_error_naming_key_and_path() {
    let d = tmp("fh-typo");
    let typo = d.join("my-datset");
    let e = Loader::from_config(&host_config(&typo)).unwrap_err();
    let m = e.to_string();
    assert!(
        m.contains("dataset.dir") && m.contains("my-datset") && m.contains("does not exist"),
        "{m}"
    );
    assert!(
        matches!(
            e,
            LoadError::Format(ubdirect_loader::formats::FormatError::NoShards { .. })
        ),
        "{e:?}"
    );
    assert!(!typo.exists(), "nothing is written into a typo'd directory");
    // An existing directory without shards: the same error, saying so.
    let e = Loader::from_config(&host_config(&d))
        .unwrap_err()
        .to_string();
    assert!(e.contains("holds no shards"), "{e}");
}

#[test]
fn generated_data_is_said_and_nothing_is_written_before_the_device() {
    let d = tmp("fh-gen");
    let mut c = host_config(&d.join("host"));
    c.dataset.generate = true;
    c.dataset.generate_samples = 96;
    let l = Loader::from_config(&c).unwrap();
    let g = l.generated().expect("the loader says it generated data");
    assert_eq!((g.samples, g.shards), (96, 4));
    assert!(g.to_string().contains("SYNTHETIC"), "{g}");
    // Opened again: the data is there, nothing is generated.
    assert!(Loader::from_config(&c).unwrap().generated().is_none());
    // `device.select = "cuda"`: without a usable GPU the error comes before a byte is written.
    let mut c = host_config(&d.join("cuda"));
    c.dataset.generate = true;
    c.dataset.generate_samples = 96;
    c.device.select = ubdirect_ub::DeviceSelection::Cuda;
    match Loader::from_config(&c) {
        Err(e) => {
            assert!(matches!(e, LoadError::Device(_)), "{e}");
            assert!(
                !d.join("cuda").exists(),
                "data written before the device failed"
            );
        }
        Ok(l) => assert!(l.generated().is_some()),
    }
}

#[test]
fn a_ub_url_as_dataset_dir_is_a_typed_error() {
    let mut c = host_config(Path::new("ub://127.0.0.1:7447/default"));
    c.dataset.generate = true;
    let e = Loader::from_config(&c).unwrap_err();
    assert!(
        matches!(
            e,
            LoadError::Format(ubdirect_loader::formats::FormatError::NotListable { .. })
        ),
        "{e:?}"
    );
    let m = e.to_string();
    assert!(
        m.contains("dataset.paths") && m.contains("ub://127.0.0.1:7447/default/shard-00000.bin"),
        "{m}"
    );
    assert!(!Path::new("ub:").exists(), "no local directory made");
}

#[test]
fn a_missing_crc_sidecar_says_ubdirect_index() {
    let d = tmp("fh-crc");
    generate(&d, "raw", 64, 2);
    let mut c = host_config(&d);
    c.dataset.record_len = 2048;
    c.dataset.verify_crc = true;
    let m = Loader::from_config(&c).unwrap_err().to_string();
    assert!(m.contains("ubdirect index") && m.contains(".crc32"), "{m}");
}

/// Holds every batch of an epoch; the error must come within a second of the last batch.
fn hold_until_error(c: &RunConfig, want_key: &str) {
    let l = Loader::from_config(c).unwrap();
    let mut held = Vec::new();
    let mut last = Instant::now();
    for b in l.epoch(0).unwrap() {
        match b {
            Ok(b) => {
                held.push(b);
                last = Instant::now();
                if held.len() == 200 {
                    break;
                }
            }
            Err(e) => {
                let waited = last.elapsed();
                let m = e.to_string();
                assert!(matches!(e, LoadError::BlocksHeld { .. }), "{e:?}");
                assert!(m.contains(want_key), "{m}");
                assert!(
                    waited < Duration::from_secs(1),
                    "the error took {waited:?}, not within a second"
                );
                assert!(held.len() < 200);
                return;
            }
        }
    }
    panic!("{} batches held without the pools running out", held.len());
}

#[test]
fn holding_200_host_batches_fails_fast_naming_the_key() {
    let d = tmp("fh-hold");
    let g = ubdirect_loader::config::DatasetSection {
        record_len: 1000,
        ..Default::default()
    };
    ubdirect_loader::dataset::generate(&d, "raw".parse().unwrap(), 3600, 3, &g).unwrap();
    // One-buffer host batches (what Python gets): the batch pool.
    let mut c = host_config(&d);
    c.loader.max_chunk_batches = 1;
    c.loader.prefetch = 4;
    c.loader.contiguous_batches = true;
    hold_until_error(&c, "pool.batch_blocks");
    // Zero-copy host batches hold their staging blocks.
    let mut c = host_config(&d);
    c.loader.max_chunk_batches = 1;
    c.loader.prefetch = 4;
    c.pool.staging_blocks = 16;
    hold_until_error(&c, "pool.staging_blocks");
    // Dropping batches as they come never stalls with the same pools.
    let l = Loader::from_config(&c).unwrap();
    assert_eq!(
        l.epoch(0).unwrap().map(|b| b.unwrap().len()).sum::<usize>(),
        3600
    );
}

#[test]
fn checkpoints_behave_like_torchdatas() {
    let d = tmp("fh-ckpt");
    let g = ubdirect_loader::config::DatasetSection {
        record_len: 1000,
        ..Default::default()
    };
    ubdirect_loader::dataset::generate(&d, "raw".parse().unwrap(), 400, 2, &g).unwrap();
    let c = host_config(&d);
    let ids = |it: ubdirect_loader::EpochIter| -> Vec<u64> {
        it.flat_map(|b| {
            b.unwrap()
                .samples()
                .iter()
                .map(|s| s.id)
                .collect::<Vec<_>>()
        })
        .collect()
    };
    // A state taken at an epoch's end resumes at the next epoch.
    let a = Loader::from_config(&c).unwrap();
    let n = a.epoch(0).unwrap().count();
    assert_eq!(n, 50);
    let s = a.state();
    assert_eq!((s.epoch, s.next_batch, s.position), (1, 0, Some(0)));
    let b = Loader::from_config(&c).unwrap();
    assert_eq!(
        ids(b.resume(&s).unwrap()),
        ids(b.epoch(1).unwrap()),
        "the end of epoch 0 resumes as epoch 1"
    );
    // len() after a resume is what remains.
    let a = Loader::from_config(&c).unwrap();
    let mut it = a.epoch(2).unwrap();
    assert_eq!(it.len(), 50);
    for _ in 0..7 {
        it.next().unwrap().unwrap();
    }
    assert_eq!(it.len(), 43);
    drop(it);
    let s = a.state();
    let resumed = Loader::from_config(&c).unwrap().resume(&s).unwrap();
    assert_eq!(resumed.len(), 43);
    assert_eq!(resumed.count(), 43);
    // A refused state names the settings that differ, and only those.
    let mut other = c.clone();
    other.loader.batch_size = 16;
    let e = Loader::from_config(&other)
        .unwrap()
        .resume(&s)
        .unwrap_err()
        .to_string();
    assert!(e.contains("loader.batch_size 8 (state) vs 16"), "{e}");
    assert!(!e.contains("loader.seed"), "{e}");
    let mut other = c.clone();
    other.loader.seed = 9;
    let e = Loader::from_config(&other)
        .unwrap()
        .resume(&s)
        .unwrap_err()
        .to_string();
    assert!(e.contains("loader.seed 3 (state) vs 9"), "{e}");
}

fn ubdirect(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_ubdirect"))
        .args(args)
        .env("UBDIRECT_LOG", "warn")
        .output()
        .unwrap()
}

#[test]
fn the_summary_is_honest() {
    let d = tmp("fh-summary");
    let cfg = d.join("c.toml");
    std::fs::write(
        &cfg,
        format!(
            "[dataset]\nformat = \"raw\"\ndir = \"{}\"\ngenerate = true\ngenerate_samples = 4096\n[loader]\nbatch_size = 16\nprefetch = 8\n[device]\nselect = \"auto\"\n",
            d.join("data").display()
        ),
    )
    .unwrap();
    // --max-batches: the chunks read ahead past the stop are not merge waste.
    let out = ubdirect(&[
        "run",
        "--json",
        "--max-batches",
        "2",
        "--config",
        cfg.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{out:?}");
    let s: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let (read, sample, wasted, ahead) = (
        s["read_bytes"].as_u64().unwrap(),
        s["sample_bytes"].as_u64().unwrap(),
        s["wasted_bytes"].as_u64().unwrap(),
        s["prefetched_unused_bytes"].as_u64().unwrap(),
    );
    assert_eq!(read, sample + wasted + ahead, "{s}");
    assert!(ahead > 0, "prefetch past the stop is counted apart: {s}");
    assert!(
        wasted * 10 <= read,
        "contiguous 4 KiB samples waste little: {s}"
    );
    // The first run generated the data: said in the summary, in the log, with no colour codes in a
    // pipe.
    assert!(s["generated"]["samples"].as_u64() == Some(4096), "{s}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("SYNTHETIC"), "{err}");
    assert!(
        !err.contains('\u{1b}'),
        "ANSI codes in piped stderr: {err:?}"
    );
    // The human summary: each reason said once, a full epoch's over-read explained, no read-ahead.
    let out = ubdirect(&["run", "--config", cfg.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    let device_line = text
        .lines()
        .find(|l| l.trim_start().starts_with("device"))
        .unwrap();
    let reason = device_line.split(" — ").nth(1).unwrap();
    assert_eq!(text.matches(reason).count(), 1, "{text}");
    assert!(
        text.contains("over-read") && text.contains("loader.max_gap"),
        "{text}"
    );
    assert!(
        !text.contains("read ahead"),
        "a whole epoch reads nothing ahead: {text}"
    );
    assert!(
        !text.contains("GENERATED"),
        "the second run generates nothing: {text}"
    );
    // Each epoch's bytes per path: one list per epoch, adding up to the run's, and the human
    // summary says each epoch's shares.
    let out = ubdirect(&[
        "run",
        "--json",
        "--epochs",
        "3",
        "--config",
        cfg.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{out:?}");
    let s: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let per_epoch = s["epoch_bytes_per_path"].as_array().unwrap();
    assert_eq!(per_epoch.len(), 3, "{s}");
    for row in s["bytes_per_path"].as_array().unwrap() {
        let path = row["path"].as_str().unwrap();
        let sum: u64 = per_epoch
            .iter()
            .flat_map(|e| e.as_array().unwrap())
            .filter(|r| r["path"] == path)
            .map(|r| r["bytes"].as_u64().unwrap())
            .sum();
        assert_eq!(Some(sum), row["bytes"].as_u64(), "{path}: {s}");
    }
    assert!(
        per_epoch.iter().all(|e| !e.as_array().unwrap().is_empty()),
        "{s}"
    );
    let out = ubdirect(&["run", "--epochs", "2", "--config", cfg.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with("per epoch"))
        .unwrap_or_else(|| panic!("no per-epoch line: {text}"));
    assert!(
        line.contains("1: ") && line.contains(" | 2: ") && line.contains('%'),
        "{line}"
    );
}

/// `dataset.num_samples` below an epoch of documents: Megatron's rule builds whole epochs and
/// delivers every sample of them, and the summary — text and JSON — says so, with the number; asked
/// for exactly an epoch, there is nothing to explain. The index cache's use is in the summary too.
#[test]
fn the_summary_explains_num_samples() {
    let d = tmp("fh-num-samples");
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gpt");
    for ext in ["bin", "idx"] {
        std::fs::copy(
            fixtures.join(format!("u16a.{ext}")),
            d.join(format!("u16a.{ext}")),
        )
        .unwrap();
    }
    let write = |num_samples: u64| {
        let cfg = d.join(format!("c{num_samples}.toml"));
        std::fs::write(
            &cfg,
            format!(
                "[dataset]\nformat = \"megatron\"\npaths = [\"{}\"]\nsequence_length = 32\nnum_samples = {num_samples}\n[loader]\norder = \"megatron\"\nbatch_size = 8\nseed = 1234\n[device]\nselect = \"host\"\n",
                d.join("u16a").display()
            ),
        )
        .unwrap();
        cfg
    };
    let json = |cfg: &Path| {
        let out = ubdirect(&["run", "--json", "--config", cfg.to_str().unwrap()]);
        assert!(out.status.success(), "{out:?}");
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let s = json(&write(100));
    let g = &s["gpt"];
    let epoch = g["samples"].as_u64().unwrap();
    assert!(epoch > 100, "{s}");
    assert_eq!(g["num_samples"].as_u64(), Some(100), "{s}");
    assert_eq!(g["document_epochs"], serde_json::json!([1]), "{s}");
    assert_eq!(g["index_cache"], serde_json::json!(["stored"]), "{s}");
    let note = g["num_samples_note"].as_str().unwrap();
    assert!(
        note.contains("whole epochs") && note.contains(&format!("holds {epoch},")),
        "{note}"
    );
    // The text summary of the next start: the same note, the cache mapped.
    let out = ubdirect(&["run", "--config", write(100).to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with("num_samples"))
        .unwrap_or_else(|| panic!("no num_samples line: {text}"));
    assert!(line.contains("dataset.num_samples = 100") && line.contains(&epoch.to_string()));
    assert!(text.contains("index cache hit"), "{text}");
    // Exactly an epoch asked, or none (0: one epoch): no note.
    for n in [epoch, 0] {
        let s = json(&write(n));
        assert_eq!(s["gpt"]["samples"].as_u64(), Some(epoch), "{s}");
        assert!(s["gpt"].get("num_samples_note").is_none(), "{s}");
    }
}

/// A dataset of more shards than a soft `RLIMIT_NOFILE` of 1,024 (a common default) allows at two
/// descriptors and two io_uring registered-file slots a shard: the loader raises the soft limit to
/// the hard one and sizes the engine's file table by it, so 600 shards open and deliver every
/// sample. (Before: 1,024 slots refused the 513th shard; a table larger than the soft limit is
/// `EMFILE` at the engine's start.)
#[test]
fn a_dataset_of_many_shards_opens_under_a_soft_limit_of_1024() {
    let hard = String::from_utf8(
        Command::new("bash")
            .args(["-c", "ulimit -Hn"])
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    let hard = hard.trim();
    if hard != "unlimited" && hard.parse::<u64>().unwrap_or(0) < 4096 {
        support::skip(&format!(
            "a_dataset_of_many_shards…: the hard RLIMIT_NOFILE is {hard}, under the 4,096 that 600 shards need"
        ));
        return;
    }
    let d = tmp("fh-many-shards");
    let data = d.join("data");
    let out = ubdirect(&[
        "gen",
        "--out",
        data.to_str().unwrap(),
        "--format",
        "raw",
        "--samples",
        "2400",
        "--shards",
        "600",
    ]);
    assert!(out.status.success(), "{out:?}");
    let cfg = d.join("c.toml");
    std::fs::write(
        &cfg,
        format!(
            "[dataset]\nformat = \"raw\"\ndir = \"{}\"\ngenerate = false\n[loader]\nbatch_size = 16\n[device]\nselect = \"host\"\n",
            data.display()
        ),
    )
    .unwrap();
    let out = Command::new("bash")
        .args([
            "-c",
            "ulimit -Sn 1024 && exec \"$0\" run --json --config \"$1\"",
            env!("CARGO_BIN_EXE_ubdirect"),
            cfg.to_str().unwrap(),
        ])
        .env("UBDIRECT_LOG", "warn")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let s: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(s["shards"].as_u64(), Some(600), "{s}");
    assert_eq!(s["samples"].as_u64(), Some(2400), "{s}");
}
