#!/usr/bin/env bash
# GPU check, prepared for ONE short run on a lent GPU machine (one NVIDIA H200, CUDA toolkit,
# python3 with numpy/typer/tqdm/matplotlib/jinja2/scikit-build-core/cmake/ninja, NO network).
# First, here (with network): tools/gpu-prep.sh   -> .gpu-carry/ (trimmed sdist, wheels, models?)
# Then:  device run, carry [".gpu-carry"], command "tools/gpu-check.sh", timeout_s 600
#
# Phases (each timed, whole run budgeted to GPU_BUDGET_S, default 540 s):
#   1. environment: nvidia-smi, nvcc, python
#   2. build: llama-cpp-python from the carried sdist with -DGGML_CUDA=on for sm_90 only
#      (flash-attention kernels off unless GPU_FA=1: they double the build; without them the bench
#      runs every model with flash_attn = false through tools/gpu-bench-launch.py), installed with
#      the carried wheels into /tmp/es-site; the build compiler's libstdc++ is preloaded (the GPU
#      image's g++ is newer than the libstdc++ python3 loads, and llama.cpp's tokenizer segfaulted
#      at model load without it)
#   3. check: llama.cpp reports GPU offload; a 16-token generation with every layer on the GPU
#   4. bench: `edgespec bench --suite structured --modes plain,chain,tree,auto --max-tokens 64
#      --n-gpu-layers -1` on .gpu-carry/models/{target,draft}.gguf (skipped if none were carried),
#      cut short by the remaining budget; JSON, markdown and plot land in $OUT
# env: GPU_BUDGET_S (540), GPU_SUITE (structured), GPU_MAX_TOKENS (64), GPU_LIMIT (prompts per file),
#      GPU_MODELS_DIR (.gpu-carry/models), CUDA_ARCHITECTURES (90), GPU_FA=1, PYTHON (python3),
#      CPU_DRYRUN=1: the same phases on a machine without a GPU (CPU build, no offload assertion),
#      e.g. CPU_DRYRUN=1 PYTHON=.venv/bin/python GPU_MODELS_DIR=... GPU_LIMIT=1 GPU_MAX_TOKENS=16
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-/tmp/gpu-check-out}
CARRY="$ROOT/.gpu-carry"
SITE=${GPU_SITE:-/tmp/es-site}
PY=${PYTHON:-python3}
BUDGET=${GPU_BUDGET_S:-540}
SUITE=${GPU_SUITE:-structured}
MAX_TOKENS=${GPU_MAX_TOKENS:-64}
ARCH=${CUDA_ARCHITECTURES:-90}
DRY=${CPU_DRYRUN:-0}
MODELS=${GPU_MODELS_DIR:-$CARRY/models}
mkdir -p "$OUT"
T0=$SECONDS
phase() { echo; echo "=== [$((SECONDS - T0)) s] $*"; }
left() { echo $((BUDGET - (SECONDS - T0))); }
fail() { echo "FAIL: $*"; echo "total $((SECONDS - T0)) s"; exit 1; }
export PYTHONUNBUFFERED=1

phase "1/4 environment"
if [[ "$DRY" != "1" ]]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || fail "no nvidia-smi"
  nvcc --version | tail -n2 || fail "no nvcc"
