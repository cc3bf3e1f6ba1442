#!/bin/bash
# The engine in a child process (default) vs on a thread of the replica (--no-engine-process), over HTTP:
# `conveyor serve` on port 8011, then `conveyor bench` at concurrency 1 and 8, two alternating rounds (~6 min).
#   bash benchmarks/engine_process_ab.sh
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/engine_process_ab}
mkdir -p "$out"
for mode in process thread process thread; do
  flag=""; [ "$mode" = thread ] && flag="--no-engine-process"
  .venv/bin/conveyor serve --port 8011 $flag > "$out/serve_$mode.log" 2>&1 &
  server=$!
  for _ in $(seq 1 180); do curl -sf http://127.0.0.1:8011/v1/models > /dev/null && break; sleep 1; done
  for c in 1 8; do
    .venv/bin/conveyor bench --base-url http://127.0.0.1:8011 --dataset random --input-len 128 --output-len 64 \
      --num-prompts $((c * 6)) --max-concurrency $c --num-warmups 2 --no-progress \
      --out "$out/${mode}_c$c.json" > /dev/null 2>&1
    .venv/bin/python - "$out/${mode}_c$c.json" "$mode c=$c" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))["points"][0]
print(sys.argv[2], "ITL p50/p99 %.1f/%.1f ms, TTFT p50 %.0f ms, %.1f output tok/s" % (
    p["itl_ms"]["p50"], p["itl_ms"]["p99"], p["ttft_ms"]["p50"], p["output_throughput"]))
PY
  done
  kill -TERM $server; wait $server 2>/dev/null  # TERM: a background job of a script ignores SIGINT
done
