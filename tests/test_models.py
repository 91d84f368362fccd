"""Demo model preparation: idempotent, checksummed, corrupted files derived again."""

from __future__ import annotations

import json
import shutil

import pytest

from edgespec.models import (
    DRAFT_TYPE,
    MANIFEST,
    model_path,
    prepare_demo,
    sha256_file,
    verify_models,
    write_random_draft,
)

pytestmark = pytest.mark.slow


@pytest.fixture
def models_dir(demo_pair, tmp_path):
    """A fresh models dir whose source GGUF is already cached (no network)."""
    d = tmp_path / "models"
    (d / ".source").mkdir(parents=True)
    src = demo_pair.target.parent / ".source" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    shutil.copy(src, d / ".source" / src.name)
    return d


def test_prepare_is_idempotent_and_rederives_a_corrupted_file(models_dir):
    logs: list[str] = []
    pair = prepare_demo(models_dir, "q8_0", log=logs.append, draft_type="q4_0")
    assert pair.target == model_path("q8_0", models_dir) and pair.draft == model_path("q4_0", models_dir)
    manifest = json.loads((models_dir / MANIFEST).read_text())["files"]
    assert manifest[pair.draft.name]["sha256"] == sha256_file(pair.draft)
    assert verify_models(models_dir) == []

    logs.clear()
    prepare_demo(models_dir, "q8_0", log=logs.append, draft_type="q4_0")
    assert logs == [f"{pair.target.name}: ok", f"{pair.draft.name}: ok"]

    with open(pair.draft, "r+b") as f:  # flip one byte in the middle
        f.seek(pair.draft.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    assert verify_models(models_dir) == [f"{pair.draft.name}: SHA-256 mismatch"]
    logs.clear()
    prepare_demo(models_dir, "q8_0", log=logs.append, draft_type="q4_0")
    assert any("checksum mismatch" in line for line in logs), logs
    assert sha256_file(pair.draft) == manifest[pair.draft.name]["sha256"]
    assert verify_models(models_dir) == []


def test_default_pair_is_f32_target_q8_0_draft(demo_pair):
    assert DRAFT_TYPE == "q8_0"
    assert demo_pair.target.name.endswith(".F32.gguf") and demo_pair.draft.name.endswith(".Q8_0.gguf")


@pytest.mark.parametrize(("target", "draft", "message"), [
    ("f32", "q2_k", "draft type must be one of q8_0, q4_0"),
    ("q8_0", "q8_0", "draft type must differ from the target type"),
    ("q4_0", "q8_0", "target type must be one of"),
])
def test_prepare_rejects_bad_types_before_touching_files(tmp_path, target, draft, message):
    from edgespec.errors import ModelError

    with pytest.raises(ModelError, match=message):
        prepare_demo(tmp_path / "models", target, draft_type=draft)
    assert not (tmp_path / "models").exists()


def test_random_draft_keeps_the_vocabulary(demo_pair, tmp_path):
    from edgespec import backend

    out = write_random_draft(demo_pair.draft, tmp_path / "rand.gguf")
    t, d = backend.Model(demo_pair.target), backend.Model(out)
    try:
        backend.check_compatible(t, d)  # same vocabulary: no exception
        assert sha256_file(out) != sha256_file(demo_pair.draft)
    finally:
        t.close()
        d.close()
