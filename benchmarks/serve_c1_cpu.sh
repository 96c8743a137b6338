#!/bin/bash
# Served batch-1 TPOT plus the CPU each process (and thread) spends while it streams (docs/performance.md,
# "Serving overhead at batch 1"). Usage, under the CPU lock:
#   /work/tools/cpu benchmarks/serve_c1_cpu.sh TREE PORT TAG
# TREE is a checkout (e.g. `git archive main | tar -x -C /tmp/base`); the venv is $PY (default
# /work/main/.venv/bin/python). Starts `pagellm serve --dtype bfloat16` from TREE, warms up with 2 requests, then
# runs 10 streamed /v1/completions (128 in, 128 out) at concurrency 1 and prints the bench line, the CPU ticks
# (10 ms each) of the API server and engine-core processes and of each busy thread, and the client's CPU time.
set -u
TREE=$1; PORT=$2; TAG=$3
PY=${PY:-/work/main/.venv/bin/python}
OUT=${OUT:-/tmp/serve_c1_cpu}; mkdir -p "$OUT"
export TREE PY PORT
cd "$TREE"
PYTHONPATH=$TREE $PY -m pagellm.cli serve --dtype bfloat16 --port "$PORT" --kv-cache-memory 4294967296 \
  > "$OUT/serve_$TAG.log" 2>&1 &
SP=$!
for _ in $(seq 300); do curl -sf "localhost:$PORT/health" >/dev/null && break; sleep 0.2; done
bench() { PYTHONPATH=$TREE $PY -m pagellm.cli bench serve --base-url "http://127.0.0.1:$PORT" --max-concurrency 1 \
            --num-prompts "$1" --input-len 128 --output-len 128; }
bench 2 >/dev/null 2>&1
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
CORE=$(for c in $(pgrep -P $SP); do echo "$(ticks "$c") $c"; done | sort -n | tail -1 | cut -d' ' -f2)
threads() { for t in /proc/$1/task/*; do echo "$(tr ' ' _ < "$t/comm") $(awk '{print $14, $15}' "$t/stat")"; done; }
A0=$(ticks $SP); C0=$(ticks "$CORE"); threads $SP > "$OUT/a0"; threads "$CORE" > "$OUT/c0"
/usr/bin/time -f "client_cpu_s=%U+%S" bash -c "$(declare -f bench); bench 10" \
  > "$OUT/bench_$TAG.txt" 2>&1
A1=$(ticks $SP); C1=$(ticks "$CORE"); threads $SP > "$OUT/a1"; threads "$CORE" > "$OUT/c1"
echo "$TAG api_ticks=$((A1 - A0)) core_ticks=$((C1 - C0)) (1280 streamed tokens)"
grep -A1 "TPOT p50" "$OUT/bench_$TAG.txt" | tail -1
grep client_cpu_s "$OUT/bench_$TAG.txt"
paste "$OUT/a0" "$OUT/a1" | awk '$5 + $6 > $2 + $3 {print "  api thread", $1, "user", $5 - $2, "sys", $6 - $3}'
paste "$OUT/c0" "$OUT/c1" | awk '$5 + $6 > $2 + $3 {print "  core thread", $1, "user", $5 - $2, "sys", $6 - $3}'
kill $SP; wait $SP 2>/dev/null
