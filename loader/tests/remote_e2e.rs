//! `ubdirect serve` + a `ub://` dataset on loopback: the epoch delivers the same sample CRCs as the
//! same dataset read locally.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::ub::{loopback, serve_in_thread};
use support::{COMMON, dump, free_port, generate, local_config, read_dump, tmp};

/// Starts `ubdirect serve` on a free loopback port with `[serve]` keys `rest` (after `listen`); waits
/// until it accepts. Returns the port and the child.
fn serve(d: &Path, rest: &str) -> (u16, std::process::Child) {
    let port = free_port();
    std::fs::write(
        d.join("serve.toml"),
        format!("[serve]\nlisten = \"127.0.0.1:{port}\"\n{rest}"),
    )
    .unwrap();
    let server = Command::new(env!("CARGO_BIN_EXE_ubdirect"))
        .args(["serve", "--config"])
        .arg(d.join("serve.toml"))
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    support::wait_accepting(
        ("127.0.0.1", port),
        Duration::from_secs(20),
        Duration::from_millis(50),
        "server",
    );
    (port, server)
}

#[test]
fn remote_epoch_equals_local_epoch() {
    let d = tmp("remote-e2e");
    let data = d.join("data");
    generate(&data, "raw", 2000, 3);
    let token = "a-test-token-of-enough-length";
    let (port, mut server) = serve(
        &d,
        &format!(
            "token = \"{token}\"\nmax_request = \"4MiB\"\nblocks = 16\n[serve.roots]\nds = \"{}\"\n",
            data.display()
        ),
    );
    let common = "[loader]\nbatch_size = 32\nseed = 5\n[device]\nselect = \"host\"\n";
    std::fs::write(d.join("local.toml"), local_config("raw", &data, common)).unwrap();
    let paths: Vec<String> = (0..3)
        .map(|i| format!("\"ub://127.0.0.1:{port}/ds/shard-{i:05}.bin\""))
        .collect();
    std::fs::write(
        d.join("remote.toml"),
        format!("[dataset]\nformat = \"raw\"\npaths = [{}]\ngenerate = false\n{common}[remote]\ntoken = \"{token}\"\ndeadline_ms = 10000\n", paths.join(", ")),
    )
    .unwrap();
    let local = dump(&d.join("local.toml"), &d.join("local.jsonl"));
    let remote = dump(&d.join("remote.toml"), &d.join("remote.jsonl"));
    assert_eq!(local.len(), 1984);
    assert_eq!(local, remote, "remote epoch differs from the local one");
    // A wrong token is a clear error naming the refusal.
    std::fs::write(
        d.join("bad.toml"),
        std::fs::read_to_string(d.join("remote.toml"))
            .unwrap()
            .replace(token, "wrong"),
    )
    .unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_ubdirect"))
        .args(["run", "--config"])
        .arg(d.join("bad.toml"))
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("wrong or missing token"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    server.kill().unwrap();
    let _ = server.wait();
}

#[test]
fn server_killed_mid_epoch_and_restarted_every_sample_once_else_typed_error() {
    let d = tmp("remote-faults");
    let data = d.join("data");
    generate(&data, "raw", 4000, 4);
    let port = free_port();
    let scfg = loopback(
        port,
        b"fault-test-token",
        vec![("ds".into(), data.clone())],
        4 << 20,
    );
    let (stop, h) = support::ub::start(scfg.clone());
    let mut cfg = ubdirect_loader::RunConfig::default();
    cfg.dataset.paths = (0..4)
        .map(|i| PathBuf::from(format!("ub://127.0.0.1:{port}/ds/shard-{i:05}.bin")))
        .collect();
    cfg.dataset.generate = false;
    cfg.device.select = ubdirect_ub::DeviceSelection::Host;
    cfg.loader.batch_size = 16;
    cfg.loader.prefetch = 2;
    cfg.loader.min_read = ubdirect_loader::config::ByteSize(0);
    cfg.loader.max_chunk_batches = 1;
    cfg.remote.token = "fault-test-token".into();
    cfg.remote.deadline_ms = 10_000;
    let loader = ubdirect_loader::Loader::from_config(&cfg).unwrap();
    let mut seen = std::collections::HashMap::new();
    let mut it = loader.epoch(0).unwrap();
    for _ in 0..20 {
        for s in it.next().unwrap().unwrap().samples() {
            *seen.entry(s.id).or_insert(0) += 1;
        }
    }
    // Kill the server mid-epoch; bring it back 500 ms later on the same address.
    stop.send(()).unwrap();
    h.join().unwrap();
    let restarted = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(500));
        serve_in_thread(scfg)
    });
    for b in it {
        for s in b.unwrap().samples() {
            *seen.entry(s.id).or_insert(0) += 1;
        }
    }
    assert_eq!(seen.len(), 4000 / 16 * 16, "every sample of the epoch");
    assert!(seen.values().all(|&c| c == 1), "a sample delivered twice");
    // Now kill it for good: the next epoch fails with a typed error within the deadline.
    let (stop2, h2) = restarted.join().unwrap();
    stop2.send(()).unwrap();
    h2.join().unwrap();
    let mut short = cfg.clone();
    short.remote.deadline_ms = 1500;
    let t = Instant::now();
    let r = ubdirect_loader::Loader::from_config(&short)
        .and_then(|l| l.epoch(0)?.collect::<Result<Vec<_>, _>>().map(|_| ()));
    let e = r.unwrap_err();
    assert!(matches!(e, ubdirect_loader::LoadError::Remote(_)), "{e}");
    assert!(e.to_string().contains("no server"), "{e}");
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "took {:?}",
        t.elapsed()
    );
}

