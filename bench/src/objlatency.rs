//! `ubdirect-bench object-latency` (feature `object-store`, since 2026-12-07, issue 47): GPT epochs
//! from `s3://` behind a proxy that adds a latency to every request (20 ms unless
//! `UBDIRECT_BENCH_LATENCY_MS` says otherwise), so that requests show as time, as on a real store:
//! block and Megatron order with no cache, a cache of half the dataset and one of twice it (and
//! Megatron order with no `[cache]`: the default cache), against the same epoch from local files
//! without latency and the Mosaic pattern — every object downloaded whole through the same proxy,
//! then the epoch from the local copy. Each row is one epoch in a fresh loader; its requests and
//! store bytes are the process's counters over that epoch, beside the run's own prediction
//! (`store_cost`).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use ubdirect_loader::objstore::object_store::{ObjectStore, path::Path as ObjPath};

use crate::common::{Figure, Row, Table};
use crate::objstore::{BUCKET, start_server, store};
use crate::scenarios::Ctx;

/// A proxy on loopback in front of `port` that holds each HTTP request `latency` before passing it
/// on (the first bytes of a request: a method at the start of what the client sends). Returns its
/// port; it serves until the runtime ends.
async fn latency_proxy(port: u16, latency: Duration) -> std::io::Result<u16> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let at = l.local_addr()?.port();
    tokio::spawn(async move {
        while let Ok((mut client, _)) = l.accept().await {
            tokio::spawn(async move {
                let Ok(mut server) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await
                else {
                    return;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let (mut cr, mut cw) = client.split();
                let (mut sr, mut sw) = server.split();
                let up = async {
                    let mut buf = vec![0u8; 64 << 10];
                    loop {
                        let n = cr.read(&mut buf).await?;
                        if n == 0 {
                            return sw.shutdown().await;
                        }
                        let head = &buf[..n.min(8)];
                        if [&b"GET "[..], b"HEAD ", b"PUT ", b"POST ", b"DELETE "]
                            .iter()
                            .any(|m| head.starts_with(m))
                        {
                            tokio::time::sleep(latency).await;
                        }
                        sw.write_all(&buf[..n]).await?;
                    }
                };
                let down = tokio::io::copy(&mut sr, &mut cw);
                let _ = tokio::join!(up, down);
            });
        }
    });
    Ok(at)
}

/// One row's measure: epoch seconds, requests, bytes from the store, bytes delivered, and the
/// run's predicted requests.
struct Epoch {
    secs: f64,
    requests: u64,
    store: u64,
    delivered: u64,
    predicted: Option<u64>,
    /// Chunks fetched for their windows, and parts fetched on their own (the cache bypassed).
    windows: u64,
    bypassed: u64,
    /// Reads served by kept windows, and those of them the pipeline took at hand (no block, no
    /// task); bytes read from chunk files.
    window_reads: (u64, u64),
    cache_bytes: u64,
}

/// Opens `toml` and runs its first epoch (its open included in the time).
fn epoch(toml: &str) -> Result<Epoch, String> {
    let s0 = ubdirect_loader::objstore::stats();
    let t = Instant::now();
    let c = ubdirect_loader::RunConfig::from_toml(toml, "bench").map_err(|e| e.to_string())?;
    let l = ubdirect_loader::Loader::from_config(&c).map_err(|e| e.to_string())?;
    let mut delivered = 0u64;
    for b in l.epoch(0).map_err(|e| e.to_string())? {
        let b = b.map_err(|e| e.to_string())?;
        delivered += b.samples().iter().map(|s| s.len as u64).sum::<u64>();
    }
    let secs = t.elapsed().as_secs_f64();
    let predicted = l.object_store_cost().map(|c| c.predicted.requests);
    let s1 = ubdirect_loader::objstore::stats();
    Ok(Epoch {
        secs,
        requests: s1.requests - s0.requests,
        store: s1.bytes_from_store - s0.bytes_from_store,
        delivered,
        predicted,
        windows: s1.window_chunks - s0.window_chunks,
        bypassed: s1.cache_bypassed - s0.cache_bypassed,
        window_reads: (
            s1.bytes_from_windows - s0.bytes_from_windows,
            s1.reads_at_hand - s0.reads_at_hand,
        ),
        cache_bytes: s1.bytes_from_cache - s0.bytes_from_cache,
    })
}

