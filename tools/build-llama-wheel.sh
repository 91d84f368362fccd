#!/usr/bin/env bash
# Build (or reuse) a llama-cpp-python wheel for the given CMake flags, from the pinned sdist with
# edgespec's ggml patches (tools/patches/*.patch) applied.
#
# pip's own wheel cache ignores CMAKE_ARGS, so a wheel built earlier with other flags would be
# silently reused.  We keep our own cache keyed by a hash of the version, the exact flags and the
# patches, and always build with --no-cache-dir.
#
# The patch (see tools/patches/README.md): ggml-batch-invariant.patch makes every CPU forward
# batch-invariant (one reduction order per element in the F32 and Q8_0 mat-muls and in flash
# attention, cells visited in position order), streams each F32 weight row once for all
# of a forward's tokens (verification costs about what a plain step costs), gives Q8_0, Q6_K and Q5_K multi-column kernels, and adds
# an abort flag the engine sets to stop a forward between graph nodes; ggml-repack-invariant.patch makes the x86
# repacked Q4_K kernels batch-invariant, so exact CPU targets keep ggml's repacked layouts.
#
# usage: tools/build-llama-wheel.sh PYTHON
#   env: LLAMA_CPP_VERSION (default 0.3.36), CUDA=1, CUDA_ARCHITECTURES, CMAKE_ARGS (override)
#        EDGESPEC_WHEEL_CACHE (default ~/.cache/edgespec/wheels)
#        EDGESPEC_SDIST_CACHE (default ~/.cache/edgespec/sdist; shared with tools/llama-anchor.sh)
#        EDGESPEC_GGML_PATCHES=0 builds the stock sdist (for A/B measurements)
#        EDGESPEC_CPU=auto|portable (tools/cpu-flags.sh)
#        RPC=1 adds llama.cpp's RPC backend (-DGGML_RPC=ON): a target spread over `rpc-server`s
#              on other boxes ([target] rpc_servers; tools/build-rpc-server.sh builds the server)
# prints the path of the wheel on its last line.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${1:-python3}
# VERSION, and the CPU instruction sets (EDGESPEC_CPU=auto|portable, tools/cpu-flags.sh): the
# features a wheel needs are recorded beside it (CPU_FEATURES) and checked by install.sh.
# shellcheck source=tools/llama-build-env.sh
source "$HERE/llama-build-env.sh"
if [[ -z "${CMAKE_ARGS:-}" ]]; then
  if [[ "${CUDA:-0}" == "1" ]]; then
    CMAKE_ARGS="$CPU_FLAGS $(cuda_flags)"
  else
    CMAKE_ARGS="$CPU_FLAGS"
  fi
else
  # an explicit override: record only what it names
  CPU_FEATURES="avx avx2 fma f16c bmi2"
  [[ "$CMAKE_ARGS" == *GGML_AVX512=ON* ]] && CPU_FEATURES="$CPU_FEATURES avx512f avx512bw avx512vl avx512dq avx512cd"
fi
if [[ "${RPC:-0}" == "1" && "$CMAKE_ARGS" != *GGML_RPC=* ]]; then
  CMAKE_ARGS="$CMAKE_ARGS -DGGML_RPC=ON"
fi
export CMAKE_ARGS
load_patches
KEY=$(printf '%s|%s|%s|%s' "$VERSION" "$CMAKE_ARGS" "$($PY -c 'import sys;print(sys.implementation.cache_tag)')" \
  "$PATCH_SUM" | sha256sum | cut -c1-16)
CACHE=${EDGESPEC_WHEEL_CACHE:-$HOME/.cache/edgespec/wheels}/$KEY
mkdir -p "$CACHE"
WHEEL=$(ls "$CACHE"/llama_cpp_python-"$VERSION"-*.whl 2>/dev/null | head -n1 || true)
if [[ -n "$WHEEL" ]]; then
  echo "reusing $WHEEL (flags: $CMAKE_ARGS; patches: ${#PATCHES[@]})" >&2
  echo "$WHEEL"
  exit 0
fi

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
patched_source "$PY" "$TMP"
echo "building llama-cpp-python $VERSION with CMAKE_ARGS=\"$CMAKE_ARGS\", ${#PATCHES[@]} patch(es) (takes ~7 min on 2 cores)" >&2
echo "$CMAKE_ARGS" > "$CACHE/CMAKE_ARGS"
echo "$CPU_FEATURES" > "$CACHE/CPU_FEATURES"
for p in "${PATCHES[@]}"; do basename "$p"; done > "$CACHE/PATCHES"
CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
  $PY -m pip wheel --no-cache-dir --no-deps "$SRC" -w "$TMP/wheel" >&2
mv "$TMP"/wheel/llama_cpp_python-*.whl "$CACHE"/
WHEEL=$(ls "$CACHE"/llama_cpp_python-"$VERSION"-*.whl | head -n1)
echo "$WHEEL"