fn sh(args: &[&str]) -> std::process::Output {
    Command::new(args[0]).args(&args[1..]).output().unwrap()
}

/// Two network namespaces joined by a veth pair, set up (and torn down) by the test itself: the server
/// in one, the loader in the other. Needs root (CI runs as root); elsewhere it prints a `skip:` line
/// and returns (or fails, under `UBDIRECT_TEST_STRICT`).
#[test]
fn across_two_network_namespaces_over_veth() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        // Written to stderr past the harness's capture (visible in every run); CI (root) sets
        // UBDIRECT_TEST_STRICT=1, so a skip there is a failure, never a silent pass.
        ubdirect_testkit::skip(
            "across_two_network_namespaces_over_veth",
            "needs root for `ip netns` (CI runs it as root)",
        );
        return;
    }
    let id = std::process::id() % 100_000;
    let (a, b, va, vb) = (
        format!("ubd-a{id}"),
        format!("ubd-b{id}"),
        format!("uva{id}"),
        format!("uvb{id}"),
    );
    let setup = [
        vec!["ip", "netns", "add", &a],
        vec!["ip", "netns", "add", &b],
        vec![
            "ip", "link", "add", &va, "type", "veth", "peer", "name", &vb,
        ],
        vec!["ip", "link", "set", &va, "netns", &a],
        vec!["ip", "link", "set", &vb, "netns", &b],
        vec!["ip", "-n", &a, "addr", "add", "10.77.0.1/24", "dev", &va],
        vec!["ip", "-n", &b, "addr", "add", "10.77.0.2/24", "dev", &vb],
        vec!["ip", "-n", &a, "link", "set", &va, "up"],
        vec!["ip", "-n", &b, "link", "set", &vb, "up"],
        vec!["ip", "-n", &a, "link", "set", "lo", "up"],
        vec!["ip", "-n", &b, "link", "set", "lo", "up"],
    ];
    let cleanup = |a: &str, b: &str| {
        let _ = sh(&["ip", "netns", "del", a]);
        let _ = sh(&["ip", "netns", "del", b]);
    };
    for cmd in &setup {
        let o = sh(cmd);
        if !o.status.success() {
            cleanup(&a, &b);
            panic!("{cmd:?}: {}", String::from_utf8_lossy(&o.stderr));
        }
    }
    let d = tmp("remote-netns");
    let data = d.join("data");
    generate(&data, "raw", 1000, 2);
    let token = "netns-test-token-long-enough";
    std::fs::write(d.join("serve.toml"), format!("[serve]\nlisten = \"10.77.0.1:7447\"\ntoken = \"{token}\"\nmax_request = \"4MiB\"\nblocks = 8\n[serve.roots]\nds = \"{}\"\n", data.display())).unwrap();
    let common = "[loader]\nbatch_size = 32\nseed = 2\n[device]\nselect = \"host\"\n";
    std::fs::write(d.join("local.toml"), local_config("raw", &data, common)).unwrap();
    std::fs::write(
        d.join("remote.toml"),
        format!("[dataset]\nformat = \"raw\"\npaths = [\"ub://10.77.0.1:7447/ds/shard-00000.bin\", \"ub://10.77.0.1:7447/ds/shard-00001.bin\"]\ngenerate = false\n{common}[remote]\ntoken = \"{token}\"\ndeadline_ms = 15000\n"),
    )
    .unwrap();
    let exe = env!("CARGO_BIN_EXE_ubdirect");
    let mut server = Command::new("ip")
        .args(["netns", "exec", &a, exe, "serve", "--config"])
        .arg(d.join("serve.toml"))
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let remote_dump = d.join("remote.jsonl");
    let o = Command::new("ip")
        .args(["netns", "exec", &b, exe, "run", "--json", "--config"])
        .arg(d.join("remote.toml"))
        .arg("--dump-samples")
        .arg(&remote_dump)
        .output()
        .unwrap();
    let _ = server.kill();
    let _ = server.wait();
    cleanup(&a, &b);
    assert!(
        o.status.success(),
        "run in netns {b}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let local = dump(&d.join("local.toml"), &d.join("local.jsonl"));
    assert_eq!(
        read_dump(&remote_dump),
        local,
        "the epoch across the veth pair differs from the local one"
    );
}

