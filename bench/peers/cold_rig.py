#!/usr/bin/env python3
"""Cold epochs at array speed: shards on ext4 over tmpfs-backed loop devices
(bench/scripts/loop_rig.sh), the page cache dropped before every run, interleaved rounds, medians.

    sudo python3 bench/peers/cold_rig.py --devices 4 --shards 16 --select cuda --ubdirect target/release/ubdirect

Rows: the O_DIRECT ceiling (one `dd iflag=direct bs=4M` per shard, all at once), the buffered fill
ceiling (the same `dd`s through the page cache), the fill without a copy to user space (`mmap` +
`MADV_POPULATE_READ`), with CUDA batches the O_DIRECT reads plus the copy to the GPU that a loader
also makes (a thread per shard, 2 or 4 pinned buffers each: CuPy), ubdirect's DEFAULT
config (one process, one epoch; and 2 epochs, whose second shows whether the first left the shards
warm), ubdirect with `page_cache_budget = 0` (O_DIRECT alone), and KvikIO (compat mode, 16 threads)
when it imports. Root only (loop devices, drop_caches); the rig is taken down at the end, also on
error. `--on-disk DIR` writes the shards to DIR on a real disk instead (no rig; removed at the end).
"""
import argparse, json, os, statistics, subprocess, sys, time

from peerlib import closed_loop, drop_caches, kvikio_read, odirect_h2d, populate_fill, ubdirect_run

HERE = os.path.dirname(os.path.abspath(__file__))
RIG = os.path.join(HERE, "..", "scripts", "loop_rig.sh")


def dd_ceiling(paths):
    t0 = time.perf_counter()
    procs = [subprocess.Popen(["dd", f"if={p}", "of=/dev/null", "bs=4M", "iflag=direct", "status=none"]) for p in paths]
    for p in procs:
        if p.wait() != 0:
            raise RuntimeError("dd failed")
    dt = time.perf_counter() - t0
    return {"gb_per_s": sum(os.path.getsize(p) for p in paths) / dt / 1e9, "cpu_s_per_gb": None, "epochs": None}


def dd_buffered(paths):
    """The page cache's fill ceiling: one buffered `dd bs=4M` per shard, all at once (each file in
    order, so the kernel's read-ahead sees sequential reads: the best case for a buffered fill)."""
    t0 = time.perf_counter()
    procs = [subprocess.Popen(["dd", f"if={p}", "of=/dev/null", "bs=4M", "status=none"]) for p in paths]
    for p in procs:
        if p.wait() != 0:
            raise RuntimeError("dd failed")
    dt = time.perf_counter() - t0
    return {"gb_per_s": sum(os.path.getsize(p) for p in paths) / dt / 1e9, "cpu_s_per_gb": None, "epochs": None}


