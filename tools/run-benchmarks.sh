#!/usr/bin/env bash
# Reproduce docs/benchmarks/results/ on this machine (idle machine; ~25 min on 2 cores).
# usage: tools/run-benchmarks.sh [LIMIT] [MAX_TOKENS] [THREADS]
set -euo pipefail
cd "$(dirname "$0")/.."
LIMIT=${1:-5}; N=${2:-96}; T=${3:-2}
ES=.venv/bin/edgespec
R=docs/benchmarks/results
M=${EDGESPEC_HOME:-$HOME/.local/share/edgespec}/models
mkdir -p "$R"
$ES models prepare-demo >/dev/null
$ES models prepare-demo --target-type q8_0 --draft-type q4_0 >/dev/null
F32=$M/SmolLM2-135M-Instruct.F32.gguf; Q8=$M/SmolLM2-135M-Instruct.Q8_0.gguf; Q4=$M/SmolLM2-135M-Instruct.Q4_0.gguf
RAND=$M/random-draft.gguf
$ES models random-draft "$RAND" >/dev/null  # from the demo draft (Q8_0): a useless draft at the real one's cost
lscpu > "$R/machine.txt"
echo "== 1. llama.cpp anchor, F32 target + Q8_0 draft (the demo pair); its speculation also with the Q4_0 draft"
tools/llama-anchor.sh run --suite all --limit "$LIMIT" --max-tokens "$N" --threads "$T" --llama-bench \
  --target "$F32" --draft "$Q8" --json "$R/anchor-f32.json"
tools/llama-anchor.sh run --suite all --limit "$LIMIT" --max-tokens "$N" --threads "$T" --modes speculative \
  --target "$F32" --draft "$Q4" --json "$R/anchor-f32-q4-draft.json"
echo "== 2. edgespec, F32 target + Q8_0 draft, all suites, modes interleaved"
$ES bench --suite all --limit "$LIMIT" --modes plain,chain,tree,auto --max-tokens "$N" --threads "$T" \
  --anchor "$R/anchor-f32.json" --json "$R/f32.json" --markdown "$R/f32.md" --plot "$R/f32.png" --no-progress
echo "== 3. Q8_0 target + Q4_0 draft (a quantized target: its forward is cheap, verification dearer)"
tools/llama-anchor.sh run --suite structured --limit 3 --max-tokens "$N" --threads "$T" \
  --target "$Q8" --draft "$Q4" --json "$R/anchor-q8.json"
$ES bench --suite structured --limit 3 --modes plain,chain,tree,auto --max-tokens "$N" --threads "$T" \
  --target "$Q8" --draft "$Q4" --anchor "$R/anchor-q8.json" --json "$R/q8.json" --markdown "$R/q8.md" --plot "$R/q8.png" --no-progress
echo "== 4. useless draft (random weights, same vocabulary)"
$ES bench --suite all --limit 3 --modes plain,auto,chain --max-tokens "$N" --threads "$T" \
  --draft "$RAND" --json "$R/random-draft.json" --markdown "$R/random-draft.md" --no-progress
