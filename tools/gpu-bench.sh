#!/usr/bin/env bash
# edgespec on a CUDA box, in one run of about 12 minutes (16 cores, one NVIDIA GPU, CUDA toolkit,
# python3 >= 3.10, network for pip and the demo's source model): builds once, makes the 8B-cost
# demo target and a random-weight Llama-3-8B there, then measures, each step time-boxed and its
# results written to $OUT as it ends:
#
#   build      the CUDA llama-cpp-python wheel with edgespec's patches into a venv (`CUDA=1 make
#              install`, tools/build-llama-wheel.sh) and, beside it in one CMake pass,
#              llama-server and llama-batched-bench (`CUDA=1 tools/llama-anchor.sh build`); both
#              for this GPU's architecture only, without the flash-attention kernels (CUDA_FA=OFF:
#              half the build), so every model below runs with flash attention off
#   models     `edgespec models prepare-demo --cost 8B` (the demo target widened to Llama-3-8B's
#              block shape, Q4_K_M) and `edgespec models synth --shape llama3-8b --type q4_k_m`
#   tcurve     T(n), n = 1..64, of both, steady shapes and shapes alternating with one-token
#              forwards (python -m edgespec.bench.cost_curve)
#   ceiling-N  `edgespec plan --measure --parallel N` for N = 1, 4: the speedup over plain a chain
#              with the Q8_0 draft can make at acceptance 0.6-0.9, one stream and four together
#   serve-N    `edgespec bench-serve` at N = 1, 4, 8 streams: the daemon auto vs plain, then
#              llama-server without and with the Q8_0 draft, on the same files
#   serve-1-unpadded  the daemon auto vs plain at one stream with its forwards not padded to fixed
#              widths ([speculation] pad_forwards = false; serve-1's auto pads them on a GPU): what
#              the CUDA graphs that padding keeps warm make (a dry run flips it: serve-1-padded)
#   mismatch   greedy speculative vs plain output, token by token, by verification width 2..64
#              (python -m edgespec.bench.mismatch)
#   batched    llama-batched-bench on the 8B-cost target (llama.cpp's own cost by batch)
#   tcurve-nographs  T(n) again with CUDA graphs off (GGML_CUDA_DISABLE_GRAPHS=1)
#
# usage: tools/gpu-bench.sh [--dry-run]
#   $OUT/summary.md (one row a step), $OUT/report.md (every step's tables), $OUT/STEP.{json,md,log}
#   --dry-run: every step on this machine's CPU with the demo files and small sizes (no build: the
#   .venv stands in for the CUDA wheel, the llama.cpp binaries of `tools/llama-anchor.sh build`
#   for the CUDA ones; the demo F32 target for the 8B-cost one, a 2-block qwen2.5-0.5b for the
#   random shape); a few minutes on 2 idle cores once those binaries exist.
# env: OUT (gpu-bench-out), BUDGET_S (720; a dry run 2400, its boxes x3), VENV (.venv-cuda), PYTHON (python3: makes the venv),
#      CUDA_ARCHITECTURES (this GPU's, from nvidia-smi), LLAMA_BIN (llama.cpp binaries built
#      already), EDGESPEC_HOME (models: $EDGESPEC_HOME/models), SERVE_REQUESTS (16),
#      SERVE_ROUNDS (2), MAX_TOKENS (96), PER_CATEGORY (2 prompts of each category suite)
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
[[ $# -gt 1 || ( $# -eq 1 && $DRY -eq 0 ) ]] && { sed -n '2,37p' "$0" >&2; exit 2; }
OUT=$(mkdir -p "${OUT:-gpu-bench-out}" && cd "${OUT:-gpu-bench-out}" && pwd)
BUDGET=${BUDGET_S:-720}
SCALE=1  # the steps' time boxes: x3 on a CPU (a dry run)
NPROC=$(nproc)
T0=$SECONDS
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1
if [[ $DRY == 1 ]]; then
  PY=$ROOT/.venv/bin/python
  BUDGET=${BUDGET_S:-2400} SCALE=3
  GPU=(--n-gpu-layers 0 --threads 1)  # one thread: on a shared host ggml's barriers wait on a descheduled one
  PLAN=(--cpu --threads 1)
  SIZES=1,2,4,8 ROUNDS=1 CONTEXT=32 WIDTHS=2,4,8 CATEGORIES=(code chat)
  PER=1 MT=8 REQ=4 SROUNDS=1 MM_TOKENS=8 NPL=1,2,4 NPP=32 NTG=2
else
  PY=$ROOT/${VENV:-.venv-cuda}/bin/python
  GPU=(--n-gpu-layers -1 --no-flash-attn)
  PLAN=(--no-flash-attn)
  SIZES=1-64 ROUNDS=5 CONTEXT=256 WIDTHS=2,4,8,16,32,64 CATEGORIES=(code json legal rag chat chinese)
  PER=${PER_CATEGORY:-2} MT=${MAX_TOKENS:-96} REQ=${SERVE_REQUESTS:-16} SROUNDS=${SERVE_ROUNDS:-2}
  MM_TOKENS=64 NPL=1,2,4,8,16,32,64 NPP=256 NTG=8
fi
ES=("$PY" -m edgespec.cli.main)

left() { echo $((BUDGET - (SECONDS - T0))); }
say() { echo "=== [$((SECONDS - T0)) s, $(left) s left] $*"; }
printf '| step | status | seconds |\n|---|---|---:|\n' > "$OUT/summary.md"
: > "$OUT/report.md"

# boxed SECONDS LOG CMD...: CMD in a process group of its own (a bench's daemons and llama-servers
# with it), stopped whole after SECONDS (TERM, then KILL); CMD's exit status, 124 when stopped
boxed() {
  local t=$1 log=$2 pid w rc
  shift 2
  set -m  # job control: the command (a function too) runs in a process group of its own
  "$@" > "$log" 2>&1 < /dev/null &
  pid=$!
  set +m
  ( sleep "$t"; kill -TERM -- -"$pid" 2>/dev/null && touch "$log.timeout"; sleep 15; kill -KILL -- -"$pid" 2>/dev/null ) &
  w=$!
  wait "$pid"
  rc=$?
  kill "$w" 2>/dev/null
  wait "$w" 2>/dev/null
  [[ -f "$log.timeout" ]] && { rm -f "$log.timeout"; rc=124; }
  return "$rc"
}

# step NAME MAX_SECONDS MIN_SECONDS CMD...: CMD boxed to MAX_SECONDS (or what is left of the budget),
# skipped when less than MIN_SECONDS are left; its log is $OUT/NAME.log, its row goes in summary.md
# and its markdown ($OUT/NAME.md, if it wrote one) in report.md
step() {
  local name=$1 max=$2 min=$3 t rc status
  shift 3
  if (( $(left) < min )); then
    echo "SKIP $name: $(left) s left, it needs $min"
    echo "| $name | skipped: $(left) s left of the budget | 0 |" >> "$OUT/summary.md"
    return 1
  fi
  max=$((max * SCALE))
  t=$(( $(left) < max ? $(left) : max ))
  say "$name (at most $t s)"
  local t1=$SECONDS
  boxed "$t" "$OUT/$name.log" "$@"
  rc=$?
  case $rc in 0) status=ok ;; 124) status="stopped at $t s" ;; *) status="exit $rc" ;; esac
  echo "$name: $status, $((SECONDS - t1)) s"
  [[ $rc == 0 ]] || tail -n 15 "$OUT/$name.log"
  echo "| $name | $status | $((SECONDS - t1)) |" >> "$OUT/summary.md"
  if [[ -f "$OUT/$name.md" ]]; then
    { echo "## $name"; echo; cat "$OUT/$name.md"; echo; } >> "$OUT/report.md"
  fi
  return "$rc"
}

