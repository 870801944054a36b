#!/usr/bin/env python3
"""One rank's peer figure for bench/scripts/ranks.sh, started once per rank (or GPU) at the same time:

    rank_peer.py kvikio --dir D --rank R --ranks N --device G [--epochs E]   # KvikIO reads its shards
    rank_peer.py h2d --device G [--seconds S]                                 # pinned H2D ceiling

`kvikio`: KvikIO in compat mode (16 threads, 4 MiB tasks) reads the shards `i ≡ R (mod N)` of D
(`*.bin`, sorted) into CuPy buffers on GPU G, E times — the same bytes a rank of `ubdirect run` with
world size N delivers. `h2d`: 256 MiB pinned → device copies on GPU G for S seconds (the link's
ceiling while the other GPUs copy too). Each prints one JSON line: bytes, seconds, GB/s.
"""
import argparse, glob, json, os, sys, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def kvikio_rank(a):
    import cupy
    from peerlib import kvikio_read

    cupy.cuda.Device(a.device).use()
    paths = sorted(glob.glob(os.path.join(a.dir, "*.bin")))[a.rank::a.ranks]
    t0 = time.perf_counter()
    n = 0
    for _ in range(a.epochs):
        r = kvikio_read(paths, 16)
        n += r["gb_per_s"] * r["wall_s"] * 1e9
    dt = time.perf_counter() - t0
    return {"bytes": n, "seconds": dt, "gb_per_s": n / dt / 1e9}


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
    ap.add_argument("mode", choices=["kvikio", "h2d"])
    ap.add_argument("--dir")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=3.0)
    a = ap.parse_args()
    print(json.dumps(kvikio_rank(a) if a.mode == "kvikio" else h2d(a)))


if __name__ == "__main__":
    main()
