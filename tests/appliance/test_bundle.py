"""Offline bundle: build it, install it with the network cut off, generate, and refuse corruption.

Builds a small bundle (the demo draft model only, fast gzip) with tools/make-bundle.sh, unpacks
it, runs install.sh --no-systemd into a temporary prefix inside `unshare -n` (no network at all),
then `edgespec generate` from that prefix, also offline. Then: one flipped byte anywhere, or a
file not in SHA256SUMS, makes install.sh refuse (exit 3) before touching anything.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from edgespec.config import models_dir
from edgespec.models import add_model, sha256_file

ROOT = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct.Q8_0.gguf"  # the demo draft: the smaller of the demo pair
OWN = "site-model.gguf"  # a small GGUF of the operator's own (`models add`)

pytestmark = pytest.mark.slow


def _can_unshare_net() -> bool:
    if not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0


def _offline(cmd: list[str], **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["unshare", "-n", *map(str, cmd)], capture_output=True, text=True, **kw)


def _flip_byte(path: Path, offset: int | None = None) -> None:
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(size // 2 if offset is None else offset)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))


def _make_bundle(dist: Path, models: str, models_dir_: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DIST": str(dist), "MODELS": models, "MODELS_DIR": str(models_dir_), "GZIP_LEVEL": "1",
           "PYTHON": sys.executable}
    return subprocess.run([ROOT / "tools/make-bundle.sh"], capture_output=True, text=True, env=env, timeout=1800)


def _unpack(tarball: Path, into: Path) -> Path:
    with tarfile.open(tarball) as tar:
        tar.extractall(into, filter="tar")
    (root,) = into.iterdir()
    return root


def _reseal(root: Path) -> None:
    """Recompute SHA256SUMS after changing a bundle's files: a new, consistent bundle."""
    subprocess.run("find . -type f ! -name SHA256SUMS -printf '%P\\n' | LC_ALL=C sort | xargs -d '\\n' sha256sum > SHA256SUMS",
                   shell=True, cwd=root, check=True)


@pytest.fixture(scope="module")
def site_models(tmp_path_factory):
    """An operator's models directory: the demo draft linked in with `models add --link`, and a
    small GGUF of their own copied in."""
    from tests.test_models_registry import write_gguf

    if not (models_dir() / MODEL).is_file():
        pytest.skip(f"demo models not prepared in {models_dir()} (run `edgespec models prepare-demo`)")
    d = tmp_path_factory.mktemp("site") / "models"
    add_model(models_dir() / MODEL, role="draft", link=True, directory=d)
    add_model(write_gguf(d.parent / "mine.gguf", arch="qwen2"), role="target", name=OWN, directory=d)
    return d


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, site_models):
    if not _can_unshare_net():
        pytest.skip("`unshare -n` not permitted here (needs root or user namespaces)")
    dist = tmp_path_factory.mktemp("dist")
    proc = _make_bundle(dist, f"{MODEL.removesuffix('.gguf')},{OWN}", site_models)  # names, ".gguf" optional
    assert proc.returncode == 0, proc.stderr[-4000:]
    tarball = Path(proc.stdout.strip().splitlines()[-1])
    assert tarball.name.startswith("edgespec-bundle-") and tarball.is_file()
    return tarball, _unpack(tarball, tmp_path_factory.mktemp("unpacked"))


@pytest.fixture(scope="module")
def software_bundle(tmp_path_factory, site_models):
    proc = _make_bundle(tmp_path_factory.mktemp("dist-sw"), "none", site_models)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return _unpack(Path(proc.stdout.strip().splitlines()[-1]), tmp_path_factory.mktemp("unpacked-sw"))


