"""Prompt suites: JSON lines `{"id", "category", "prompt"}`, optionally `"schema"` (a JSON schema the
answer must follow, for the `MODE+schema` modes).

A suite is named (a shipped file under `suites/`, or a virtual union: `structured`, `all`) or
given as a file path. Every line is validated; errors name the file, the line and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from edgespec.errors import BadRequest

SUITES_DIR = Path(__file__).parent / "suites"
SHIPPED = ("code", "json", "legal", "rag", "chat", "chinese", "drift")
# structured work with long inputs (370-2400 prompt tokens: a knowledge base, records, a module,
# a contract; categories long-rag, long-json, long-code, long-legal), written by
# edgespec/bench/suites_long.py; not part of `all`
LONG = "long"
# repetitive intranet work as a stream of requests (templated extraction, SQL over one schema, a
# ticket form, an agent loop's JSON actions; categories repetitive-*), written by
# edgespec/bench/suites_repetitive.py; run in order, its modes with +suffix draft from the cross-request
# suffix cache the earlier requests filled; not part of `all`
REPETITIVE = "repetitive"
VIRTUAL = {
    "structured": ("code", "json", "legal", "rag"),
    "all": SHIPPED,
}
FIELDS = ("id", "category", "prompt")


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    prompt: str
    schema: str | None = None  # a JSON schema (JSON text) the answer must follow: the `MODE+schema` bench modes


def suite_names() -> tuple[str, ...]:
    return SHIPPED + (LONG, REPETITIVE) + tuple(VIRTUAL)


def resolve(suite: str) -> list[Path]:
    """NAME (shipped or virtual) or FILE -> the suite files to read."""
    if suite in VIRTUAL:
        return [SUITES_DIR / f"{name}.jsonl" for name in VIRTUAL[suite]]
    if suite in SHIPPED or suite in (LONG, REPETITIVE):
        return [SUITES_DIR / f"{suite}.jsonl"]
    path = Path(suite)
    if path.is_file():
        return [path]
    raise BadRequest("suite", f"no shipped suite or file named {suite!r} (shipped: {', '.join(suite_names())})")


def read_suite_file(path: Path) -> list[Prompt]:
    prompts = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise BadRequest("suite", f"{where}: not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise BadRequest("suite", f"{where}: expected a JSON object")
            for name in FIELDS:
                value = obj.get(name)
                if value is None:
                    raise BadRequest("suite", f"{where}: missing field {name!r}")
                if not isinstance(value, str) or not value.strip():
                    raise BadRequest("suite", f"{where}: field {name!r} must be a non-empty string")
            schema = obj.get("schema")
            if schema is not None and not isinstance(schema, (dict, bool)):
                raise BadRequest("suite", f"{where}: field 'schema' must be a JSON schema (an object)")
            prompts.append(Prompt(obj["id"], obj["category"], obj["prompt"],
                                  None if schema is None else json.dumps(schema, ensure_ascii=False)))
    return prompts


def load_suite(suite: str, limit: int | None = None) -> list[Prompt]:
    """All prompts of a suite, ids unique. `limit` keeps the first N prompts of each file."""
    prompts: list[Prompt] = []
    for path in resolve(suite):
        got = read_suite_file(path)
        prompts.extend(got[:limit] if limit else got)
    if not prompts:
        raise BadRequest("suite", f"{suite}: no prompts")
    seen: set[str] = set()
    for p in prompts:
        if p.id in seen:
            raise BadRequest("suite", f"{suite}: duplicate id {p.id!r}")
        seen.add(p.id)
    return prompts
