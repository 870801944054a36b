//! `ubdirect-bench object-store` (feature `object-store`): `s3://` epochs against a real S3 server on
//! loopback (moto's `moto_server`, started here), in the same run as their baselines:
//!
//! - the loader reading `s3://` without a cache (reads in flight, bodies copied into leases as they
//!   stream) against plain ranged-GET clients of the same server: the best concurrent one (4 MiB
//!   ranges, N GETs in flight, N of 2..32 at its best: the reference) and the sequential one (one
//!   request stream, the shape most loaders have). N is chosen in a calibration pass of its own;
//!   then every row is measured in the same rounds, one epoch of each in turn (a 2-core machine
//!   shared with builds drifts by more than the differences measured), and the ratio to the
//!   reference is also given paired by round;
//! - cache-hit epochs (chunks on local disk, read through io_uring) against the same epoch from the
//!   local files.
//!
//! moto is a Python server: the absolute figures are its, the ratios are ours. With
//! `UBDIRECT_BENCH_S3FS=PATH` the server is `s3s-fs` instead (Rust, requests served in parallel).

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ubdirect_loader::objstore::object_store::{self, ObjectStore};

use crate::common::{Figure, Row, Table, cpu_time, measure};
use crate::scenarios::Ctx;

pub(crate) const BUCKET: &str = "bench";

/// The server process, and the directory it serves (s3s-fs), removed with it.
pub(crate) struct Moto(Child, Option<std::path::PathBuf>);

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
        if let Some(root) = &self.1 {
            let _ = std::fs::remove_dir_all(root);
        }
    }
}

