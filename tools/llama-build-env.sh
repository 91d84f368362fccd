# Sourced by tools/build-llama-wheel.sh and tools/build-rpc-server.sh (with HERE = tools/): what
# both builds of llama.cpp share. Sets VERSION (LLAMA_CPP_VERSION, default 0.3.36) and, through
# tools/cpu-flags.sh, CPU_FLAGS and CPU_FEATURES; defines the functions below.
# shellcheck shell=bash
VERSION=${LLAMA_CPP_VERSION:-0.3.36}
# shellcheck source=tools/cpu-flags.sh
source "$HERE/cpu-flags.sh"

# The CMake flags of a CUDA build (CUDA=1): the GPU archs named explicitly
# (90 = Hopper H100/H200, 89 = Ada L4/L40, 80 = A100, 86 = A10/RTX 30xx); CUDA_FA=OFF leaves out
# the flash-attention kernels (half the build; the models then need flash_attn = false).
cuda_flags() {
  echo "-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHITECTURES:-80;86;89;90}${CUDA_FA:+ -DGGML_CUDA_FA=$CUDA_FA}"
}

# PATCHES: edgespec's ggml patches (tools/patches/*.patch; none with EDGESPEC_GGML_PATCHES=0),
# PATCH_SUM: a hash of their contents, for the build caches' keys.
load_patches() {
  PATCHES=()
  if [[ "${EDGESPEC_GGML_PATCHES:-1}" != "0" ]]; then
    mapfile -t PATCHES < <(ls "$HERE"/patches/*.patch 2>/dev/null | sort)
  fi
  PATCH_SUM=$(cat /dev/null "${PATCHES[@]}" | sha256sum | cut -c1-16)
}

# patched_source PYTHON DIR: the pinned sdist (tools/llama-sdist.sh) extracted into DIR with
# PATCHES applied; sets SRC to the source tree.
patched_source() {
  # shellcheck source=tools/llama-sdist.sh
  source "$HERE/llama-sdist.sh"
  local sdist
  sdist=$(llama_sdist "$1" "$VERSION" "${EDGESPEC_SDIST_CACHE:-$HOME/.cache/edgespec/sdist}")
  tar xzf "$sdist" -C "$2"
  SRC="$2/llama_cpp_python-$VERSION"
  local p
  for p in "${PATCHES[@]}"; do
    echo "applying $(basename "$p")" >&2
    patch -p1 -s -d "$SRC" < "$p" >&2
  done
}
