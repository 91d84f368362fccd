#!/usr/bin/env bash
# Prepare, on a machine WITH network, what tools/gpu-check.sh needs on a GPU machine WITHOUT one:
#   .gpu-carry/llama_cpp_python-<v>-trimmed.tar.gz  the pinned sdist minus docs, vocab models, tests,
#                                                   the web UI and the non-CUDA GPU backends
#   .gpu-carry/wheels/                              pure-Python wheels the GPU image lacks
#   .gpu-carry/models/target.gguf, draft.gguf       only when GPU_TARGET / GPU_DRAFT are given
# `.gpu-carry/` is listed in .git/info/exclude (never committed) and is carried explicitly:
#   device run: carry [".gpu-carry"], command "tools/gpu-check.sh"
# The whole working tree that travels is limited to 64 MiB: this script prints the sizes and
# refuses to finish above GPU_CARRY_MAX_MB (default 60). The demo pair (F32 target 515 MiB,
# Q8_0 draft 138 MiB) does not fit; without models gpu-check.sh does the build and GPU checks and
# skips the bench.
#
# env: LLAMA_CPP_VERSION (0.3.36), EDGESPEC_ANCHOR_CACHE (~/.cache/edgespec), PYTHON (.venv/bin/python),
#      GPU_TARGET, GPU_DRAFT (GGUF paths to carry), GPU_CARRY_MAX_MB (60)
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$HERE")
VERSION=${LLAMA_CPP_VERSION:-0.3.36}
CACHE=${EDGESPEC_ANCHOR_CACHE:-$HOME/.cache/edgespec}
PY=${PYTHON:-$ROOT/.venv/bin/python}
CARRY="$ROOT/.gpu-carry"
MAX_MB=${GPU_CARRY_MAX_MB:-60}
# pure-Python packages edgespec + llama-cpp-python need that the GPU image does not hold
# (it has numpy, jinja2, typer, tqdm, matplotlib, pyyaml, scikit-build-core, cmake, ninja)
WHEELS=("gguf==0.19.0" "structlog==26.1.0" "diskcache==5.6.3")

EXCLUDE=$(git -C "$ROOT" rev-parse --git-path info/exclude)
case "$EXCLUDE" in /*) ;; *) EXCLUDE="$ROOT/$EXCLUDE" ;; esac
mkdir -p "$(dirname "$EXCLUDE")"
grep -qxF '/.gpu-carry/' "$EXCLUDE" 2>/dev/null || echo '/.gpu-carry/' >> "$EXCLUDE"
mkdir -p "$CARRY/wheels" "$CARRY/models"

# 1. the sdist (shared with tools/llama-anchor.sh's cache), trimmed
# shellcheck source=tools/llama-sdist.sh
source "$HERE/llama-sdist.sh"
SDIST=$(llama_sdist "$PY" "$VERSION" "$CACHE/sdist")
TRIMMED="$CARRY/llama_cpp_python-$VERSION-trimmed.tar.gz"
if [[ ! -f "$TRIMMED" ]]; then
  TMP=$(mktemp -d)
  tar xzf "$SDIST" -C "$TMP"
  SRC="$TMP/llama_cpp_python-$VERSION"
  V="$SRC/vendor/llama.cpp"
  rm -rf "$SRC/.git" "$SRC/docker" "$SRC/examples" \
    "$V/docs" "$V/models" "$V/benches" "$V/tests" "$V/tools/ui" "$V/.github" "$V/.devops" "$V/media"
  for b in sycl vulkan opencl hexagon metal et cann musa hip webgpu zdnn zendnn openvino virtgpu; do
    rm -rf "$V/ggml/src/ggml-$b"
  done
  tar czf "$TRIMMED" -C "$TMP" "llama_cpp_python-$VERSION"
  rm -rf "$TMP"
fi

# 2. wheels
"$PY" -m pip download -q --no-deps --only-binary :all: -d "$CARRY/wheels" "${WHEELS[@]}"

# 3. models (optional)
[[ -n "${GPU_TARGET:-}" ]] && cp -f "$GPU_TARGET" "$CARRY/models/target.gguf"
[[ -n "${GPU_DRAFT:-}" ]] && cp -f "$GPU_DRAFT" "$CARRY/models/draft.gguf"

du -sh "$TRIMMED" "$CARRY/wheels" "$CARRY/models" >&2
CARRY_MB=$(du -sm "$CARRY" | cut -f1)
TREE_MB=$(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | xargs -0 du -cm 2>/dev/null | tail -n1 | cut -f1)
echo "carry: ${CARRY_MB} MiB, working tree: ${TREE_MB} MiB, together $((CARRY_MB + TREE_MB)) MiB (limit 64 MiB)" >&2
if (( CARRY_MB + TREE_MB > MAX_MB )); then
  echo "error: over ${MAX_MB} MiB: carry smaller models (or none)" >&2
  exit 1
fi
echo "ready: device run with carry [\".gpu-carry\"] and command \"tools/gpu-check.sh\"" >&2
