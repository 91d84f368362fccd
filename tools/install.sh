#!/usr/bin/env bash
# edgespec offline installer: run from an unpacked bundle (tools/make-bundle.sh). Never uses the
# network: every checksum is verified before anything is touched, and pip installs only from the
# bundle's wheelhouse (--no-index).
#
# usage: install.sh [--prefix DIR] [--no-systemd] [--python PY] [--health-timeout SECONDS]
#        install.sh --uninstall [--prefix DIR] [--purge]
#
#   --prefix DIR      software goes to DIR (default /opt/edgespec): DIR/versions/<v>/venv,
#                     DIR/current -> versions/<v>, DIR/bin/edgespec
#   --no-systemd      no user, no units, no service: config and models go under DIR/etc and DIR/var
#                     (run with EDGESPEC_HOME=DIR/var). Implied when not run as root.
#   --uninstall       stop and remove the service and DIR; keeps /etc/edgespec and the models
#                     under /var/lib/edgespec (or DIR/etc, DIR/var) unless --purge.
#
# As root (systemd mode) it creates the `edgespec` system user, installs the config to
# /etc/edgespec (never overwriting the operator's: a differing packaged one is left as .new),
# the models to /var/lib/edgespec/models, the units to /etc/systemd/system, enables and starts the
# service and waits until it is active (Type=notify: READY=1 after both models are warm). If an
# upgrade does not become healthy, the previous version and the models it replaced (kept in
# models/.previous) are restored and restarted. A bundle with no models leaves the models alone.
#
# exit codes: 0 ok, 2 usage, 3 bundle corrupt (nothing touched), 4 not healthy (rolled back), 1 other
set -euo pipefail

PREFIX=/opt/edgespec
SYSTEMD=1
UNINSTALL=0
PURGE=0
PYTHON_BIN=${PYTHON:-}
HEALTH_TIMEOUT=300
SERVICE=edgespec.service
CHECK_SERVICE=edgespec-models-check.service
SERVICE_USER=edgespec
UNIT_DIR=${EDGESPEC_UNIT_DIR:-/etc/systemd/system}

die() { local code=$1; shift; echo "install.sh: error: $*" >&2; exit "$code"; }
say() { echo "install.sh: $*" >&2; }

