"""docs/configuration.md and `edgespec config defaults` are written from the one declaration of
every key (edgespec/settings.py): the file must be what `edgespec config reference` prints."""

from __future__ import annotations

import tomllib
from pathlib import Path

from typer.testing import CliRunner

from edgespec.cli.main import app
from edgespec.server.config import load, reference
from edgespec.settings import SECTIONS, SETTINGS

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def test_docs_configuration_md_is_the_generated_reference():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert doc == reference(), "docs/configuration.md is stale: run `edgespec config reference > docs/configuration.md`"


def test_reference_lists_every_key_with_its_default_and_range():
    r = runner.invoke(app, ["config", "reference"])
    assert r.exit_code == 0 and r.output == reference()
    rows = {}
    section = None
    for line in r.output.splitlines():
        if line.startswith("## ["):
            section = line[4:-1]
        elif line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            rows[(section, cells[0].strip("`"))] = cells
    from edgespec.server.chat_config import ENTRY_SETTINGS

    assert set(rows) == {(s.section, s.key) for s in SETTINGS} | {("[chat]", s.key) for s in ENTRY_SETTINGS}
    assert rows[("server", "parallel")][1:4] == ["integer", "`2`", "[1, 64]"]
    assert rows[("speculation", "tree_nodes")][2:4] == ["`16`", "[1, 64]"]
    assert rows[("controller", "window")][2:4] == ["`32`", "[1, 4096]"]


def test_config_defaults_prints_every_key_at_its_default_and_loads(tmp_path):
    r = runner.invoke(app, ["config", "defaults"])
    assert r.exit_code == 0
    data = tomllib.loads(r.output)
    assert {(s, k) for s, keys in data.items() for k in keys} == {(s.section, s.key) for s in SETTINGS}
    for s in SETTINGS:
        assert data[s.section][s.key] == s.default, s.name
    f = tmp_path / "defaults.toml"
    f.write_text(r.output)
    cfg = load(f, env={})
    assert (cfg.server.parallel, cfg.engine.draft_window) == (2, 256)
    assert cfg.controller == {k: s.default for k, s in SECTIONS["controller"].items()}


def test_the_shipped_config_is_the_generated_defaults():
    shipped = (ROOT / "configs" / "edgespec.toml").read_text()
    r = runner.invoke(app, ["config", "defaults"])
    assert r.exit_code == 0 and shipped == r.output, \
        "configs/edgespec.toml is stale: run `edgespec config defaults > configs/edgespec.toml`"
    data = tomllib.loads(shipped)
    assert {(s, k) for s, keys in data.items() for k in keys} == {(s.section, s.key) for s in SETTINGS}
    assert "--http-port" in shipped
