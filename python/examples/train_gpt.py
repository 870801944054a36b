#!/usr/bin/env python3
"""Train a small GPT twice on one Megatron dataset — batches from ubdirect, then batches from
Megatron-Core's own GPTDataset — and compare the losses step by step.

Both runs start from the same weights (same seed), use deterministic kernels, and feed the model the
same tensors Megatron's training loop feeds it: tokens, labels, loss_mask, position_ids and (with
--attention-mask) attention_mask. With ubdirect, those come from the batch itself (`[dataset.tensors]`,
moved to the GPU with the tokens); with Megatron-Core, from `GPTDataset.__getitem__` through a
PyTorch DataLoader in Megatron's sequential pretraining order (`MegatronPretrainingSampler` with one
data-parallel rank is `range(consumed, total)` in batches, which is what the DataLoader below does).

    # a dataset (documents ending with the EOD token), written by Megatron-Core's own builder:
    python3 python/examples/train_gpt.py --make-data /tmp/gptdata --docs 6000
    python3 python/examples/train_gpt.py --data /tmp/gptdata/train --steps 200 --device cuda

Prints one line per run (data seconds per step, step seconds) and, with both loaders, the largest
per-step loss difference; `--json FILE` writes every step's loss and times.

Needs PyTorch and megatron-core (0.16) for the Megatron run and for --make-data; the ubdirect run
alone (--loader ubdirect) needs only PyTorch.
"""

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

EOD = 2


def make_data(out: str, docs: int, vocab: int, seed: int) -> str:
    """A Megatron dataset (uint16) of `docs` documents ending with EOD, via Megatron-Core's builder."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    os.makedirs(out, exist_ok=True)
    prefix = os.path.join(out, "train")
    rng = np.random.default_rng(seed)
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for d in range(docs):
        n = int(rng.integers(8, 600))
        toks = rng.integers(3, vocab, size=n, dtype=np.int64)
        toks[-1] = EOD
        b.add_item(torch.from_numpy(toks))
        b.end_document()
    b.finalize(prefix + ".idx")
    return prefix


class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.ln2 = torch.nn.LayerNorm(d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

    def forward(self, x, masked):
        b, s, d = x.shape
        h = self.heads
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, h, d // h).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d // h)
        att = att.masked_fill(masked, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class GPT(torch.nn.Module):
    def __init__(self, vocab: int, seq: int, d: int = 256, layers: int = 4, heads: int = 4):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Embedding(seq, d)
        self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, tokens, position_ids, attention_mask):
        x = self.tok(tokens) + self.pos(position_ids)
        for blk in self.blocks:
            x = blk(x, attention_mask)
        return self.head(self.ln(x))


def causal(b: int, s: int, device) -> torch.Tensor:
    return torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), 1).expand(b, 1, s, s)


def ubdirect_batches(a, device):
    """(tokens, labels, loss_mask, position_ids, attention_mask) per step, from ubdirect."""
    import ubdirect

    cfg = {
        "dataset": {"format": "megatron", "paths": [a.data], "generate": False,
                    "sequence_length": a.seq, "split": "100,0,0",
                    "tensors": {"eod": EOD, "reset_position_ids": a.reset, "reset_attention_mask": a.reset,
                                "eod_mask_loss": a.reset, "create_attention_mask": a.attention_mask}},
        "device": {"select": "cuda" if device.type == "cuda" else "host"},
        "loader": {"batch_size": a.batch, "seed": a.seed, "order": "megatron"},
    }
    loader = ubdirect.Loader(cfg)
    for batch in loader.epoch(0):
        text = torch.from_dlpack(batch).long()  # (b, seq + 1) on the batch's device
        masked = (torch.from_dlpack(batch.attention_mask) if a.attention_mask
                  else causal(len(batch), a.seq, text.device))
        yield (text[:, :-1], text[:, 1:], torch.from_dlpack(batch.loss_mask),
               torch.from_dlpack(batch.position_ids), masked)


def megatron_batches(a, device):
    """The same from Megatron-Core's GPTDataset, in Megatron's sequential pretraining order."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    class Tok:
        vocab_size = None
        eod = EOD
        pad = -1
        unique_identifiers = {"class": "train_gpt.Tok"}

    cfg = GPTDatasetConfig(
        random_seed=a.seed, sequence_length=a.seq, blend=([a.data], None), split="100,0,0",
        path_to_cache=None, tokenizer=Tok(), reset_position_ids=a.reset, reset_attention_mask=a.reset,
        eod_mask_loss=a.reset, create_attention_mask=a.attention_mask, mmap_bin_files=True,
    )
    ds = BlendedMegatronDatasetBuilder(GPTDataset, [None, None, None], lambda: True, cfg).build()[0]
    dl = torch.utils.data.DataLoader(ds, batch_size=a.batch, shuffle=False, drop_last=True,
                                     num_workers=a.workers, pin_memory=device.type == "cuda",
                                     persistent_workers=a.workers > 0)
    for item in dl:
        g = {k: v.to(device, non_blocking=True) for k, v in item.items()}
        masked = g["attention_mask"] if a.attention_mask else causal(a.batch, a.seq, device)
        yield (g["tokens"].long(), g["labels"].long(), g["loss_mask"].float(),
               g["position_ids"].long(), masked)


