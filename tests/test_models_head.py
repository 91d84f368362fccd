"""The shipped EAGLE-3 head: `prepare-demo` installs it beside the F32 target with role head and
its SHA-256 in the manifest, `models verify` covers it, and with [draft] path unset the daemon's
config picks it only where its card's measured speed-up beats the Q8_0 draft's. Small GGUFs
written here stand in for the models (no model load)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgespec import models as M
from tests.test_models_registry import _flip, write_gguf


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    """A fake shipped head and card, a models directory holding a fake F32 target."""
    d = tmp_path / "models"
    d.mkdir()
    target = write_gguf(d / M.model_path("f32").name, arch="llama")
    M._write_manifest(d, {"files": {target.name: {"sha256": M.sha256_file(target), "size": target.stat().st_size,
                                                   "role": "target"}}})
    src = write_gguf(tmp_path / M.HEAD_NAME, arch="eagle3", fill=0.5)
    card = {"head": M.HEAD_NAME, "sha256": M.sha256_file(src), "target_sha256": M.sha256_file(target),
            "heldout": {"depth1": 0.7}, "bench": {"1": {"head": 1.6, "draft": 1.3}, "4": {"head": 1.1, "draft": 1.2}}}
    monkeypatch.setattr(M, "shipped_head", lambda: (src, card))
    return d, target, src, card


def test_prepare_installs_the_head_with_its_sha256_and_verify_covers_it(shipped):
    d, target, src, card = shipped
    manifest = M._read_manifest(d)
    assert M._install_head(d, manifest, target, lambda s: None) == d / M.HEAD_NAME
    e = M._read_manifest(d)["files"][M.HEAD_NAME]
    assert (e["role"], e["sha256"], e["architecture"]) == ("head", card["sha256"], "eagle3")
    assert e["for_target"] == {"name": target.name, "sha256": card["target_sha256"]}
    assert M.verify_models(d) == []
    assert [x.role for x in M.list_models(d) if x.name == M.HEAD_NAME] == ["head"]
    _flip(d / M.HEAD_NAME)
    assert M.verify_models(d) == [f"{M.HEAD_NAME}: SHA-256 mismatch"]
    M._install_head(d, M._read_manifest(d), target, lambda s: None)  # a corrupted copy is replaced
    assert M.verify_models(d) == []


def test_a_shipped_head_that_does_not_match_its_card_is_refused(shipped):
    d, target, src, card = shipped
    card["sha256"] = "0" * 64
    with pytest.raises(M.ModelError, match="SHA-256"):
        M._install_head(d, M._read_manifest(d), target, lambda s: None)
    assert M.HEAD_NAME not in M._read_manifest(d)["files"]


def test_the_installed_head_is_found_for_its_target_only(shipped):
    d, target, src, card = shipped
    assert M.installed_head(target, d) is None  # not installed yet
    M._install_head(d, M._read_manifest(d), target, lambda s: None)
    assert M.installed_head(target, d) == d / M.HEAD_NAME
    assert M.installed_head(d / "other.gguf", d) is None  # another target: never its head


def test_a_head_for_another_build_of_the_target_is_not_used(shipped):
    d, target, src, card = shipped
    M._install_head(d, M._read_manifest(d), target, lambda s: None)
    m = M._read_manifest(d)
    m["files"][target.name]["sha256"] = "f" * 64  # the target re-derived into other bytes
    M._write_manifest(d, m)
    assert M.installed_head(target, d) is None


def test_the_daemon_config_loads_the_head_beside_the_draft_when_draft_path_is_unset(shipped, monkeypatch):
    """[draft] path unset: the Q8_0 demo draft, and the installed head beside it at any
    parallelism (each request then chooses, edgespec/controller/drafter_choice.py); `head = none`
    or an explicit path leave the draft model alone; `head` = a file puts that head beside it."""
    from edgespec.server import config as C

    d, target, src, card = shipped
    monkeypatch.setenv("EDGESPEC_HOME", str(d.parent))
    alone = C.load(env={}).engine
    assert Path(alone.draft.path).name == C.DEMO_DRAFT and alone.head is None  # no head installed
    M._install_head(d, M._read_manifest(d), target, lambda s: None)
    for parallel in (1, 4):
        eng = C.load(env={}, overrides={"server": {"parallel": parallel}}).engine
        assert Path(eng.draft.path).name == C.DEMO_DRAFT and Path(eng.head.path) == d / M.HEAD_NAME
    assert C.load(env={}, overrides={"draft": {"head": "none"}}).engine.head is None
    explicit = C.load(env={}, overrides={"draft": {"path": str(target)}}).engine
    assert Path(explicit.draft.path) == target and explicit.head is None
    chosen = C.load(env={}, overrides={"draft": {"path": str(target), "head": str(src)}}).engine
    assert Path(chosen.head.path) == src
    with pytest.raises(C.ConfigError, match="draft.head"):
        C.load(env={}, overrides={"draft": {"head": str(d / "missing.gguf")}})


def test_the_shipped_card_matches_the_shipped_head():
    """The repository's one model file: its card's SHA-256 and size are the file's, it is <= 20 MB,
    and the card says how it was trained and what it measured."""
    shipped = M.shipped_head()
    # the head is a product part (edgespec/data/heads/): missing, this fails rather than skips
    assert shipped is not None, "no head shipped in edgespec/data/heads/ (the package must carry it)"
    path, card = shipped
    assert path.stat().st_size <= 20 * 10**6 and card["size"] == path.stat().st_size
    assert M.sha256_file(path) == card["sha256"]
    assert card["command"].startswith("edgespec models train-head") and "seed" in card
    assert 0 < card["heldout"]["depth1"] <= 1
    assert json.dumps(card)