/// Every object of `objects` downloaded whole through `s` into `dir`, all at once (one GET each:
/// the Mosaic pattern's shard downloads).
async fn download(s: &Arc<dyn ObjectStore>, objects: &[(ObjPath, PathBuf)]) -> Result<u64, String> {
    let mut gets = tokio::task::JoinSet::new();
    for (loc, to) in objects {
        let (s, loc, to) = (s.clone(), loc.clone(), to.clone());
        gets.spawn(async move {
            let b = s.get(&loc).await.map_err(|e| e.to_string())?;
            let b = b.bytes().await.map_err(|e| e.to_string())?;
            std::fs::write(&to, &b).map_err(|e| e.to_string())?;
            Ok::<u64, String>(b.len() as u64)
        });
    }
    let mut n = 0;
    while let Some(r) = gets.join_next().await {
        n += r.map_err(|e| e.to_string())??;
    }
    Ok(n)
}

/// The scenario's GPT keys: sequence 64, batches of 8 on the host, one epoch of `order`.
fn gpt(dir: &str, order: &str) -> String {
    format!(
        "[dataset]\nformat = \"megatron\"\ndir = \"{dir}\"\ngenerate = false\nsequence_length = 64\n\
         [loader]\norder = \"{order}\"\nbatch_size = 8\nseed = 3\nepochs = 1\n[device]\nselect = \"host\"\n"
    )
}

