//! Helpers shared by the integration tests (each test file has `mod support;`): loopback ports and
//! servers, scratch directories, datasets and their configurations, `ubdirect run --dump-samples`
//! and its dump. A test binary uses some of them, hence `dead_code` is allowed here.

#![allow(dead_code)]

pub mod gpt;
#[cfg(feature = "object-store")]
pub mod objstore;
pub mod ub;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// `[loader]` (batches of 16, seed 3) and `[device]` (the host) of the end-to-end configurations.
pub const COMMON: &str = "[loader]\nbatch_size = 16\nseed = 3\n[device]\nselect = \"host\"\n";

#[allow(unused_imports)] // each test binary uses some
pub use ubdirect_testkit::{free_port, wait_accepting};

/// A `skip:` line for a test that cannot run here; under `UBDIRECT_TEST_STRICT` (CI) a failure
/// (`ubdirect_testkit::skip`, with the thread's test name).
pub fn skip(why: &str) {
    let t = std::thread::current();
    ubdirect_testkit::skip(t.name().unwrap_or("this test"), why);
}

/// `NAME` under the target's test directory, emptied.
pub fn tmp(name: &str) -> PathBuf {
    ubdirect_testkit::tmp!(name)
}

/// Generates a dataset of `format` (`raw`, `megatron`, `npy`, `arrow`) in `dir`: `samples`
/// samples in `shards` shards, the default dataset settings.
pub fn generate(dir: &Path, format: &str, samples: u64, shards: u32) {
    let cfg = ubdirect_loader::config::DatasetSection::default();
    ubdirect_loader::dataset::generate(dir, format.parse().unwrap(), samples, shards, &cfg)
        .unwrap();
}

/// A configuration reading the `format` dataset in `dir` as it is, then `rest` (`[loader]`, ...).
pub fn local_config(format: &str, dir: &Path, rest: &str) -> String {
    format!(
        "[dataset]\nformat = \"{format}\"\ndir = \"{}\"\ngenerate = false\n{rest}",
        dir.display()
    )
}

/// `ubdirect run --json --config CFG --dump-samples OUT`, to its end.
pub fn run_dump(cfg: &Path, out: &Path) -> Output {
    run_dump_home(cfg, out, None)
}

/// [`run_dump`] with `HOME` set to `home` (where `~/` defaults such as the object cache land).
pub fn run_dump_home(cfg: &Path, out: &Path, home: Option<&Path>) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ubdirect"));
    if let Some(h) = home {
        c.env("HOME", h);
    }
    c.args(["run", "--json", "--config"])
        .arg(cfg)
        .arg("--dump-samples")
        .arg(out)
        .output()
        .unwrap()
}

/// (sample, crc32) of every line of a `--dump-samples` file.
pub fn read_dump(p: &Path) -> Vec<(u64, u64)> {
    std::fs::read_to_string(p)
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (v["sample"].as_u64().unwrap(), v["crc32"].as_u64().unwrap())
        })
        .collect()
}

/// The epoch of `cfg` through `ubdirect run`, which must succeed: its dump, written to `out`.
pub fn dump(cfg: &Path, out: &Path) -> Vec<(u64, u64)> {
    let o = run_dump(cfg, out);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    read_dump(out)
}