def test_bundle_contents(bundle):
    tarball, root = bundle
    assert (tarball.parent / (tarball.name + ".sha256")).is_file()
    listed = {line.split("  ", 1)[1] for line in (root / "SHA256SUMS").read_text().splitlines()}
    present = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != "SHA256SUMS"}
    assert listed == present  # a checksum for every file
    wheels = {p.name.split("-")[0] for p in (root / "wheelhouse").glob("*.whl")}
    assert {"edgespec", "llama_cpp_python", "numpy", "gguf", "grpcio", "typer", "structlog"} <= wheels
    assert (root / "models" / MODEL).is_file() and not (root / "models" / MODEL).is_symlink()  # linked: the file ships
    assert sha256_file(root / "models" / MODEL) == sha256_file(models_dir() / MODEL)
    files = json.loads((root / "models/manifest.json").read_text())["files"]
    assert set(files) == {MODEL, OWN}
    assert (files[OWN]["role"], files[OWN]["architecture"]) == ("target", "qwen2")
    assert files[MODEL]["role"] == "draft" and files[MODEL]["file_type"] == "Q8_0" and "link" not in files[MODEL]
    for name in ("install.sh", "BUNDLE_INFO", "config/edgespec.toml", "systemd/edgespec.service",
                 "systemd/edgespec-models-check.service", "systemd/edgespec.service.d/override.conf.example"):
        assert (root / name).is_file(), name
    assert "CUDA=0" in (root / "BUNDLE_INFO").read_text()


def test_offline_install_generates_and_upgrades(bundle, software_bundle, tmp_path):
    _, root = bundle
    prefix = tmp_path / "pfx"
    proc = _offline([root / "install.sh", "--prefix", prefix, "--no-systemd"], timeout=900)
    assert proc.returncode == 0, proc.stderr
    exe = prefix / "bin/edgespec"
    assert exe.exists()
    env = {**os.environ, "EDGESPEC_HOME": str(prefix / "var")}
    model = prefix / "var/models" / MODEL
    run = _offline(
        [exe, "generate", "Hi", "--max-tokens", "8", "--target", model, "--draft", model, "--n-ctx", "512"],
        env=env, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip(), "no text generated"

    # Upgrade/reinstall: the operator's config stays, the packaged one lands beside it as .new,
    # the models are kept, and the previous version is kept for a rollback.
    conf = prefix / "etc/edgespec.toml"
    conf.write_text(conf.read_text() + "\n# operator was here\n")
    first = os.readlink(prefix / "current")
    model_inode = model.stat().st_ino
    again = _offline([root / "install.sh", "--prefix", prefix, "--no-systemd"], timeout=900)
    assert again.returncode == 0, again.stderr
    assert "operator was here" in conf.read_text() and (prefix / "etc/edgespec.toml.new").is_file()
    assert os.readlink(prefix / "current") != first and (prefix / first).is_dir()
    assert model.stat().st_ino == model_inode  # unchanged model not copied again
    assert _offline([exe, "version"]).returncode == 0

    # A software-only bundle (MODELS=none) ships no weights and leaves the installed models and
    # their manifest alone.
    manifest = (prefix / "var/models/manifest.json").read_text()
    assert software_bundle.joinpath("models/manifest.json").is_file()
    assert not [p for p in (software_bundle / "models").iterdir() if p.suffix == ".gguf"]
    sw = _offline([software_bundle / "install.sh", "--prefix", prefix, "--no-systemd"], timeout=900)
    assert sw.returncode == 0, sw.stderr
    assert "software-only bundle" in sw.stderr
    assert model.stat().st_ino == model_inode and (prefix / "var/models/manifest.json").read_text() == manifest
    assert subprocess.run([exe, "models", "verify"], env=env, capture_output=True).returncode == 0

    # Uninstall keeps config and models; --purge removes them.
    gone = subprocess.run([root / "install.sh", "--uninstall", "--no-systemd", "--prefix", prefix], capture_output=True)
    assert gone.returncode == 0 and not exe.exists() and not (prefix / "versions").exists()
    assert conf.is_file() and model.is_file()
    subprocess.run([root / "install.sh", "--uninstall", "--no-systemd", "--purge", "--prefix", prefix], check=True)
    assert not prefix.exists()


@pytest.mark.parametrize("victim", ["model", "wheel", "installer", "extra-file"])
def test_corrupted_bundle_is_refused(bundle, tmp_path, victim):
    _, clean = bundle
    root = tmp_path / clean.name
    shutil.copytree(clean, root, copy_function=os.link if victim == "extra-file" else shutil.copy2)
    if victim == "model":
        _flip_byte(root / "models" / MODEL)
    elif victim == "wheel":
        _flip_byte(next((root / "wheelhouse").glob("numpy-*.whl")))
    elif victim == "installer":
        text = (root / "install.sh").read_bytes()
        (root / "install.sh").write_bytes(text.replace(b"offline installer", b"offline installeR", 1))
    else:
        (root / "wheelhouse/evil-1.0-py3-none-any.whl").write_bytes(b"not listed")
    prefix = tmp_path / "pfx"
    proc = _offline([root / "install.sh", "--prefix", prefix, "--no-systemd"], timeout=300)
    assert proc.returncode == 3, proc.stderr
    assert "refusing to install" in proc.stderr
    assert not prefix.exists()  # nothing was touched


def test_cpu_without_the_wheels_instruction_sets_is_refused(bundle, tmp_path):
    """The bundle records the instruction sets its llama.cpp was compiled for; a CPU lacking one
    would die of SIGILL at the first forward, so install.sh refuses before touching anything."""
    _, clean = bundle
    info = (clean / "BUNDLE_INFO").read_text()
    assert "LLAMA_CPU_FEATURES=" in info and "avx2" in info
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2\n")
    prefix = tmp_path / "pfx"
    proc = subprocess.run([clean / "install.sh", "--prefix", prefix, "--no-systemd"], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "CPUINFO": str(cpuinfo)})
    assert proc.returncode == 1, proc.stderr
    assert "this CPU lacks" in proc.stderr and "avx2" in proc.stderr and "EDGESPEC_CPU=portable" in proc.stderr
    assert not prefix.exists()


