//! Pools that fit the machine they land on: a user without CAP_IPC_LOCK under the common 8 MiB
//! RLIMIT_MEMLOCK runs the default config (pageable pools, said in the summary); pools that cannot
//! fit the memory are refused before a generated dataset is written; a small dataset's pools hold
//! it and little more (docs/tuning.md, "Pool memory").

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed unwrap is a failed test

use std::path::{Path, PathBuf};

use ubdirect_loader::{Loader, RunConfig};

fn dir(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("fits-machine")
        .join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The embedded default config over `d` (its synthetic dataset generated there on first use).
fn default_config(d: &Path) -> RunConfig {
    let mut c = RunConfig::from_toml(ubdirect_loader::config::DEFAULT_CONFIG, "default").unwrap();
    c.dataset.dir = Some(d.join("default-raw"));
    c.device.select = ubdirect_ub::DeviceSelection::Host;
    c
}

fn samples_of_epoch(loader: &Loader) -> usize {
    let mut n = 0;
    for b in loader.epoch(0).unwrap() {
        n += b.unwrap().samples().len();
    }
    n
}

/// Runs in a child process as `nobody` (no CAP_IPC_LOCK) with RLIMIT_MEMLOCK at 8 MiB, the default
/// of many clusters and containers: the default config (zero-copy host batches) and the Python
/// default (contiguous batches) both run a whole epoch; the pools are pageable, said once as the
/// `pools_not_locked` fallback; the depths say why they are what they are.
#[test]
fn the_default_config_runs_as_nobody_under_an_8_mib_memlock_limit() {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if ubdirect_testkit::is_nobody_child() || !root {
        ubdirect_testkit::set_memlock_soft_limit(8 << 20);
        let d = PathBuf::from(std::env::var_os("HOME").unwrap());
        for contiguous in [false, true] {
            let mut c = default_config(&d);
            c.loader.contiguous_batches = contiguous;
            let loader = Loader::from_config(&c).unwrap();
            assert_eq!(samples_of_epoch(&loader), 16384, "contiguous {contiguous}");
            let staging = &loader.resolved()[0];
            assert_eq!(staging.key, "pool.staging_blocks");
            assert!(
                staging.value < 64 && staging.why.starts_with("the dataset: "),
                "{staging:?}"
            );
        }
        let not_locked = ubdirect_loader::fallbacks()
            .into_iter()
            .find(|f| f.0 == "pools_not_locked")
            .expect("the pools_not_locked fallback");
        assert!(
            not_locked.2.contains("RLIMIT_MEMLOCK is 8388608") && not_locked.2.contains("pageable"),
            "{not_locked:?}"
        );
        return;
    }
    let d = dir("nobody");
    ubdirect_testkit::rerun_as_nobody(
        "the_default_config_runs_as_nobody_under_an_8_mib_memlock_limit",
        &d,
        &[],
    );
}

/// Pools set by hand past this machine's memory: an error naming the keys, and not one byte of the
/// synthetic dataset written first.
#[test]
fn pools_that_cannot_fit_are_refused_before_anything_is_written() {
    let d = dir("refused");
    let mut c = default_config(&d);
    c.pool.staging_blocks = 1 << 20; // 4 TiB of 4160 KiB blocks
    let e = refused(&c);
    assert!(e.contains("pool.staging_blocks"), "{e}");
    assert!(
        walk(&d).is_empty(),
        "written before the check: {:?}",
        walk(&d)
    );
    // Each pool within the memory, the two together past it: the same, from the pools' check.
    let total = std::fs::read_to_string("/proc/meminfo").unwrap();
    let kib: u64 = total
        .lines()
        .next()
        .unwrap()
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let half = kib * 1024 / 2;
    let mut c = default_config(&d);
    c.loader.contiguous_batches = true;
    c.pool.staging_blocks = (half / c.pool.staging_block_size.0 + 1) as usize;
    c.pool.batch_block_size = ubdirect_loader::config::ByteSize(1 << 30);
    c.pool.batch_blocks = (half >> 30) as usize + 1;
    let e = refused(&c);
    assert!(
        e.contains("the pools need") && e.contains("pool.batch_blocks × pool.batch_block_size"),
        "{e}"
    );
    assert!(
        walk(&d).is_empty(),
        "written before the check: {:?}",
        walk(&d)
    );
}

fn refused(c: &RunConfig) -> String {
    match Loader::from_config(c) {
        Ok(_) => panic!("the pools were made"),
        Err(e) => e.to_string(),
    }
}

fn walk(d: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(d).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// A 6 MiB dataset (1,536 samples of 4 KiB) read by the CLI with contiguous batches, as Python
/// does: its pools hold an epoch, not the defaults (64 staging and 18 batch blocks, 548 MiB), and
/// the process's peak RSS stays under 200 MiB (was 1.08 GB).
#[test]
fn a_small_datasets_run_holds_little_memory() {
    let d = dir("small");
    #[allow(clippy::zombie_processes)] // reaped by wait4 below, which also gives its peak RSS
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_ubdirect"))
        .args(["run", "--set"])
        .arg(format!("dataset.dir={}", d.display()))
        .args([
            "--set",
            "dataset.generate_samples=1536",
            "--set",
            "loader.contiguous_batches=true",
            "--set",
            "device.select=host",
            "--json",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id() as libc::pid_t;
    let mut stdout = child.stdout.unwrap();
    let mut json = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut json).unwrap();
    // SAFETY: wait4 writes the status and usage of our own child into structs we own.
    let (status, usage) = unsafe {
        let mut status = 0;
        let mut usage: libc::rusage = std::mem::zeroed();
        assert_eq!(libc::wait4(pid, &mut status, 0, &mut usage), pid);
        (status, usage)
    };
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "{json}"
    );
    let peak_mib = usage.ru_maxrss / 1024;
    assert!(peak_mib < 200, "peak RSS {peak_mib} MiB");
    let report: serde_json::Value = serde_json::from_str(&json).unwrap();
    let depth = |key: &str| {
        report["resolved"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["key"] == key)
            .map(|r| r["value"].as_u64().unwrap())
            .unwrap()
    };
    assert!(depth("pool.staging_blocks") <= 8, "{}", report["resolved"]);
    assert!(depth("pool.batch_blocks") <= 4, "{}", report["resolved"]);
    assert_eq!(report["samples"], 1536, "{json}");
}
