"""The chat models of one daemon, as configured: the default one ([target], [draft],
[speculation]) and each `[[chat]]` entry, with its own target, draft or head and speculation
settings:

    [[chat]]
    name = "smollm2-q8"            # its name in /v1/models and in requests' `model`
    load = "on_demand"             # or "start"
    keep_alive = 120               # seconds idle before it unloads (-1 = never)
    [chat.target]
    path = "SmolLM2-135M-Instruct.Q8_0.gguf"   # a bare file name: the models directory's
    [chat.draft]
    enabled = false
    [chat.speculation]
    mode = "auto"

An entry's [chat.target], [chat.draft] and [chat.speculation] take the keys of the sections of
the same name (their defaults: the top-level sections' values); [server]'s slot settings are
shared. Every problem is named `chat[i].section.key`."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from edgespec.config import EngineConfig, models_dir
from edgespec.settings import SECTIONS, Setting

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
LOADS = ("start", "on_demand")
ENTRY_KEYS = ("name", "load", "keep_alive")
ENTRY_SECTIONS = ("target", "draft", "speculation")
# keys of [target] an entry may not set: they belong to the daemon's default model alone
DEFAULT_ONLY = ("rpc_servers",)

# the entry's own keys, declared as the sections' are (docs/configuration.md lists them)
ENTRY_SETTINGS = (
    Setting("chat", "name", (str,), "", "the model's name in /v1/models and in requests' `model` (required; "
            "letters, digits, . _ : / -)"),
    Setting("chat", "load", (str,), "on_demand", "start = loaded as the daemon starts; on_demand = on its first "
            "request (which waits for the load under its own deadline)", choices=LOADS),
    Setting("chat", "keep_alive", (int, float), None, "seconds idle before it unloads (load = \"on_demand\"), "
            "or before it may be unloaded to make room for another model (load = \"start\"); -1 = never; "
            "unset = [models] keep_alive", lo=-1, hi=1e9),
)


@dataclass(frozen=True)
class ChatEntry:
    """One chat model: its engine, its speculation section and how it is loaded."""

    name: str
    engine: EngineConfig
    speculation: Any  # a SpeculationConfig (server/config.py)
    chat_template: str = ""  # the template file's text ("" = the GGUF's own)
    tool_format: str = "auto"
    reasoning_format: str = "auto"
    load: str = "start"  # start | on_demand
    keep_alive: float = -1.0  # seconds idle before it unloads (on_demand) or may go for another (start); -1 = never


def resolve_path(path: str) -> str:
    """A model path: `~` expanded; a bare file name that is not a file here is the models directory's."""
    p = Path(path).expanduser()
    if p.parent == Path(".") and not p.is_file():
        return str(models_dir() / p.name)
    return str(p)


Problems = list[tuple[str, str]]


def raw_entries(raw: Any, problems: Problems) -> list[Mapping[str, Any]]:
    """The `chat` array of the TOML document ([] when absent); a problem when it is not an array of tables."""
    if raw is None:
        return []
    if not isinstance(raw, list) or not all(isinstance(e, Mapping) for e in raw):
        problems.append(("chat", "must be an array of tables: write each chat model as [[chat]]"))
        return []
    return list(raw)


def _check_table(where: str, section: str, table: Any, problems: Problems) -> dict[str, Any]:
    if not isinstance(table, Mapping):
        problems.append((where, "must be a table"))
        return {}
    out: dict[str, Any] = {}
    for key, value in table.items():
        s = SECTIONS[section].get(key)
        if s is None or key in DEFAULT_ONLY:
            known = ", ".join(k for k in SECTIONS[section] if k not in DEFAULT_ONLY)
            why = "belongs to the default model's [target] only" if key in DEFAULT_ONLY else f"unknown key (known: {known})"
            problems.append((f"{where}.{key}", why))
            continue
        if key == "path" and isinstance(value, str) and value:
            value = resolve_path(value)
        if (msg := s.problem(value)) is not None:
            problems.append((f"{where}.{key}", msg))
            continue
        out[key] = value
    return out


