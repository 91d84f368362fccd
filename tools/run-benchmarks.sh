#!/usr/bin/env bash
# Reproduce docs/benchmarks/results/ on this machine (idle machine; ~12 min on 2 cores).
# usage: tools/run-benchmarks.sh [LIMIT] [MAX_TOKENS] [THREADS]
# llama.cpp's own binaries (the anchor) run inside each bench's interleaved rotation
# (`edgespec bench --anchor-bin`), so their ratios carry no drift between runs.
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
echo "== 1. llama.cpp's binaries from the pinned sdist (stock source; built once, cached)"
BIN=$(tools/llama-anchor.sh build | tail -n1)
echo "== 2. F32 target + Q8_0 draft, all suites, edgespec's modes and llama.cpp's interleaved"
$ES bench --suite all --limit "$LIMIT" --modes plain,chain,tree,auto --max-tokens "$N" --threads "$T" \
  --anchor-bin "$BIN" --json "$R/f32.json" --markdown "$R/f32.md" --plot "$R/f32.png" --no-progress
echo "== 2b. the same again, structured suites: this VM's speed drifts between runs (see the README)"
$ES bench --suite structured --limit "$LIMIT" --modes plain,chain,tree,auto --max-tokens "$N" --threads "$T" \
  --json "$R/f32-run2.json" --markdown "$R/f32-run2.md" --no-progress
echo "== 2c. llama.cpp's speculation with the Q4_0 draft instead (stock llama.cpp has no fast Q8_0 path)"
$ES bench --suite structured --limit "$LIMIT" --modes plain,auto --max-tokens "$N" --threads "$T" \
  --anchor-bin "$BIN" --anchor-draft "$Q4" --json "$R/f32-llama-q4-draft.json" --markdown "$R/f32-llama-q4-draft.md" --no-progress
echo "== 3. Q8_0 target + Q4_0 draft (a quantized target: its forward is cheap, verification dearer)"
$ES bench --suite structured --limit 3 --modes plain,chain,tree,auto --max-tokens "$N" --threads "$T" \
  --target "$Q8" --draft "$Q4" --anchor-bin "$BIN" --json "$R/q8.json" --markdown "$R/q8.md" --plot "$R/q8.png" --no-progress
echo "== 4. useless draft (random weights, same vocabulary)"
$ES bench --suite all --limit 3 --modes plain,auto,chain --max-tokens "$N" --threads "$T" \
  --draft "$RAND" --json "$R/random-draft.json" --markdown "$R/random-draft.md" --no-progress
echo "== 5. long inputs (370-2400 prompt tokens): the suite the context-aware costs and the draft window are for"
$ES bench --suite long --modes plain,chain,tree,auto --max-tokens 128 --threads "$T" \
  --json "$R/long.json" --markdown "$R/long.md" --plot "$R/long.png" --no-progress
echo "== 6. sampled decoding (temperature 0.7, top_p 0.95): every mode draws with the same seed per prompt"
$ES bench --suite all --limit 3 --modes plain,chain,tree,auto --max-tokens "$N" --threads "$T" \
  --temperature 0.7 --top-p 0.95 --seed 0 --json "$R/sampled.json" --markdown "$R/sampled.md" --plot "$R/sampled.png" --no-progress
