#!/usr/bin/env bash
# The llama.cpp anchor: build llama.cpp's own binaries from the llama.cpp vendored in the
# llama-cpp-python sdist we pin (same source as the engine's backend), then run plain decoding
# (llama-completion) and llama.cpp's own draft-model speculation (llama-speculative-simple) on
# the same models, prompts and token counts as `edgespec bench`; llama.cpp's HTTP server
# (llama-server) is built too, for `edgespec bench-serve --llama-server-bin`, and
# llama-batched-bench (forward cost by batch, tools/gpu-bench.sh) in the same CMake pass.
#
# usage:
#   tools/llama-anchor.sh build                      # prints the bin dir on its last line
#   tools/llama-anchor.sh run --suite structured --target T.gguf --draft D.gguf \
#        [--max-tokens 128] [--threads 2] [--draft-max 4] [--json anchor.json] [--limit N]
#   then: edgespec bench ... --anchor anchor.json
#
# env: LLAMA_CPP_VERSION (default 0.3.36), EDGESPEC_CPU=auto|portable, CUDA=1 (adds -DGGML_CUDA=on), CUDA_ARCHITECTURES,
#      CUDA_FA=OFF (leaves out the CUDA flash-attention kernels: half the build; run with -fa off),
#      EDGESPEC_ANCHOR_CACHE (default ~/.cache/edgespec), JOBS (default 2), PYTHON (default .venv/bin/python)
# The sdist and the build live in the cache, never in the repository.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$HERE")
VERSION=${LLAMA_CPP_VERSION:-0.3.36}
CACHE=${EDGESPEC_ANCHOR_CACHE:-$HOME/.cache/edgespec}
PY=${PYTHON:-$ROOT/.venv/bin/python}
JOBS=${JOBS:-2}
TARGETS=(llama-speculative-simple llama-completion llama-bench llama-server)
# built in the same pass, not required of a bin dir built before they were added (reused as it is)
EXTRA_TARGETS=(llama-batched-bench)
# the same CPU instruction sets as the engine's wheel (tools/cpu-flags.sh), stock source (no patches)
# shellcheck source=tools/cpu-flags.sh
source "$HERE/cpu-flags.sh"
FLAGS="-DCMAKE_BUILD_TYPE=Release $CPU_FLAGS -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF"
if [[ "${CUDA:-0}" == "1" ]]; then
  FLAGS="$FLAGS -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHITECTURES:-80;86;89;90}${CUDA_FA:+ -DGGML_CUDA_FA=$CUDA_FA}"
fi

# the sdist, downloaded once from the package registry (or placed in the cache beforehand)
# shellcheck source=tools/llama-sdist.sh
source "$HERE/llama-sdist.sh"
sdist() { llama_sdist "$PY" "$VERSION" "$CACHE/sdist"; }

build() {
  local key src bin tarball
  key=$(printf '%s|%s|%s' "$VERSION" "$FLAGS" "${TARGETS[*]}" | sha256sum | cut -c1-16)
  bin="$CACHE/llama-anchor/$key/bin"
  local t have=1
  for t in "${TARGETS[@]}"; do [[ -x "$bin/$t" ]] || have=0; done
  if [[ $have == 1 ]]; then
    echo "reusing $bin" >&2
    echo "$bin"
    return
  fi
  tarball=$(sdist)
  src="$CACHE/llama-anchor/$key/src"
  rm -rf "$src" && mkdir -p "$src"
  tar xzf "$tarball" -C "$src" --strip-components=1
  echo "$FLAGS" > "$CACHE/llama-anchor/$key/FLAGS"
  echo "building ${TARGETS[*]} (llama.cpp from llama-cpp-python $VERSION) with: $FLAGS" >&2
  local t0=$SECONDS
  # shellcheck disable=SC2086
  cmake -S "$src/vendor/llama.cpp" -B "$src/build" -G Ninja $FLAGS >&2
  cmake --build "$src/build" -j "$JOBS" --target "${TARGETS[@]}" "${EXTRA_TARGETS[@]}" >&2
  mkdir -p "$bin"
  cp -a "$src/build/bin/." "$bin/"
  rm -rf "$src"  # keep only the (statically linked) binaries
  echo "built in $((SECONDS - t0)) s" >&2
  echo "$bin"
}

cmd=${1:-}
shift || true
case "$cmd" in
  build) build ;;
  run)
    bin=$(build | tail -n1)
    PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" -m edgespec.bench.anchor --bin "$bin" "$@"
    ;;
  *) sed -n '2,18p' "$0" >&2; exit 2 ;;
esac