def train(a, which: str, device):
    torch.manual_seed(a.seed)
    model = GPT(a.vocab, a.seq).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    batches = ubdirect_batches(a, device) if which == "ubdirect" else megatron_batches(a, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    losses, data_s, step_s = [], [], []
    for step in range(a.steps):
        sync()
        t0 = time.perf_counter()
        try:
            tokens, labels, loss_mask, pos, masked = next(batches)
        except StopIteration:
            break
        sync()
        t1 = time.perf_counter()
        logits = model(tokens, pos, masked)
        ce = F.cross_entropy(logits.float().view(-1, a.vocab), labels.reshape(-1), reduction="none")
        lm = loss_mask.reshape(-1)
        loss = (ce * lm).sum() / lm.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        t2 = time.perf_counter()
        data_s.append(t1 - t0)
        step_s.append(t2 - t1)
    # The first fetch includes opening the dataset (and Megatron's index build): reported apart.
    out = {"loader": which, "steps": len(losses), "losses": losses,
           "first_batch_s": data_s[0] if data_s else None,
           "data_s_per_step": float(np.median(data_s[1:])) if len(data_s) > 1 else None,
           "data_s_mean": float(np.mean(data_s[1:])) if len(data_s) > 1 else None,
           "step_s": float(np.median(step_s)) if step_s else None}
    print(f"{which:9}: {out['steps']} steps, first batch {out['first_batch_s']:.3f} s, data "
          f"{out['data_s_per_step'] * 1e3:.3f} ms/step (median; mean {out['data_s_mean'] * 1e3:.3f}), "
          f"step {out['step_s'] * 1e3:.2f} ms, final loss {losses[-1]:.6f}", flush=True)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--make-data", metavar="DIR", help="write a Megatron dataset in DIR and exit")
    p.add_argument("--docs", type=int, default=6000)
    p.add_argument("--data", help="Megatron dataset prefix (PREFIX.bin / PREFIX.idx)")
    p.add_argument("--loader", choices=["both", "ubdirect", "megatron"], default="both")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--workers", type=int, default=2, help="Megatron run: DataLoader workers")
    p.add_argument("--reset", action="store_true",
                   help="reset_position_ids, reset_attention_mask and eod_mask_loss on (implies --attention-mask)")
    p.add_argument("--attention-mask", action="store_true", help="create_attention_mask (else causal)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", help="write every step's loss and times here")
    a = p.parse_args()
    if a.make_data:
        print(make_data(a.make_data, a.docs, a.vocab, a.seed))
        return 0
    if not a.data:
        p.error("--data PREFIX (or --make-data DIR first)")
    a.attention_mask = a.attention_mask or a.reset
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device(a.device)
    runs = ["ubdirect", "megatron"] if a.loader == "both" else [a.loader]
    res = {r: train(a, r, device) for r in runs}
    ok = True
    if len(res) == 2:
        u, m = res["ubdirect"]["losses"], res["megatron"]["losses"]
        n = min(len(u), len(m))
        diff = max((abs(x - y) for x, y in zip(u[:n], m[:n])), default=float("nan"))
        same = n == len(u) == len(m) and all(x == y for x, y in zip(u, m))
        print(f"per-step loss over {n} steps: identical={same}, largest difference {diff:.3e}")
        res["compare"] = {"steps": n, "identical": same, "max_abs_diff": diff}
        ok = same
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), **res}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
