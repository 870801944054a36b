#!/usr/bin/env python3
"""Object-cache hits into the GPU against the same epochs from local files (docs/benchmarks.md,
"2026-12-02, set 4"): `ubdirect run --json`, `device.select = "cuda"` (`--device host` on a machine without one)`, 6 epochs per
process, one process per row and round, rows interleaved, medians. s3s-fs on loopback (CPUs 8-15,
the loader on 0-7) serves 16 x 256 MiB of random shards; the cache is filled once before the rounds.

    python3 object_cache_gpu.py --ubdirect PATH --s3s-fs PATH [--baseline PATH] [--rounds 3]
"""
import argparse, json, os, socket, statistics, subprocess, sys, time
ap = argparse.ArgumentParser()
ap.add_argument("--ubdirect", required=True)
ap.add_argument("--s3s-fs", required=True)
ap.add_argument("--baseline", help="another ubdirect build, run on the cache-hit row too")
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--diag", action="store_true", help="also the copy path from local files, and both sources registering without rest (UBDIRECT_REGISTER_REST=0)")
ap.add_argument("--rows", help="only the rows whose names contain one of these comma-separated words")
ap.add_argument("--work", default="/tmp/object-cache-gpu")
ap.add_argument("--device", default="cuda", help="device.select (host: the development machine, no GPU)")
ap.add_argument("--shards", type=int, default=16, help="shards (objects)")
ap.add_argument("--shard-mib", type=int, default=256, help="MiB a shard (s3s-fs hashes the whole object per GET: smaller objects for small chunks)")
ap.add_argument("--chunk-size", default="", help="cache.chunk_size (default: the config's, 8 MiB)")
ap.add_argument("--taskset", default="0-7,8-15", help="CPUs of the loader and of s3s-fs ('' : no pinning)")
args = ap.parse_args()
OUT = os.environ.get("OUT", "/tmp")
W = args.work
UBD = os.path.abspath(args.ubdirect)
subprocess.run(["rm", "-rf", W])
os.makedirs(f"{W}/root/bench/ds")
SHARDS, SIZE = args.shards, args.shard_mib << 20
PIN = args.taskset.split(",") if args.taskset else None
pin = lambda i: ["taskset", "-c", PIN[i]] if PIN else []
for i in range(SHARDS):
    subprocess.run(["dd", "if=/dev/urandom", f"of={W}/root/bench/ds/shard-{i:03}.bin", "bs=1M", f"count={args.shard_mib}", "status=none"], check=True)
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
srv = subprocess.Popen(pin(1) + [os.path.abspath(args.s3s_fs), "--host", "127.0.0.1", "--port", str(port),
                        "--access-key", "bench", "--secret-key", "bench", f"{W}/root"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
for _ in range(300):
    try:
        socket.create_connection(("127.0.0.1", port)).close(); break
    except OSError:
        time.sleep(0.1)

def cfg(name, dataset, rec, extra=""):
    t = f"""[dataset]
format = "raw"
dir = "{dataset}"
generate = false
dtype = "u16"
record_len = {rec}
[loader]
epochs = 6
[device]
select = "{args.device}"
[remote]
deadline_ms = 120000
[object_store]
endpoint = "http://127.0.0.1:{port}"
allow_http = true
region = "us-east-1"
access_key_id = "bench"
secret_access_key = "bench"
[cache]
dir = "{W}/cache"
{f'chunk_size = "{args.chunk_size}"' if args.chunk_size else ""}
{extra}"""
    p = f"{W}/{name}.toml"
    open(p, "w").write(t)
    return p

def run(p, tag, ubd=UBD, env=None):
    t = time.time()
    o = subprocess.run(pin(0) + [ubd, "run", "--json", "--config", p], capture_output=True, text=True, timeout=300,
                       env={**os.environ, **(env or {})})
    if o.returncode != 0:
        print(f"{tag}: FAILED {o.stderr[-2000:]}", flush=True)
        return None
    v = json.loads(o.stdout)
    if os.environ.get("UBDIRECT_LOG"):  # phase timings (e.g. ubdirect_loader::epoch=debug) beside the figures
        print("\n".join(f"{tag} | {l[-400:]}" for l in o.stderr.splitlines() if "ubdirect_loader" in l), flush=True)
    pc = v.get("page_cache") or {}
    st = v.get("object_store") or {}
    r = dict(epochs=[round(x, 1) for x in v["epoch_gb_per_s"]], wall=round(v["wall_gb_per_s"], 1), cpu=round(v["cpu_s_per_gb"], 3),
             mapped=pc.get("mapped_shards"), regs=pc.get("registrations"), register_s=pc.get("register_s"), chunk_maps=pc.get("object_chunks_mapped"),
             ttfb=round(v.get("time_to_first_batch_s", 0), 3), e1_start=round((v.get("epoch_start_s") or [0])[0], 4), starts=[round(x, 5) for x in v.get("epoch_start_s") or []], staged=pc.get("object_chunks_staged"), startup=[(k, round(t, 3)) for k, t in v.get("startup_s", [])],
             paths={x["path"]: x["bytes"] for x in v.get("bytes_per_path", []) if x.get("bytes")} if isinstance(v.get("bytes_per_path"), list) else v.get("bytes_per_path"),
             store=st.get("bytes_from_store"), fallbacks=[f.get("kind") for f in v.get("fallbacks", [])], secs=round(time.time() - t, 1),
             # each epoch's share of bytes copied out of registered mappings (the ramp)
             mapped_share=[round(sum(x["bytes"] for x in e if x["path"] == "mapped") / max(1, sum(x["bytes"] for x in e)), 2)
                           for e in v.get("epoch_bytes_per_path", [])])
    print(f"{tag}: {json.dumps(r)}", flush=True)
    return r

res = {}
for rec in (2048, 131072):
    local = cfg(f"local-{rec}", f"{W}/root/bench/ds", rec)
    s3 = cfg(f"s3-{rec}", "s3://bench/ds", rec)
    never = cfg(f"s3never-{rec}", "s3://bench/ds", rec, '[pool]\npage_cache_register = "never"\n')
    local_never = cfg(f"localnever-{rec}", f"{W}/root/bench/ds", rec, '[pool]\npage_cache_register = "never"\n')
    local_eager = cfg(f"localeager-{rec}", f"{W}/root/bench/ds", rec, '[pool]\npage_cache_register = "eager"\n')
    s3_eager = cfg(f"s3eager-{rec}", "s3://bench/ds", rec, '[pool]\npage_cache_register = "eager"\n')
    if rec == 2048:
        run(s3, "fill")
    for r in range(args.rounds):
        rows = [("local", local, UBD, None), ("s3 cache hits (default)", s3, UBD, None)]
        if args.baseline:
            rows.append(("s3 cache hits (default), baseline build", s3, os.path.abspath(args.baseline), None))
        rows.append(("s3 cache hits, never mapped", never, UBD, None))
        if args.diag:
            rest0 = {"UBDIRECT_REGISTER_REST": "0"}
            rows += [("local, never mapped", local_never, UBD, None), ("local, registrar without rest", local, UBD, rest0),
                     ("s3 cache hits, registrar without rest", s3, UBD, rest0),
                     ("local, eager", local_eager, UBD, None), ("s3 cache hits, eager", s3_eager, UBD, None)]
        if args.rows:
            rows = [r for r in rows if any(w in r[0] for w in args.rows.split(","))]
        for name, p, ubd, env in rows:
            x = run(p, f"rec {rec * 2} B round {r} {name}", ubd, env)
            if x:
                res.setdefault((rec, name), []).append(x)
print("=== medians (epochs 3-6 = steady state; epoch 1 = first pass of the process)")
for (rec, name), xs in res.items():
    ss = statistics.median([statistics.median(x["epochs"][2:]) for x in xs])
    e1 = statistics.median([x["epochs"][0] for x in xs])
    wall = statistics.median([x["wall"] for x in xs])
    cpu = statistics.median([x["cpu"] for x in xs])
    m1 = statistics.median([x["mapped_share"][0] for x in xs if x.get("mapped_share")] or [float("nan")])
    reg = statistics.median([x["register_s"] or 0 for x in xs])
    ttfb = statistics.median([x["ttfb"] for x in xs])
    e1s = statistics.median([x.get("e1_start", 0) for x in xs])
    print(f"rec {rec*2:>7} B  {name:<40} registering {reg:.3f} s  first batch {ttfb:.3f} s  epoch 1 start {e1s:.4f} s")
    print(f"rec {rec*2:>7} B  {name:<40} epoch1 {e1:6.1f}  steady {ss:6.1f}  wall {wall:6.1f} GB/s  cpu {cpu} s/GB  epoch1 mapped {m1:.2f}  n={len(xs)}")
json.dump({f"{k[0]}|{k[1]}": v for k, v in res.items()}, open(f"{OUT}/object_cache_gpu.json", "w"))
srv.kill()
