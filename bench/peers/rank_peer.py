#!/usr/bin/env python3
"""One rank's peer figure for bench/scripts/ranks.sh, started once per rank (or GPU) at the same time:

    rank_peer.py kvikio --dir D --rank R --ranks N --device G [--epochs E]   # KvikIO reads its shards
    rank_peer.py h2d --device G [--seconds S]                                 # pinned H2D ceiling
    rank_peer.py ubdirect --dir D --rank R --ranks N --device G [--epochs E] --barrier B

`kvikio`: KvikIO in compat mode (16 threads, 4 MiB tasks) reads the shards `i ≡ R (mod N)` of D
(`*.bin`, sorted) into CuPy buffers on GPU G, E times — the same bytes a rank of `ubdirect run` with
world size N delivers. `h2d`: 256 MiB pinned → device copies on GPU G for S seconds (the link's
ceiling while the other GPUs copy too). `ubdirect`: a training rank as it meets the loader — the
process's CUDA context made first (by PyTorch, as a training script does), then, once every rank of
the barrier directory B has its context, the loader built (`ubdirect.Loader`, RANK/WORLD_SIZE/
LOCAL_WORLD_SIZE from the arguments) and E epochs of 256 KiB records of D delivered as CUDA batches;
start and end are wall-clock times, so a driver can take the node's aggregate over the slowest rank
(bench/peers/ranks_ctx.py). `kvikio` with `--barrier` waits the same way after its buffers exist.
Each prints one JSON line: bytes, seconds, GB/s.
"""
import argparse, glob, json, os, sys, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def barrier(a):
    """Every rank of the barrier directory ready (a file each), then go: no rank's start-up work
    overlaps another's context creation."""
    if not a.barrier:
        return
    open(os.path.join(a.barrier, f"ready.{a.rank}"), "w").close()
    while len(glob.glob(os.path.join(a.barrier, "ready.*"))) < a.ranks:
        time.sleep(0.001)


def kvikio_rank(a):
    import cupy
    from peerlib import kvikio_read

    cupy.cuda.Device(a.device).use()
    cupy.zeros(1)
    paths = sorted(glob.glob(os.path.join(a.dir, "*.bin")))[a.rank::a.ranks]
    barrier(a)
    start, t0 = time.time(), time.perf_counter()
    n = 0
    for _ in range(a.epochs):
        r = kvikio_read(paths, 16)
        n += r["gb_per_s"] * r["wall_s"] * 1e9
    dt = time.perf_counter() - t0
    return {"bytes": n, "start": start, "end": start + dt, "seconds": dt, "gb_per_s": n / dt / 1e9}


def ubdirect_rank(a):
    import torch

    torch.cuda.set_device(a.device)
    torch.zeros(1, device="cuda")  # the training process's own context, made before the loader
    import ubdirect

    os.environ.update(RANK=str(a.rank), WORLD_SIZE=str(a.ranks), LOCAL_WORLD_SIZE=str(a.ranks), LOCAL_RANK=str(a.device))
    cfg = {"dataset": {"format": "raw", "dir": a.dir, "generate": False, "dtype": "u8", "record_len": 262144},
           "device": {"select": "cuda"}, "loader": {"epochs": a.epochs}}
    for kv in a.set or []:  # SECTION.KEY=INT, e.g. pool.staging_blocks=12
        k, v = kv.split("=", 1)
        sec, key = k.split(".", 1)
        cfg.setdefault(sec, {})[key] = int(v)
    barrier(a)
    start = time.time()
    loader = ubdirect.Loader(cfg)
    built = time.time()
    n = first = 0
    for e in range(a.epochs):
        for b in loader.epoch(e):
            first = first or time.time()
            n += b.nbytes
            del b
    torch.cuda.synchronize()
    end = time.time()
    return {"bytes": n, "start": start, "end": end, "seconds": end - start, "gb_per_s": n / (end - start) / 1e9,
            "built_s": built - start, "first_batch_s": first - start, "data_gb_per_s": n / (end - built) / 1e9}


def h2d(a):
    import torch

    dev = torch.device("cuda", a.device)
    src = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
    dst = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    s = torch.cuda.Stream(dev)
    with torch.cuda.stream(s):
        dst.copy_(src, non_blocking=True)
    s.synchronize()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < a.seconds:
        with torch.cuda.stream(s):
            for _ in range(8):
                dst.copy_(src, non_blocking=True)
        s.synchronize()
        n += 8 * (256 << 20)
    dt = time.perf_counter() - t0
    return {"bytes": n, "seconds": dt, "gb_per_s": n / dt / 1e9}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["kvikio", "h2d", "ubdirect"])
    ap.add_argument("--barrier", help="a directory every rank of the run marks ready in, then waits for all")
    ap.add_argument("--set", action="append", help="ubdirect: SECTION.KEY=INT config settings")
    ap.add_argument("--dir")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=3.0)
    a = ap.parse_args()
    print(json.dumps({"kvikio": kvikio_rank, "h2d": h2d, "ubdirect": ubdirect_rank}[a.mode](a)))


if __name__ == "__main__":
    main()
