#!/usr/bin/env python3
"""What ubdirect pays before the first batch as the dataset grows: time to the first batch, its
start-up parts (dataset open, pools, first plan), and peak RSS, over sparse datasets that cost no disk.

Raw 4 KiB records (u8, record_len 4096) in S shards of sparse files (`truncate`): nothing is read
but the first batch's bytes (zeros). Each size runs `ubdirect run --config C --max-batches 1 --json`
ROUNDS times, interleaved across sizes (round 1 of every size, then round 2, ...), each in a fresh
process whose peak RSS comes from wait4(2). Every round's figure is printed, and the median.

  bench/scripts/scale.py [--bin target/release/ubdirect] [--dir /tmp/ubdirect-scale]
                         [--samples 1e6,1e7] [--shards 1000] [--rounds 3] [--json out.json]
  bench/scripts/scale.py --quick          # 10^6 and 10^7 raw samples and GPT windows (block and
                                          # megatron order), 2 rounds (CI's rows)
  bench/scripts/scale.py --megatron 1e7,1e8 --orders block,megatron --samples ''
                                          # GPT windows (seq 4096) over a hand-written Megatron
                                          # .idx and a sparse .bin (documents of 40,960 u16 tokens)

The datasets stay in --dir (sparse: ls -s shows 0); --clean removes them after.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

RECORD = 4096


def make_raw(d, samples, shards):
    """`shards` sparse files holding `samples` records of RECORD bytes in all (made once)."""
    os.makedirs(d, exist_ok=True)
    stamp = os.path.join(d, ".made")
    want = f"{samples} {shards} {RECORD}"
    if os.path.exists(stamp) and open(stamp).read() == want:
        return
    for f in os.listdir(d):
        os.unlink(os.path.join(d, f))
    per, extra = divmod(samples, shards)
    for i in range(shards):
        n = per + (1 if i < extra else 0)
        with open(os.path.join(d, f"s{i:06d}.bin"), "wb") as f:
            f.truncate(n * RECORD)
    with open(stamp, "w") as f:
        f.write(want)


DOC_TOKENS = 40960
SEQ = 4096


def make_megatron(d, windows):
    """One Megatron shard (`shard.idx` + sparse `shard.bin`, u16) holding about `windows` GPT windows
    of SEQ tokens: documents of DOC_TOKENS tokens, one sequence each (as Megatron's builder writes)."""
    import struct
    os.makedirs(d, exist_ok=True)
    stamp = os.path.join(d, ".made")
    want = f"megatron {windows} {DOC_TOKENS} {SEQ}"
    if os.path.exists(stamp) and open(stamp).read() == want:
        return
    docs = windows * SEQ // DOC_TOKENS + 1
    with open(os.path.join(d, "shard.idx"), "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8) + struct.pack("<QQ", docs, docs + 1))
        step = 1 << 20
        for a in range(0, docs, step):
            n = min(step, docs - a)
            f.write(struct.pack(f"<{n}i", *([DOC_TOKENS] * n)))
        for a in range(0, docs, step):
            n = min(step, docs - a)
            f.write(struct.pack(f"<{n}q", *range(a * DOC_TOKENS * 2, (a + n) * DOC_TOKENS * 2, DOC_TOKENS * 2)))
        for a in range(0, docs + 1, step):
            n = min(step, docs + 1 - a)
            f.write(struct.pack(f"<{n}q", *range(a, a + n)))
    with open(os.path.join(d, "shard.bin"), "wb") as f:
        f.truncate(docs * DOC_TOKENS * 2)
    with open(stamp, "w") as f:
        f.write(want)


def config_megatron(d, path, order):
    with open(path, "w") as f:
        f.write(
            f"""[dataset]
format = "megatron"
dir = "{d}"
generate = false
sequence_length = {SEQ}
[loader]
batch_size = 8
order = "{order}"
[device]
select = "host"
"""
        )


def config(d, path):
    with open(path, "w") as f:
        f.write(
            f"""[dataset]
format = "raw"
dir = "{d}"
generate = false
dtype = "u8"
record_len = {RECORD}
[loader]
batch_size = 64
[device]
select = "host"
"""
        )


def run_measured(binary, cfg):
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        fd = os.open(cfg + ".json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        err = os.open(cfg + ".err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(err, 2)
        os.execv(binary, [binary, "run", "--config", cfg, "--max-batches", "1", "--json"])
    _, status, ru = os.wait4(pid, 0)
    wall = time.monotonic() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"ubdirect run failed: {open(cfg + '.err').read()[-2000:]}")
    return json.load(open(cfg + ".json")), ru.ru_maxrss * 1024, wall


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    here = os.path.dirname(os.path.abspath(__file__))
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(here, "..", "..", "target"))
    ap.add_argument("--bin", default=os.path.join(target, "release", "ubdirect"))
    ap.add_argument("--dir", default="/tmp/ubdirect-scale")
    ap.add_argument("--samples", default="1e6,1e7,1e8")
    ap.add_argument("--megatron", default="", help="GPT windows: sizes (e.g. 1e7,1e8)")
    ap.add_argument("--orders", default="block", help="GPT windows: loader.order values")
    ap.add_argument("--shards", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--clean", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.quick:
        a.samples, a.rounds = "1e6,1e7", 2
        a.megatron, a.orders = a.megatron or "1e6,1e7", "block,megatron"
    if not os.access(a.bin, os.X_OK):
        sys.exit(f"{a.bin}: not built (cargo build --release -p ubdirect-loader)")
    # Cases: (label, config path).
    cases = []
    for n in [int(float(x)) for x in a.samples.split(",") if x]:
        d = os.path.join(a.dir, f"raw-{n}-{a.shards}")
        make_raw(d, n, a.shards)
        config(d, d + ".toml")
        cases.append((f"raw {n:,} samples, {a.shards} shards", d + ".toml"))
    for n in [int(float(x)) for x in a.megatron.split(",") if x]:
        d = os.path.join(a.dir, f"megatron-{n}")
        make_megatron(d, n)
        for order in a.orders.split(","):
            config_megatron(d, f"{d}-{order}.toml", order)
            cases.append((f"GPT {n:,} windows, order {order}", f"{d}-{order}.toml"))
    rows = {c: [] for c, _ in cases}
    for r in range(a.rounds):
        for n, cfg in cases:
            s, rss, wall = run_measured(a.bin, cfg)
            parts = dict(s.get("startup_s", []))
            rows[n].append(
                {
                    "first_batch_s": s["time_to_first_batch_s"],
                    "wall_s": wall,
                    "rss_mb": rss / 1e6,
                    "parts": parts,
                }
            )
            print(
                f"round {r + 1}: {n}: first batch {s['time_to_first_batch_s']:.3f} s, "
                f"peak RSS {rss / 1e6:.0f} MB, wall {wall:.2f} s; "
                + ", ".join(f"{k} {v:.3f}" for k, v in parts.items()),
                flush=True,
            )
    print(f"\nraw: {RECORD} B records, batches of 64; GPT: seq {SEQ}, batches of 8; host batches, sparse files; medians of {a.rounds} interleaved rounds")
    print(f"{'case':>44} {'first batch s':>14} {'peak RSS MB':>12} {'first plan s':>13}  every round (first batch s / RSS MB)")
    out = []
    for n, _ in cases:
        fb = statistics.median(x["first_batch_s"] for x in rows[n])
        rss = statistics.median(x["rss_mb"] for x in rows[n])
        plan = statistics.median(x["parts"].get("first_plan", 0.0) for x in rows[n])
        every = " ".join(f"{x['first_batch_s']:.3f}/{x['rss_mb']:.0f}" for x in rows[n])
        print(f"{n:>44} {fb:>14.3f} {rss:>12.0f} {plan:>13.3f}  {every}")
        out.append({"case": n, "first_batch_s": fb, "rss_mb": rss, "first_plan_s": plan, "rounds": rows[n]})
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    if a.clean:
        shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
