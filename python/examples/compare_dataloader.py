"""Samples/s of `ubdirect.Loader` (batches as CUDA tensors via DLPack) next to a PyTorch DataLoader
(map-style, 8 workers, pin_memory, .cuda(non_blocking=True)) on the same raw token shards.

    python3 python/examples/compare_dataloader.py DIR [--record-bytes 4096] [--batch 64]
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
    a = ap.parse_args()
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
           "loader": {"batch_size": a.batch}, "device": {"select": "cuda"}}
    loader = ubdirect.Loader(cfg)
    dl = DataLoader(Shards(), batch_size=a.batch, shuffle=True, num_workers=8, pin_memory=True, persistent_workers=True)
    for e in range(a.epochs):
        t0, n = time.perf_counter(), 0
        for b in loader.epoch(e):
            x = torch.from_dlpack(b)
            n += len(b)
        torch.cuda.synchronize()
        u = n / (time.perf_counter() - t0)
        t0, m = time.perf_counter(), 0
        for b in dl:
            x = b.cuda(non_blocking=True)
            m += x.shape[0]
        torch.cuda.synchronize()
        d = m / (time.perf_counter() - t0)
        print(f"epoch {e}: ubdirect {u:,.0f} samples/s, PyTorch DataLoader {d:,.0f} samples/s ({u / d:.1f}x), {rb} B samples, batch {a.batch}")


if __name__ == "__main__":
    main()