say "environment -> $OUT/env.txt"
{
  date -u
  [[ $DRY == 1 ]] && echo "DRY RUN: CPU, demo files, small sizes"
  nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv 2>/dev/null || echo "no nvidia-smi"
  nvcc --version 2>/dev/null | tail -n 2
  echo "cores: $NPROC"; grep -m1 "model name" /proc/cpuinfo; free -g | head -n 2; df -h "$OUT" | tail -n 1
  git -C "$ROOT" log -1 --format='edgespec %H %s'
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# --- build ------------------------------------------------------------------------------------------
if [[ $DRY == 1 ]]; then
  echo "dry run: no CUDA build; $PY stands in for the CUDA wheel"
  if [[ -z "${LLAMA_BIN:-}" ]]; then
    LLAMA_BIN=$(tools/llama-anchor.sh build 2>>"$OUT/build-anchor.log" | tail -n 1)
  fi
else
  if [[ -z "${CUDA_ARCHITECTURES:-}" ]]; then
    CUDA_ARCHITECTURES=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' .')
  fi
  [[ -n "$CUDA_ARCHITECTURES" ]] || { echo "FAIL: no GPU architecture (nvidia-smi; or set CUDA_ARCHITECTURES)"; exit 1; }
  export CUDA=1 CUDA_ARCHITECTURES CUDA_FA=OFF CMAKE_BUILD_PARALLEL_LEVEL=$NPROC JOBS=$NPROC
  echo "CUDA build for sm_$CUDA_ARCHITECTURES, without flash-attention kernels, $NPROC jobs"
  if [[ -z "${LLAMA_BIN:-}" ]]; then
    # llama-server + llama-batched-bench: one CMake pass, beside the wheel's
    set -m  # a process group of its own: stopped whole if the run ends first
    ( tools/llama-anchor.sh build > "$OUT/build-anchor.log" 2>&1; echo $? > "$OUT/build-anchor.rc" ) &
    ANCHOR_PID=$!
    set +m
    trap 'kill -- -$ANCHOR_PID 2>/dev/null' EXIT
  fi
  step build 540 300 make install VENV="${VENV:-.venv-cuda}" PYTHON="${PYTHON:-python3}" \
    || { echo "FAIL: the CUDA wheel did not build ($OUT/build.log)"; exit 1; }
  "$PY" -c "from edgespec import backend; import sys; ok = backend.gpu_offload_supported(); \
print('gpu offload:', ok); sys.exit(0 if ok else 1)" || { echo "FAIL: the wheel cannot offload to the GPU"; exit 1; }
fi
"$PY" -c "import llama_cpp, edgespec; print('llama-cpp-python', llama_cpp.__version__, llama_cpp.__file__)"

