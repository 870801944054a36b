//! Object-store servers on loopback (processes started by the tests) and uploads to them.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;

use object_store::ObjectStore;

/// A server process listening on `port`; killed on drop.
#[derive(Debug)]
pub struct Server {
    pub port: u16,
    pub child: Child,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Spawns `cmd` (its output discarded) as the server on `port`; `None` after the `skip:` line
/// `WHAT cannot be started (ERROR): INSTALL` when it cannot start.
pub fn spawn(cmd: &mut Command, port: u16, what: &str, install: &str) -> Option<Server> {
    match cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn() {
        Ok(child) => Some(Server { port, child }),
        Err(e) => {
            super::skip(&format!("{what} cannot be started ({e}): {install}"));
            None
        }
    }
}

/// Uploads every file of `dir` as `prefix/NAME` through `store`.
pub fn upload(store: Arc<dyn ObjectStore>, dir: &Path, prefix: &str) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if !p.is_file() {
                continue;
            }
            let name = p.file_name().unwrap().to_string_lossy().to_string();
            let loc = object_store::path::Path::from(format!("{prefix}/{name}"));
            store
                .put(&loc, std::fs::read(&p).unwrap().into())
                .await
                .unwrap();
        }
    });
}

/// The `object_store` counters of a `ubdirect run --json` summary (its stdout).
pub fn counters(stdout: &[u8]) -> serde_json::Value {
    let v: serde_json::Value = serde_json::from_slice(stdout).unwrap();
    v["object_store"].clone()
}

/// The bucket the `moto_server` tests use.
pub const BUCKET: &str = "ubd";

/// Starts `moto_server` on a free loopback port and creates [`BUCKET`]; `None` (after a `skip:`
/// line) when it is missing. A port taken between choosing it and the server's bind (another test
/// process on a busy machine) is retried on another port, at most five times.
pub fn moto() -> Option<Server> {
    let mut last = String::new();
    for _ in 0..5 {
        let port = super::free_port();
        match try_moto_on(port)? {
            Ok(s) => return Some(s),
            Err(why) => {
                eprintln!("moto_server on {port}: {why}; trying another port");
                last = why;
            }
        }
    }
    panic!("moto_server did not start on five ports: {last}");
}

/// `moto_server` on `port` with [`BUCKET`] made: `Err` when it is not ours that answers there (it
/// exited: the port was taken) or the bucket is not made; within 30 s.
fn try_moto_on(port: u16) -> Option<Result<Server, String>> {
    use std::io::{Read, Write};
    let mut s = spawn(
        Command::new("moto_server").args(["-H", "127.0.0.1", "-p", &port.to_string()]),
        port,
        "moto_server",
        "pip install 'moto[server]'",
    )?;
    let t = std::time::Instant::now();
    loop {
        if let Ok(Some(st)) = s.child.try_wait() {
            return Some(Err(format!(
                "it exited ({st}) before answering: the port is taken"
            )));
        }
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            break;
        }
        if t.elapsed() > std::time::Duration::from_secs(30) {
            return Some(Err("not accepting within 30 s".into()));
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    // Create the bucket (moto does not check signatures).
    let Ok(mut c) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return Some(Err("refused the bucket's connection".into()));
    };
    let _ = write!(
        c,
        "PUT /{BUCKET} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    let mut reply = String::new();
    let _ = c.read_to_string(&mut reply);
    if !reply.starts_with("HTTP/1.1 200") {
        return Some(Err(format!("create bucket: {reply:?}")));
    }
    // Still ours: a server of another process would have answered while ours failed to bind.
    if let Ok(Some(st)) = s.child.try_wait() {
        return Some(Err(format!(
            "it exited ({st}): another server answered on its port"
        )));
    }
    Some(Ok(s))
}

/// A client of [`BUCKET`] on the `moto_server` at `port`.
pub fn moto_store(port: u16) -> Arc<dyn ObjectStore> {
    Arc::new(
        object_store::aws::AmazonS3Builder::new()
            .with_endpoint(format!("http://127.0.0.1:{port}"))
            .with_allow_http(true)
            .with_region("us-east-1")
            .with_bucket_name(BUCKET)
            .with_access_key_id("test")
            .with_secret_access_key("test")
            .build()
            .unwrap(),
    )
}

/// The `[object_store]` and `[remote]` sections for the `moto_server` at `port`.
pub fn moto_sections(port: u16) -> String {
    format!(
        "[remote]\ndeadline_ms = 30000\n[object_store]\nendpoint = \"http://127.0.0.1:{port}\"\nallow_http = true\nregion = \"us-east-1\"\naccess_key_id = \"test\"\nsecret_access_key = \"test\"\n"
    )
}

/// Runs `ubdirect run --json --dump-samples OUT` on `cfg`, which must succeed: (sample, crc32) of
/// every delivered sample, and the summary JSON.
pub fn run_summary(cfg: &Path, out: &Path) -> (Vec<(u64, u64)>, serde_json::Value) {
    run_summary_home(cfg, out, None)
}

/// [`run_summary`] with `HOME` set to `home`.
pub fn run_summary_home(
    cfg: &Path,
    out: &Path,
    home: Option<&Path>,
) -> (Vec<(u64, u64)>, serde_json::Value) {
    let o = super::run_dump_home(cfg, out, home);
    assert!(
        o.status.success(),
        "{}: {}",
        cfg.display(),
        String::from_utf8_lossy(&o.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    (super::read_dump(out), v)
}
