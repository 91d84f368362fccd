#!/usr/bin/env bash
# edgespec's speed on a lent GPU box (one NVIDIA H200, CUDA toolkit, python3 3.12, NO network),
# in three device calls made back to back while the box stays warm. A call's working tree is at
# most 64 MiB and the tracked tree is ~20 MiB (the shipped head: 16.7 MiB), so the demo target
# travels as its Q4_1 source GGUF (94 MiB; its weights dequantized ARE the F32 target's) in three
# parts, staged in /tmp; the CUDA build starts in the background in call 1 and runs while the
# other parts travel.
#
#   here:   tools/gpu-bench.sh prep       -> .gpu-carry/bench/{src,wheels,p1,p2,p3} (git-excluded)
#                                            and edgespec/proto (generated, git-ignored)
#   call 1: carry [".gpu-carry/bench/src", ".gpu-carry/bench/wheels", ".gpu-carry/bench/p1", "edgespec/proto"],
#           command "tools/gpu-bench.sh stage1"   environment, imports, part 1, build started
#   call 2: carry [".gpu-carry/bench/p2"], command "tools/gpu-bench.sh stage2"
#   call 3: carry [".gpu-carry/bench/p3", "edgespec/proto"], command "GPU_BUDGET_S=N tools/gpu-bench.sh run",
#           timeout_s N + 20  -> $OUT/gpu-bench.log, $OUT/results.tgz (JSON + markdown of each bench)
#
# The build: the pinned llama-cpp-python with edgespec's ggml patches (tools/patches; what
# `CUDA=1 tools/build-llama-wheel.sh` builds), -DGGML_CUDA=on for sm_90 only and without the
# flash-attention kernels (-DGGML_CUDA_FA=OFF: they double the build), so every model runs with
# flash_attn = false (tools/gpu-bench-launch.py). The run: the source reassembled and checked, the
# build awaited, the demo pair derived as `make models` does (edgespec.models.prepare_demo: F32
# target, Q8_0 draft, the shipped head installed; SHA-256 compared with this machine's), then, in
# this order and each cut to what is left of GPU_BUDGET_S, every layer on the GPU, greedy:
#   1. heldout:      edgespec bench, 1 stream, HELDOUT12 (the first 2 prompts of each category
#                    suite), plain / auto with the Q8_0 draft / auto with the head, 64 tokens
#   2. serve-head, serve-q8: edgespec bench-serve at 4 streams, HELDOUT12, auto vs plain, --draft
#                    the head / the Q8_0 draft
#      serve-repetitive: bench-serve at 4 streams, the repetitive suite, suffix cache on
#   3. repetitive:   edgespec bench, 1 stream, repetitive suite, plain / auto / auto+suffix,
#                    without CUDA graphs (GGML_CUDA_DISABLE_GRAPHS=1: with them a plain decode of
#                    this suite stops at an illegal instruction in a replayed graph)
#   4. serve1-head, serve1-q8: bench-serve at 1 stream; heldout-nographs: step 1 without CUDA graphs
# env: GPU_BUDGET_S (540), GPU_ONLY (space-separated step names), GPU_PER_CATEGORY (2),
#      GPU_MAX_TOKENS (64), GPU_SERVE_REQUESTS (48), GPU_SERVE_ROUNDS (8), GPU_REP_LIMIT (60),
#      GPU_REP_MAX_TOKENS (96), GPU_REP_REQUESTS (120), GPU_REP_ROUNDS (12), GPU_FLASH_ATTN (0),
#      CUDA_ARCHITECTURES (90), PYTHON (python3),
#      CPU_DRYRUN=1: the same verbs on a machine without a GPU: no build (the .venv's llama_cpp
#      stands in for it), a wheel PYTHON cannot take replaced by the .venv's copy, state in
#      /tmp/es-dry. `tools/gpu-bench.sh emu` makes /tmp/es-emu, a python that sees only what the
#      GPU image also holds, so that a missing import fails here first:
#        tools/gpu-bench.sh emu; export CPU_DRYRUN=1 PYTHON=/tmp/es-emu/bin/python
#        tools/gpu-bench.sh stage1; tools/gpu-bench.sh stage2
#        GPU_PER_CATEGORY=1 GPU_MAX_TOKENS=8 GPU_SERVE_REQUESTS=4 GPU_SERVE_ROUNDS=2 GPU_REP_LIMIT=3 \
#          GPU_REP_MAX_TOKENS=8 GPU_REP_REQUESTS=4 GPU_REP_ROUNDS=2 GPU_BUDGET_S=1500 tools/gpu-bench.sh run
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
VERSION=0.3.36
CARRY="$ROOT/.gpu-carry/bench"
DRY=${CPU_DRYRUN:-0}
S=/tmp/es; [[ "$DRY" == "1" ]] && S=/tmp/es-dry
SITE="$S/site"        # the carried wheels
LLAMA="$S/llama"      # the llama-cpp-python built here
OUT=${OUT:-$S/out}
PY=${PYTHON:-python3}
SOURCE_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
SOURCE_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
# what `make models` derives from it on the 2-core CPU host (its manifest.json)
TARGET_SHA256=6532799f494167f79cf75f7de685ad44fe6a1fe1a9cd41d7a2cd9603e64d4b9b
DRAFT_SHA256=7b46609d11703c058397e5cfe4cc6e4b2508cb1eb4c80ddc472a5d421fbdb508
# pure-Python packages (and grpcio, protobuf) that the GPU image lacks or may hold in other
# versions; the daemon's generated modules need grpcio >= 1.85.1 and protobuf >= 7.35.1
WHEELS=("gguf==0.19.0" "structlog==26.1.0" "diskcache==5.6.3" "grpcio==1.85.3" "protobuf==7.36.2"
        "grpcio-health-checking==1.85.1" "grpcio-reflection==1.85.1" "prometheus-client==0.26.0"
        # the CLI's typer as pinned, and what it parses options with
        "typer==0.29.2" "pydantic==2.14.4" "pydantic-core==2.50.5" "annotated-types==0.8.0"
        "typing-inspection==0.4.5" "typing-extensions==4.16.0")