# --- models -----------------------------------------------------------------------------------------
MODELS=$("$PY" -c "from edgespec.config import models_dir; print(models_dir())")
mkdir -p "$MODELS"
if [[ $DRY == 1 ]]; then
  SHAPE_ARGS=(--shape qwen2.5-0.5b --layers 2)
  SYNTH=$MODELS/synth-qwen2.5-0.5b-2.Q4_K_M.gguf
  COST_ARGS=()
else
  SHAPE_ARGS=(--shape llama3-8b)
  SYNTH=$MODELS/synth-llama3-8b.Q4_K_M.gguf
  COST_ARGS=(--cost 8B)
fi
make_models() {
  # the random shape in the background: both write F16 then run llama.cpp's quantizer
  [[ -f "$SYNTH" ]] || "${ES[@]}" models synth "${SHAPE_ARGS[@]}" --type q4_k_m --out "$SYNTH" &
  local s=$!
  "${ES[@]}" models prepare-demo "${COST_ARGS[@]}" || return 1
  wait "$s"
}
step models 360 120 make_models || echo "models incomplete: the steps that need them are skipped"
read -r TARGET DRAFT < <("$PY" - "$DRY" <<'PY'
import sys
from edgespec.models import default_pair
from edgespec.realistic import cost_target_path
pair = default_pair()
print(pair.target if sys.argv[1] == "1" else cost_target_path("8B"), pair.draft)
PY
)
echo "target $TARGET"; echo "draft $DRAFT"; echo "random shape $SYNTH"
HAVE_MODELS=0
[[ -f "$TARGET" && -f "$DRAFT" && -f "$SYNTH" ]] && HAVE_MODELS=1

HELD=$OUT/heldout.jsonl
"$PY" - "$HELD" "$PER" "${CATEGORIES[@]}" <<'PY'
import sys
from edgespec.bench.suite import resolve
n = int(sys.argv[2])
with open(sys.argv[1], "w", encoding="utf-8") as out:
    for cat in sys.argv[3:]:
        (path,) = resolve(cat)
        out.writelines([line for line in open(path, encoding="utf-8") if line.strip()][:n])
PY
echo "held-out prompts: $(wc -l < "$HELD") ($PER of each of ${CATEGORIES[*]})"

