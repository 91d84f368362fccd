#!/usr/bin/env bash
# GPU check, prepared for ONE short run on a lent GPU machine (one NVIDIA H200, CUDA toolkit,
# python3 with numpy/typer/tqdm/matplotlib/jinja2/scikit-build-core/cmake/ninja, NO network).
# First, here (with network): tools/gpu-prep.sh   -> .gpu-carry/ (trimmed sdist, wheels, models?)
# Then:  device run, carry [".gpu-carry"], command "tools/gpu-check.sh", timeout_s 600
#
# Phases (each timed, whole run budgeted to GPU_BUDGET_S, default 540 s):
#   1. environment: nvidia-smi, nvcc, python
#   2. build: llama-cpp-python from the carried sdist with -DGGML_CUDA=on for sm_90 only
#      (flash-attention kernels off unless GPU_FA=1: they double the build; the engine does not
#      use flash attention by default), installed with the carried wheels into /tmp/es-site
#   3. check: llama.cpp reports GPU offload; a 16-token generation with every layer on the GPU
#   4. bench: `edgespec bench --suite structured --modes plain,chain,tree,auto --max-tokens 64
#      --n-gpu-layers -1` on .gpu-carry/models/{target,draft}.gguf (skipped if none were carried),
#      cut short by the remaining budget; JSON, markdown and plot land in $OUT
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-/tmp/gpu-check-out}
CARRY="$ROOT/.gpu-carry"
SITE=/tmp/es-site
PY=${PYTHON:-python3}
BUDGET=${GPU_BUDGET_S:-540}
SUITE=${GPU_SUITE:-structured}
MAX_TOKENS=${GPU_MAX_TOKENS:-64}
ARCH=${CUDA_ARCHITECTURES:-90}
mkdir -p "$OUT"
T0=$SECONDS
phase() { echo; echo "=== [$((SECONDS - T0)) s] $*"; }
left() { echo $((BUDGET - (SECONDS - T0))); }
fail() { echo "FAIL: $*"; echo "total $((SECONDS - T0)) s"; exit 1; }
export PYTHONUNBUFFERED=1

phase "1/4 environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || fail "no nvidia-smi"
nvcc --version | tail -n2 || fail "no nvcc"
"$PY" --version
nproc
ls "$CARRY"/llama_cpp_python-*-trimmed.tar.gz "$CARRY"/wheels/*.whl >/dev/null || fail "run tools/gpu-prep.sh first and carry .gpu-carry"

phase "2/4 build llama-cpp-python (CUDA, sm_$ARCH) + carried wheels -> $SITE"
t=$SECONDS
FA=OFF; [[ "${GPU_FA:-0}" == "1" ]] && FA=ON
export CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=$ARCH -DGGML_CUDA_FA=$FA -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DLLAVA_BUILD=OFF -DLLAMA_CURL=OFF"
export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
"$PY" -m pip install -q --no-index --no-deps --target "$SITE" "$CARRY"/wheels/*.whl || fail "wheels"
timeout "$(left)" "$PY" -m pip install --no-index --no-deps --no-build-isolation --target "$SITE" -v \
  "$CARRY"/llama_cpp_python-*-trimmed.tar.gz > "$OUT/build.log" 2>&1 \
  || { tail -n 60 "$OUT/build.log"; fail "build (log: build.log)"; }
grep -E "^\s*\[[0-9]+/[0-9]+\]" "$OUT/build.log" | tail -n1
echo "build: $((SECONDS - t)) s"
export PYTHONPATH="$ROOT:$SITE"

phase "3/4 GPU offload check"
MODELS="$CARRY/models"
"$PY" - <<'PY' || fail "GPU offload check"
import llama_cpp
from edgespec import backend
print("llama-cpp-python", llama_cpp.__version__, "gpu offload:", backend.gpu_offload_supported())
assert backend.gpu_offload_supported(), "this llama.cpp build cannot offload to the GPU"
PY
if [[ -f "$MODELS/target.gguf" ]]; then
  "$PY" - "$MODELS/target.gguf" <<'PY' || fail "generation on the GPU"
import sys, time
from edgespec.config import EngineConfig, ModelConfig
from edgespec.engine import Engine
from edgespec.sampling import SamplingParams
from edgespec.types import GenerationRequest, SpeculationParams
eng = Engine.load(EngineConfig(target=ModelConfig(path=sys.argv[1], n_gpu_layers=-1, n_ctx=512), draft=None))
print("backend:", eng.model_info()["backend"])
toks = tuple(eng.tokenize(eng.chat_prompt([("user", "Say hello.")]), parse_special=True))
t = time.perf_counter()
res = eng.generate(GenerationRequest(toks, SamplingParams(temperature=0, max_tokens=16), SpeculationParams(mode="plain")))
print(f"plain: {res.stats.emitted_tokens} tokens in {time.perf_counter() - t:.3f} s: {res.text!r}")
assert eng.model_info()["backend"] == "cuda"
eng.close()
PY
fi

phase "4/4 bench"
if [[ ! -f "$MODELS/target.gguf" ]]; then
  echo "SKIP: no models carried (.gpu-carry/models/target.gguf, draft.gguf): see tools/gpu-prep.sh"
else
  DRAFT="$MODELS/draft.gguf"; [[ -f "$DRAFT" ]] || DRAFT=none
  t=$SECONDS
  timeout "$(( $(left) - 10 ))" "$PY" -m edgespec.bench --suite "$SUITE" --modes plain,chain,tree,auto \
    --max-tokens "$MAX_TOKENS" --n-gpu-layers -1 --target "$MODELS/target.gguf" --draft "$DRAFT" \
    --json "$OUT/gpu-bench.json" --markdown "$OUT/gpu-bench.md" --plot "$OUT/gpu-bench.png" --no-progress \
    || fail "bench (exit $?)"
  echo "bench: $((SECONDS - t)) s"
fi
echo
echo "OK: total $((SECONDS - T0)) s"
