"""GPU check (run by hand on a CUDA machine): every format's batches arrive as CUDA tensors through
DLPack, and the CRC-32 of every sample computed from device memory equals the host run's.

    python3 python/tests/gpu_check.py /tmp/ds   # a directory from `ubdirect gen --format all`
"""
import sys
import time
import zlib

import torch

import ubdirect


def crcs(fmt, d, device):
    cfg = {"dataset": {"format": fmt, "dir": f"{d}/{fmt}", "generate": False}, "device": {"select": device},
           "loader": {"batch_size": 64, "seed": 5}}
    loader = ubdirect.Loader(cfg)
    out, n, t0 = {}, 0, time.perf_counter()
    for batch in loader.epoch(0):
        data = torch.from_dlpack(batch)
        assert data.is_cuda == (device == "cuda"), (data.device, device)
        host = data.cpu().numpy() if data.is_cuda else data.numpy()
        for sid, off, ln in zip(batch.ids, batch.offsets, batch.lengths):
            out[int(sid)] = zlib.crc32(host[off:off + ln].tobytes())
            n += int(ln)
    return out, n / (time.perf_counter() - t0) / 1e9, loader.summary()


def main():
    d = sys.argv[1]
    ok = True
    for fmt in ["raw", "megatron", "npy", "arrow"]:
        h, hg, _ = crcs(fmt, d, "host")
        c, cg, s = crcs(fmt, d, "cuda")
        same = h == c
        ok &= same
        print(f"{fmt:9} samples {len(c):6}  CRCs from CUDA tensors == host: {same}   host {hg:.2f} GB/s  cuda {cg:.2f} GB/s (incl. copy back for CRC)  {s['device']}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
