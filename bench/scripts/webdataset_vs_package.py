#!/usr/bin/env python3
"""Samples/s of one epoch over WebDataset shards: ubdirect (the Python wheel, host batches) against the
`webdataset` package's own iteration, on the same shards in the same run (warm page cache), medians
of --runs. Each sample is a 1 KiB `jpg` and a `cls`; both sides deliver every sample's two parts as
bytes in file order (shuffle off; ubdirect also with its shuffle on).

    pip install ./python 'webdataset==1.0.2'
    python3 bench/scripts/webdataset_vs_package.py [--samples 100000] [--shards 8] [--runs 3]

ubdirect figures are given twice: the epoch of an open loader (a training run opens it once for all its
epochs), and the epoch with the opening (the index: a header scan, or the sidecar read back; the
pools: allocated and locked). The package opens its shards in its iteration: one figure. "touch"
variants also read each sample's parts in Python (`batch.parts(i)` and a slice per part), as a
consumer handling samples one by one would."""
import argparse
import io
import json
import os
import statistics
import tarfile
import time

import numpy as np


def write(d, samples, shards):
    os.makedirs(d, exist_ok=True)
    paths = [os.path.join(d, f"shard-{s:05}.tar") for s in range(shards)]
    if all(os.path.exists(p) for p in paths) and os.path.exists(os.path.join(d, "done")):
        return paths
    rng = np.random.default_rng(0)
    per = -(-samples // shards)
    k = 0
    for p in paths:
        with tarfile.open(p, "w", format=tarfile.GNU_FORMAT) as t:
            for _ in range(min(per, samples - k)):
                for ext, data in (("jpg", rng.bytes(1024)), ("cls", str(k % 1000).encode())):
                    ti = tarfile.TarInfo(f"{k:09}.{ext}")
                    ti.size = len(data)
                    t.addfile(ti, io.BytesIO(data))
                k += 1
    open(os.path.join(d, "done"), "w").close()
    return paths


def warm(paths):
    for p in paths:
        with open(p, "rb") as f:
            while f.read(1 << 24):
                pass


def run_wds(paths):
    import webdataset as wds

    n = nbytes = 0
    t = time.perf_counter()
    for s in wds.WebDataset(paths, shardshuffle=False, empty_check=False):
        nbytes += len(s["jpg"]) + len(s["cls"])
        n += 1
    return n, (time.perf_counter() - t,), nbytes


def run_ub(paths, batch, shuffle, touch):
    import ubdirect

    cfg = {
        "dataset": {"format": "webdataset", "paths": paths, "generate": False,
                    "columns": ["jpg", "cls"]},
        "device": {"select": "host"},
        "loader": {"batch_size": batch, "shuffle": shuffle, "remainder": "pad", "seed": 1},
    }
    n = nbytes = 0
    t0 = time.perf_counter()
    loader = ubdirect.Loader(cfg)
    t = time.perf_counter()
    for b in loader.epoch(0):
        buf = np.from_dlpack(b)
        k = len(b.ids)
        if touch:
            for i in range(k):
                for off, ln in b.parts(i):
                    nbytes += len(buf[off:off + ln])
        else:
            nbytes += int(b.lengths.sum())
        n += k
    end = time.perf_counter()
    return n, (end - t, end - t0), nbytes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/ubdirect-bench/webdataset")
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--json")
    a = ap.parse_args()
    paths = write(a.dir, a.samples, a.shards)
    warm(paths)
    cases = {
        "webdataset package": lambda: run_wds(paths),
        "ubdirect (shuffle off)": lambda: run_ub(paths, a.batch, False, False),
        "ubdirect (shuffle on)": lambda: run_ub(paths, a.batch, True, False),
        "ubdirect (shuffle off, touch every part)": lambda: run_ub(paths, a.batch, False, True),
    }
    out = {}
    for r in range(a.runs):  # interleaved: each run of each case sees the same machine state
        for name, f in cases.items():
            n, secs, nbytes = f()
            assert n >= a.samples, (name, n)
            out.setdefault(name, []).append(n / secs[0])
            if len(secs) > 1:
                out.setdefault(f"{name} + open", []).append(n / secs[1])
    base = statistics.median(out["webdataset package"])
    print(f"{a.samples} samples (1 KiB jpg + cls) in {a.shards} shards, median of {a.runs} runs:")
    for name, v in out.items():
        m = statistics.median(v)
        print(f"  {name:49s} {m:12,.0f} samples/s  [{min(v):,.0f}-{max(v):,.0f}]  {m / base:6.1f} x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({k: {"median": statistics.median(v), "runs": v} for k, v in out.items()}, f)


if __name__ == "__main__":
    main()
