#!/usr/bin/env python3
"""N training ranks on a node, each with its CUDA context already made (as PyTorch makes it in a
training script), against one rank alone: the node's aggregate GB/s from the first rank's start to
the last rank's last batch, interleaved rounds, medians.

    python3 bench/peers/ranks_ctx.py --dir SHARDS --ranks 8 --gpus 1 --epochs 2 --rounds 3 [--kvikio]

Each rank is `rank_peer.py ubdirect` (the `ubdirect` wheel: `ubdirect.Loader`, CUDA batches, default
config; RANK/WORLD_SIZE/LOCAL_WORLD_SIZE as torchrun sets them, LOCAL_RANK = rank mod GPUS): it
makes its context, waits until every rank has one, then builds its loader and reads its epochs. The
clock runs from that barrier, so what is measured is the loader's part of a rank — its pools, its
registrations, its reads and copies — and not the CUDA context a training process makes anyway
(`bench/scripts/ranks.sh` times whole `ubdirect run` processes, contexts and exits included).
`--kvikio` adds the same for KvikIO per rank (compat mode, 16 threads, its buffers made before the
barrier).
"""
import argparse, json, os, statistics, subprocess, sys, tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def launch(mode, a, ranks, sets=None):
    with tempfile.TemporaryDirectory() as bar:
        procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "rank_peer.py"), mode, "--dir", a.dir, "--rank", str(r),
                                   "--ranks", str(ranks), "--device", str(r % a.gpus), "--epochs", str(a.epochs),
                                   "--barrier", bar] + sum((["--set", s] for s in (a.set if sets is None else sets) or [] if mode == "ubdirect"), []),
                                  stdout=subprocess.PIPE, text=True) for r in range(ranks)]
        outs = [p.communicate()[0] for p in procs]
        if any(p.returncode for p in procs):
            raise RuntimeError(f"{mode}: a rank failed")
    rs = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    wall = max(r["end"] for r in rs) - min(r["start"] for r in rs)
    return {"aggregate": sum(r["bytes"] for r in rs) / wall / 1e9, "wall": wall, "ranks": rs}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kvikio", action="store_true")
    ap.add_argument("--set", action="append", help="SECTION.KEY=INT for every ubdirect rank, e.g. pool.staging_blocks=12")
    ap.add_argument("--alt-set", action="append", help="also run the ranks with these settings in every round, and compare")
    a = ap.parse_args()
    rows = {"alone": [], "ranks": [], "kvikio": [], "alt": []}
    for r in range(a.rounds):
        alone = launch("ubdirect", a, 1)
        ranks = launch("ubdirect", a, a.ranks)
        rows["alone"].append(alone)
        rows["ranks"].append(ranks)
        line = (f"round {r}: alone {alone['aggregate']:.2f} GB/s ({alone['wall']:.2f} s, loader built in {alone['ranks'][0]['built_s']:.2f} s); "
                f"{a.ranks} ranks {ranks['aggregate']:.2f} GB/s ({ranks['wall']:.2f} s) = {ranks['aggregate'] / alone['aggregate']:.2f} x alone; "
                f"per rank {min(x['gb_per_s'] for x in ranks['ranks']):.2f}-{max(x['gb_per_s'] for x in ranks['ranks']):.2f} GB/s, "
                f"built in {min(x['built_s'] for x in ranks['ranks']):.2f}-{max(x['built_s'] for x in ranks['ranks']):.2f} s, "
                f"after it {min(x['data_gb_per_s'] for x in ranks['ranks']):.2f}-{max(x['data_gb_per_s'] for x in ranks['ranks']):.2f} GB/s")
        if a.alt_set:
            alt = launch("ubdirect", a, a.ranks, a.alt_set)
            rows["alt"].append(alt)
            line += f"; with {' '.join(a.alt_set)}: {alt['aggregate']:.2f} GB/s"
        if a.kvikio:
            kv = launch("kvikio", a, a.ranks)
            rows["kvikio"].append(kv)
            ours = statistics.median(x["gb_per_s"] for x in ranks["ranks"])
            theirs = statistics.median(x["gb_per_s"] for x in kv["ranks"])
            line += f"; KvikIO per rank {theirs:.2f} GB/s (aggregate {kv['aggregate']:.2f}): ubdirect per rank = {ours / theirs:.2f} x"
        print(line, flush=True)
    ratio = statistics.median(x["aggregate"] / y["aggregate"] for x, y in zip(rows["ranks"], rows["alone"]))
    print(f"\nmedian of {a.rounds} interleaved rounds: {a.ranks} ranks' aggregate = {ratio:.2f} x one rank alone "
          f"({statistics.median(x['aggregate'] for x in rows['ranks']):.2f} vs {statistics.median(x['aggregate'] for x in rows['alone']):.2f} GB/s)")
    if rows["alt"]:
        r = statistics.median(x["aggregate"] / y["aggregate"] for x, y in zip(rows["ranks"], rows["alt"]))
        print(f"{a.ranks} ranks' aggregate = {r:.2f} x the same with {' '.join(a.alt_set)} "
              f"({statistics.median(x['aggregate'] for x in rows['alt']):.2f} GB/s)")
    if rows["kvikio"]:
        per = statistics.median(statistics.median(x["gb_per_s"] for x in rk["ranks"]) / statistics.median(x["gb_per_s"] for x in kv["ranks"])
                                for rk, kv in zip(rows["ranks"], rows["kvikio"]))
        agg = statistics.median(rk["aggregate"] / kv["aggregate"] for rk, kv in zip(rows["ranks"], rows["kvikio"]))
        print(f"ubdirect per rank = {per:.2f} x KvikIO per rank; node aggregate = {agg:.2f} x KvikIO's")


if __name__ == "__main__":
    main()