pub fn run(ctx: &Ctx) -> Result<Vec<Table>, String> {
    let latency = Duration::from_millis(
        std::env::var("UBDIRECT_BENCH_LATENCY_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(20),
    );
    let (port, _server, server) = start_server()?;
    let base = ctx.dir.join("object-latency");
    let _ = std::fs::remove_dir_all(&base);
    let (data, copy) = (base.join("data"), base.join("whole"));
    std::fs::create_dir_all(&copy).map_err(|e| e.to_string())?;
    // The dataset (6000 documents in 2 shards, 24 MB); --quick: 600.
    let docs = if ctx.quick { 600 } else { 6000 };
    let cfg = ubdirect_loader::config::DatasetSection::default();
    let files = ubdirect_loader::dataset::generate(
        &data,
        ubdirect_loader::formats::Format::Megatron,
        docs,
        2,
        &cfg,
    )
    .map_err(|e| e.to_string())?;
    let direct = store(port)?;
    let mut objects = Vec::new();
    let mut bytes = 0u64;
    // Each shard's `.idx` (what `generate` returns) and its `.bin`.
    for p in files
        .iter()
        .flat_map(|f| [f.clone(), f.with_extension("bin")])
    {
        let name = p
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default();
        let body = std::fs::read(&p).map_err(|e| e.to_string())?;
        bytes += body.len() as u64;
        let loc = ObjPath::from(format!("mg/{name}"));
        ctx.rt
            .block_on(direct.put(&loc, body.into()))
            .map_err(|e| e.to_string())?;
        objects.push((loc, copy.join(name)));
    }
    let proxy = ctx
        .rt
        .block_on(latency_proxy(port, latency))
        .map_err(|e| e.to_string())?;
    let slow = store(proxy)?;
    println!(
        "object-latency: {} objects, {bytes} bytes on {server}, {} ms added per request (proxy at 127.0.0.1:{proxy})",
        objects.len(),
        latency.as_millis()
    );
    let keys = format!(
        "[object_store]\nendpoint = \"http://127.0.0.1:{proxy}\"\nallow_http = true\nregion = \"us-east-1\"\naccess_key_id = \"bench\"\nsecret_access_key = \"bench\"\nestimate_request_ms = {}\n",
        latency.as_millis()
    );
    let s3 = format!("s3://{BUCKET}/mg");
    let cache = |name: &str, max: u64| {
        let d = base.join(format!("cache-{name}"));
        let _ = std::fs::remove_dir_all(&d);
        format!(
            "[cache]\ndir = \"{}\"\nmax_bytes = {max}\nchunk_size = \"256KiB\"\n",
            d.display()
        )
    };
    let local = |order: &str| gpt(&data.display().to_string(), order);
    let remote = |order: &str, c: &str| format!("{}{keys}{c}", gpt(&s3, order));
    let mut rows: Vec<(String, Vec<Epoch>, bool)> = vec![
        (
            "local files, megatron order, no latency".into(),
            vec![],
            true,
        ),
        (
            "whole-shard download + local epoch (Mosaic)".into(),
            vec![],
            true,
        ),
    ];
    let mut variants: Vec<(String, String)> = Vec::new();
    for order in ["block", "megatron"] {
        for (what, c) in [
            ("½ the dataset", cache(&format!("{order}-half"), bytes / 2)),
            (
                "2 × the dataset",
                cache(&format!("{order}-twice"), bytes * 2),
            ),
        ] {
            variants.push((
                format!("s3://, {order} order, cache {what}"),
                remote(order, &c),
            ));
        }
    }
    variants.push((
        "s3://, megatron order, no [cache] (the default cache)".into(),
        format!("{}{keys}", gpt(&s3, "megatron")),
    ));
    variants.push((
        "s3://, block order, no cache".into(),
        remote("block", "[cache]\ndir = \"\"\n"),
    ));
    if ctx.quick {
        // A GET per window: minutes at the full size.
        variants.push((
            "s3://, megatron order, no cache".into(),
            remote("megatron", "[cache]\ndir = \"\"\n"),
        ));
    }
    // `UBDIRECT_BENCH_ROWS=text`: only the rows whose label holds it (and the two baselines).
    if let Ok(only) = std::env::var("UBDIRECT_BENCH_ROWS") {
        variants.retain(|(l, _)| l.contains(&only));
    }
    for (label, _) in &variants {
        rows.push((label.clone(), vec![], false));
    }
    // Rounds: every row once per round, in turn (the default cache's directory is the user's, so
    // its later rounds may start warm: said in the note).
    for round in 0..ctx.runs.max(1) {
        rows[0].1.push(epoch(&local("megatron"))?);
        let t = Instant::now();
        let got = ctx.rt.block_on(download(&slow, &objects))?;
        let mut e = epoch(&local_copy(&copy, "megatron"))?;
        e.secs = t.elapsed().as_secs_f64();
        e.requests = objects.len() as u64;
        e.store = got;
        rows[1].1.push(e);
        for (i, (label, toml)) in variants.iter().enumerate() {
            let toml = toml.replace("cache-", &format!("r{round}-cache-"));
            let e = epoch(&toml)?;
            println!(
                "object-latency: round {round}: {label}: {:.2} s, {} requests ({} chunks for windows, {} parts on their own); {} bytes from windows ({} reads at hand), {} from chunk files",
                e.secs,
                e.requests,
                e.windows,
                e.bypassed,
                e.window_reads.0,
                e.window_reads.1,
                e.cache_bytes
            );
            rows[2 + i].1.push(e);
        }
    }
    Ok(vec![table(&rows, latency)])
}

/// The local copy of the downloaded objects, as a dataset.
fn local_copy(dir: &Path, order: &str) -> String {
    gpt(&dir.display().to_string(), order)
}

/// The table: per row, median epoch seconds (GB/s delivered in the figure), its ratio to the
/// whole-shard download, and the requests per sample and bytes from the store per delivered.
fn table(rows: &[(String, Vec<Epoch>, bool)], latency: Duration) -> Table {
    let median = |v: &[f64]| Figure::of(v.to_vec()).median;
    let whole = median(&rows[1].1.iter().map(|e| e.secs).collect::<Vec<_>>());
    let local = median(&rows[0].1.iter().map(|e| e.secs).collect::<Vec<_>>());
    let mut t = Table::new(&format!(
        "object store with {} ms per request: GPT epoch time vs a whole-shard download",
        latency.as_millis()
    ));
    t.reference =
        "whole-shard download + local epoch (epoch seconds; ratio = its ÷ this row's)".into();
    for (label, es, baseline) in rows {
        let secs: Vec<f64> = es.iter().map(|e| e.secs).collect();
        let gbps = Figure::of(
            es.iter()
                .map(|e| e.delivered as f64 / e.secs.max(1e-9) / 1e9)
                .collect(),
        );
        let s = median(&secs);
        let req: Vec<String> = es.iter().map(|e| e.requests.to_string()).collect();
        let pred = es
            .first()
            .and_then(|e| e.predicted)
            .map_or(String::new(), |p| format!(", predicted {p}"));
        let per = es
            .first()
            .map_or(0.0, |e| e.store as f64 / e.delivered.max(1) as f64);
        let secs_s: Vec<String> = secs.iter().map(|x| format!("{x:.2}")).collect();
        t.rows.push(Row {
            label: label.clone(),
            gbps,
            cpu_s_per_gb: 0.0,
            ratio: Some(whole / s.max(1e-9)),
            baseline: *baseline,
            note: format!(
                "epoch {} s (median {s:.2}; {:.2} × local, {:.2} × whole-shard), requests {}{pred}, store ÷ delivered {per:.2}",
                secs_s.join("/"),
                s / local.max(1e-9),
                s / whole.max(1e-9),
                req.join("/"),
            ),
        });
    }
    t
}