#[test]
fn remote_megatron_epoch_equals_local() {
    let d = tmp("remote-megatron");
    let data = d.join("data");
    generate(&data, "megatron", 1200, 2);
    let port = free_port();
    let (stop, h) = support::ub::start(loopback(
        port,
        b"megatron-remote-token",
        vec![("ds".into(), data.clone())],
        1 << 20,
    ));
    std::fs::write(
        d.join("local.toml"),
        local_config("megatron", &data, COMMON),
    )
    .unwrap();
    std::fs::write(
        d.join("remote.toml"),
        format!(
            "[dataset]\nformat = \"megatron\"\npaths = [\"ub://127.0.0.1:{port}/ds/shard-00000\", \"ub://127.0.0.1:{port}/ds/shard-00001.idx\"]\ngenerate = false\n{COMMON}[remote]\ntoken = \"megatron-remote-token\"\n"
        ),
    )
    .unwrap();
    let local = dump(&d.join("local.toml"), &d.join("local.jsonl"));
    let remote = dump(&d.join("remote.toml"), &d.join("remote.jsonl"));
    stop.send(()).unwrap();
    h.join().unwrap();
    assert_eq!(local.len(), 1200);
    assert_eq!(
        local, remote,
        "remote Megatron epoch differs from the local one"
    );
}

#[test]
fn npy_and_arrow_over_ub_equal_their_local_epochs() {
    let d = tmp("remote-e2e-npy-arrow");
    for fmt in ["npy", "arrow"] {
        generate(&d.join(fmt), fmt, 1500, 3);
    }
    let token = "npy-arrow-remote-token";
    let (port, mut server) = serve(
        &d,
        &format!(
            "token = \"{token}\"\n[serve.roots]\nds = \"{}\"\n",
            d.display()
        ),
    );
    for fmt in ["npy", "arrow"] {
        let mut files: Vec<String> = std::fs::read_dir(d.join(fmt))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
            .filter(|n| n.ends_with(&format!(".{fmt}")))
            .collect();
        files.sort();
        assert_eq!(files.len(), 3, "{files:?}");
        std::fs::write(
            d.join(format!("{fmt}-local.toml")),
            local_config(fmt, &d.join(fmt), COMMON),
        )
        .unwrap();
        let paths: Vec<String> = files
            .iter()
            .map(|f| format!("\"ub://127.0.0.1:{port}/ds/{fmt}/{f}\""))
            .collect();
        std::fs::write(
            d.join(format!("{fmt}-remote.toml")),
            format!(
                "[dataset]\nformat = \"{fmt}\"\npaths = [{}]\ngenerate = false\n{COMMON}[remote]\ntoken = \"{token}\"\ndeadline_ms = 10000\n",
                paths.join(", ")
            ),
        )
        .unwrap();
        let local = dump(
            &d.join(format!("{fmt}-local.toml")),
            &d.join(format!("{fmt}-local.jsonl")),
        );
        let remote = dump(
            &d.join(format!("{fmt}-remote.toml")),
            &d.join(format!("{fmt}-remote.jsonl")),
        );
        assert!(local.len() >= 1488, "{fmt}: {} samples", local.len());
        assert_eq!(
            local, remote,
            "{fmt}: remote epoch differs from the local one"
        );
    }
    let _ = server.kill();
    let _ = server.wait();
}
