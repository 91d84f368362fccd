"""The packaged units verify clean and score <= 1.5 in `systemd-analyze security --offline=yes`.

`systemd-analyze verify` insists that ExecStart= binaries exist, so the units are copied into a
temporary directory with /opt/edgespec rewritten to a tree holding a stub executable.
systemd-analyze comes from Debian's `systemd` package (tools/ensure-test-deps.sh installs it).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNITS = ROOT / "systemd"
UNIT_NAMES = ("edgespec.service", "edgespec-models-check.service")
MAX_EXPOSURE = 1.5

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
pytestmark = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None, reason="systemd-analyze not installed: run tools/ensure-test-deps.sh (apt-get install systemd)"
)


def _stage(tmp_path: Path, with_dropin: bool = False) -> Path:
    """Copy the units into tmp_path/units with ExecStart pointing at a stub `edgespec`."""
    prefix = tmp_path / "opt/edgespec"
    (prefix / "bin").mkdir(parents=True)
    stub = prefix / "bin/edgespec"
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    out = tmp_path / "units"
    out.mkdir()
    for name in UNIT_NAMES:
        text = (UNITS / name).read_text().replace("/opt/edgespec", str(prefix))
        (out / name).write_text(text)
    if with_dropin:
        # Every example setting switched on, to prove the example parses and keeps the score.
        text = (UNITS / "edgespec.service.d/override.conf.example").read_text()
        text = re.sub(r"^#(?=[A-Z]\w*=)", "", text, flags=re.M).replace("/opt/edgespec", str(prefix))
        (out / "edgespec.service.d").mkdir()
        (out / "edgespec.service.d/override.conf").write_text(text)
    return out


def _verify(unit: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SYSTEMD_ANALYZE, "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=60
    )


def _exposure(unit: Path) -> float:
    proc = subprocess.run(
        [SYSTEMD_ANALYZE, "security", "--offline=yes", "--no-pager", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    match = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", proc.stdout)
    assert match, f"no exposure score in output:\n{proc.stdout}\n{proc.stderr}"
    return float(match.group(1))


@pytest.mark.parametrize("name", UNIT_NAMES)
def test_unit_verifies_clean(tmp_path, name):
    units = _stage(tmp_path)
    proc = _verify(units / name)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == "", proc.stderr  # no warnings either


@pytest.mark.parametrize("name", UNIT_NAMES)
def test_unit_exposure_at_most_1_5(tmp_path, name):
    units = _stage(tmp_path)
    score = _exposure(units / name)
    assert score <= MAX_EXPOSURE, f"{name}: exposure {score} > {MAX_EXPOSURE}"


def test_dropin_example_parses_and_keeps_exposure(tmp_path):
    units = _stage(tmp_path, with_dropin=True)
    proc = _verify(units / "edgespec.service")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == "", proc.stderr
    assert _exposure(units / "edgespec.service") <= MAX_EXPOSURE


def test_service_contract():
    """The settings the daemon's behaviour relies on (sd_notify, user, directories)."""
    text = (UNITS / "edgespec.service").read_text()
    settings = {}
    for line in text.splitlines():
        if line and not line.startswith(("#", "[")) and "=" in line:
            key, value = line.split("=", 1)
            settings.setdefault(key, []).append(value)
    assert settings["Type"] == ["notify"]
    assert settings["NotifyAccess"] == ["main"]
    assert settings["ExecStart"] == ["/opt/edgespec/bin/edgespec serve --config /etc/edgespec/edgespec.toml"]
    assert settings["Restart"] == ["on-failure"]
    assert settings["User"] == ["edgespec"]
    assert "WatchdogSec" in settings
    assert settings["StateDirectory"] == ["edgespec"] and settings["ConfigurationDirectory"] == ["edgespec"]
    assert settings["ProtectSystem"] == ["strict"] and settings["DevicePolicy"] == ["closed"]
    assert settings["CapabilityBoundingSet"] == [""] and settings["NoNewPrivileges"] == ["yes"]
    assert "MemoryDenyWriteExecute" not in settings  # see docs/appliance.md: left out on purpose
    assert any("nvidia" in v for v in settings["DeviceAllow"])
    # descriptors for the listeners' bounded connections, and a bound on threads (docs/appliance.md)
    assert int(settings["LimitNOFILE"][0]) >= 65536 and 256 <= int(settings["TasksMax"][0]) <= 4096
