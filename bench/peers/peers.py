#!/usr/bin/env python3
"""Peers, side by side on the same files in the same run: a PyTorch DataLoader, KvikIO, and
`ubdirect run`, each moving the shards into GPU memory, cold (page cache dropped with
posix_fadvise before each run) and warm. Prints a table and the ratios ubdirect / peer.

    python3 bench/peers/peers.py --dir /tmp/ubdirect-bench/epoch-4096 --ubdirect target/release/ubdirect

The GPU machine has no network: bring KvikIO as wheels (see bench/peers/README.md).
"""
import argparse, glob, json, os, statistics, subprocess, sys, tempfile, time

from peerlib import kvikio_read

def shards(d):
    s = sorted(glob.glob(os.path.join(d, "shard-*.bin")))
    if not s:
        sys.exit(f"no shard-*.bin in {d}: run `ubdirect-bench epoch --keep` first (it writes them; without --keep it removes them at the end)")
    return s

def drop(paths):
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)

def warm(paths):
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.read(16 << 20):
                pass

def total_bytes(paths):
    return sum(os.path.getsize(p) for p in paths)

def torch_dataloader(paths, sample, workers, batch):
    import torch
    from torch.utils.data import DataLoader, Dataset

    class Shards(Dataset):
        def __init__(self):
            self.index = [(p, o) for p in paths for o in range(0, os.path.getsize(p) - sample + 1, sample)]
            self.fds = {}
        def __len__(self):
            return len(self.index)
        def __getitem__(self, i):
            p, o = self.index[i]
            fd = self.fds.get(p)
            if fd is None:
                fd = self.fds[p] = os.open(p, os.O_RDONLY)
            return torch.frombuffer(bytearray(os.pread(fd, sample, o)), dtype=torch.uint8)

    ds = Shards()
    dl = DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers, pin_memory=True, drop_last=False)
    n = 0
    t0 = time.perf_counter()
    for b in dl:
        g = b.cuda(non_blocking=True)
        n += g.numel()
    torch.cuda.synchronize()
    return n / (time.perf_counter() - t0) / 1e9

def ubdirect(binary, d, sample, warm_run, rings):
    cfg = f"""
[dataset]
format = "raw"
dir = "{d}"
generate = false
dtype = "u8"
record_len = {sample}
[loader]
batch_size = 32
min_read = "4MiB"
max_read = "4MiB"
prefetch = {64 if warm_run else 32}
threads = 8
[device]
select = "cuda"
[engine]
rings = {rings}
queue_depth = {16 if warm_run else 64}
direct = "{'off' if warm_run else 'auto'}"
async_buffered = true
[pool]
staging_block_size = "{(4 << 20) + 65536}"
staging_blocks = 128
batch_block_size = "32MiB"
"""
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(cfg)
    out = subprocess.run([binary, "run", "--config", f.name, "--json"], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(out.stderr)
    return json.loads(out.stdout)["gb_per_s"]

def ubdirect_default(binary, d, sample, warm_run):
    """What a user runs: configs/default.toml with only the dataset and the GPU named. Cold: one
    epoch. Warm: two epochs in one process, the figure is the last epoch's (the first registers the
    page cache; its cost is in the wall figure printed beside it)."""
    cfg = f"""
[dataset]
format = "raw"
dir = "{d}"
generate = false
dtype = "u8"
record_len = {sample}
[device]
select = "cuda"
"""
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(cfg)
    epochs = "2" if warm_run else "1"
    out = subprocess.run([binary, "run", "--config", f.name, "--json", "--epochs", epochs], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(out.stderr)
    j = json.loads(out.stdout)
    print(f"  default config: first batch after {j['time_to_first_batch_s']:.2f} s, wall {j['wall_gb_per_s']:.2f} GB/s, "
          f"last epoch {j['last_epoch_gb_per_s']:.2f} GB/s, paths {j['bytes_per_path']}, page cache {j['page_cache']}")
    return j["last_epoch_gb_per_s"] if warm_run else j["gb_per_s"]

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--ubdirect", default="target/release/ubdirect")
    ap.add_argument("--sample", type=int, default=256 << 10)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    paths = shards(a.dir)
    print(f"{len(paths)} shards, {total_bytes(paths) >> 20} MiB, {a.sample >> 10} KiB samples, {a.runs} runs per figure")
    rings = max(1, min(8, (os.cpu_count() or 2) // 2))
    peers = [
        ("ubdirect (DEFAULT config)", lambda w: ubdirect_default(a.ubdirect, a.dir, a.sample, w)),
        ("ubdirect (tuned)", lambda w: ubdirect(a.ubdirect, a.dir, a.sample, w, rings if w else 2)),
        ("PyTorch DataLoader (8 workers, pin_memory)", lambda w: torch_dataloader(paths, a.sample, 8, 32)),
    ]
    try:
        import kvikio  # noqa: F401
        peers.append(("KvikIO (compat, 16 threads, 4 MiB tasks)", lambda w: kvikio_read(paths, 16, 4 << 20)["gb_per_s"]))
    except Exception as e:  # not installed: say so, never pretend
        print(f"KvikIO not available ({e}); its rows are skipped")
    results = {}
    for cond in ("cold", "warm"):
        for name, fn in peers:
            v = []
            for _ in range(a.runs):
                if cond == "cold":
                    drop(paths)
                else:
                    warm(paths)
                v.append(fn(cond == "warm"))
            results[(cond, name)] = (statistics.median(v), min(v), max(v))
    print(f"\n{'':46} {'cold GB/s':>22} {'warm GB/s':>22}")
    for name, _ in peers:
        c, w = results[("cold", name)], results[("warm", name)]
        print(f"{name:46} {c[0]:8.3f} [{c[1]:.2f}-{c[2]:.2f}] {w[0]:10.3f} [{w[1]:.2f}-{w[2]:.2f}]")
    u = {c: results[(c, "ubdirect (DEFAULT config)")][0] for c in ("cold", "warm")}
    print()
    for name, _ in peers[1:]:
        print(f"ubdirect (default) / {name}: cold {u['cold'] / results[('cold', name)][0]:.2f}x, warm {u['warm'] / results[('warm', name)][0]:.2f}x")
    if a.json:
        json.dump({f"{c}/{n}": r for (c, n), r in results.items()}, open(a.json, "w"), indent=1)

if __name__ == "__main__":
    main()