CATEGORIES=(code json legal rag chat chinese)
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1
mkdir -p "$S" "$OUT"
T0=$SECONDS
say() { echo "=== [$((SECONDS - T0)) s] $*"; }

install_wheels() {
  if [[ "$DRY" == "1" ]]; then
    # this machine's python may not take a wheel made for 3.12: the .venv's copy of that package
    # stands in for it
    local w n venv_site
    venv_site=$("$ROOT/.venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    for w in "$CARRY"/wheels/*.whl; do
      "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$w" 2>/dev/null && continue
      for n in $("$PY" -c "import sys, zipfile; print(*sorted({p.split('/')[0] for p in zipfile.ZipFile(sys.argv[1]).namelist()} ), sep=chr(10))" "$w" | grep -v '\.dist-info$'); do
        ln -sfn "$venv_site/$n" "$SITE/$n"
      done
      echo "dry run: $(basename "$w") replaced by the .venv's copy"
    done
  else
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$CARRY"/wheels/*.whl
  fi
}

do_run() {
  BUDGET=${GPU_BUDGET_S:-540}
  left() { echo $((BUDGET - (SECONDS - T0))); }
  R="$S/results"
  rm -rf "$R" && mkdir -p "$R"
  pack() { tar czf "$OUT/results.tgz" -C "$R" . 2>/dev/null; }
  if [[ "$DRY" != "1" ]]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv
  fi
  say "the source GGUF"
  cp "$CARRY"/p3/q41.part* "$S/parts/" 2>/dev/null
  HOME_DIR="$S/home"
  mkdir -p "$HOME_DIR/models/.source"
  SRCGGUF="$HOME_DIR/models/.source/$SOURCE_NAME"
  cat "$S/parts/q41.part1" "$S/parts/q41.part2" "$S/parts/q41.part3" > "$SRCGGUF"
  echo "$SOURCE_SHA256  $SRCGGUF" | sha256sum -c - || { echo "FAIL: source GGUF"; exit 1; }
  say "waiting for the build"
  while [[ ! -f "$S/build.rc" ]] && (( $(left) > 60 )); do sleep 2; done
  grep -E "^build: |Using CMAKE_CUDA_ARCHITECTURES|CUDA Toolkit found|error" "$S/build.log" | head -n 20
  if [[ "$(cat "$S/build.rc" 2>/dev/null)" != "0" ]]; then
    tail -n 80 "$S/build.log"; cp "$S/build.log" "$OUT/" 2>/dev/null
    echo "FAIL: build"; exit 1
  fi
  # shellcheck disable=SC1091
  [[ -f "$S/build.env" ]] && . "$S/build.env"
  export PYTHONPATH="$ROOT:$SITE:$LLAMA" EDGESPEC_HOME="$HOME_DIR" GPU_FLASH_ATTN=${GPU_FLASH_ATTN:-0}
  say "GPU offload, the demo pair (prepare_demo)"
  "$PY" - "$DRY" "$TARGET_SHA256" "$DRAFT_SHA256" <<'PY' || { echo "FAIL: models"; exit 1; }
import sys, time
import llama_cpp
from edgespec import backend
from edgespec.models import HEAD_NAME, prepare_demo, sha256_file
print("llama-cpp-python", llama_cpp.__version__, llama_cpp.__file__, "gpu offload:", backend.gpu_offload_supported())
assert sys.argv[1] == "1" or backend.gpu_offload_supported(), "this build cannot offload to the GPU"
t = time.perf_counter()
pair = prepare_demo(log=print)
print(f"prepare_demo: {time.perf_counter() - t:.1f} s")
for path, want in ((pair.target, sys.argv[2]), (pair.draft, sys.argv[3])):
    got = sha256_file(path)
    print(f"{path.name}: sha256 {got[:16]} {'= the CPU host' if got == want else '!= the CPU host ' + want[:16]}")
print("head:", (pair.target.parent / HEAD_NAME).is_file())
PY
  MODELS="$HOME_DIR/models"
  TARGET="$MODELS/SmolLM2-135M-Instruct.F32.gguf"
  DRAFT="$MODELS/SmolLM2-135M-Instruct.Q8_0.gguf"
  HEAD="$MODELS/SmolLM2-135M-Instruct.F32.eagle3.gguf"
  HELD="$S/heldout.jsonl"
  "$PY" - "$HELD" "${GPU_PER_CATEGORY:-2}" "${CATEGORIES[@]}" <<'PY'
import sys
n = int(sys.argv[2])
with open(sys.argv[1], "w", encoding="utf-8") as out:
    for cat in sys.argv[3:]:
        lines = [l for l in open(f"edgespec/bench/suites/{cat}.jsonl", encoding="utf-8") if l.strip()]
        out.writelines(lines[:n])
PY
  echo "HELDOUT: $(wc -l < "$HELD") prompts"
  LAUNCH=("$PY" tools/gpu-bench-launch.py)
  MT=${GPU_MAX_TOKENS:-64}
  REQ=${GPU_SERVE_REQUESTS:-48}
  ROUNDS=${GPU_SERVE_ROUNDS:-8}
  # step NAME MIN_SECONDS [VAR=VALUE ...] ARGS...: edgespec ARGS (with those variables set), cut
  # to what is left, reports into $R
  step() {
    local name=$1 need=$2; shift 2
    local vars=()
    while [[ "${1:-}" =~ ^[A-Z_]+= ]]; do vars+=("$1"); shift; done
    if [[ -n "${GPU_ONLY:-}" && " $GPU_ONLY " != *" $name "* ]]; then return; fi
    if (( $(left) < need )); then echo "SKIP $name: $(left) s left, it needs ~$need"; return; fi
    say "$name ($(left) s left) ${vars[*]}"
    local t=$SECONDS
    env "${vars[@]}" timeout -k 5 $(( $(left) - 8 )) "${LAUNCH[@]}" "$@" --json "$R/$name.json" --markdown "$R/$name.md" --no-progress
    echo "$name: exit $?, $((SECONDS - t)) s"
    [[ -f "$R/$name.md" ]] && cat "$R/$name.md"
    pack
  }
  GPU=(--n-gpu-layers -1)
  step heldout 40 bench --suite "$HELD" --modes plain,auto --head "$HEAD" --draft "$DRAFT" --max-tokens "$MT" "${GPU[@]}"
  SERVE=(bench-serve --modes auto,plain --suite "$HELD" --requests "$REQ" --rounds "$ROUNDS" --max-tokens "$MT" --no-scenario "${GPU[@]}")
  step serve-head 60 "${SERVE[@]}" --concurrency 4 --draft "$HEAD" --workdir "$R/serve-head"
  step serve-q8 60 "${SERVE[@]}" --concurrency 4 --draft "$DRAFT" --workdir "$R/serve-q8"
  step serve-repetitive 60 bench-serve --concurrency 4 --modes auto,plain --suite repetitive \
    --requests "${GPU_REP_REQUESTS:-120}" --rounds "${GPU_REP_ROUNDS:-12}" --max-tokens "${GPU_REP_MAX_TOKENS:-96}" \
    --suffix-cache --no-scenario "${GPU[@]}" --workdir "$R/serve-repetitive"
  # llama.cpp's CUDA graphs: a plain decode of this suite stops at an illegal instruction in a
  # replayed graph ("CUDA error: an illegal instruction was encountered" at the stream's
  # synchronize, after "CUDA graph warmup complete"); every mode of this step runs without them
  step repetitive 60 GGML_CUDA_DISABLE_GRAPHS=1 bench --suite repetitive --modes plain,auto,auto+suffix --max-tokens "${GPU_REP_MAX_TOKENS:-96}" \
    --limit "${GPU_REP_LIMIT:-60}" "${GPU[@]}"
  step serve1-head 40 "${SERVE[@]}" --concurrency 1 --draft "$HEAD" --workdir "$R/serve1-head"
  step serve1-q8 40 "${SERVE[@]}" --concurrency 1 --draft "$DRAFT" --workdir "$R/serve1-q8"
  # step 1 again without CUDA graphs: what they do to the cost curve and to the ratios
  step heldout-nographs 30 GGML_CUDA_DISABLE_GRAPHS=1 bench --suite "$HELD" --modes plain,auto --head "$HEAD" \
    --draft "$DRAFT" --max-tokens "$MT" "${GPU[@]}"
  grep -E "^build: " "$S/build.log" 2>/dev/null
  pack
  ls -la "$R" "$OUT"
  say "done"
}

case "${1:-}" in
prep)
  PREP_PY=${PREP_PYTHON:-$ROOT/.venv/bin/python}
  EXCLUDE=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$EXCLUDE")"
  grep -qxF '/.gpu-carry/' "$EXCLUDE" 2>/dev/null || echo '/.gpu-carry/' >> "$EXCLUDE"
  rm -rf "$CARRY" && mkdir -p "$CARRY"/{src,wheels,p1,p2,p3}
  # 1. the patched source, trimmed to what the library build reads (docs, tests, vocab models,
  #    the other GPU backends and llama.cpp's tools out)
  HERE="$ROOT/tools"
  # shellcheck source=tools/llama-build-env.sh
  source "$HERE/llama-build-env.sh"
  load_patches
  TMP=$(mktemp -d)
  patched_source "$PREP_PY" "$TMP"
  V="$SRC/vendor/llama.cpp"
  rm -rf "$SRC/.git" "$SRC/docker" "$SRC/examples" \
    "$V/docs" "$V/models" "$V/benches" "$V/tests" "$V/tools/ui" "$V/.github" "$V/.devops" "$V/media" "$V/examples" "$V/pocs"
  for b in sycl vulkan opencl hexagon metal et cann musa hip webgpu zdnn zendnn openvino virtgpu; do
    rm -rf "$V/ggml/src/ggml-$b"
  done
  find "$V/tools" -mindepth 1 -maxdepth 1 ! -name mtmd ! -name CMakeLists.txt -exec rm -rf {} +
  tar czf "$CARRY/src/llama_cpp_python-$VERSION-patched.tar.gz" -C "$TMP" "llama_cpp_python-$VERSION"
  rm -rf "$TMP"
  # 2. wheels for the box's python (3.12, x86-64)
  "$PREP_PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$CARRY/wheels" "${WHEELS[@]}"
  # 3. the source GGUF in three parts (call 1 also carries the source and the wheels)
  SRCGGUF=$("$PREP_PY" -c "from edgespec.config import models_dir; print(models_dir() / '.source' / '$SOURCE_NAME')")
  echo "$SOURCE_SHA256  $SRCGGUF" | sha256sum -c - || exit 1
  head -c $((22 * 1024 * 1024)) "$SRCGGUF" > "$CARRY/p1/q41.part1"
  tail -c +$((22 * 1024 * 1024 + 1)) "$SRCGGUF" | head -c $((36 * 1024 * 1024)) > "$CARRY/p2/q41.part2"
  tail -c +$((58 * 1024 * 1024 + 1)) "$SRCGGUF" > "$CARRY/p3/q41.part3"
  cat "$CARRY"/p*/q41.part* | sha256sum | grep -q "^$SOURCE_SHA256 " || { echo "parts do not reassemble" >&2; exit 1; }
  # 4. the daemon's generated protobuf modules
  "$PREP_PY" tools/gen_protos.py
  # 5. what each call carries
  TREE=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -n1 | cut -f1)
  PROTO=$(du -sb edgespec/proto | cut -f1)
  mb() { echo $(( ($1 + 1048575) / 1048576 )); }
  for call in "1 src wheels p1" "2 p2" "3 p3"; do
    set -- $call
    n=$1; shift
    b=$((TREE + PROTO))
    for d in "$@"; do b=$((b + $(du -sb "$CARRY/$d" | cut -f1))); done
    echo "call $n: $(mb $b) MiB (limit 64)"
    (( b < 63 * 1048576 )) || { echo "call $n is over the limit" >&2; exit 1; }
  done
  du -sh "$CARRY"/* edgespec/proto
  ;;

stage1)
  say "environment"
  if [[ "$DRY" != "1" ]]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
    nvcc --version | tail -n2
  fi
  "$PY" --version; nproc; grep -m1 "model name" /proc/cpuinfo; free -g | head -2; df -h /tmp | tail -1
  mkdir -p "$S/parts"
  cp "$CARRY"/p1/q41.part* "$S/parts/"
  say "carried wheels -> $SITE"
  rm -rf "$SITE" && install_wheels || { echo "FAIL: wheels"; exit 1; }
  say "the CUDA build, in the background -> $S/build.log"
  rm -rf "$S/llama_cpp_python-$VERSION" "$LLAMA" "$S/build.rc"
  tar xzf "$CARRY"/src/llama_cpp_python-*-patched.tar.gz -C "$S"
  if [[ "$DRY" == "1" ]]; then
    # no build: the repository's .venv llama_cpp (the patched CPU wheel) stands in for it
    mkdir -p "$LLAMA"
    ln -s "$("$ROOT/.venv/bin/python" -c 'import llama_cpp, os; print(os.path.dirname(llama_cpp.__file__))')" "$LLAMA/llama_cpp"
    echo 0 > "$S/build.rc"
  else
    FA=OFF; [[ "${GPU_FLASH_ATTN:-0}" == "1" ]] && FA=ON
    export BUILD_PY="$PY" BUILD_S="$S" BUILD_LLAMA="$LLAMA" BUILD_SRC="$S/llama_cpp_python-$VERSION" BUILD_FA=$FA \
      BUILD_ARCH=${CUDA_ARCHITECTURES:-90}
    cat > "$S/build.sh" <<'EOF'
t=$SECONDS
CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=$BUILD_ARCH -DGGML_CUDA_FA=$BUILD_FA -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DLLAVA_BUILD=OFF -DLLAMA_CURL=OFF"
# cuBLAS: from the toolkit beside nvcc, else wherever its header and library lie (the image's pip
# nvidia-cublas); the run then needs that library's directory too ($BUILD_S/build.env)
CUDA_ROOT=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
echo "nvcc: $(command -v nvcc) (toolkit $CUDA_ROOT)"
: > "$BUILD_S/build.env"
if ! ls "$CUDA_ROOT"/include/cublas_v2.h "$CUDA_ROOT"/targets/*/include/cublas_v2.h \
    /usr/local/cuda/include/cublas_v2.h /usr/local/cuda/targets/*/include/cublas_v2.h >/dev/null 2>&1; then
  H=$(find /usr/local /opt /usr/include -name cublas_v2.h 2>/dev/null | head -n1)
  L=$(find "$(dirname "$(dirname "$H")")" /usr/local /opt -name 'libcublas.so*' 2>/dev/null | head -n1)
  LT=$(find "$(dirname "$L")" -name 'libcublasLt.so*' 2>/dev/null | head -n1)
  echo "cuBLAS not beside nvcc: header $H, library $L, $LT"
  export CPATH="$(dirname "$H")${CPATH:+:$CPATH}"
  CMAKE_ARGS="$CMAKE_ARGS -DCUDA_cublas_LIBRARY=$L -DCUDA_cublasLt_LIBRARY=$LT"
  echo "export LD_LIBRARY_PATH=$(dirname "$L")\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" > "$BUILD_S/build.env"
  . "$BUILD_S/build.env"
fi
export CMAKE_ARGS CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
echo "CMAKE_ARGS=$CMAKE_ARGS"
"$BUILD_PY" -m pip install --no-index --no-deps --no-build-isolation --no-compile --target "$BUILD_LLAMA" -v "$BUILD_SRC"
rc=$?
# the C++ runtime the build was compiled against (the GPU image's g++ is /opt/gcc's, newer than
# the system libstdc++ python3 loads: without this, llama.cpp's tokenizer regex segfaults at load)
echo "export LD_PRELOAD=$("${CXX:-g++}" -print-file-name=libstdc++.so.6)" >> "$BUILD_S/build.env"
echo "build: $((SECONDS - t)) s, exit $rc"
echo $rc > "$BUILD_S/build.rc"
EOF
    setsid nohup bash "$S/build.sh" > "$S/build.log" 2>&1 < /dev/null &
    echo "build started (pid $!)"
  fi
  say "imports (PYTHONPATH = repo + carried wheels; llama_cpp comes with the build)"
  PYTHONPATH="$ROOT:$SITE" "$PY" - <<'PY'
import importlib
for name in ("numpy", "jinja2", "tqdm", "yaml", "typer", "typer._adapters", "pydantic", "rich", "gguf", "structlog", "diskcache", "grpc",
             "google.protobuf", "grpc_health.v1.health", "grpc_reflection.v1alpha.reflection", "prometheus_client",
             "matplotlib", "edgespec.proto.edgespec.v1.inference_pb2_grpc", "edgespec.proto.edgespec.v1.admin_pb2_grpc",
             "edgespec.bench.suite", "edgespec.bench.serve_clients", "edgespec.settings"):
    try:
        m = importlib.import_module(name)
        print(f"ok   {name} {getattr(m, '__version__', '')} {getattr(m, '__file__', '')}")
    except Exception as e:  # noqa: BLE001 - a report
        print(f"FAIL {name}: {type(e).__name__}: {e}")
PY
  ;;

stage2)
  cp "$CARRY"/p2/q41.part* "$S/parts/"
  ls -la "$S/parts"
  grep -oE "\[[0-9]+/[0-9]+\]" "$S/build.log" 2>/dev/null | tail -n1 || true
  cat "$S/build.rc" 2>/dev/null || echo "build running"
  ;;

run)
  do_run 2>&1 | tee "$OUT/gpu-bench.log"
  exit "${PIPESTATUS[0]}"
  ;;


emu)
  # a python standing in for the GPU image's, for CPU_DRYRUN=1: a bare venv that sees, of this
  # repository's .venv, only the packages the image also holds (docs: the device's KINDS.md), so
  # an import of anything else fails here as it would there (PYTHON=/tmp/es-emu/bin/python)
  EMU=/tmp/es-emu
  VENV_SITE=$("$ROOT/.venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  rm -rf "$EMU" && "$(readlink -f "$ROOT/.venv/bin/python")" -m venv "$EMU" && mkdir -p "$EMU/image"
  for name in numpy numpy.libs jinja2 markupsafe tqdm yaml _yaml typer click rich markdown_it mdurl pygments \
      shellingham annotated_doc typing_extensions.py grpc google prometheus_client matplotlib mpl_toolkits \
      contourpy cycler fontTools kiwisolver PIL pillow.libs pyparsing dateutil packaging requests urllib3 idna \
      certifi charset_normalizer anyio h11 sniffio; do
    [[ -e "$VENV_SITE/$name" ]] && ln -s "$VENV_SITE/$name" "$EMU/image/$name"
  done
  ls "$VENV_SITE" | grep -iE '^(numpy|jinja2|markupsafe|tqdm|pyyaml|typer|click|rich|grpcio|protobuf|prometheus_client|matplotlib|pillow|packaging)-[0-9].*dist-info$' \
    | while read -r d; do ln -s "$VENV_SITE/$d" "$EMU/image/$d"; done
  echo "$EMU/image" > "$("$EMU/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/image.pth"
  "$EMU/bin/python" -c "import numpy, typer, grpc; print('emulated image ok:', numpy.__version__, grpc.__version__)"
  ;;

*)
  echo "usage: $0 prep|stage1|stage2|run|emu" >&2
  exit 2
  ;;
esac
