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
