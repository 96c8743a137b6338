#!/bin/bash
# CPU the `pagellm bench serve` client spends per streamed chunk at c=32 (docs/performance.md, "Benchmark client
# cost"). Usage, under the CPU lock:
#   /work/tools/cpu benchmarks/client_cost.sh TREE PORT
# TREE is a checkout (server and client both run from it); the venv is $PY (default /work/main/.venv/bin/python).
# Starts `pagellm serve --dtype bfloat16`, warms up, then times (/usr/bin/time, user+sys) the whole client for
# --num-prompts 32 and 96 (128 in, 128 out, --max-concurrency 32). The difference, 64 requests x 128 chunks, is the
# client's CPU per chunk with its fixed cost (imports, dataset, warm-up) cancelled.
set -u
TREE=$1; PORT=$2
PY=${PY:-/work/main/.venv/bin/python}
cd "$TREE"
PYTHONPATH=$TREE PAGELLM_NUM_THREADS=2 $PY -m pagellm.cli serve --dtype bfloat16 --port "$PORT" \
  --kv-cache-memory 4294967296 --disable-log-stats > "/tmp/client_cost_serve_$PORT.log" 2>&1 &
SP=$!
for _ in $(seq 300); do curl -sf "localhost:$PORT/health" >/dev/null && break; sleep 0.2; done
bench() { PYTHONPATH=$TREE /usr/bin/time -f "client_cpu_s %U %S" $PY -m pagellm.cli bench serve \
            --base-url "http://127.0.0.1:$PORT" --max-concurrency "$1" --num-prompts "$2" --input-len 128 \
            --output-len "$3" 2>&1; }
bench 4 4 16 >/dev/null
declare -A CPU
for N in 32 96; do
  OUTPUT=$(bench 32 $N 128)
  echo "== $TREE N=$N"; echo "$OUTPUT" | grep -A1 "TPOT p50"
  CPU[$N]=$(echo "$OUTPUT" | awk '/client_cpu_s/ {print $2 + $3}')
  echo "client cpu s: ${CPU[$N]}"
done
echo "$TREE client us/chunk: $(echo "${CPU[96]} ${CPU[32]}" | awk '{printf "%.0f", ($1 - $2) / (64 * 128) * 1e6}')"
kill $SP; wait
