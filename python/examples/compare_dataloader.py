"""Samples/s of `ubdirect.Loader` (batches via DLPack: CUDA tensors on a GPU, host tensors otherwise)
next to a PyTorch DataLoader (map-style, `--workers` workers; on a GPU pin_memory and
.cuda(non_blocking=True)) on the same raw token shards. Runs on a machine without a GPU too.

    python3 python/examples/compare_dataloader.py DIR [--record-bytes 4096] [--batch 64] [--workers N]
"""
import argparse
import glob
import os
import time

import torch
from torch.utils.data import DataLoader, Dataset

import ubdirect


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--record-bytes", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    paths = sorted(glob.glob(os.path.join(a.dir, "*.bin")))
    rb = a.record_bytes

    class Shards(Dataset):
        def __init__(self):
            self.index = [(p, o) for p in paths for o in range(0, os.path.getsize(p) - rb + 1, rb)]
            self.fds = {}

        def __len__(self):
            return len(self.index)

        def __getitem__(self, i):
            p, o = self.index[i]
            fd = self.fds.get(p) or self.fds.setdefault(p, os.open(p, os.O_RDONLY))
            return torch.frombuffer(bytearray(os.pread(fd, rb, o)), dtype=torch.uint8)

    cfg = {"dataset": {"format": "raw", "dir": a.dir, "generate": False, "dtype": "u8", "record_len": rb},
           "loader": {"batch_size": a.batch}, "device": {"select": "cuda" if cuda else "host"}}
    loader = ubdirect.Loader(cfg)
    dl = DataLoader(Shards(), batch_size=a.batch, shuffle=True, num_workers=a.workers, pin_memory=cuda,
                    persistent_workers=a.workers > 0)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for e in range(a.epochs):
        t0, n = time.perf_counter(), 0
        for b in loader.epoch(e):
            x = torch.from_dlpack(b)
            n += len(b)
        sync()
        u = n / (time.perf_counter() - t0)
        t0, m = time.perf_counter(), 0
        for b in dl:
            x = b.cuda(non_blocking=True) if cuda else b
            m += x.shape[0]
        sync()
        d = m / (time.perf_counter() - t0)
        print(f"epoch {e}: ubdirect {u:,.0f} samples/s, PyTorch DataLoader {d:,.0f} samples/s ({u / d:.1f}x), {rb} B samples, batch {a.batch}, {'cuda' if cuda else 'host'}, {a.workers} DataLoader workers")


if __name__ == "__main__":
    main()
