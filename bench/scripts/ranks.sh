#!/usr/bin/env bash
# One `ubdirect run` per rank at once, as torchrun starts them (RANK, WORLD_SIZE, LOCAL_RANK,
# LOCAL_WORLD_SIZE), against one process alone on the same shards: the node's aggregate GB/s over
# the wall, each rank's figure, and the pinned bytes of every rank summed.
#
#   BIN=target/release/ubdirect RANKS=8 GPUS=1 EPOCHS=2 bench/scripts/ranks.sh CONFIG.toml
#
# GPUS: the GPUs of the node; rank r uses LOCAL_RANK = r % GPUS (several ranks per GPU when there
# are fewer GPUs than ranks: the one-GPU stand-in for an 8-GPU node).
# COLD=1 drops the page cache before each phase (root); PEERS=1 also runs, at once per rank, KvikIO
# over the same bytes (bench/peers/rank_peer.py, needs kvikio+cupy and DATA, the shards' directory)
# and, at once per GPU, the pinned host-to-device ceiling (needs torch).
set -euo pipefail
BIN=${BIN:-target/release/ubdirect}
RANKS=${RANKS:-8}
GPUS=${GPUS:-1}
EPOCHS=${EPOCHS:-2}
CFG=$1
COLD=${COLD:-0}
PEERS=${PEERS:-0}
PEER=$(dirname "$0")/../peers/rank_peer.py
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
cold() { if [ "$COLD" = 1 ]; then sync; echo 3 > /proc/sys/vm/drop_caches; fi; }
cold
t0=$(date +%s.%N)
"$BIN" run --config "$CFG" --json --epochs "$EPOCHS" > "$OUT/alone.json"
t1=$(date +%s.%N)
cold
t1=$(date +%s.%N)
pids=()
for r in $(seq 0 $((RANKS - 1))); do
  ( RANK=$r WORLD_SIZE=$RANKS LOCAL_RANK=$((r % GPUS)) LOCAL_WORLD_SIZE=$RANKS \
    "$BIN" run --config "$CFG" --json --epochs "$EPOCHS" > "$OUT/rank$r.json"; date +%s.%N > "$OUT/end$r" ) &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
t2=$(date +%s.%N)
if [ "$PEERS" = 1 ]; then
  cold
  pids=()
  for r in $(seq 0 $((RANKS - 1))); do
    python3 "$PEER" kvikio --dir "$DATA" --rank "$r" --ranks "$RANKS" --device $((r % GPUS)) --epochs "$EPOCHS" > "$OUT/kvikio$r.json" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  pids=()
  for g in $(seq 0 $((GPUS - 1))); do
    python3 "$PEER" h2d --device "$g" > "$OUT/h2d$g.json" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
fi
python3 - "$OUT" "$RANKS" "$t0" "$t1" "$t2" "$GPUS" <<'PY'
import glob, json, sys
out, n, t0, t1, t2, gpus = sys.argv[1], int(sys.argv[2]), *map(float, sys.argv[3:6]), int(sys.argv[6])
alone = json.load(open(f"{out}/alone.json"))
ranks = [json.load(open(f"{out}/rank{r}.json")) for r in range(n)]
a_gbps = alone["sample_bytes"] / (t1 - t0) / 1e9
agg = sum(j["sample_bytes"] for j in ranks) / (t2 - t1) / 1e9
pinned = sum((j.get("page_cache") or {}).get("pinned_bytes", 0) for j in ranks)
print(f"one process alone: start-up {', '.join(f'{k} {v:.2f}' for k, v in alone.get('startup_s', []))}")
print(f"one process alone: {a_gbps:.2f} GB/s over its wall ({t1 - t0:.2f} s), epochs {[round(x, 1) for x in alone['epoch_gb_per_s']]}, pinned {(alone.get('page_cache') or {}).get('pinned_bytes', 0)} B")
print(f"{n} ranks at once: {agg:.2f} GB/s aggregate over the wall ({t2 - t1:.2f} s) = {agg / a_gbps:.2f} x alone; pinned bytes summed over ranks {pinned}")
for r, j in enumerate(ranks):
    st = ", ".join(f"{k} {v:.2f}" for k, v in j.get("startup_s", []))
    end = float(open(f"{out}/end{r}").read())
    # The rest of the process's wall: exec and config before the loader, and the teardown of the
    # loader and its CUDA context after the last batch.
    pre = sum(v for k, v in j.get("startup_s", []) if k != "first_batch")
    st += f"; rest of the wall (exec, teardown) {end - t1 - pre - j['seconds']:.2f}, of it the loader's shut-down {j.get('teardown_s', 0):.2f}"
    print(f"  rank {r}: {j['gb_per_s']:.2f} GB/s, epochs {[round(x, 1) for x in j['epoch_gb_per_s']]}, first batch {j['time_to_first_batch_s']:.2f} s ({st}), copy threads {j.get('copy_threads')}")
kv = [json.load(open(f"{out}/kvikio{r}.json")) for r in range(n) if glob.glob(f"{out}/kvikio{r}.json")]
if kv:
    per = [k["gb_per_s"] for k in kv]
    ours = [j["gb_per_s"] for j in ranks]
    print(f"KvikIO per rank at once: {min(per):.2f}-{max(per):.2f} GB/s; ubdirect per rank {min(ours):.2f}-{max(ours):.2f} = {sorted(ours)[n // 2] / sorted(per)[n // 2]:.2f} x KvikIO (medians)")
    h = [json.load(open(f"{out}/h2d{g}.json"))["gb_per_s"] for g in range(gpus)]
    print(f"pinned H2D ceiling, {gpus} GPU(s) at once: {sum(h):.2f} GB/s ({', '.join(f'{x:.1f}' for x in h)}); ubdirect aggregate = {agg / sum(h):.2f} x")
PY