fi
"$PY" --version
nproc
ls "$CARRY"/llama_cpp_python-*-trimmed.tar.gz "$CARRY"/wheels/*.whl >/dev/null || fail "run tools/gpu-prep.sh first and carry .gpu-carry"

KIND="CUDA, sm_$ARCH"; [[ "$DRY" == "1" ]] && KIND="CPU dry run"
phase "2/4 build llama-cpp-python ($KIND) + carried wheels -> $SITE"
t=$SECONDS
FA=OFF; [[ "${GPU_FA:-0}" == "1" ]] && FA=ON
CUDA_FLAGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=$ARCH -DGGML_CUDA_FA=$FA"
[[ "$DRY" == "1" ]] && CUDA_FLAGS=""
export CMAKE_ARGS="$CUDA_FLAGS -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DLLAVA_BUILD=OFF -DLLAMA_CURL=OFF"
export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
if [[ -d "$SITE/llama_cpp" && "${GPU_REBUILD:-0}" != "1" ]]; then
  echo "reusing $SITE (a rerun on the same machine; GPU_REBUILD=1 rebuilds)"
else
  rm -rf "$SITE"
  "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "$CARRY"/wheels/*.whl || fail "wheels"
  timeout "$(left)" "$PY" -m pip install --no-index --no-deps --no-build-isolation --target "$SITE" -v \
    "$CARRY"/llama_cpp_python-*-trimmed.tar.gz > "$OUT/build.log" 2>&1 \
    || { tail -n 60 "$OUT/build.log"; fail "build (log: build.log)"; }
  grep -E "^\s*\[[0-9]+/[0-9]+\]" "$OUT/build.log" | tail -n1
fi
echo "build: $((SECONDS - t)) s"
export PYTHONPATH="$ROOT:$SITE"
if [[ "$DRY" != "1" ]]; then
  LD_PRELOAD=$("${CXX:-g++}" -print-file-name=libstdc++.so.6)
  export LD_PRELOAD
fi
export GPU_FLASH_ATTN=${GPU_FA:-0}

phase "3/4 GPU offload check"
"$PY" - "$DRY" "$SITE" <<'PY' || fail "GPU offload check"
import sys
import llama_cpp
from edgespec import backend
print("llama-cpp-python", llama_cpp.__version__, "from", llama_cpp.__file__, "gpu offload:", backend.gpu_offload_supported())
assert llama_cpp.__file__.startswith(sys.argv[2]), "not the llama-cpp-python just built"
assert sys.argv[1] == "1" or backend.gpu_offload_supported(), "this llama.cpp build cannot offload to the GPU"
PY
if [[ -f "$MODELS/target.gguf" ]]; then
  "$PY" - "$MODELS/target.gguf" "$DRY" <<'PY' || fail "generation on the GPU"
import sys, time
from edgespec.config import EngineConfig, ModelConfig
from edgespec.engine import Engine
from edgespec.sampling import SamplingParams
from edgespec.types import GenerationRequest, SpeculationParams
cfg = EngineConfig(target=ModelConfig(path=sys.argv[1], n_gpu_layers=-1, n_ctx=512), draft=None)
eng = Engine.load(cfg, calibrate=False)  # plain decoding needs no cost model
print("backend:", eng.model_info()["backend"])
toks = tuple(eng.tokenize(eng.chat_prompt([("user", "Say hello.")]), parse_special=True))
t = time.perf_counter()
res = eng.generate(GenerationRequest(toks, SamplingParams(temperature=0, max_tokens=16), SpeculationParams(mode="plain")))
print(f"plain: {res.stats.emitted_tokens} tokens in {time.perf_counter() - t:.3f} s: {res.text!r}")
assert sys.argv[2] == "1" or eng.model_info()["backend"] == "cuda"
eng.close()
PY
fi

phase "4/4 bench"
if [[ ! -f "$MODELS/target.gguf" ]]; then
  echo "SKIP: no models carried ($MODELS/target.gguf, draft.gguf): see tools/gpu-prep.sh"
else
  DRAFT="$MODELS/draft.gguf"; [[ -f "$DRAFT" ]] || DRAFT=none
  t=$SECONDS
  timeout "$(( $(left) - 10 ))" "$PY" tools/gpu-bench-launch.py bench --suite "$SUITE" --modes plain,chain,tree,auto \
    --max-tokens "$MAX_TOKENS" --n-gpu-layers -1 --target "$MODELS/target.gguf" --draft "$DRAFT" \
    --json "$OUT/gpu-bench.json" --markdown "$OUT/gpu-bench.md" --plot "$OUT/gpu-bench.png" --no-progress \
    ${GPU_LIMIT:+--limit "$GPU_LIMIT"} \
    || fail "bench (exit $?)"
  echo "bench: $((SECONDS - t)) s"
fi
echo
echo "OK: total $((SECONDS - T0)) s"
