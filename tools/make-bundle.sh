#!/usr/bin/env bash
# Build the offline bundle: dist/edgespec-bundle-<version>.tar.gz (+ .sha256 beside it).
#
# The bundle holds everything an air-gapped box needs: a wheelhouse with every dependency (with a
# llama-cpp-python wheel built here with chosen CMake flags), the models and their manifest (after
# `make models`: the demo pair and the demo target's EAGLE-3 head, role head; the edgespec wheel
# also carries the head as package data), the
# systemd units, a default config, the docs, install.sh, and SHA256SUMS over every file.
# Building may use the network (PyPI); installing never does (install.sh: pip --no-index).
#
# usage: tools/make-bundle.sh            (run by `make bundle`)
#   env: PYTHON       venv python used to build wheels (default .venv/bin/python)
#        CUDA=1       llama-cpp-python with -DGGML_CUDA=on; CUDA_ARCHITECTURES="80;86;89;90"
#        RPC=1        llama-cpp-python with -DGGML_RPC=ON, and rpc-server/rpc-server for helper boxes
#        CMAKE_ARGS   full override of the llama.cpp CMake flags (see tools/build-llama-wheel.sh)
#        MODELS_DIR   where the models are (default: edgespec.config.models_dir())
#        MODELS       manifest names to bundle, comma- or space-separated (default: every file in the
#                     manifest); MODELS=none: a software-only bundle (the installer keeps the models
#                     already installed)
#        DIST         output directory (default dist/)
#        GZIP_LEVEL   1..9 (default 6)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-$ROOT/.venv/bin/python}
DIST=${DIST:-$ROOT/dist}
VERSION=$("$PY" -c 'import tomllib;print(tomllib.load(open("pyproject.toml","rb"))["project"]["version"])')
NAME=edgespec-bundle-$VERSION
MODELS_DIR=${MODELS_DIR:-$("$PY" -c 'from edgespec.config import models_dir; print(models_dir())')}
log() { echo "make-bundle: $*" >&2; }

