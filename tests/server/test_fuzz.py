"""The short run of tools/fuzz.py against a real daemon on the demo models (the long run is the
same tool with --requests 5000: docs/appliance.md, "Threat model"). Slow: CI runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from edgespec.config import models_dir
from edgespec.server.config import DEMO_DRAFT, DEMO_TARGET

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_a_few_hundred_hostile_requests():
    if not ((models_dir() / DEMO_TARGET).is_file() and (models_dir() / DEMO_DRAFT).is_file()):
        pytest.skip("demo models missing: run `edgespec models prepare-demo`")
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "fuzz.py"), "--serve", "--requests", "300",
                          "--seed", "20"], cwd=ROOT, capture_output=True, text=True, timeout=1500)
    report = json.loads(run.stdout) if run.stdout.strip().startswith("{") else {}
    assert run.returncode == 0 and report.get("violations") == [], (run.stdout[-4000:], run.stderr[-3000:])
    assert report["watch_flood"] == {"opened": 40, "held": 8, "refused": 32, "authorised_generate_served": True}
    assert report["health_after"] == "SERVING" and report["normal_request_after"]["completion_tokens"] >= 1
    assert report["exit_code"] == 0
    assert not any(k.endswith(("INTERNAL", "UNKNOWN", "DATA_LOSS")) for k in report["statuses"])
    assert sum(report["statuses"].values()) >= 300  # every request answered (plus the flood's)