def parse_entry(i: int, raw: Mapping[str, Any], values: Mapping[str, dict[str, Any]], problems: Problems,
                build: Callable[[dict[str, dict[str, Any]], str], ChatEntry | None]) -> ChatEntry | None:
    """Entry `i`, its keys checked (problems named `chat[i].key`), built by `build(values, where)`
    from the top-level sections' `values` with the entry's tables on top."""
    where = f"chat[{i}]"
    n = len(problems)
    own: dict[str, Any] = {}
    for key, value in raw.items():
        if key in ENTRY_SECTIONS:
            continue
        s = next((e for e in ENTRY_SETTINGS if e.key == key), None)
        if s is None:
            problems.append((f"{where}.{key}", f"unknown key (known: {', '.join(ENTRY_KEYS + ENTRY_SECTIONS)})"))
        elif (msg := s.problem(value)) is not None:
            problems.append((f"{where}.{key}", msg))
        else:
            own[key] = value
    name = own.get("name", "")
    if "name" not in raw:
        problems.append((f"{where}.name", "is required"))
    elif not NAME.match(name):
        problems.append((f"{where}.name", f"{name!r}: letters, digits and . _ : / - only, at most 128"))
    tables = {sec: _check_table(f"{where}.{sec}", sec, raw.get(sec, {}), problems) for sec in ENTRY_SECTIONS}
    if "path" not in tables["target"] or not tables["target"]["path"]:
        problems.append((f"{where}.target.path", "is required (the entry's GGUF file)"))
    if len(problems) > n:
        return None
    merged = {k: dict(v) for k, v in values.items()}
    for sec in ENTRY_SECTIONS:
        base = dict(values[sec])
        if sec in ("target", "draft"):  # the model's own file and context: not the default model's
            base = {k: SECTIONS[sec][k].default for k in base} | {k: v for k, v in base.items()
                                                                  if k in ("threads", "n_gpu_layers", "flash_attn")}
        merged[sec] = base | tables[sec]
    entry = build(merged, where)
    if entry is None:
        return None
    keep = float(own["keep_alive"] if "keep_alive" in own else values["models"]["keep_alive"])
    return replace(entry, name=name, load=own.get("load", "on_demand"), keep_alive=keep)


def check_names(default: str, entries: list[ChatEntry], problems: Problems) -> None:
    """Every chat model's name differs from the others' (the default's: its file's name)."""
    seen: dict[str, str] = {default: "the default model ([target] path)"}
    for i, e in enumerate(entries):
        if e.name in seen:
            problems.append((f"chat[{i}].name", f"{e.name!r} is already the name of {seen[e.name]}"))
        seen.setdefault(e.name, f"chat[{i}]")


# configs/edgespec.toml's closing lines: an entry, commented out
EXAMPLE = ["# [[chat]]: another chat model beside the default one (docs/configuration.md, [[chat]]).",
           "# [[chat]]", '# name = "smollm2-q8"', '# load = "on_demand"', "# keep_alive = 300", "# [chat.target]",
           '# path = "SmolLM2-135M-Instruct.Q8_0.gguf"', "# [chat.draft]", "# enabled = false", ""]


def reference_rows() -> list[str]:
    """docs/configuration.md's [[chat]] part."""
    return ["## [[chat]]", "",
            "More chat models beside the default one ([target], [draft], [speculation]), each in its own "
            "engine with its own slots, caches and speculation. An entry takes the keys below, and the tables "
            "[chat.target], [chat.draft] and [chat.speculation] with the keys of the sections of those names "
            "([chat.target] path is required; a bare file name is looked up in the models directory; "
            "[chat.speculation] starts from [speculation]'s values). Requests pick one by `model`; the default "
            "model answers an empty one. [models] says how much memory they share.", "",
            "| key | type | default | range | what it does |", "| --- | --- | --- | --- | --- |",
            *["| " + " | ".join(c.replace("|", "\\|") for c in (f"`{s.key}`", s.type_text,
                                                                   "unset" if s.key == "keep_alive" else f"`{s.default!r}`".replace("'", '"'),
                                                                   s.range_text(), s.help)) + " |"
              for s in ENTRY_SETTINGS], ""]
