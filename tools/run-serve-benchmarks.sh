#!/usr/bin/env bash
# Reproduce docs/benchmarks/results/serve.{json,md,png}: edgespec's daemon (speculation auto and
# plain) beside llama.cpp's llama-server (without and with the draft) at N concurrent streams,
# interleaved, plus the long-prompt scenario. Idle machine; ~20 min on 2 cores.
# usage: tools/run-serve-benchmarks.sh [CONCURRENCY] [REQUESTS] [MAX_TOKENS] [THREADS]
# env: OUT (default docs/benchmarks/results), NGL (n_gpu_layers, default 0; -1 on a CUDA build),
#      ROUNDS (interleaved rounds per cell, default 2), SCENARIO_ROUNDS (default 2),
#      STREAM_TOKENS (max tokens of the scenario's 3 streams, default 256)
set -euo pipefail
cd "$(dirname "$0")/.."
C=${1:-1,2,4}; R=${2:-16}; N=${3:-128}; T=${4:-$(nproc)}
ES=.venv/bin/edgespec
OUT=${OUT:-docs/benchmarks/results}
mkdir -p "$OUT"
$ES models prepare-demo >/dev/null
lscpu > "$OUT/serve-machine.txt"
echo "== llama.cpp's llama-server from the pinned sdist (stock source; built once, cached)"
BIN=$(tools/llama-anchor.sh build | tail -n1)
echo "== concurrency $C, $R requests per cell, max $N tokens, $T threads"
$ES bench-serve --concurrency "$C" --requests "$R" --rounds "${ROUNDS:-2}" --max-tokens "$N" --threads "$T" \
  --n-gpu-layers "${NGL:-0}" --suite structured --limit 4 --llama-server-bin "$BIN" \
  --scenario-rounds "${SCENARIO_ROUNDS:-2}" --scenario-stream-tokens "${STREAM_TOKENS:-256}" \
  --json "$OUT/serve.json" --markdown "$OUT/serve.md" --plot "$OUT/serve.png"
