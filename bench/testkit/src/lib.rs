//! What ubdirect's tests and benchmarks share, in one place:
//!
//! - [`skip`] / [`strict`]: a test that cannot run on this machine prints a `skip:` line (past the
//!   harness's capture, so every run shows it) and passes, except under `UBDIRECT_TEST_STRICT`
//!   (CI sets it: CI can run everything, so a skip there is a failure).
//! - [`tmp!`]: an emptied scratch directory under the test target's `CARGO_TARGET_TMPDIR`.
//! - [`as_nobody`]: a child command without privileges (util-linux `setpriv`, as `nobody`), for
//!   tests of what a non-root user meets (the 8 MiB memlock limit, files one does not own);
//!   [`rerun_as_nobody`] runs one test of the current binary so.
//! - [`fds`], [`rss_mib`]: process gauges for leak checks.
//! - [`soak_secs`]: how long a soak runs: seconds by default, longer by an environment variable.
//! - [`free_port`], [`wait_accepting`]: loopback ports and servers coming up.
//! - `attack` (feature `net`): the adversarial loopback scenarios that the net tests assert
//!   behaviour on and `ubdirect-bench` measures throughput ratios of.
//!
//! Time in a test is only ever a deadline against a hang: see docs/testing.md.

#![allow(clippy::unwrap_used)] // test support: a failed unwrap is a failed test

#[cfg(feature = "net")]
pub mod attack;

use std::io::Write;
use std::net::ToSocketAddrs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// The environment variable that makes a skip a failure.
pub const STRICT: &str = "UBDIRECT_TEST_STRICT";

/// Whether `UBDIRECT_TEST_STRICT` is set (CI): then nothing may skip.
pub fn strict() -> bool {
    std::env::var_os(STRICT).is_some()
}

/// A test (or part of one) that this machine cannot run: `skip: WHAT: WHY` on stderr, written past
/// the harness's capture, and the caller returns; under `UBDIRECT_TEST_STRICT` a panic instead.
pub fn skip(what: &str, why: &str) {
    assert!(
        !strict(),
        "{STRICT} is set and {what} cannot run here: {why}"
    );
    let _ = writeln!(std::io::stderr(), "skip: {what}: {why}");
}

/// `base/name`, emptied and created. Use [`tmp!`], which passes the test target's directory.
pub fn tmp_in(base: &Path, name: &str) -> PathBuf {
    let d = base.join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display()));
    d
}

/// `tmp!("name")`: an emptied scratch directory `name` under the integration test's
/// `CARGO_TARGET_TMPDIR` (inside `target/`, on the work disk).
#[macro_export]
macro_rules! tmp {
    ($name:expr) => {
        $crate::tmp_in(::std::path::Path::new(env!("CARGO_TARGET_TMPDIR")), $name)
    };
}

/// Open descriptors of this process.
pub fn fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Resident memory of this process, MiB.
pub fn rss_mib() -> f64 {
    let s = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages = s
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse::<u64>().ok())
        .unwrap_or(0);
    (pages * 4096) as f64 / (1 << 20) as f64
}

/// Seconds a soak or attack test runs: `var` when set (a longer run by hand), else `default` (a few
/// seconds, so `cargo test` stays quick on a busy 2-core machine).
pub fn soak_secs(var: &str, default: f64) -> f64 {
    std::env::var(var)
        .ok()
        .and_then(|s| s.parse().ok())
        .filter(|s: &f64| s.is_finite() && *s > 0.0)
        .unwrap_or(default)
}

/// Whether this process runs as root.
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(1).map(|u| u == "0"))
        })
        .unwrap_or(false)
}

/// `program` as `nobody` with no capabilities and no groups (util-linux `setpriv`; the caller must
/// be root): what a non-root user of a cluster or container meets (memlock limits, files one does not
/// own). Add the program's arguments to the returned command.
pub fn as_nobody(program: &Path) -> Command {
    let mut c = Command::new("setpriv");
    c.args([
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--",
    ])
    .arg(program);
    c
}

/// Lowers this process's soft RLIMIT_MEMLOCK to `bytes` (at most the hard limit; lowering needs no
/// privilege): what a child of a tested process inherits, e.g. the common 8 MiB default.
pub fn set_memlock_soft_limit(bytes: u64) {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write a struct we own.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut rl), 0);
        rl.rlim_cur = bytes.min(rl.rlim_max);
        assert_eq!(libc::setrlimit(libc::RLIMIT_MEMLOCK, &rl), 0);
    }
}