/// The S3 server on loopback: moto (one Python process), or — with `UBDIRECT_BENCH_S3FS=PATH` —
/// `s3s-fs` (`cargo install s3s-fs`, a Rust S3 server over a directory that serves requests in
/// parallel), so that the store is not what the ratio measures. Returns (port, the server, its name).
pub(crate) fn start_server() -> Result<(u16, Moto, &'static str), String> {
    let Some(bin) = std::env::var_os("UBDIRECT_BENCH_S3FS") else {
        return start_moto().map(|(p, m)| (p, m, "moto"));
    };
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| e.to_string())?
        .port();
    let root = std::env::temp_dir().join(format!("ubdirect-bench-s3fs-{port}"));
    let _ = std::fs::remove_dir_all(&root);
    // A bucket is a directory of the root.
    std::fs::create_dir_all(root.join(BUCKET)).map_err(|e| e.to_string())?;
    let child = server_command(&bin)
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--access-key", "bench", "--secret-key", "bench"])
        .arg(&root)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("{} ({e})", Path::new(&bin).display()))?;
    let m = Moto(child, Some(root));
    let t = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if t.elapsed() > Duration::from_secs(30) {
            return Err("s3s-fs did not come up in 30 s".into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok((port, m, "s3s-fs"))
}

/// The server's command: run on the CPUs of `UBDIRECT_BENCH_SERVER_CPUS` (a `taskset` list such as
/// `8-15`) when set, so that on a machine with cores to spare the store does not share the client's
/// (run the bench itself under `taskset -c` for the other half).
fn server_command(bin: &std::ffi::OsStr) -> Command {
    match std::env::var("UBDIRECT_BENCH_SERVER_CPUS") {
        Ok(cpus) if !cpus.is_empty() => {
            let mut c = Command::new("taskset");
            c.args(["-c", &cpus]).arg(bin);
            c
        }
        _ => Command::new(bin),
    }
}

fn start_moto() -> Result<(u16, Moto), String> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| e.to_string())?
        .port();
    let child = server_command(std::ffi::OsStr::new("moto_server"))
        .args(["-H", "127.0.0.1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("moto_server ({e}): pip install 'moto[server]'"))?;
    let m = Moto(child, None);
    let t = Instant::now();
    loop {
        if let Ok(mut c) = std::net::TcpStream::connect(("127.0.0.1", port)) {
            write!(
                c,
                "PUT /{BUCKET} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            )
            .map_err(|e| e.to_string())?;
            let mut reply = String::new();
            let _ = c.read_to_string(&mut reply);
            if !reply.starts_with("HTTP/1.1 200") {
                return Err(format!("moto: create bucket: {reply}"));
            }
            return Ok((port, m));
        }
        if t.elapsed() > Duration::from_secs(30) {
            return Err("moto_server did not come up in 30 s".into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub(crate) fn store(port: u16) -> Result<Arc<dyn ObjectStore>, String> {
    Ok(Arc::new(
        object_store::aws::AmazonS3Builder::new()
            .with_endpoint(format!("http://127.0.0.1:{port}"))
            .with_allow_http(true)
            .with_region("us-east-1")
            .with_bucket_name(BUCKET)
            .with_access_key_id("bench")
            .with_secret_access_key("bench")
            .build()
            .map_err(|e| e.to_string())?,
    ))
}

/// The scenario's configuration: `s3://` epochs run with the defaults (`object_store.min_read`
/// groups batches into 4 MiB reads, the plain client's range; the local epochs
/// set `loader.min_read = "4MiB"` themselves, so that both sides of a ratio read the same plan).
/// `loader` and `store` are more keys of `[loader]` and `[object_store]`.
fn loader_config(
    select: &str,
    dataset_dir: &str,
    port: u16,
    cache: Option<&Path>,
    (loader, store): (&str, &str),
) -> String {
    let mut t = format!(
        "[dataset]\nformat = \"raw\"\ndir = \"{dataset_dir}\"\ngenerate = false\n\
         [loader]\nbatch_size = 64\n{loader}[device]\nselect = \"{select}\"\n[remote]\ndeadline_ms = 60000\n\
         [object_store]\nendpoint = \"http://127.0.0.1:{port}\"\nallow_http = true\n\
         region = \"us-east-1\"\naccess_key_id = \"bench\"\nsecret_access_key = \"bench\"\n{store}"
    );
    if let Some(c) = cache {
        t += &format!("[cache]\ndir = \"{}\"\n", c.display());
    }
    t
}

/// (shards wholly in the page cache now, shards): the `.bin` files of `dir` (`cachestat`; `None`
/// where the kernel cannot say).
fn resident_shards(dir: &Path) -> (Option<usize>, usize) {
    let files: Vec<_> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "bin"))
        .collect();
    let resident: Option<Vec<bool>> = files
        .iter()
        .map(|p| {
            let f = std::fs::File::open(p).ok()?;
            let len = f.metadata().map_or(0, |m| m.len());
            ubdirect_nvme::page_cache_resident(&f, 0, len).ok()
        })
        .collect();
    (
        resident.map(|r| r.into_iter().filter(|&x| x).count()),
        files.len(),
    )
}

fn epoch_bytes(loader: &ubdirect_loader::Loader, e: u64) -> Result<u64, String> {
    let mut n = 0u64;
    for b in loader.epoch(e).map_err(|e| e.to_string())? {
        let b = b.map_err(|e| e.to_string())?;
        n += b.samples().iter().map(|s| s.len as u64).sum::<u64>();
    }
    Ok(n)
}

/// Every 4 MiB range of `objects` through `s`, `n` GETs in flight at once: bytes received.
async fn concurrent_gets(
    s: &Arc<dyn ObjectStore>,
    objects: &[(object_store::path::Path, u64)],
    range: u64,
    n: usize,
) -> Result<u64, String> {
    let permits = Arc::new(tokio::sync::Semaphore::new(n));
    let mut set = tokio::task::JoinSet::new();
    for (loc, len) in objects {
        let mut at = 0;
        while at < *len {
            let end = (at + range).min(*len);
            let permit = permits
                .clone()
                .acquire_owned()
                .await
                .map_err(|e| e.to_string())?;
            let (s, loc) = (s.clone(), loc.clone());
            set.spawn(async move {
                let r = s.get_range(&loc, at..end).await;
                drop(permit);
                r.map(|b| b.len() as u64).map_err(|e| e.to_string())
            });
            at = end;
        }
    }
    let mut total = 0u64;
    while let Some(r) = set.join_next().await {
        total += r.map_err(|e| e.to_string())??;
    }
    Ok(total)
}

/// A figure and the CPU s/GB of its median run, with the rates of every round (for ratios paired
/// by round).
type Interleaved = ((Figure, f64), Vec<f64>);

/// Runs every function of `fs` once per round, in turn, for `runs` rounds, so that a machine's drift
/// and other load fall on all of them alike; each call returns bytes moved.
fn measure_interleaved(
    runs: usize,
    fs: &mut [&mut dyn FnMut() -> Result<u64, String>],
) -> Result<Vec<Interleaved>, String> {
    let mut rates = vec![Vec::new(); fs.len()];
    let mut cpus = vec![Vec::new(); fs.len()];
    for _ in 0..runs.max(1) {
        for (i, f) in fs.iter_mut().enumerate() {
            let c0 = cpu_time();
            let t0 = Instant::now();
            let bytes = f()?;
            let secs = t0.elapsed().as_secs_f64().max(1e-9);
            let cpu = (cpu_time() - c0).as_secs_f64();
            rates[i].push(bytes as f64 / secs / 1e9);
            cpus[i].push(if bytes > 0 {
                cpu / (bytes as f64 / 1e9)
            } else {
                0.0
            });
        }
    }
    Ok(rates
        .into_iter()
        .zip(cpus)
        .map(|(r, c)| {
            let mut idx: Vec<usize> = (0..r.len()).collect();
            idx.sort_by(|&a, &b| r[a].total_cmp(&r[b]));
            let cpu = idx.get(idx.len() / 2).map_or(0.0, |&i| c[i]);
            ((Figure::of(r.clone()), cpu), r)
        })
        .collect())
}

/// The median of `a[i] / b[i]` over the rounds.
fn paired_ratio(a: &[f64], b: &[f64]) -> f64 {
    let mut v: Vec<f64> = a
        .iter()
        .zip(b)
        .filter(|(_, y)| **y > 0.0)
        .map(|(x, y)| x / y)
        .collect();
    v.sort_by(|x, y| x.total_cmp(y));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn row(label: &str, (gbps, cpu): (Figure, f64), baseline: bool, note: &str) -> Row {
    Row {
        label: label.into(),
        gbps,
        cpu_s_per_gb: cpu,
        ratio: None,
        baseline,
        note: note.into(),
    }
}

/// The scenario's two tables.
pub fn run(ctx: &Ctx) -> Result<Vec<Table>, String> {
    let (port, _server, server) = start_server()?;
    let base = ctx.dir.join("object-store");
    let _ = std::fs::remove_dir_all(&base);
    let data = base.join("data");
    let bytes: u64 = if ctx.quick { 64 << 20 } else { 512 << 20 };
    let cfg = ubdirect_loader::config::DatasetSection::default();
    ubdirect_loader::dataset::generate(
        &data,
        ubdirect_loader::formats::Format::Raw,
        bytes / 4096,
        4,
        &cfg,
    )
    .map_err(|e| e.to_string())?;
    let s = store(port)?;
    let mut objects = Vec::new();
    ctx.rt.block_on(async {
        let mut files: Vec<_> = std::fs::read_dir(&data)
            .map_err(|e| e.to_string())?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "bin"))
            .collect();
        files.sort();
        for p in files {
            let name = p.file_name().map(|n| n.to_string_lossy().to_string());
            let loc = object_store::path::Path::from(format!("data/{}", name.unwrap_or_default()));
            let body = std::fs::read(&p).map_err(|e| e.to_string())?;
            let len = body.len() as u64;
            s.put(&loc, body.into()).await.map_err(|e| e.to_string())?;
            objects.push((loc, len));
        }
        Ok::<(), String>(())
    })?;
    let total: u64 = objects.iter().map(|(_, l)| l).sum();
    println!(
        "object-store: {} objects, {total} bytes on {server} at 127.0.0.1:{port}",
        objects.len()
    );
    let mut t = Table::new(&format!(
        "object store: s3:// epoch vs a plain ranged-GET client ({server}, loopback)"
    ));
    let range = 4u64 << 20;
    let ranges: usize = objects
        .iter()
        .map(|(_, l)| l.div_ceil(range) as usize)
        .sum();
    let s3_dir = format!("s3://{BUCKET}/data");
    // Calibration: N of 2..32 GETs in flight (none beyond the first N ≥ the number of ranges: more
    // is the same client), `ctx.runs` epochs each; the best median is N. This pass only chooses N:
    // the reference is measured again below, interleaved with the loader's epochs, so that the
    // choice (the largest of several noisy medians) does not inflate it.
    let mut best: Option<(usize, f64)> = None;
    for n in [2usize, 4, 8, 16, 32] {
        let f = measure(ctx.runs, || {
            ctx.rt.block_on(concurrent_gets(&s, &objects, range, n))
        })?;
        println!(
            "object-store: calibration, plain client, {n} GETs in flight: {:.3} GB/s",
            f.0.median
        );
        if best.is_none_or(|(_, b)| f.0.median > b) {
            best = Some((n, f.0.median));
        }
        if n >= ranges {
            break;
        }
    }
    let n_best = best.map_or(16, |(n, _)| n);
    let open = |loader_keys: &str, store_keys: &str| -> Result<_, String> {
        let c = ubdirect_loader::RunConfig::from_toml(
            &loader_config("host", &s3_dir, port, None, (loader_keys, store_keys)),
            "bench",
        )
        .map_err(|e| e.to_string())?;
        let loader = ubdirect_loader::Loader::from_config(&c).map_err(|e| e.to_string())?;
        println!("object-store: {}", loader.io_path());
        Ok::<_, String>(loader)
    };
    let default = open("", "")?;
    let small = open("min_read = \"256KiB\"\n", "min_read = 0\n")?;
    // A setting to compare in the same rounds (docs/benchmarks.md): more `[loader]` and
    // `[object_store]` keys for one more row.
    let variant_keys = (
        std::env::var("UBDIRECT_BENCH_VARIANT_LOADER").unwrap_or_default(),
        std::env::var("UBDIRECT_BENCH_VARIANT_STORE").unwrap_or_default(),
    );
    let variant = if variant_keys.0.is_empty() && variant_keys.1.is_empty() {
        None
    } else {
        Some(open(
            &format!("{}\n", variant_keys.0),
            &format!("{}\n", variant_keys.1),
        )?)
    };
    let sequential = || {
        ctx.rt.block_on(async {
            let mut n = 0u64;
            for (loc, len) in &objects {
                let mut at = 0;
                while at < *len {
                    let end = (at + range).min(*len);
                    n += s
                        .get_range(loc, at..end)
                        .await
                        .map_err(|e| e.to_string())?
                        .len() as u64;
                    at = end;
                }
            }
            Ok(n)
        })
    };
    // Every figure of this table in the same rounds, one epoch of each in turn.
    let (mut e_default, mut e_small, mut e_variant) = (0, 0, 0);
    let mut seq = sequential;
    let mut best = || {
        ctx.rt
            .block_on(concurrent_gets(&s, &objects, range, n_best))
    };
    let mut def = || {
        e_default += 1;
        epoch_bytes(&default, e_default)
    };
    let mut sm = || {
        e_small += 1;
        epoch_bytes(&small, e_small)
    };
    let mut var = || {
        e_variant += 1;
        variant
            .as_ref()
            .map_or(Ok(0), |v| epoch_bytes(v, e_variant))
    };
    let mut fs: Vec<&mut dyn FnMut() -> Result<u64, String>> =
        vec![&mut seq, &mut best, &mut def, &mut sm];
    if variant.is_some() {
        fs.push(&mut var);
    }
    let mut figs = measure_interleaved(ctx.runs, &mut fs)?.into_iter();
    drop(fs);
    let (Some(seq_f), Some(best_f), Some(default_f), Some(small_f)) =
        (figs.next(), figs.next(), figs.next(), figs.next())
    else {
        return Err("object-store: interleaved figures missing".to_string());
    };
    let variant_f = figs.next();
    drop((default, small, variant));
    let paired = |f: &Vec<f64>| paired_ratio(f, &best_f.1);
    t.rows.push(row(
        "plain client: 4 MiB ranged GETs, one at a time",
        seq_f.0,
        false,
        "object_store get_range",
    ));
    let best_label = "plain client: 4 MiB ranged GETs, best concurrency";
    t.rows.push(row(
        best_label,
        best_f.0,
        true,
        &format!(
            "object_store get_range, {n_best} in flight (best of 2..32 in a calibration pass; measured interleaved)"
        ),
    ));
    t.rows.push(row(
        "ubdirect s3:// epoch, no cache (default config)",
        default_f.0,
        false,
        &format!(
            "object_store.min_read 4 MiB: 4 MiB ranged GETs in flight, bodies into staging leases; paired by round {:.3}",
            paired(&default_f.1)
        ),
    ));
    t.rows.push(row(
        "ubdirect s3:// epoch, no cache, 256 KiB reads",
        small_f.0,
        false,
        &format!(
            "object_store.min_read = 0, loader.min_read 256 KiB (the defaults before); paired by round {:.3}",
            paired(&small_f.1)
        ),
    ));
    if let Some(f) = variant_f {
        t.rows.push(row(
            &format!(
                "ubdirect s3:// epoch, no cache, variant: {} {}",
                variant_keys.0.trim(),
                variant_keys.1.trim()
            ),
            f.0,
            false,
            &format!(
                "UBDIRECT_BENCH_VARIANT_LOADER / _STORE keys; paired by round {:.3}",
                paired(&f.1)
            ),
        ));
    }
    t.ratios_to(best_label);
    // Into GPU memory where there is one: the local shards' warm epochs copy out of the registered
    // page cache once the registrar ran, and so do the cache's (its chunks mapped as shards).
    let select = if ctx.cuda.is_some() { "cuda" } else { "host" };
    let mut h = Table::new(&format!(
        "object store: cache-hit epochs vs the same epoch from local files ({select} batches)"
    ));
    let local = ubdirect_loader::RunConfig::from_toml(
        &loader_config(
            select,
            &data.display().to_string(),
            port,
            None,
            ("min_read = \"4MiB\"\n", ""),
        ),
        "bench",
    )
    .map_err(|e| e.to_string())?;
    let local = ubdirect_loader::Loader::from_config(&local).map_err(|e| e.to_string())?;
    epoch_bytes(&local, 0)?;
    let cached = ubdirect_loader::RunConfig::from_toml(
        &loader_config(select, &s3_dir, port, Some(&base.join("cache")), ("", "")),
        "bench",
    )
    .map_err(|e| e.to_string())?;
    let cached = ubdirect_loader::Loader::from_config(&cached).map_err(|e| e.to_string())?;
    epoch_bytes(&cached, 0)?; // fills the cache
    let before = ubdirect_loader::objstore::stats();
    // Warm epochs of the quick dataset take ~10 ms: 5 rounds of each were 0.45–1.28× from one
    // invocation to the next. Interleaved, and 8 times the rounds.
    let (mut e_local, mut e_hit) = (0, 0);
    let figs = measure_interleaved(
        ctx.runs * 8,
        &mut [
            &mut || {
                e_local += 1;
                epoch_bytes(&local, e_local)
            },
            &mut || {
                e_hit += 1;
                epoch_bytes(&cached, e_hit)
            },
        ],
    )?;
    let after = ubdirect_loader::objstore::stats();
    let local_mapped = local.page_cache().map_or(0, |p| p.0);
    let (hit_mapped, hit_unmapped) = cached.page_cache_chunk_maps();
    drop((local, cached));
    let [local_f, hit_f] = <[_; 2]>::try_from(figs)
        .map_err(|_| "object-store: interleaved figures missing".to_string())?;
    // "Warm" is checked, not assumed: a machine whose kernel reclaims idle page cache (the
    // development VM drops a file's pages within a minute, with memory free) reads the baseline
    // from the disk, and the ratio then measures that.
    let (resident, shards) = resident_shards(&data);
    let warm = if resident == Some(shards) {
        String::new()
    } else if let Some(resident) = resident {
        println!(
            "object-store: only {resident} of {shards} local shard(s) wholly in the page cache after the rounds: the baseline was not warm"
        );
        format!("; NOT WARM: {resident} of {shards} shard(s) resident after the rounds")
    } else {
        "; warm not checked (no cachestat: Linux < 6.5)".to_string()
    };
    h.rows.push(row(
        "local files (warm)",
        local_f.0,
        true,
        &format!(
            "io_uring file source, {local_mapped} shard(s) mapped by the page-cache pool at the end; measured interleaved with the cache hits{warm}"
        ),
    ));
    h.rows.push(row(
        "s3:// epoch from the cache (hit)",
        hit_f.0,
        false,
        &format!(
            "{} bytes from the store during these epochs; {hit_mapped} object(s) mapped from their chunk files ({hit_unmapped} unmapped again); paired by round {:.3}",
            after.bytes_from_store - before.bytes_from_store,
            paired_ratio(&hit_f.1, &local_f.1)
        ),
    ));
    h.ratios_to("local files (warm)");
    Ok(vec![t, h])
}
