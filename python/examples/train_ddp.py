"""Train a tiny token model for a few steps with one ubdirect loader per rank.

    torchrun --nproc_per_node=1 python/examples/train_ddp.py --steps 50 [--config configs/gpu.toml]

Each rank's loader reads its own slice of the token shards (RANK / WORLD_SIZE from torchrun) straight
into GPU memory; batches arrive as CUDA tensors through DLPack, without a copy.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import ubdirect


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None, help="TOML config (default: a generated raw u16 token dataset)")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--seq", type=int, default=2048, help="tokens per sample (raw record_len)")
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", 0))
    dev = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)

    cfg = args.config or {
        "dataset": {"format": "raw", "dir": os.path.expanduser("~/.cache/ubdirect/train-ddp"), "dtype": "u16",
                    "record_len": args.seq, "generate": True, "generate_samples": 8192, "generate_shards": 4},
        "loader": {"batch_size": args.batch, "seed": 1},
        "device": {"select": "cuda" if cuda else "host"},
    }
    loader = ubdirect.Loader(cfg)  # rank and world size from torchrun's environment
    vocab = 65536
    model = nn.Sequential(nn.Embedding(vocab, 64), nn.Linear(64, vocab)).to(dev)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local] if cuda else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    step, epoch, t0, samples = 0, 0, time.perf_counter(), 0
    while step < args.steps:
        for batch in loader.epoch(epoch):
            data = torch.from_dlpack(batch)                      # uint8, on the GPU
            n = int(batch.lengths[0])
            start = int(batch.offsets[0])
            assert (batch.lengths == n).all()
            if (batch.offsets[1:] - batch.offsets[:-1] == n).all():
                tokens = data[start:start + n * len(batch)].view(torch.int16).view(len(batch), -1)
            else:
                tokens = torch.stack([data[int(o):int(o) + n].view(torch.int16) for o in batch.offsets])
            tokens = tokens.to(torch.int64) & 0xFFFF               # u16 tokens
            x, y = tokens[:, :-1], tokens[:, 1:]
            logits = model(x)
            loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            samples += len(batch)
            step += 1
            if rank == 0 and (step % 10 == 0 or step == 1):
                print(f"step {step:4d}  loss {loss.item():.3f}  device {data.device}", flush=True)
            if step >= args.steps:
                break
        epoch += 1
    if cuda:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    if rank == 0:
        print(f"done: {step} steps, {samples * world} samples in {dt:.2f} s ({samples * world / dt:.0f} samples/s); {loader.summary()['io_path']}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