def test_flipped_byte_in_archive_is_detected(bundle, tmp_path):
    tarball, _ = bundle
    bad = tmp_path / tarball.name
    shutil.copyfile(tarball, bad)
    _flip_byte(bad)
    shutil.copyfile(tarball.parent / (tarball.name + ".sha256"), tmp_path / (tarball.name + ".sha256"))
    check = subprocess.run(["sha256sum", "-c", tarball.name + ".sha256"], cwd=tmp_path, capture_output=True)
    assert check.returncode != 0
    unpack = subprocess.run(["tar", "-xzf", bad, "-C", tmp_path], capture_output=True)
    assert unpack.returncode != 0  # gzip's CRC catches it too


STUB_SYSTEMCTL = r"""#!/usr/bin/env bash
# Records calls; ActiveState after the N-th restart of edgespec.service is word N of $STUB_HEALTH.
echo "systemctl $*" >> "$STUB_LOG"
case "$1" in
  restart) [[ "$2" == edgespec.service ]] && echo x >> "$STUB_RESTARTS" ;;
  show) n=$(wc -l < "$STUB_RESTARTS"); set -- $STUB_HEALTH; echo "${!n:-failed}" ;;
esac
exit 0
"""


def test_systemd_install_upgrade_and_rollback(bundle, tmp_path):
    """Root/systemd mode against stubbed systemctl/useradd/chown (no systemd PID 1 in CI)."""
    if os.geteuid() != 0:
        pytest.skip("systemd mode needs root")
    _, root = bundle
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    (stubs / "systemctl").write_text(STUB_SYSTEMCTL)
    for tool in ("journalctl", "useradd", "usermod", "chown", "userdel"):
        (stubs / tool).write_text(f'#!/bin/sh\necho "{tool} $*" >> "$STUB_LOG"\n')
    (stubs / "id").write_text('#!/bin/sh\n[ "$1" = edgespec ] && exit 0\nexec /usr/bin/id "$@"\n')
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    prefix, units = tmp_path / "opt", tmp_path / "units"
    log = tmp_path / "calls.log"
    env = {
        **os.environ,
        "PATH": f"{stubs}:{os.environ['PATH']}",
        "EDGESPEC_UNIT_DIR": str(units),
        "EDGESPEC_CONF_DIR": str(tmp_path / "etc"),
        "EDGESPEC_STATE_DIR": str(tmp_path / "var"),
        "STUB_LOG": str(log),
    }

    def install(health: str) -> subprocess.CompletedProcess[str]:
        restarts = tmp_path / "restarts"
        restarts.write_text("")
        cmd = [root / "install.sh", "--prefix", prefix, "--health-timeout", "10"]
        return _offline(cmd, env={**env, "STUB_HEALTH": health, "STUB_RESTARTS": str(restarts)}, timeout=900)

    first = install("active")
    assert first.returncode == 0, first.stderr
    unit = (units / "edgespec.service").read_text()
    assert f"ExecStart={prefix}/bin/edgespec serve --config /etc/edgespec/edgespec.toml" in unit
    assert (units / "edgespec-models-check.service").is_file()
    assert (units / "edgespec.service.d/override.conf.example").is_file()
    calls = log.read_text()
    assert "systemctl enable edgespec.service" in calls and "systemctl restart edgespec.service" in calls
    assert "useradd" not in calls  # the stubbed `id` says the user exists
    assert (tmp_path / "var/models" / MODEL).is_file() and (tmp_path / "etc/edgespec.toml").is_file()
    good = os.readlink(prefix / "current")

    # The upgrade never becomes healthy: back to the previous version, restarted, exit 4.
    # It also replaces a model under the same name and adds one: the rollback puts the previous
    # model set back (files and manifest).
    models = tmp_path / "var/models"
    before = {p.name: sha256_file(p) for p in models.glob("*.gguf")}
    manifest_before = (models / "manifest.json").read_text()
    shipped = (root / "models/manifest.json").read_text()
    upgrade = tmp_path / "upgrade" / root.name
    shutil.copytree(root, upgrade)
    from tests.test_models_registry import write_gguf

    write_gguf(upgrade / "models" / OWN, arch="qwen2", fill=3.0)  # new weights, same name
    write_gguf(upgrade / "models/extra.gguf")
    m = json.loads(shipped)
    for name in (OWN, "extra.gguf"):
        p = upgrade / "models" / name
        m["files"][name] = {**m["files"][OWN], "sha256": sha256_file(p), "size": p.stat().st_size}
    (upgrade / "models/manifest.json").write_text(json.dumps(m))
    _reseal(upgrade)
    root = upgrade
    second = install("failed active")
    assert second.returncode == 4, second.stderr
    assert "rolling back" in second.stderr and f"model {OWN} restored" in second.stderr
    assert os.readlink(prefix / "current") == good
    assert _offline([prefix / "bin/edgespec", "version"]).returncode == 0
    assert log.read_text().count("systemctl restart edgespec.service") == 3
    assert {p.name: sha256_file(p) for p in models.glob("*.gguf")} == before  # extra.gguf gone too
    assert (models / "manifest.json").read_text() == manifest_before and not (models / ".previous").exists()

    # The same upgrade, healthy: the new model serves, the previous one is kept for one rollback.
    third = install("active")
    assert third.returncode == 0, third.stderr
    assert sha256_file(models / OWN) == m["files"][OWN]["sha256"]
    assert sha256_file(models / ".previous" / OWN) == before[OWN]


def test_a_name_the_manifest_lacks_is_refused_before_building(site_models, tmp_path):
    proc = _make_bundle(tmp_path / "dist", f"{OWN},not-there", site_models)
    assert proc.returncode == 1
    assert "MODELS: not-there.gguf is not in" in proc.stderr and OWN in proc.stderr and "edgespec models add" in proc.stderr
    assert "llama-cpp-python:" not in proc.stderr  # nothing was built
    assert not (tmp_path / "dist").exists()