MODELS=${MODELS:-}
MODELS=${MODELS//,/ }
if [[ $MODELS == none ]]; then
  MODELS=""
  log "software-only bundle: no models (install.sh keeps the installed ones)"
else
  [[ -f "$MODELS_DIR/manifest.json" ]] || { log "no $MODELS_DIR/manifest.json: run 'make models' or 'edgespec models add' first"; exit 1; }
  if [[ -z "${MODELS// /}" ]]; then
    MODELS=$("$PY" -c 'import json,sys; print(" ".join(sorted(json.load(open(sys.argv[1]))["files"])))' "$MODELS_DIR/manifest.json")
  fi
  [[ -n "${MODELS// /}" ]] || { log "$MODELS_DIR/manifest.json lists no models (MODELS=none for a software-only bundle)"; exit 1; }
fi

STAGE=$(mktemp -d "${TMPDIR:-/tmp}/edgespec-bundle.XXXXXX")
trap 'rm -rf "$STAGE"' EXIT
B=$STAGE/$NAME
mkdir -p "$B"/{wheelhouse,models,systemd/edgespec.service.d,config,doc}

# 0. Models and their manifest (only the chosen files; none for a software-only bundle), first:
#    a name the manifest lacks fails before minutes of wheel building.
"$PY" - "$MODELS_DIR" "$B/models" $MODELS <<'EOF'
import json, shutil, sys
from pathlib import Path
src, dst, names = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
if not names:  # software-only: an empty manifest tells install.sh to leave the models alone
    (dst / "manifest.json").write_text(json.dumps({"files": {}, "software_only": True}, indent=2) + "\n")
    sys.exit(0)
manifest = json.loads((src / "manifest.json").read_text())
files = {}
for name in names:
    name = name if name in manifest["files"] or name.endswith(".gguf") else name + ".gguf"
    entry = manifest["files"].get(name)
    if entry is None:
        known = ", ".join(sorted(manifest["files"])) or "none"
        sys.exit(f"make-bundle: MODELS: {name} is not in {src}/manifest.json (listed: {known}; "
                 "add a file with `edgespec models add PATH`)")
    if (src / name).stat().st_size != entry["size"]:
        sys.exit(f"make-bundle: {src / name} is not the size its manifest entry says: run `edgespec models verify`")
    shutil.copyfile(src / name, dst / name)  # a --link entry ships the file it points at
    files[name] = {k: v for k, v in entry.items() if k != "link"}
(dst / "manifest.json").write_text(json.dumps({**manifest, "files": files}, indent=2, sort_keys=True) + "\n")
EOF

# 1. llama-cpp-python, built here with explicit flags (cached by flags; CPU-portable by default).
LLAMA_WHEEL=$(tools/build-llama-wheel.sh "$PY" | tail -n1)
cp "$LLAMA_WHEEL" "$B/wheelhouse/"
log "llama-cpp-python: $(basename "$LLAMA_WHEEL") ($(cat "$(dirname "$LLAMA_WHEEL")/CMAKE_ARGS" 2>/dev/null || echo flags unknown))"

# 1b. RPC=1: llama.cpp's rpc-server for the helper boxes of a target larger than one box.
if [[ "${RPC:-0}" == "1" ]]; then
  mkdir -p "$B/rpc-server"
  cp "$(tools/build-rpc-server.sh "$PY" | tail -n1)" "$B/rpc-server/rpc-server"
fi

# 2. edgespec itself (generated protobuf modules included) and every runtime dependency.
#    --find-links the built llama wheel so pip takes it instead of building PyPI's sdist.
[[ -f tools/gen_protos.py ]] && "$PY" tools/gen_protos.py >&2
"$PY" -m pip wheel -q --no-build-isolation --prefer-binary \
  --find-links "$B/wheelhouse" --wheel-dir "$B/wheelhouse" . >&2
n_llama=$(ls "$B"/wheelhouse/llama_cpp_python-*.whl | wc -l)
[[ $n_llama == 1 ]] || { log "expected exactly one llama-cpp-python wheel, found $n_llama"; exit 1; }
cmp -s "$LLAMA_WHEEL" "$B"/wheelhouse/llama_cpp_python-*.whl || { log "pip replaced the built llama wheel"; exit 1; }

# 3. Units, config, docs, installer, build facts.
cp systemd/*.service "$B/systemd/"
cp systemd/edgespec.service.d/override.conf.example "$B/systemd/edgespec.service.d/"
if [[ -f configs/edgespec.toml ]]; then
  cp configs/edgespec.toml "$B/config/edgespec.toml"
else
  printf '# edgespec daemon configuration: empty = built-in defaults (demo models under EDGESPEC_HOME).\n' \
    > "$B/config/edgespec.toml"
fi
[[ -f docs/appliance.md ]] && cp docs/appliance.md "$B/doc/"
cp tools/install.sh "$B/install.sh"
chmod 755 "$B/install.sh"
{
  echo "VERSION=$VERSION"
  echo "PYTHON_VERSION=$("$PY" -c 'import sys;print("%d.%d" % sys.version_info[:2])')"
  echo "PLATFORM=$(uname -m)"
  echo "CUDA=${CUDA:-0}"
  echo "RPC=${RPC:-0}"
  echo "LLAMA_CMAKE_ARGS=\"$(cat "$(dirname "$LLAMA_WHEEL")/CMAKE_ARGS" 2>/dev/null || true)\""
  echo "LLAMA_CPU_FEATURES=\"$(cat "$(dirname "$LLAMA_WHEEL")/CPU_FEATURES" 2>/dev/null || echo avx avx2 fma f16c bmi2)\""
  echo "LLAMA_PATCHES=\"$(tr '\n' ' ' < "$(dirname "$LLAMA_WHEEL")/PATCHES" 2>/dev/null || true)\""
  echo "GIT_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "BUILT=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
} > "$B/BUNDLE_INFO"

# 4. SHA-256 over every file (install.sh checks it before touching anything).
(cd "$B" && find . -type f ! -name SHA256SUMS -printf '%P\n' | LC_ALL=C sort | xargs -d '\n' sha256sum > SHA256SUMS)

# 5. The archive, and its own checksum for transfer.
mkdir -p "$DIST"
OUT=$DIST/$NAME.tar.gz
GZ=$(command -v pigz || command -v gzip)  # pigz: same format, all cores
tar -C "$STAGE" --owner=0 --group=0 --numeric-owner -cf - "$NAME" | "$GZ" -"${GZIP_LEVEL:-6}" > "$OUT.tmp"
mv "$OUT.tmp" "$OUT"
(cd "$DIST" && sha256sum "$NAME.tar.gz" > "$NAME.tar.gz.sha256")
log "wrote $OUT ($(du -h "$OUT" | cut -f1), $(wc -l < "$B/SHA256SUMS") files)"
echo "$OUT"
