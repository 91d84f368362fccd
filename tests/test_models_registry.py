"""Bring your own models: `models add` copies or links a GGUF and records it in the manifest;
`models list` and `models verify` read the manifest. Small GGUFs written here (no model load)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edgespec.errors import BadRequest, ModelError
from edgespec.models import MANIFEST, add_model, list_models, sha256_file, verify_models

EDGESPEC = [sys.executable, "-m", "edgespec.cli.main"]


def write_gguf(path: Path, *, arch: str = "llama", file_type=None, rows: int = 4, fill: float = 0.0,
               parameter_count: int | None = None) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    if file_type is not None:
        w.add_file_type(file_type)
    if parameter_count is not None:
        w.add_uint64("general.parameter_count", parameter_count)
    w.add_tensor("w", np.full((rows, 8), fill, dtype=np.float32))
    w.add_tensor("b", np.full((8,), fill, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _flip(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([b[0] ^ 1]))


def test_add_copies_and_records_header_facts(tmp_path):
    import gguf

    src = write_gguf(tmp_path / "big.gguf", arch="qwen2", file_type=gguf.LlamaFileType.MOSTLY_Q4_K_M)
    d = tmp_path / "models"
    e = add_model(src, role="target", directory=d)
    assert (d / "big.gguf").is_file() and not (d / "big.gguf").is_symlink()
    entry = json.loads((d / MANIFEST).read_text())["files"]["big.gguf"]
    assert entry["sha256"] == sha256_file(src) == e.sha256
    assert entry["size"] == src.stat().st_size
    assert (entry["role"], entry["architecture"], entry["parameters"], entry["file_type"]) == (
        "target", "qwen2", 4 * 8 + 8, "Q4_K_M")
    assert [m.name for m in list_models(d)] == ["big.gguf"]
    assert verify_models(d) == []
    # the same file again is a no-op; the manifest's recorded parameter count wins over counting
    add_model(src, role="target", directory=d)
    p = write_gguf(tmp_path / "counted.gguf", parameter_count=7_000_000_000)
    assert add_model(p, name="seven-b", directory=d).parameters == 7_000_000_000
    assert {m.name for m in list_models(d)} == {"big.gguf", "seven-b.gguf"}


def test_link_points_at_the_file_and_verify_sees_through_it(tmp_path):
    src = write_gguf(tmp_path / "src.gguf")
    d = tmp_path / "models"
    e = add_model(src, role="draft", name="d.gguf", link=True, directory=d)
    assert (d / "d.gguf").is_symlink() and e.linked_to == str(src.resolve())
    assert verify_models(d) == []
    _flip(src)
    assert verify_models(d) == ["d.gguf: SHA-256 mismatch"]
    src.unlink()
    assert verify_models(d) == [f"d.gguf: missing (link to {src.resolve()})"]


def test_verify_names_and_problems(tmp_path):
    d = tmp_path / "models"
    add_model(write_gguf(tmp_path / "a.gguf"), directory=d)
    add_model(write_gguf(tmp_path / "b.gguf", fill=1.0), directory=d)
    _flip(d / "b.gguf")
    assert verify_models(d, ["a.gguf"]) == []
    assert verify_models(d) == ["b.gguf: SHA-256 mismatch"]
    assert verify_models(d, ["nope.gguf"]) == [f"nope.gguf: not in {d / MANIFEST}"]
    with open(d / "a.gguf", "ab") as f:
        f.write(b"x")
    assert verify_models(d, ["a.gguf"])[0].startswith("a.gguf: size ")


def test_bad_input_names_the_field_and_writes_nothing(tmp_path):
    d = tmp_path / "models"
    good = write_gguf(tmp_path / "a.gguf")
    with pytest.raises(BadRequest, match="--role"):
        add_model(good, role="verifier", directory=d)
    with pytest.raises(BadRequest, match="PATH: model file not found"):
        add_model(tmp_path / "missing.gguf", directory=d)
    with pytest.raises(BadRequest, match="--name"):
        add_model(good, name="../escape", directory=d)
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_bytes(b"hello, not a model" * 10)
    with pytest.raises(ModelError, match="not a readable GGUF"):
        add_model(not_gguf, directory=d)
    assert not d.exists()
    add_model(good, directory=d)
    other = write_gguf(tmp_path / "other.gguf", fill=2.0)
    with pytest.raises(BadRequest, match="--name: a.gguf is already in the manifest"):
        add_model(other, name="a", directory=d)
    assert sha256_file(d / "a.gguf") == sha256_file(good)


@pytest.mark.parametrize("text", ["{not json", "[]", '{"files": []}', '{"files": {"a.gguf": 3}}', "\xff\xfe"])
def test_a_corrupt_manifest_is_an_error_and_add_keeps_it(tmp_path, text):
    """Read as empty, the next add wrote it back holding only the new file: every other digest
    gone, and verify with nothing to check. It is a ModelError naming the file; nothing is written."""
    d = tmp_path / "models"
    d.mkdir()
    (d / MANIFEST).write_text(text, encoding="latin-1")
    before = (d / MANIFEST).read_bytes()
    with pytest.raises(ModelError, match="manifest"):
        add_model(write_gguf(tmp_path / "a.gguf"), directory=d)
    with pytest.raises(ModelError, match=str(d / MANIFEST)):
        verify_models(d)
    with pytest.raises(ModelError):
        list_models(d)
    assert (d / MANIFEST).read_bytes() == before and sorted(p.name for p in d.iterdir()) == [MANIFEST]


def test_add_records_the_digest_of_the_copy_it_made(tmp_path, monkeypatch):
    """A source that changes between a hash and a separate copy (swapped by whoever can write it)
    must not land under the first file's digest: the copy is hashed as it is written."""
    import edgespec.models as models

    src = write_gguf(tmp_path / "a.gguf")
    real = models.sha256_file

    def hash_then_swap(path, *a, **k):
        digest = real(path, *a, **k)
        if Path(path) == src:
            with open(src, "ab") as f:
                f.write(b"swapped")
        return digest

    monkeypatch.setattr(models, "sha256_file", hash_then_swap)
    d = tmp_path / "models"
    e = add_model(src, directory=d)
    assert e.sha256 == real(d / "a.gguf") and e.size == (d / "a.gguf").stat().st_size
    assert verify_models(d) == []


def test_cli_add_list_verify(tmp_path):
    env = {**os.environ, "EDGESPEC_HOME": str(tmp_path / "home")}
    src = write_gguf(tmp_path / "mine.gguf", arch="phi3")

    def cli(*args):
        return subprocess.run([*EDGESPEC, "models", *args], capture_output=True, text=True, env=env, timeout=120)

    r = cli("add", str(src), "--role", "draft", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["architecture"] == "phi3"
    assert (tmp_path / "home/models/mine.gguf").is_file()
    r = cli("list", "--json")
    assert [m["name"] for m in json.loads(r.stdout)] == ["mine.gguf"]
    assert "role=draft" in cli("list").stdout
    assert cli("verify").returncode == 0
    bad = cli("add", str(src), "--role", "oracle")
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: --role") and "Traceback" not in bad.stderr
    _flip(tmp_path / "home/models/mine.gguf")
    r = cli("verify", "mine.gguf")
    assert r.returncode == 1 and "mine.gguf: SHA-256 mismatch" in r.stderr
