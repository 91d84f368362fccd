#!/usr/bin/env bash
# Build (or reuse) a llama-cpp-python wheel for the given CMake flags.
#
# pip's own wheel cache ignores CMAKE_ARGS, so a wheel built earlier with other
# flags would be silently reused.  We keep our own cache keyed by a hash of the
# version and the exact flags, and always build with --no-cache-dir.
#
# usage: tools/build-llama-wheel.sh PYTHON OUT_VAR_FILE
#   env: LLAMA_CPP_VERSION (default 0.3.36), CUDA=1, CUDA_ARCHITECTURES, CMAKE_ARGS (override)
#        EDGESPEC_WHEEL_CACHE (default ~/.cache/edgespec/wheels)
# prints the path of the wheel on its last line.
set -euo pipefail
PY=${1:-python3}
VERSION=${LLAMA_CPP_VERSION:-0.3.36}
CPU_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
if [[ -z "${CMAKE_ARGS:-}" ]]; then
  if [[ "${CUDA:-0}" == "1" ]]; then
    # CUDA build: GGML_NATIVE=OFF keeps the CPU part portable; pick the GPU archs explicitly
    # (90 = Hopper H100/H200, 89 = Ada L4/L40, 80 = A100, 86 = A10/RTX 30xx).
    CMAKE_ARGS="$CPU_FLAGS -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHITECTURES:-80;86;89;90}"
  else
    CMAKE_ARGS="$CPU_FLAGS"
  fi
fi
export CMAKE_ARGS
KEY=$(printf '%s|%s|%s' "$VERSION" "$CMAKE_ARGS" "$($PY -c 'import sys;print(sys.implementation.cache_tag)')" | sha256sum | cut -c1-16)
CACHE=${EDGESPEC_WHEEL_CACHE:-$HOME/.cache/edgespec/wheels}/$KEY
mkdir -p "$CACHE"
WHEEL=$(ls "$CACHE"/llama_cpp_python-"$VERSION"-*.whl 2>/dev/null | head -n1 || true)
if [[ -z "$WHEEL" ]]; then
  echo "building llama-cpp-python $VERSION with CMAKE_ARGS=\"$CMAKE_ARGS\" (takes ~7 min on 2 cores)" >&2
  echo "$CMAKE_ARGS" > "$CACHE/CMAKE_ARGS"
  TMP=$(mktemp -d)
  CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
    $PY -m pip wheel --no-cache-dir --no-deps --no-binary llama-cpp-python \
      "llama-cpp-python==$VERSION" -w "$TMP" >&2
  mv "$TMP"/llama_cpp_python-*.whl "$CACHE"/
  rmdir "$TMP" 2>/dev/null || true
  WHEEL=$(ls "$CACHE"/llama_cpp_python-"$VERSION"-*.whl | head -n1)
else
  echo "reusing $WHEEL (flags: $CMAKE_ARGS)" >&2
fi
echo "$WHEEL"
