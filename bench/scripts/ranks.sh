#!/usr/bin/env bash
# One `ubdirect run` per rank at once, as torchrun starts them (RANK, WORLD_SIZE, LOCAL_RANK,
# LOCAL_WORLD_SIZE), against one process alone on the same shards: the node's aggregate GB/s over
# the wall, each rank's figure, and the pinned bytes of every rank summed.
#
#   BIN=target/release/ubdirect RANKS=8 GPUS=1 EPOCHS=2 bench/scripts/ranks.sh CONFIG.toml
#
# GPUS: the GPUs of the node; rank r uses LOCAL_RANK = r % GPUS (several ranks per GPU when there
# are fewer GPUs than ranks: the one-GPU stand-in for an 8-GPU node).
set -euo pipefail
BIN=${BIN:-target/release/ubdirect}
RANKS=${RANKS:-8}
GPUS=${GPUS:-1}
EPOCHS=${EPOCHS:-2}
CFG=$1
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
t0=$(date +%s.%N)
"$BIN" run --config "$CFG" --json --epochs "$EPOCHS" > "$OUT/alone.json"
t1=$(date +%s.%N)
pids=()
for r in $(seq 0 $((RANKS - 1))); do
  RANK=$r WORLD_SIZE=$RANKS LOCAL_RANK=$((r % GPUS)) LOCAL_WORLD_SIZE=$RANKS \
    "$BIN" run --config "$CFG" --json --epochs "$EPOCHS" > "$OUT/rank$r.json" &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
t2=$(date +%s.%N)
python3 - "$OUT" "$RANKS" "$t0" "$t1" "$t2" <<'PY'
import json, sys
out, n, t0, t1, t2 = sys.argv[1], int(sys.argv[2]), *map(float, sys.argv[3:])
alone = json.load(open(f"{out}/alone.json"))
ranks = [json.load(open(f"{out}/rank{r}.json")) for r in range(n)]
a_gbps = alone["sample_bytes"] / (t1 - t0) / 1e9
agg = sum(j["sample_bytes"] for j in ranks) / (t2 - t1) / 1e9
pinned = sum((j.get("page_cache") or {}).get("pinned_bytes", 0) for j in ranks)
print(f"one process alone: {a_gbps:.2f} GB/s over its wall ({t1 - t0:.2f} s), epochs {[round(x, 1) for x in alone['epoch_gb_per_s']]}, pinned {(alone.get('page_cache') or {}).get('pinned_bytes', 0)} B")
print(f"{n} ranks at once: {agg:.2f} GB/s aggregate over the wall ({t2 - t1:.2f} s) = {agg / a_gbps:.2f} x alone; pinned bytes summed over ranks {pinned}")
for r, j in enumerate(ranks):
    print(f"  rank {r}: {j['gb_per_s']:.2f} GB/s, epochs {[round(x, 1) for x in j['epoch_gb_per_s']]}, first batch {j['time_to_first_batch_s']:.2f} s, copy threads {j.get('copy_threads')}")
PY
