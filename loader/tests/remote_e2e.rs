//! `ubdirect serve` + a `ub://` dataset on loopback: the epoch delivers the same sample CRCs as the
//! same dataset read locally.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn dump(cfg: &Path, out: &Path) -> Vec<(u64, u64)> {
    let o = Command::new(env!("CARGO_BIN_EXE_ubdirect"))
        .args(["run", "--json", "--config"])
        .arg(cfg)
        .arg("--dump-samples")
        .arg(out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    std::fs::read_to_string(out)
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (v["sample"].as_u64().unwrap(), v["crc32"].as_u64().unwrap())
        })
        .collect()
}

#[test]
fn remote_epoch_equals_local_epoch() {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("remote-e2e");
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    let data = d.join("data");
    let cfg = ubdirect_loader::config::DatasetSection::default();
    ubdirect_loader::dataset::generate(&data, "raw", 2000, 3, &cfg).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let token = "a-test-token-of-enough-length";
    std::fs::write(d.join("serve.toml"), format!("[serve]\nlisten = \"127.0.0.1:{port}\"\ntoken = \"{token}\"\nmax_request = \"4MiB\"\nblocks = 16\n[serve.roots]\nds = \"{}\"\n", data.display())).unwrap();
    let mut server = Command::new(env!("CARGO_BIN_EXE_ubdirect"))
        .args(["serve", "--config"])
        .arg(d.join("serve.toml"))
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "server did not come up"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let common = "[loader]\nbatch_size = 32\nseed = 5\n[device]\nselect = \"host\"\n";
    std::fs::write(
        d.join("local.toml"),
        format!(
            "[dataset]\nformat = \"raw\"\ndir = \"{}\"\ngenerate = false\n{common}",
            data.display()
        ),
    )
    .unwrap();
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
