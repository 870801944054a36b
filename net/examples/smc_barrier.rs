//! Times a 4 MiB write-back barrier against a plain socket moving the same bytes, on loopback, in
//! one process (for profiling: `perf record` this). `smc_barrier [rounds]`.

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use ubdirect_net::smc::{MapOptions, SmcClient, SmcOptions};
use ubdirect_net::{RegionConfig, Server, ServerConfig};

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(200);
    let block = 4 << 20;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let server = rt.block_on(Server::start(ServerConfig {
        listen: "127.0.0.1:0".parse()?,
        token: b"example-token-0123".to_vec(),
        max_request: 16 << 20,
        blocks: 1,
        regions: vec![RegionConfig {
            name: "r".into(),
            size: block as u64,
            key: b"example-region-key".to_vec(),
            writable: true,
            gpu: None,
        }],
        ..ServerConfig::default()
    }))?;
    let c = SmcClient::new(
        server.local_addr(),
        "example-token-0123",
        SmcOptions {
            deadline: Duration::from_secs(10),
            retries: 1,
        },
    );
    let m = c
        .register("r", "example-region-key")?
        .map(MapOptions::default())?;
    let mut src = vec![7u8; block];
    m.store(0, &src)?;
    m.barrier()?;
    let (mut bar, mut plain) = (Vec::new(), Vec::new());
    for i in 0..rounds {
        src[0] = i as u8;
        m.store(0, &src)?;
        let t = Instant::now();
        m.barrier()?;
        bar.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?;
    std::thread::spawn(move || {
        let Ok((mut s, _)) = l.accept() else { return };
        let mut buf = vec![0u8; block];
        while s.read_exact(&mut buf).is_ok() && s.write_all(&[1]).is_ok() {}
    });
    let mut sock = std::net::TcpStream::connect(addr)?;
    sock.set_nodelay(true)?;
    for _ in 0..rounds {
        let t = Instant::now();
        sock.write_all(&src)?;
        sock.read_exact(&mut [0u8; 1])?;
        plain.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let (b, p) = (median(&mut bar), median(&mut plain));
    println!(
        "barrier {b:.0} us, plain socket {p:.0} us: {:.2} x",
        p / b.max(1e-9)
    );
    Ok(())
}
