#!/usr/bin/env python3
"""Start-up at scale against Megatron-Core's own GPTDataset, on the same files.

For each size (GPT windows of 4096 tokens over one Megatron shard: the sparse `.bin` and the `.idx`
that bench/scripts/scale.py writes, documents of 40,960 u16 tokens), each round runs, each in a
fresh process, interleaved:

  mc first     Megatron-Core 0.16: BlendedMegatronDatasetBuilder(GPTDataset) with its index cache
               emptied, build + the first sample (ds[0])
  mc cached    the same with its cache from the run before
  ub block     ubdirect run --max-batches 1, loader.order = "block" (the default)
  ub megatron  loader.order = "megatron", ubdirect's GPT index cache removed first (first run)
  ub cached    loader.order = "megatron" again (its index cache mapped)

and prints each process's time (Megatron-Core: build + first sample, imports excluded; ubdirect:
time to first batch, which includes opening the dataset, the pools and the first plan) and peak RSS
(wait4), every round and the median. Megatron-Core gets the same seed (0), sequence length and split.

  PYTHONPATH=/tmp/site python3 bench/peers/megatron_scale.py --ubdirect PATH [--windows 1e7,1e8]
        [--rounds 3] [--dir /tmp/ubdirect-scale] [--json out.json] [--only ub|mc]

On the GPU machine, the megatron-core wheel travels as bench/peers/README.md says (torch and numpy
are there already).
"""

import argparse
import glob
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

MC_CHILD = r"""
import json, os, sys, time
import numpy
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

class Tok:
    vocab_size = None
    eod = 0
    pad = -1
    unique_identifiers = {"class": "Tok"}

prefix, cache, seq = sys.argv[1], sys.argv[2], int(sys.argv[3])
cfg = GPTDatasetConfig(random_seed=0, sequence_length=seq, blend=([prefix], None), split="100,0,0",
    path_to_cache=cache, tokenizer=Tok(), reset_position_ids=False, reset_attention_mask=False,
    eod_mask_loss=False, create_attention_mask=False, add_extra_token_to_sequence=True,
    mmap_bin_files=True)
t0 = time.monotonic()
ds = BlendedMegatronDatasetBuilder(GPTDataset, [None, None, None], lambda: True, cfg).build()[0]
first = ds[0]
t1 = time.monotonic()
assert len(first["tokens"]) == seq, len(first["tokens"])
print(json.dumps({"s": t1 - t0, "samples": len(ds)}))
"""


def scale_module():
    spec = importlib.util.spec_from_file_location("scale", os.path.join(HERE, "..", "scripts", "scale.py"))
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def measured(argv):
    """Runs argv (output to files: no pipe to fill); returns (stdout, peak RSS bytes, wall s)."""
    import tempfile
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.monotonic()
        p = subprocess.Popen(argv, stdout=out, stderr=err)
        _, status, ru = os.wait4(p.pid, 0)
        wall = time.monotonic() - t0
        out.seek(0)
        err.seek(0)
        o, e = out.read().decode(), err.read().decode()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{argv[:3]} failed: {e[-3000:]}")
    return o, ru.ru_maxrss * 1024, wall


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ubdirect", required=True)
    ap.add_argument("--windows", default="1e7,1e8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/ubdirect-scale")
    ap.add_argument("--json")
    ap.add_argument("--only", choices=("ub", "mc"), help="run one side only (the other's rows are left out)")
    a = ap.parse_args()
    scale = scale_module()
    seq = scale.SEQ - 1  # windows of SEQ tokens: sequence_length + the extra token
    sizes = [int(float(x)) for x in a.windows.split(",") if x]
    rows = {}
    for n in sizes:
        d = os.path.join(a.dir, f"megatron-{n}")
        scale.make_megatron(d, n)
        for order in ("block", "megatron"):
            with open(f"{d}-{order}-peer.toml", "w") as f:
                f.write(
                    f'[dataset]\nformat = "megatron"\ndir = "{d}"\ngenerate = false\n'
                    f"sequence_length = {seq}\n[loader]\nbatch_size = 8\norder = \"{order}\"\n"
                    '[device]\nselect = "host"\n'
                )
    for r in range(a.rounds):
        for n in sizes:
            d = os.path.join(a.dir, f"megatron-{n}")
            cache = os.path.join(a.dir, f"mc-cache-{n}")
            prefix = os.path.join(d, "shard")
            runs = []
            shutil.rmtree(cache, ignore_errors=True)
            for label in ("mc first", "mc cached") if a.only != "ub" else ():
                out, rss, wall = measured([sys.executable, "-c", MC_CHILD, prefix, cache, str(seq)])
                j = json.loads(out.strip().splitlines()[-1])
                runs.append((label, j["s"], rss, wall, ""))
            ub = (("ub block", "block", False), ("ub megatron", "megatron", True), ("ub cached", "megatron", False))
            for label, order, clear in ub if a.only != "mc" else ():
                if clear:
                    for f in glob.glob(prefix + ".idx.ubdirect-gpt-*"):
                        os.unlink(f)
                out, rss, wall = measured([a.ubdirect, "run", "--config", f"{d}-{order}-peer.toml",
                                           "--max-batches", "1", "--json"])
                j = json.loads(out)
                phases = " ".join(f"{k} {v:.3f}" for k, v in j.get("startup_s", []) if v >= 0.001)
                runs.append((label, j["time_to_first_batch_s"], rss, wall, phases))
            for label, s, rss, wall, phases in runs:
                rows.setdefault((n, label), []).append((s, rss))
                print(f"round {r + 1}: {n:,} windows, {label:12}: {s:7.3f} s, peak RSS {rss / 1e9:5.2f} GB, "
                      f"process wall {wall:6.2f} s" + (f" ({phases})" if phases else ""), flush=True)
    print("\nmedians (every round: s / GB)")
    out = []
    for (n, label), v in rows.items():
        s = statistics.median(x[0] for x in v)
        rss = statistics.median(x[1] for x in v)
        every = " ".join(f"{x[0]:.3f}/{x[1] / 1e9:.2f}" for x in v)
        print(f"{n:>13,} {label:12} {s:8.3f} s {rss / 1e9:6.2f} GB   {every}")
        out.append({"windows": n, "case": label, "s": s, "rss_gb": rss / 1e9, "rounds": v})
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