# --- measurements, most wanted first ----------------------------------------------------------------
if [[ $HAVE_MODELS == 1 ]]; then
  step tcurve 120 30 "$PY" -m edgespec.bench.cost_curve --model "widened=$TARGET" --model "synth=$SYNTH" \
    --sizes "$SIZES" --rounds "$ROUNDS" --context "$CONTEXT" "${GPU[@]}" --json "$OUT/tcurve.json" --markdown "$OUT/tcurve.md"
  ceiling() {  # ceiling N: plan --measure at N streams, its table as the step's markdown
    "${ES[@]}" plan --measure --target "$TARGET" --draft "$DRAFT" --parallel "$1" --rounds "$ROUNDS" \
      --context "$CONTEXT" --acceptance 0.6,0.7,0.8,0.9 "${PLAN[@]}" > "$OUT/ceiling-$1.txt" || return 1
    { echo '```'; cat "$OUT/ceiling-$1.txt"; echo '```'; } > "$OUT/ceiling-$1.md"
  }
  step ceiling-1 60 20 ceiling 1
  step ceiling-4 60 20 ceiling 4
  if [[ -n "${ANCHOR_PID:-}" ]]; then
    say "waiting for llama-server's build ($OUT/build-anchor.log)"
    while kill -0 "$ANCHOR_PID" 2>/dev/null && (( $(left) > 120 )); do sleep 2; done
    [[ "$(cat "$OUT/build-anchor.rc" 2>/dev/null)" == 0 ]] && LLAMA_BIN=$(tail -n 1 "$OUT/build-anchor.log")
  fi
  LLAMA=()
  if [[ -n "${LLAMA_BIN:-}" && -x "$LLAMA_BIN/llama-server" ]]; then
    LLAMA=(--llama-server-bin "$LLAMA_BIN" --llama-server-modes plain,draft)
  else
    echo "no llama-server (LLAMA_BIN='${LLAMA_BIN:-}', $OUT/build-anchor.log): the daemon alone"
  fi
  serve() {  # serve N MAX_SECONDS [NAME BENCH-SERVE-OPTIONS...]
    local n=$1 max=$2 name=${3:-serve-$1}
    shift $(( $# < 3 ? $# : 3 ))
    step "$name" "$max" 60 "${ES[@]}" bench-serve --concurrency "$n" --modes auto,plain \
      --target "$TARGET" --suite "$HELD" --requests "$REQ" --rounds "$SROUNDS" --max-tokens "$MT" --no-scenario \
      "${GPU[@]}" --no-progress --workdir "$OUT/$name" --json "$OUT/$name.json" --markdown "$OUT/$name.md" "$@"
  }
  serve 1 180 serve-1 "${LLAMA[@]}"
  # serve-1 again with its forwards' padding flipped (pad_forwards: auto pads on a GPU, not on a CPU):
  # CUDA graphs stay warm only for repeated shapes; auto / plain here against serve-1's is what padding makes
  FLIP=(serve-1-unpadded --pad-forwards false)
  [[ $DRY == 1 ]] && FLIP=(serve-1-padded --pad-forwards true)
  serve 1 120 "${FLIP[@]}"
  serve 4 150 serve-4 "${LLAMA[@]}"
  step mismatch 120 40 "$PY" -m edgespec.bench.mismatch --target "$TARGET" --draft "$DRAFT" --suite "$HELD" \
    --limit 1000 --widths "$WIDTHS" --max-tokens "$MM_TOKENS" "${GPU[@]}" --json "$OUT/mismatch.json" \
    --markdown "$OUT/mismatch.md"
  serve 8 150 serve-8 "${LLAMA[@]}"
  if [[ -n "${LLAMA_BIN:-}" && -x "$LLAMA_BIN/llama-batched-bench" ]]; then
    NGL=99; [[ $DRY == 1 ]] && NGL=0
    batched() {
      "$LLAMA_BIN/llama-batched-bench" -m "$TARGET" -c $(( (NPP + NTG) * ${NPL##*,} + 64 )) -b 2048 -ub 512 \
        -npp "$NPP" -ntg "$NTG" -npl "$NPL" -ngl "$NGL" -fa off --output-format jsonl 2>&1 | grep '^{' > "$OUT/batched.jsonl"
      "$PY" - "$OUT/batched.jsonl" "$NPP" "$NTG" > "$OUT/batched.md" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
if not rows:
    sys.exit("llama-batched-bench printed no results")
print(f"llama-batched-bench: {sys.argv[2]} prompt tokens a sequence, then {sys.argv[3]} decode forwards of one "
      "token per sequence, all sequences in each forward\n")
print("| sequences (tokens a forward) | ms a decode forward | tokens/s |\n|---:|---:|---:|")
for d in rows:
    print(f"| {d['pl']} | {d['t_tg'] * 1e3 / d['tg']:.2f} | {d['speed_tg']:.1f} |")
PY
    }
    step batched 60 20 batched
  else
    echo "SKIP batched: no llama-batched-bench in '${LLAMA_BIN:-}' (a bin dir built before it was added)"
    echo "| batched | skipped: no llama-batched-bench | 0 |" >> "$OUT/summary.md"
  fi
  step tcurve-nographs 90 30 env GGML_CUDA_DISABLE_GRAPHS=1 "$PY" -m edgespec.bench.cost_curve \
    --model "widened=$TARGET" --model "synth=$SYNTH" --sizes "$SIZES" --rounds "$ROUNDS" --context "$CONTEXT" \
    --shapes steady "${GPU[@]}" --json "$OUT/tcurve-nographs.json" --markdown "$OUT/tcurve-nographs.md"
fi
say "done: $OUT/summary.md, $OUT/report.md"
cat "$OUT/summary.md"
