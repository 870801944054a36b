//! In-process `ubdirect serve` (`ubdirect_net::Server`) on loopback.

use std::path::PathBuf;
use std::sync::mpsc::Sender;
use std::thread::JoinHandle;
use std::time::Duration;

/// A server configuration on `127.0.0.1:PORT` with `token`, `roots`, requests up to `max_request`
/// bytes and 8 staging blocks.
pub fn loopback(
    port: u16,
    token: &[u8],
    roots: Vec<(String, PathBuf)>,
    max_request: u32,
) -> ubdirect_net::ServerConfig {
    ubdirect_net::ServerConfig {
        listen: format!("127.0.0.1:{port}").parse().unwrap(),
        token: token.to_vec(),
        roots,
        max_request,
        blocks: 8,
        ..ubdirect_net::ServerConfig::default()
    }
}

/// Runs a server of `cfg` on a runtime of its own thread until the sender sends or is dropped.
pub fn serve_in_thread(cfg: ubdirect_net::ServerConfig) -> (Sender<()>, JoinHandle<()>) {
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let h = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let s = rt.block_on(ubdirect_net::Server::start(cfg)).unwrap();
        let _ = rx.recv();
        s.shutdown();
    });
    (tx, h)
}

/// [`serve_in_thread`], returning once the server accepts (`server did not come up` after 20 s).
pub fn start(cfg: ubdirect_net::ServerConfig) -> (Sender<()>, JoinHandle<()>) {
    let addr = cfg.listen;
    let served = serve_in_thread(cfg);
    super::wait_accepting(
        addr,
        Duration::from_secs(20),
        Duration::from_millis(20),
        "server",
    );
    served
}