while [[ $# -gt 0 ]]; do
  case $1 in
    --prefix) [[ $# -ge 2 ]] || die 2 "--prefix needs a directory"; PREFIX=$2; shift 2 ;;
    --prefix=*) PREFIX=${1#*=}; shift ;;
    --no-systemd) SYSTEMD=0; shift ;;
    --python) [[ $# -ge 2 ]] || die 2 "--python needs an interpreter"; PYTHON_BIN=$2; shift 2 ;;
    --health-timeout) [[ $# -ge 2 ]] || die 2 "--health-timeout needs seconds"; HEALTH_TIMEOUT=$2; shift 2 ;;
    --uninstall) UNINSTALL=1; shift ;;
    --purge) PURGE=1; shift ;;
    -h|--help) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die 2 "unknown argument: $1 (see --help)" ;;
  esac
done
[[ $PREFIX == /* ]] || PREFIX=$(pwd)/$PREFIX
if [[ $(id -u) != 0 ]]; then SYSTEMD=0; fi
if [[ $SYSTEMD == 1 ]]; then
  # overridable only to stage or test an install (tests/appliance/test_bundle.py)
  CONF_DIR=${EDGESPEC_CONF_DIR:-/etc/edgespec}
  STATE_DIR=${EDGESPEC_STATE_DIR:-/var/lib/edgespec}
else
  CONF_DIR=$PREFIX/etc
  STATE_DIR=$PREFIX/var
fi

# ---------------------------------------------------------------------------------------------
uninstall() {
  if [[ $SYSTEMD == 1 ]] && command -v systemctl >/dev/null; then
    systemctl disable --now "$SERVICE" "$CHECK_SERVICE" 2>/dev/null || true
    rm -f "$UNIT_DIR/$SERVICE" "$UNIT_DIR/$CHECK_SERVICE" "$UNIT_DIR/$SERVICE.d/override.conf.example" \
      "$UNIT_DIR/$SERVICE.d/memory.conf"
    rmdir "$UNIT_DIR/$SERVICE.d" 2>/dev/null || true  # kept when it holds an operator's drop-in
    systemctl daemon-reload || true
  fi
  rm -rf "$PREFIX/versions" "$PREFIX/current" "$PREFIX/bin/edgespec" "$PREFIX/share/edgespec" "$PREFIX/share/doc"
  rmdir "$PREFIX/bin" "$PREFIX/share" 2>/dev/null || true
  if [[ $PURGE == 1 ]]; then
    rm -rf "$CONF_DIR" "$STATE_DIR"
    if [[ $SYSTEMD == 1 ]] && id "$SERVICE_USER" >/dev/null 2>&1; then userdel "$SERVICE_USER" || true; fi
    say "removed edgespec, its configuration and models"
  else
    say "removed edgespec; kept configuration ($CONF_DIR) and models ($STATE_DIR/models); --purge removes them"
  fi
  rmdir "$PREFIX" 2>/dev/null || true
}

if [[ $UNINSTALL == 1 ]]; then uninstall; exit 0; fi

# --- 1. verify the bundle before touching anything --------------------------------------------
BUNDLE=$(cd "$(dirname "$0")" && pwd)
cd "$BUNDLE"
[[ -f SHA256SUMS && -f BUNDLE_INFO ]] || die 3 "$BUNDLE is not an edgespec bundle (no SHA256SUMS/BUNDLE_INFO)"
if ! sha256sum --quiet --strict -c SHA256SUMS >&2; then
  die 3 "checksum mismatch in $BUNDLE: refusing to install a corrupted bundle (nothing was changed)"
fi
listed=$(cut -d' ' -f3- SHA256SUMS | LC_ALL=C sort)
present=$(find . -type f ! -name SHA256SUMS -printf '%P\n' | LC_ALL=C sort)
if [[ "$listed" != "$present" ]]; then
  diff <(echo "$listed") <(echo "$present") >&2 || true
  die 3 "files in $BUNDLE differ from SHA256SUMS: refusing to install (nothing was changed)"
fi
# shellcheck disable=SC1091
source ./BUNDLE_INFO
say "bundle $VERSION verified ($(wc -l < SHA256SUMS) files)"

# the llama.cpp in this bundle was compiled for these instruction sets: without them it dies of
# SIGILL at the first forward, so refuse now (nothing was changed)
if [[ -n "${LLAMA_CPU_FEATURES:-}" && -r "${CPUINFO:-/proc/cpuinfo}" ]]; then
  cpu_flags=" $(grep -m1 '^flags' "${CPUINFO:-/proc/cpuinfo}" | cut -d: -f2) "
  missing=""
  for f in $LLAMA_CPU_FEATURES; do [[ "$cpu_flags" == *" $f "* ]] || missing="$missing $f"; done
  [[ -z $missing ]] || die 1 "this CPU lacks${missing}, which the bundle's llama.cpp was built for; rebuild the bundle with EDGESPEC_CPU=portable make bundle (nothing was changed)"
fi

# --- 2. a matching Python --------------------------------------------------------------------
py_ok() { "$1" -c "import sys, venv; sys.exit(0 if '%d.%d' % sys.version_info[:2] == '$PYTHON_VERSION' else 1)" 2>/dev/null; }
if [[ -z $PYTHON_BIN ]]; then
  for cand in "python$PYTHON_VERSION" python3 /usr/bin/python3; do
    if command -v "$cand" >/dev/null && py_ok "$(command -v "$cand")"; then PYTHON_BIN=$(command -v "$cand"); break; fi
  done
fi
[[ -n $PYTHON_BIN ]] && py_ok "$PYTHON_BIN" ||
  die 1 "need Python $PYTHON_VERSION with the venv module (the wheels are built for it); pass --python"

# --- 3. the software: a fresh venv per install, switched atomically --------------------------
# venvs are not relocatable, so each install gets its own directory and DIR/current points at it.
STAMP=$VERSION-$(date +%Y%m%d%H%M%S)
VDIR=$PREFIX/versions/$STAMP
PREVIOUS=$(readlink "$PREFIX/current" 2>/dev/null || true)  # e.g. versions/0.1.0-20250101120000
mkdir -p "$PREFIX/versions" "$PREFIX/bin"
trap 'rm -rf "$VDIR"' EXIT  # a half-built venv never stays behind
"$PYTHON_BIN" -m venv "$VDIR/venv"
PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 \
  "$VDIR/venv/bin/python" -m pip install -q --no-index --find-links "$BUNDLE/wheelhouse" \
  "edgespec==$VERSION" >&2
mkdir -p "$VDIR/share"
cp -r "$BUNDLE/systemd" "$VDIR/share/systemd"
cp "$BUNDLE/install.sh" "$BUNDLE/BUNDLE_INFO" "$VDIR/share/"
"$VDIR/venv/bin/edgespec" version >/dev/null || die 1 "the new edgespec does not run"
trap - EXIT

switch_to() {  # atomically repoint DIR/current and DIR/bin/edgespec
  ln -sfn "$1" "$PREFIX/current.tmp" && mv -T "$PREFIX/current.tmp" "$PREFIX/current"
  ln -sfn ../current/venv/bin/edgespec "$PREFIX/bin/edgespec.tmp" && mv -T "$PREFIX/bin/edgespec.tmp" "$PREFIX/bin/edgespec"
}

# --- 4. config (never overwritten) and models (kept when unchanged) ---------------------------
mkdir -p "$CONF_DIR" "$STATE_DIR/models"
if [[ ! -e "$CONF_DIR/edgespec.toml" ]]; then
  install -m 0640 "$BUNDLE/config/edgespec.toml" "$CONF_DIR/edgespec.toml"
elif ! cmp -s "$BUNDLE/config/edgespec.toml" "$CONF_DIR/edgespec.toml"; then
  install -m 0640 "$BUNDLE/config/edgespec.toml" "$CONF_DIR/edgespec.toml.new"
  say "kept your $CONF_DIR/edgespec.toml; the packaged default is $CONF_DIR/edgespec.toml.new"
fi
restore_models() {  # undo this install's model changes: previous files and manifest back, added ones gone
  "$PYTHON_BIN" - "$STATE_DIR/models" <<'EOF'
import shutil, sys
from pathlib import Path
dst = Path(sys.argv[1])
keep = dst / ".previous"
if not keep.is_dir():
    sys.exit(0)
for name in (keep / "added").read_text().split() if (keep / "added").exists() else ():
    (dst / name).unlink(missing_ok=True)
for f in keep.iterdir():
    if f.name not in ("added", "manifest.json"):
        f.replace(dst / f.name)
        print(f"install.sh: model {f.name} restored", file=sys.stderr)
if (keep / "manifest.json").exists():
    (keep / "manifest.json").replace(dst / "manifest.json")
else:
    (dst / "manifest.json").unlink(missing_ok=True)
shutil.rmtree(keep)
EOF
}

# The models this install replaces or adds are recorded in models/.previous (the files it
# overwrites are moved there, not deleted; the manifest before it is copied there), so a rollback
# restores the previous model set. One generation: each install starts a new record.
if ! "$VDIR/venv/bin/python" - "$BUNDLE/models" "$STATE_DIR/models" <<'EOF'
import json, shutil, sys
from pathlib import Path
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
new = json.loads((src / "manifest.json").read_text())
path = dst / "manifest.json"
have = json.loads(path.read_text()) if path.exists() else {"files": {}}
keep = dst / ".previous"
shutil.rmtree(keep, ignore_errors=True)
keep.mkdir()
if path.exists():
    shutil.copyfile(path, keep / "manifest.json")
if not new["files"]:
    print("install.sh: software-only bundle: the installed models stay as they are", file=sys.stderr)
added = []
for name, entry in new["files"].items():
    old = have["files"].get(name)
    target = dst / name
    if old and old.get("sha256") == entry["sha256"] and target.is_file() and target.stat().st_size == entry["size"]:
        continue  # the same model is already there (checked in full by `edgespec models verify`)
    tmp = dst / (name + ".tmp")
    shutil.copyfile(src / name, tmp)
    if target.is_symlink() or target.exists():
        target.replace(keep / name)  # the previous file, kept for a rollback
        print(f"install.sh: model {name} replaced (previous one kept for a rollback)", file=sys.stderr)
    else:
        added.append(name)
        print(f"install.sh: model {name}", file=sys.stderr)
    tmp.replace(target)
(keep / "added").write_text("".join(f"{n}\n" for n in added))
have["files"].update(new["files"])  # models the operator added beside ours stay listed
meta = {k: v for k, v in new.items() if k not in ("files", "software_only")}
tmp = dst / "manifest.json.tmp"
tmp.write_text(json.dumps({**have, **meta, "files": have["files"]}, indent=2, sort_keys=True) + "\n")
tmp.replace(path)
EOF
then
  restore_models
  die 1 "installing the models failed: the previous models and version stay in place"
fi

# --- the switch: only once the software, config and models are in place ---------------------
switch_to "versions/$STAMP"
mkdir -p "$PREFIX/share/doc" "$PREFIX/share/edgespec"
[[ -f "$BUNDLE/doc/appliance.md" ]] && cp "$BUNDLE/doc/appliance.md" "$PREFIX/share/doc/"
cp "$BUNDLE/install.sh" "$PREFIX/share/edgespec/install.sh"
say "installed edgespec $VERSION to $PREFIX (bin/edgespec)"

prune_versions() {  # keep the running version and the one before it (for a rollback)
  local d
  for d in "$PREFIX"/versions/*; do
    [[ "versions/${d##*/}" == "versions/$STAMP" || "versions/${d##*/}" == "$PREVIOUS" ]] || rm -rf "$d"
  done
}

if [[ $SYSTEMD == 0 ]]; then
  prune_versions
  say "done (no systemd): EDGESPEC_HOME=$STATE_DIR $PREFIX/bin/edgespec generate \"Hello\""
  exit 0
fi

# --- 5. systemd: user, units, enable, start, wait for health; roll back on failure -----------
command -v systemctl >/dev/null || die 1 "systemctl not found: rerun with --no-systemd"
if ! id "$SERVICE_USER" >/dev/null 2>&1; then
  useradd --system --user-group --home-dir "$STATE_DIR" --no-create-home --shell /usr/sbin/nologin \
    --comment "edgespec daemon" "$SERVICE_USER"
fi
for grp in video render; do getent group "$grp" >/dev/null && usermod -aG "$grp" "$SERVICE_USER"; done
chown -R "$SERVICE_USER:$SERVICE_USER" "$STATE_DIR"
# the models and their manifest belong to root: a compromised daemon can neither rewrite a model
# nor the digest `models verify` checks it against (the unit mounts the directory read-only too)
if [[ -d "$STATE_DIR/models" ]]; then
  chown -R root:"$SERVICE_USER" "$STATE_DIR/models"
  chmod -R u=rwX,g=rX,o= "$STATE_DIR/models"
fi
chown root:"$SERVICE_USER" "$CONF_DIR" "$CONF_DIR"/edgespec.toml*
chmod 0750 "$CONF_DIR"

install_units() {  # $1 = version dir holding share/systemd
  mkdir -p "$UNIT_DIR/$SERVICE.d"
  for unit in "$SERVICE" "$CHECK_SERVICE"; do
    sed "s#/opt/edgespec#$PREFIX#g" "$1/share/systemd/$unit" > "$UNIT_DIR/$unit.tmp"
    mv "$UNIT_DIR/$unit.tmp" "$UNIT_DIR/$unit"
  done
  cp "$1/share/systemd/edgespec.service.d/override.conf.example" "$UNIT_DIR/$SERVICE.d/"
  # MemoryHigh/MemoryMax sized by `edgespec plan` for the configured models, slots and caches
  if EDGESPEC_HOME="$STATE_DIR" "$1/venv/bin/edgespec" plan --config "$CONF_DIR/edgespec.toml" --systemd \
      > "$UNIT_DIR/$SERVICE.d/memory.conf.tmp"; then
    mv "$UNIT_DIR/$SERVICE.d/memory.conf.tmp" "$UNIT_DIR/$SERVICE.d/memory.conf"
  else
    rm -f "$UNIT_DIR/$SERVICE.d/memory.conf.tmp"
    say "warning: no memory limits for $SERVICE (edgespec plan --config $CONF_DIR/edgespec.toml --systemd failed)"
  fi
  systemctl daemon-reload
}

wait_healthy() {  # Type=notify: active only after READY=1
  local deadline=$((SECONDS + HEALTH_TIMEOUT)) state
  while ((SECONDS < deadline)); do
    state=$(systemctl show -p ActiveState --value "$SERVICE")
    case $state in
      active) return 0 ;;
      failed) return 1 ;;
    esac
    sleep 2
  done
  return 1
}

install_units "$VDIR"
systemctl enable "$SERVICE" "$CHECK_SERVICE" >&2
systemctl restart "$CHECK_SERVICE" >&2 || true  # re-hash the models that were just installed
if systemctl restart "$SERVICE" && wait_healthy; then
  say "edgespec $VERSION is active ($(systemctl show -p StatusText --value "$SERVICE"))"
  # keep the previous version for one more rollback, drop older ones
  prune_versions
  exit 0
fi
journalctl -u "$SERVICE" -n 30 --no-pager >&2 || true
if [[ -n $PREVIOUS && -d "$PREFIX/$PREVIOUS" ]]; then
  say "edgespec $VERSION did not become healthy: rolling back to $PREVIOUS"
  switch_to "$PREVIOUS"
  install_units "$PREFIX/$PREVIOUS"
  restore_models
  systemctl restart "$CHECK_SERVICE" || true
  systemctl restart "$SERVICE" && wait_healthy && say "rolled back to $PREVIOUS" || say "rollback did not become healthy either"
  die 4 "upgrade to $VERSION failed; running $PREVIOUS with its models"
fi
die 4 "edgespec $VERSION did not become healthy within ${HEALTH_TIMEOUT}s (see journalctl -u $SERVICE)"
