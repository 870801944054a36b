#!/usr/bin/env bash
# GPT windows at the link: Megatron and block order, 2 KiB and 8 KiB windows (u16 tokens), batches
# on the device `select` names, warm, one process per figure, interleaved rounds. Prints GB/s and CPU
# seconds per million windows for the DEFAULT config and for the 2026-11-30 engine (registration
# before the first batch, io_uring copies, 64 staging blocks, 1 MiB chunks) beside it.
#
#   BIN=target/release/ubdirect DOCS=200000 ROUNDS=3 SELECT=cuda bench/scripts/gpt_windows.sh [DIR]
set -euo pipefail
BIN=${BIN:-target/release/ubdirect}
DOCS=${DOCS:-200000}
ROUNDS=${ROUNDS:-3}
SELECT=${SELECT:-cuda}
DIR=${1:-/tmp/ubdirect-gpt-windows}
mkdir -p "$DIR"
[ -s "$DIR/data/megatron/shard-00000.idx" ] || "$BIN" gen --out "$DIR/data/megatron" --format megatron --samples "$DOCS" --shards 4 >/dev/null
cat "$DIR"/data/megatron/*.bin > /dev/null
old='[engine]
thread_copies = false
[pool]
page_cache_register = "eager"
staging_blocks = 64'
old_loader='chunk_bytes = 0'
for round in $(seq 1 "$ROUNDS"); do
  for order in megatron block; do
    for seq in 1023 4095; do
      for variant in default old; do
        cfg=$DIR/$order-$seq-$variant.toml
        {
          printf '[dataset]\nformat = "megatron"\ndir = "%s/data/megatron"\nsequence_length = %s\n' "$DIR" "$seq"
          printf '[loader]\norder = "%s"\n' "$order"
          [ $variant = old ] && printf '%s\n' "$old_loader"
          printf '[device]\nselect = "%s"\n' "$SELECT"
          [ $variant = old ] && printf '%s\n' "$old"
        } > "$cfg"
        "$BIN" run --config "$cfg" --json 2>/dev/null | python3 -c '
import json, sys
j = json.load(sys.stdin)
r, order, seq, variant = sys.argv[1:]
cpu = j["cpu_s_per_gb"] * j["sample_bytes"] / 1e9
per_m = cpu / j["samples"] * 1e6
g, fb, n = j["gb_per_s"], j["time_to_first_batch_s"], j["samples"]
print(f"round {r} {order:8} window {int(seq) + 1:5} tokens {variant:7}: {g:6.2f} GB/s  {per_m:6.2f} CPU s per million windows  first batch {fb:.2f} s  samples {n}")
' "$round" "$order" "$seq" "$variant"
      done
    done
  done
done