/// Files held in the page cache while this lives: each read, mapped and locked (`mlock`: as root, or
/// within RLIMIT_MEMLOCK), so that memory pressure on a busy machine (other jobs; `drop_caches`
/// shows it) cannot evict them under a test whose premise is that they are resident. Where a lock is
/// refused they are only read (`locked` says which).
#[derive(Debug)]
pub struct Resident {
    maps: Vec<(*mut libc::c_void, usize)>,
    /// Whether every file is locked (not only read).
    pub locked: bool,
}

/// [`Resident`] for `paths` (empty files are skipped).
pub fn hold_resident(paths: &[PathBuf]) -> Resident {
    use std::os::fd::AsRawFd;
    let mut r = Resident {
        maps: Vec::new(),
        locked: true,
    };
    for p in paths {
        let f = std::fs::File::open(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        let len = f.metadata().map_or(0, |m| m.len()) as usize;
        if len == 0 {
            continue;
        }
        // SAFETY: a new read-only shared mapping of an open file; the kernel picks the address.
        // Nothing reads through it (a file cut short meanwhile cannot fault here); `Drop` unmaps it.
        let a = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                f.as_raw_fd(),
                0,
            )
        };
        if a == libc::MAP_FAILED {
            r.locked = false;
            let _ = std::fs::read(p);
            continue;
        }
        // SAFETY: `a..a+len` is the mapping made above.
        if unsafe { libc::mlock(a, len) } != 0 {
            r.locked = false;
        }
        r.maps.push((a, len));
    }
    r
}

impl Drop for Resident {
    fn drop(&mut self) {
        for &(a, len) in &self.maps {
            // SAFETY: each is a mapping `hold_resident` made and nothing else unmaps.
            unsafe { libc::munmap(a, len) };
        }
    }
}

/// The variable that marks a test's re-run as `nobody` ([`rerun_as_nobody`]).
pub const NOBODY_CHILD: &str = "UBDIRECT_NOBODY_CHILD";

/// Whether this test process is the unprivileged re-run of [`rerun_as_nobody`].
pub fn is_nobody_child() -> bool {
    std::env::var_os(NOBODY_CHILD).is_some()
}

/// Re-runs the test `test` of this test binary as `nobody` ([`as_nobody`]) with `envs`, after
/// making `dir` writable by it and its parents searchable (a test target under `/root`), and
/// asserts that it ran and passed. The child sees [`is_nobody_child`]; `HOME` is `dir`.
pub fn rerun_as_nobody(test: &str, dir: &Path, envs: &[(&str, &std::ffi::OsStr)]) {
    let _ = Command::new("chmod")
        .args(["-R", "a+rwx"])
        .arg(dir)
        .status();
    for parent in dir.ancestors().skip(1) {
        if parent.as_os_str().len() > 1 {
            let _ = Command::new("chmod").arg("a+x").arg(parent).status();
        }
    }
    let exe = std::env::current_exe().unwrap();
    let mut c = as_nobody(&exe);
    c.args(["--exact", test, "--test-threads=1", "--nocapture"])
        .env(NOBODY_CHILD, "1")
        .env("HOME", dir);
    for (k, v) in envs {
        c.env(k, v);
    }
    let out = c
        .output()
        .expect("setpriv (util-linux) must be installed to run this test as root");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "child failed:\n{text}");
    assert!(
        text.contains("1 passed"),
        "child did not run the test:\n{text}"
    );
}

/// A loopback port nothing listens on now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Waits, trying every `poll`, until `addr` accepts a connection; panics `WHAT did not come up`
/// after `within` (a deadline against a hang, not a speed).
pub fn wait_accepting<A: ToSocketAddrs + Copy>(
    addr: A,
    within: Duration,
    poll: Duration,
    what: &str,
) {
    let t = Instant::now();
    while std::net::TcpStream::connect(addr).is_err() {
        assert!(
            t.elapsed() < within,
            "{what} did not come up within {within:?}"
        );
        std::thread::sleep(poll);
    }
}

/// The median of `v` (the mean of the middle two for an even count); NaN when empty.
pub fn median(v: &[f64]) -> f64 {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| !x.is_nan()).collect();
    if s.is_empty() {
        return f64::NAN;
    }
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
    }

    #[test]
    fn soak_secs_takes_a_positive_number_or_the_default() {
        assert_eq!(soak_secs("UBDIRECT_TESTKIT_UNSET_FOR_SURE", 3.0), 3.0);
    }
}
