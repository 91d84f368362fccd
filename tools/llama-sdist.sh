# Sourced by tools/build-llama-wheel.sh and tools/llama-anchor.sh.
# llama_sdist PYTHON VERSION DIR: print the path of the llama-cpp-python VERSION sdist in DIR,
# downloading it once from the package registry (progress on stderr).
llama_sdist() {
  local py=$1 version=$2 dir=$3
  local f="$dir/llama_cpp_python-$version.tar.gz"
  if [[ ! -f "$f" ]]; then
    mkdir -p "$dir"
    echo "downloading llama-cpp-python==$version sdist" >&2
    "$py" -m pip download -q --no-cache-dir --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$dir" >&2
  fi
  echo "$f"
}