def ubdirect(binary, paths, sample, select, extra, epochs=1):
    plist = ", ".join(f'"{p}"' for p in paths)
    j, _ = ubdirect_run(binary, f"paths = [{plist}]", sample, select, extra, epochs)
    return {"gb_per_s": j["epoch_gb_per_s"][0], "epochs": j["epoch_gb_per_s"], "cpu_s_per_gb": j["cpu_s_per_gb"],
            "paths": j.get("bytes_per_path"), "first_batch_s": j["time_to_first_batch_s"],
            "epoch_start_s": (j.get("epoch_start_s") or [None])[0],
            "cold_staging": (j.get("cold_staging_blocks"), j.get("cold_staging_epochs"))}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--gib-per-device", type=int, default=0, help="0: just enough for the shards")
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--shard-mib", type=int, default=256)
    ap.add_argument("--sample", type=int, default=256 << 10)
    ap.add_argument("--select", default="cuda")
    ap.add_argument("--ubdirect", default="target/release/ubdirect")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--extra-config", action="append", default=[], help="NAME=TOML (\\n for newlines; a NAME ending in '2 epochs' runs two)")
    ap.add_argument("--json")
    ap.add_argument("--on-disk", help="a directory on a real disk: the shards are written there, no loop rig")
    ap.add_argument("--closed-loop", type=int, action="append", default=[],
                    help="N: rows of O_DIRECT reads N at a time, shuffled and balanced over the devices")
    ap.add_argument("--read-ahead-kb", type=int, help="the loop devices' read_ahead_kb (default: the kernel's, 128)")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("cold_rig.py: needs root (loop devices, drop_caches)")
    per_dev = -(-a.shards // a.devices)
    gib = a.gib_per_device or max(1, -(-(per_dev * a.shard_mib * 110 // 100) // 1024))
    if a.on_disk:
        os.makedirs(a.on_disk, exist_ok=True)
        mounts = [a.on_disk]
    else:
        env = {**os.environ, **({"READ_AHEAD_KB": str(a.read_ahead_kb)} if a.read_ahead_kb else {})}
        up = subprocess.run(["bash", RIG, "up", str(a.devices), str(gib)], capture_output=True, text=True, env=env)
        if up.returncode != 0:
            sys.exit(f"rig: {up.stderr}")
        mounts = up.stdout.split()
    paths = []
    try:
        for i in range(a.shards):
            p = os.path.join(mounts[i % len(mounts)], f"shard-{i:05d}.bin")
            subprocess.run(["dd", "if=/dev/urandom", f"of={p}", "bs=16M", f"count={a.shard_mib // 16}", "status=none"], check=True)
            paths.append(p)
        rows = [("O_DIRECT ceiling (dd 4 MiB, every shard at once)", lambda: dd_ceiling(paths)),
                ("buffered fill ceiling (dd 4 MiB through the page cache, every shard at once)", lambda: dd_buffered(paths)),
                ("page-cache fill, no copy to user (mmap + MADV_POPULATE_READ, a thread per shard)", lambda: populate_fill(paths)),
                ("ubdirect DEFAULT, 1 epoch", lambda: ubdirect(a.ubdirect, paths, a.sample, a.select, "")),
                ("ubdirect DEFAULT, 2 epochs (first cold)", lambda: ubdirect(a.ubdirect, paths, a.sample, a.select, "", epochs=2)),
                ("ubdirect page_cache_budget = 0 (O_DIRECT)", lambda: ubdirect(a.ubdirect, paths, a.sample, a.select, "[pool]\npage_cache_budget = 0"))]
        for n in a.closed_loop:
            for bal in (False, True):
                rows.append((f"O_DIRECT, {n} reads in flight, {'balanced over the devices' if bal else 'shuffled order'}",
                             (lambda n, bal: lambda: closed_loop(paths, n, bal))(n, bal)))
        for e in a.extra_config:
            n, t = e.split("=", 1)
            ep = 2 if n.endswith("2 epochs") else 1
            rows.append((n, (lambda t, ep: lambda: ubdirect(a.ubdirect, paths, a.sample, a.select, t.replace("\\n", "\n"), epochs=ep))(t, ep)))
        if a.select == "cuda":
            try:
                import cupy  # noqa: F401
                for depth in (2, 4):
                    rows.insert(2, (f"O_DIRECT + copy to the GPU (a thread per shard, {depth} pinned 4 MiB buffers each)",
                                    (lambda d: lambda: odirect_h2d(paths, depth=d))(depth)))
            except Exception as e:
                print(f"CuPy not available ({e}); the O_DIRECT + copy ceiling is skipped")
        try:
            import kvikio  # noqa: F401
            if a.select == "cuda":
                rows.append(("KvikIO compat 16 threads", lambda: kvikio_read(paths, 16)))
        except Exception as e:
            print(f"KvikIO not available ({e}); its row is skipped")
        results = {}
        for r in range(a.rounds):
            for name, fn in rows:
                drop_caches()
                try:
                    v = fn()
                except Exception as e:
                    print(f"  round {r} {name}: FAILED {e}", flush=True)
                    continue
                v["round"] = r
                results.setdefault(name, []).append(v)
                print(f"  round {r} {name}: {v['gb_per_s']:.2f} GB/s epochs {v.get('epochs')} cpu {v.get('cpu_s_per_gb')} paths {v.get('paths')} cold staging {v.get('cold_staging')} start {v.get('epoch_start_s')} first batch {v.get('first_batch_s')}", flush=True)
        ceiling = statistics.median(v["gb_per_s"] for v in results.get(rows[0][0], [{"gb_per_s": float("nan")}]))
        total = a.shards * a.shard_mib
        where = f"on {a.on_disk}" if a.on_disk else f"{a.devices} loop devices"
        print(f"\n{where}, {a.shards} x {a.shard_mib} MiB = {total} MiB, {a.sample} B samples, {a.select}; medians of {a.rounds} interleaved rounds")
        by_round = {v["round"]: v["gb_per_s"] for v in results.get(rows[0][0], [])}
        print(f"{'row':52} {'GB/s':>7} {'x ceiling':>9} {'paired':>7} {'CPU s/GB':>9} {'2nd epoch':>9}")
        table = []
        for name, vs in results.items():
            g = statistics.median(v["gb_per_s"] for v in vs)
            cpu = [v["cpu_s_per_gb"] for v in vs if v.get("cpu_s_per_gb") is not None]
            e2 = [v["epochs"][1] for v in vs if v.get("epochs") and len(v["epochs"]) > 1]
            cpu_m = statistics.median(cpu) if cpu else float("nan")
            e2_m = statistics.median(e2) if e2 else float("nan")
            # Each run against its own round's ceiling (the rig's ceiling moves between rounds).
            pr = [v["gb_per_s"] / by_round[v["round"]] for v in vs if by_round.get(v["round"])]
            paired = statistics.median(pr) if pr else float("nan")
            print(f"{name:52} {g:7.2f} {g / ceiling:9.2f} {paired:7.2f} {cpu_m:9.3f} {e2_m:9.2f}")
            table.append({"row": name, "gb_per_s": g, "x_ceiling": g / ceiling, "paired_x_ceiling": paired, "cpu_s_per_gb": cpu_m, "second_epoch": e2_m, "runs": vs})
        if a.json:
            json.dump({"ceiling": ceiling, "rows": table}, open(a.json, "w"), indent=1)
    finally:
        if a.on_disk:
            for p in paths:
                os.unlink(p)
        else:
            subprocess.run(["bash", RIG, "down"])


if __name__ == "__main__":
    main()
