#!/usr/bin/env bash
# Build (or reuse) llama.cpp's `rpc-server` (target ggml-rpc-server) from the same pinned sdist,
# ggml patches and CPU flags as the wheel (tools/build-llama-wheel.sh), as one static binary.
#
# An rpc-server lends its box's memory and compute to a target too large for one appliance:
# run it on each helper box, list them in the appliance's `[target] rpc_servers`, and build the
# appliance's wheel with RPC=1 (docs/appliance.md, "A target larger than one box").
#
# usage: tools/build-rpc-server.sh PYTHON
#   env: LLAMA_CPP_VERSION (default 0.3.36), CUDA=1 + CUDA_ARCHITECTURES (a helper box with a
#        GPU), EDGESPEC_CPU=auto|portable, EDGESPEC_RPC_CACHE (default ~/.cache/edgespec/rpc-server),
#        EDGESPEC_SDIST_CACHE, EDGESPEC_GGML_PATCHES=0 (as tools/build-llama-wheel.sh)
# prints the path of the binary on its last line.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${1:-python3}
# shellcheck source=tools/llama-build-env.sh
source "$HERE/llama-build-env.sh"
FLAGS="$CPU_FLAGS -DGGML_RPC=ON"
[[ "${CUDA:-0}" == "1" ]] && FLAGS="$FLAGS $(cuda_flags)"
load_patches
KEY=$(printf '%s|%s|%s' "$VERSION" "$FLAGS" "$PATCH_SUM" | sha256sum | cut -c1-16)
CACHE=${EDGESPEC_RPC_CACHE:-$HOME/.cache/edgespec/rpc-server}/$KEY
if [[ -x "$CACHE/rpc-server" ]]; then
  echo "reusing $CACHE/rpc-server (flags: $FLAGS)" >&2
  echo "$CACHE/rpc-server"
  exit 0
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
patched_source "$PY" "$TMP"
echo "building rpc-server from llama-cpp-python $VERSION's llama.cpp with $FLAGS" >&2
# shellcheck disable=SC2086
cmake -S "$SRC/vendor/llama.cpp" -B "$TMP/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_CURL=OFF $FLAGS >&2
cmake --build "$TMP/build" --target ggml-rpc-server -j "${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" >&2
mkdir -p "$CACHE"
cp "$TMP/build/bin/ggml-rpc-server" "$CACHE/rpc-server.tmp"
mv "$CACHE/rpc-server.tmp" "$CACHE/rpc-server"
echo "$FLAGS" > "$CACHE/FLAGS"
echo "$CACHE/rpc-server"
