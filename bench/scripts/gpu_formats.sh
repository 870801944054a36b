#!/usr/bin/env bash
# One epoch of every format to the host device and to CUDA. The per-sample CRCs of the CUDA run are
# computed from device memory (copied back) and must equal the host run's. Then both runs again
# without dumping, for throughput.
#
#   BIN=target/release/ubdirect SAMPLES=32768 bench/scripts/gpu_formats.sh [OUTDIR]
set -euo pipefail
BIN=${BIN:-target/release/ubdirect}
SAMPLES=${SAMPLES:-32768}
OUT=${1:-/tmp/ubdirect-gpu-formats}
rm -rf "$OUT" && mkdir -p "$OUT"
"$BIN" gen --out "$OUT/data" --format all --samples "$SAMPLES" --shards 4
status=0
for f in raw megatron npy arrow; do
  src=configs/$f.toml; [ "$f" = raw ] && src=configs/default.toml
  for dev in host cuda; do
    sed -e "s|^dir = .*|dir = \"$OUT/data/$f\"|" -e 's|^generate = true.*|generate = false|' \
        -e "s|^select = .*|select = \"$dev\"|" "$src" > "$OUT/$f-$dev.toml"
    "$BIN" run --config "$OUT/$f-$dev.toml" --json --dump-samples "$OUT/$f-$dev.jsonl" > "$OUT/$f-$dev-dump.json"
    "$BIN" run --config "$OUT/$f-$dev.toml" --json > "$OUT/$f-$dev.json"
  done
  if cmp -s "$OUT/$f-host.jsonl" "$OUT/$f-cuda.jsonl"; then same=equal; else same=DIFFERENT; status=1; fi
  python3 - "$OUT" "$f" "$same" <<'PY'
import json, sys
out, f, same = sys.argv[1:]
h = json.load(open(f"{out}/{f}-host.json")); c = json.load(open(f"{out}/{f}-cuda.json"))
n = sum(1 for _ in open(f"{out}/{f}-cuda.jsonl"))
print(f"{f:9} samples {c['samples']:6}  CRCs of {n} samples host vs cuda: {same}   "
      f"host {h['gb_per_s']:.3f} GB/s ({h['samples_per_s']:.0f}/s)   cuda {c['gb_per_s']:.3f} GB/s ({c['samples_per_s']:.0f}/s)   "
      f"read {c['read_gb_per_s']:.3f} GB/s, mean read {c['mean_read_bytes']} B, waste {100*c['wasted_bytes']/max(1,c['read_bytes']):.1f} %   device: {c['device']} → {c['delivered_to']}")
PY
done
exit $status
