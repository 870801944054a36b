#!/usr/bin/env python3
"""Every pass at the link: what a user meets first. One `ubdirect run` process per epoch over warm
shards (a benchmark run, a job restarted from a checkpoint), the same with 3 epochs in one process,
KvikIO at its best thread count, and the pinned H2D ceiling, interleaved: every round runs every row
once, in the same order, and each row's figure is the median over rounds.

    python3 bench/peers/single_pass.py --dir /dev/shm/sp --gib 8 24 --sample 262144 4096 \
        --ubdirect target/release/ubdirect --rounds 3 --json out.json

Rows (per data size and sample size): the DEFAULT config first (only the dataset and
`select = "cuda"` set), `page_cache_budget = 0` (the staging path alone), `page_cache_register =
"eager"` (registration before the first batch, the 2026-11-30 default), the 2026-11-30 engine
(`eager` + io_uring buffered reads: `thread_copies = false`), then KvikIO with 16/32/64 threads
(256 KiB samples only: KvikIO reads whole shards). Each ubdirect row prints delivered GB/s, time to
first batch and CPU s/GB. `--epochs3` adds 3-epoch runs in one process (default, budget 0, eager):
the wall time of the whole run is the figure.

Shards are written (zeros, `dd`) when missing and read once to make them warm. KvikIO comes as
wheels (bench/peers/README.md); without it its rows are skipped, and said so.
"""
import argparse, json, os, statistics, subprocess, sys, time

from peerlib import kvikio_read, ubdirect_run


def write_shards(d, gib, shard_mib=256):
    os.makedirs(d, exist_ok=True)
    n = gib * 1024 // shard_mib
    paths = []
    for i in range(n):
        p = os.path.join(d, f"shard-{i:05d}.bin")
        if not os.path.exists(p) or os.path.getsize(p) != shard_mib << 20:
            subprocess.run(["dd", "if=/dev/zero", f"of={p}", "bs=16M", f"count={shard_mib // 16}", "status=none"], check=True)
        paths.append(p)
    return paths


def warm(paths):
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.read(64 << 20):
                pass


def h2d_ceiling():
    import torch
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8).pin_memory()
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(4):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 4 * n / (time.perf_counter() - t0) / 1e9


def ubdirect(binary, d, sample, extra, epochs=1, env=None):
    j, wall = ubdirect_run(binary, f'dir = "{d}"', sample, "cuda", extra, epochs, env)
    pc = j.get("page_cache") or {}
    return {"gb_per_s": j["epoch_gb_per_s"][0] if epochs == 1 else j["wall_gb_per_s"],
            "epochs_gb_per_s": j["epoch_gb_per_s"], "first_batch_s": j["time_to_first_batch_s"],
            "cpu_s_per_gb": j["cpu_s_per_gb"], "wall_s": wall, "paths": j.get("bytes_per_path"),
            "registrations": pc.get("registrations"), "register_s": pc.get("register_s"),
            "background": pc.get("background_registrations")}


CONFIGS = [
    ("ubdirect DEFAULT", ""),
    ("ubdirect budget 0 (staging only)", "[pool]\npage_cache_budget = 0"),
    ("ubdirect register eager", "[pool]\npage_cache_register = \"eager\""),
    ("ubdirect 2026-11-30 (eager, io_uring copies)", "[engine]\nthread_copies = false\n[pool]\npage_cache_register = \"eager\""),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/dev/shm/ubdirect-sp")
    ap.add_argument("--gib", type=int, nargs="+", default=[8, 24])
    ap.add_argument("--sample", type=int, nargs="+", default=[256 << 10, 4096])
    ap.add_argument("--ubdirect", default="target/release/ubdirect")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kvikio-threads", type=int, nargs="*", default=[16, 32, 64])
    ap.add_argument("--epochs3", action="store_true")
    ap.add_argument("--extra-config", action="append", default=[], help="NAME=TOML rows to add (\\n for newlines)")
    ap.add_argument("--base", type=int, default=len(CONFIGS), help="how many of the standard rows to run (DEFAULT first)")
    ap.add_argument("--epochs3-rows", type=int, default=3, help="how many of the standard rows get a 3-epoch run")
    ap.add_argument("--json")
    a = ap.parse_args()
    configs = CONFIGS[: a.base] + [tuple(e.split("=", 1)) for e in a.extra_config]
    configs = [(n, t.replace("\\n", "\n")) for n, t in configs]
    try:
        import kvikio  # noqa: F401
        have_kvikio = True
    except Exception as e:  # not installed: say so, never pretend
        print(f"KvikIO not available ({e}); its rows are skipped")
        have_kvikio = False
    ceiling = h2d_ceiling()
    print(f"pinned H2D ceiling: {ceiling:.1f} GB/s (1 GiB cuMemcpyHtoDAsync x4)")
    results = {}
    biggest = max(a.gib)
    allpaths = write_shards(a.dir, biggest)
    for gib in a.gib:
        d = a.dir if gib == biggest else f"{a.dir}-{gib}"
        if gib != biggest:
            os.makedirs(d, exist_ok=True)
            for p in allpaths[: gib * 4]:
                q = os.path.join(d, os.path.basename(p))
                if not os.path.exists(q):
                    os.symlink(p, q)
        paths = allpaths[: gib * 4]
        warm(paths)
        for sample in a.sample:
            rows = [(n, (lambda t: lambda: ubdirect(a.ubdirect, d, sample, t))(t)) for n, t in configs]
            if sample >= 256 << 10 and have_kvikio:
                for th in a.kvikio_threads:
                    rows.append((f"KvikIO compat {th} threads", (lambda th: lambda: kvikio_read(paths, th))(th)))
            if a.epochs3:
                for n, t in CONFIGS[: a.epochs3_rows]:
                    rows.append((f"3 epochs: {n}", (lambda t: lambda: ubdirect(a.ubdirect, d, sample, t, epochs=3))(t)))
            for r in range(a.rounds):
                for name, fn in rows:
                    try:
                        v = fn()
                    except Exception as e:
                        print(f"  {gib} GiB {sample} B {name}: FAILED {e}")
                        continue
                    results.setdefault((gib, sample, name), []).append(v)
                    print(f"  round {r} {gib} GiB {sample >> 10} KiB {name}: {v['gb_per_s']:.2f} GB/s wall {v['wall_s']:.2f} s "
                          f"first {v['first_batch_s']} cpu {v['cpu_s_per_gb']:.3f} s/GB {v.get('epochs_gb_per_s', '')} "
                          f"reg {v.get('registrations')} bg {v.get('background')} paths {v.get('paths')}", flush=True)
    print(f"\nmedians of {a.rounds} interleaved rounds; pinned H2D ceiling {ceiling:.1f} GB/s")
    print(f"{'data':>6} {'sample':>7} {'row':48} {'GB/s':>7} {'x H2D':>6} {'1st batch s':>11} {'CPU s/GB':>9} {'wall s':>7}")
    table = []
    for (gib, sample, name), vs in results.items():
        med = lambda k: statistics.median([v[k] for v in vs if v.get(k) is not None]) if any(v.get(k) is not None for v in vs) else float("nan")
        g, fb, cpu, wall = med("gb_per_s"), med("first_batch_s"), med("cpu_s_per_gb"), med("wall_s")
        print(f"{gib:>4}Gi {sample >> 10:>5}Ki {name:48} {g:7.2f} {g / ceiling:6.2f} {fb:11.2f} {cpu:9.3f} {wall:7.2f}")
        table.append({"gib": gib, "sample": sample, "row": name, "gb_per_s": g, "x_h2d": g / ceiling,
                      "first_batch_s": fb, "cpu_s_per_gb": cpu, "wall_s": wall, "runs": vs})
    if a.json:
        json.dump({"h2d": ceiling, "rows": table}, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
