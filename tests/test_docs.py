"""The documents stay current with the code: every RPC, message field and enum value of the
protos, every HTTP route, field and status code is in docs/api.md; the README's commands, flags,
make targets, tools and links exist; no document narrates its own development history."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import typer

ROOT = Path(__file__).resolve().parent.parent
PROTOS = sorted((ROOT / "protos/edgespec/v1").glob("*.proto"))
API = ROOT / "docs/api.md"
# the product documents this test holds to the rules below
DOCS = [ROOT / "README.md", API, ROOT / "docs/benchmarks/README.md", ROOT / "docs/controller.md",
        ROOT / "docs/appliance.md", ROOT / "docs/eagle3.md", ROOT / "docs/architecture.md"]
# generated from the config declaration (edgespec.server.config): may be linked before it is built
GENERATED = {ROOT / "docs/configuration.md"}


def text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


# ---- the protos, read simply ------------------------------------------------------------------


def _strip_comments(src: str) -> str:
    return re.sub(r"//[^\n]*", "", src)


def _blocks(src: str, kind: str) -> dict[str, str]:
    """name -> body of every top-level `message` / `enum` block (no nesting in our protos)."""
    return {m.group(1): m.group(2) for m in re.finditer(kind + r"\s+(\w+)\s*\{([^{}]*)\}", src)}


# what a line of a block declares: a message field's name, an enum value
DECLARED = {"message": r"(?:optional\s+|repeated\s+)?(?:map<[^>]+>|[\w.]+)\s+(\w+)\s*=\s*\d+\s*;",
            "enum": r"(\w+)\s*=\s*\d+\s*;"}


def proto_names(kind: str) -> dict[str, list[str]]:
    """name -> the fields (kind "message") or values (kind "enum") it declares, over every proto."""
    return {name: re.findall(DECLARED[kind], body)
            for p in PROTOS for name, body in _blocks(_strip_comments(text(p)), kind).items()}


def proto_messages() -> dict[str, list[str]]:
    return proto_names("message")


def proto_enums() -> dict[str, list[str]]:
    return proto_names("enum")


def proto_rpcs() -> list[tuple[str, str]]:
    out = []
    for p in PROTOS:
        src = _strip_comments(text(p))
        for service, body in re.findall(r"service\s+(\w+)\s*\{(.*?)\n\}", src, flags=re.S):
            out += [(service, rpc) for rpc in re.findall(r"rpc\s+(\w+)\s*\(", body)]
    return out


def api_section(name: str) -> str:
    """The part of docs/api.md under the heading that names `name` in backticks, up to the next
    heading of any level."""
    doc = text(API)
    m = re.search(r"^#+ .*`" + re.escape(name) + r"`.*$", doc, flags=re.M)
    assert m, f"docs/api.md: no heading names `{name}`"
    nxt = re.search(r"^#+ ", doc[m.end():], flags=re.M)
    return doc[m.end():m.end() + nxt.start()] if nxt else doc[m.end():]


def test_proto_parser_sees_what_the_protos_hold():
    msgs, enums, rpcs = proto_messages(), proto_enums(), proto_rpcs()
    assert "max_tokens" in msgs["SamplingOptions"] and "tick_totals" in msgs["StatsResponse"]
    assert "EOS" in enums["FinishReason"] and ("Inference", "GenerateStream") in rpcs
    assert ("Admin", "Drain") in rpcs


@pytest.mark.parametrize("message", sorted(proto_messages()))
def test_every_message_field_is_documented(message):
    section = api_section(message)
    missing = [f for f in proto_messages()[message] if f"`{f}`" not in section]
    assert not missing, f"docs/api.md, `{message}`: undocumented fields {missing}"


@pytest.mark.parametrize("enum", sorted(proto_enums()))
def test_every_enum_value_is_documented(enum):
    section = api_section(enum)
    missing = [v for v in proto_enums()[enum] if f"`{v}`" not in section]
    assert not missing, f"docs/api.md, `{enum}`: undocumented values {missing}"


def test_every_rpc_is_documented():
    doc = text(API)
    missing = [f"{s}.{r}" for s, r in proto_rpcs() if f"`{s}.{r}`" not in doc]
    assert not missing, f"docs/api.md: undocumented RPCs {missing}"


def test_every_grpc_status_code_is_documented():
    from edgespec.server.status import DENIED, STATUS

    doc = text(API)
    codes = {code.name for _, code in STATUS} | {code.name for code, _ in DENIED.values()} | {"INTERNAL"}
    missing = sorted(c for c in codes if f"`{c}`" not in doc)
    assert not missing, f"docs/api.md: undocumented gRPC status codes {missing}"


# ---- the HTTP API ------------------------------------------------------------------------------


def http_routes() -> list[tuple[str, str]]:
    src = text(ROOT / "edgespec/server/http_api.py")
    return [(method, path) for path, method in
            re.findall(r'Route\("([^"]+)",[^\n]*methods=\["(\w+)"\]', src)]


def test_every_http_route_is_documented():
    routes = http_routes()
    assert ("POST", "/v1/chat/completions") in routes and ("GET", "/health") in routes
    doc = text(API)
    missing = [f"{m} {p}" for m, p in routes if f"`{m} {p}`" not in doc]
    assert not missing, f"docs/api.md: undocumented HTTP routes {missing}"


def test_every_http_field_and_status_is_documented():
    from edgespec.server import openai_api as oa
    from edgespec.server.http_errors import STATUS

    doc = text(API)
    fields = set(oa._KNOWN) | set(oa._REFUSED) | set(oa._NEUTRAL)
    missing = sorted(f for f in fields if f"`{f}`" not in doc)
    assert not missing, f"docs/api.md: undocumented HTTP request fields {missing}"
    statuses = {str(status) for _, status, _ in STATUS} | {"500"}
    missing = sorted(s for s in statuses if f"| {s} " not in doc)
    assert not missing, f"docs/api.md: HTTP status codes missing from its table {missing}"


# ---- no development diary ----------------------------------------------------------------------

ORDINAL = r"(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|\d+(?:st|nd|rd|th))"
DIARY = [
    ORDINAL + r"\s+(?:work\s+)?(?:session|period)s?\b",
    r"\bwork\s+periods?\b",
    r"\b(?:this|that|next|previous|earlier|later|last)\s+(?:session|week|morning|afternoon|evening)\b",
    r"\bsessions?\s+until\s+now\b",
    r"\b(?:today|yesterday|tonight)\b",
    r"\bbefore that it made\b",
    r"\bwhat made the difference\b",
    r"\b(?:the project|we) met\b",
    r"\blent\b",
    r"\bdevice run\b",
    r"\bcarry \[",
]
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def test_diary_patterns_catch_diary_lines():
    diary = ["In the sixth session the tree lost.", "What made the difference this session: the draft.",
             "the 8th work period", "Before that it made 1.05x.", "On a device run, carry [\".x\"]."]
    for line in diary:
        assert any(re.search(p, line, flags=re.I) for p in DIARY), line
    for line in ["a session's KV range (edgespec/session.py)", "every request session steps", "the first run builds"]:
        assert not any(re.search(p, line, flags=re.I) for p in DIARY), line


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_document_narrates_its_history(doc):
    found = []
    for n, line in enumerate(text(doc).splitlines(), 1):
        for p in DIARY:
            if m := re.search(p, line, flags=re.I):
                found.append(f"{doc.name}:{n}: {m.group(0)!r}")
        # a measurement's date belongs in its results table, nowhere else
        if DATE.search(line) and not line.lstrip().startswith("|"):
            found.append(f"{doc.name}:{n}: a date outside a table")
    assert not found, "\n".join(found)


# ---- the README's commands, targets, tools and links exist -----------------------------------


def _cli() -> Any:
    from edgespec.cli.main import app

    return typer.main.get_command(app)


def _is_group(cmd: Any) -> bool:
    """A command group (typer ships its own click: no isinstance against the click package)."""
    return isinstance(getattr(cmd, "commands", None), dict)


def _options(cmd: Any) -> set[str]:
    out = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
    if _is_group(cmd):
        for sub in cmd.commands.values():
            out |= _options(sub)
    return out


def code_blocks(doc: str) -> list[str]:
    return re.findall(r"^```[\w-]*\n(.*?)^```", doc, flags=re.S | re.M)


def edgespec_invocations(doc: str) -> list[tuple[str, list[str]]]:
    """(the line, its words from `edgespec` on up to a comment or a pipe) of every code line
    that runs edgespec."""
    out = []
    for block in code_blocks(doc):
        for line in block.splitlines():
            m = re.search(r"(?:^|[\s/])edgespec\s+(.*)", line.split(" # ")[0].split("  #")[0])
            if m and not line.lstrip().startswith(("#", "curl", "grpcurl")):
                words = re.split(r"\s*(?:&&|;|\|\s)\s*", m.group(1))[0].split()
                out.append((line, words))
    return out


def test_readme_commands_and_flags_exist():
    root = _cli()
    invocations = edgespec_invocations(text(ROOT / "README.md"))
    assert len(invocations) >= 10
    bad = []
    for line, words in invocations:
        cmd = root
        for w in words:
            if not _is_group(cmd) or w.startswith(("-", "[")) or w not in cmd.commands:
                break
            cmd = cmd.commands[w]
        if cmd is root and words and not words[0].startswith("-"):
            bad.append(f"{line.strip()}: no command {words[0]!r}")
            continue
        known = _options(cmd) | (_options(root) if cmd is root else set())
        for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", " ".join(words)):
            if flag not in known:
                bad.append(f"{line.strip()}: {flag} is not an option of `{cmd.name}`")
    assert not bad, "\n".join(bad)


def test_readme_make_targets_and_tools_exist():
    readme = text(ROOT / "README.md")
    makefile = text(ROOT / "Makefile")
    targets = set(re.findall(r"^([\w-]+):", makefile, flags=re.M)) | {
        t for line in re.findall(r"^\.PHONY:(.*)$", makefile, flags=re.M) for t in line.split()}
    used = set(re.findall(r"\bmake\s+((?:[a-z][\w-]*\s*)+)", "\n".join(code_blocks(readme))))
    missing = {t for group in used for t in group.split() if "=" not in t and t not in targets}
    assert not missing, f"README: make targets not in the Makefile {sorted(missing)}"
    tools = set(re.findall(r"\btools/[\w./-]+\w", readme))
    assert tools, "README names no tool"
    missing = sorted(t for t in tools if not (ROOT / t).exists())
    assert not missing, f"README: missing tools {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files(doc):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text(doc)):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (doc.parent / target.split("#", 1)[0]).resolve()
        if not path.exists() and path not in GENERATED:
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)}: broken links {broken}"


def test_readme_links_the_references():
    readme = text(ROOT / "README.md")
    for target in ("docs/api.md", "docs/configuration.md", "docs/benchmarks/README.md", "docs/appliance.md"):
        assert f"]({target})" in readme, f"README does not link {target}"


# ---- configuration keys ------------------------------------------------------------------------

SECTIONS = ("server", "target", "draft", "embedding", "speculation", "limits", "auth", "tls", "http", "metrics", "logging", "controller")


def _rendered(value: Any) -> str:
    """A default as the documents write it (TOML's spelling)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value or '""'
    if isinstance(value, (list, tuple)):
        return "[]" if not value else repr(list(value))
    return f"{value:g}" if isinstance(value, float) else str(value)


def readme_config_rows() -> list[tuple[list[str], list[str]]]:
    """(keys, defaults) of every row of the README's most-used-keys table."""
    readme = text(ROOT / "README.md")
    table = readme[readme.index("| key | default | meaning |"):].split("\n\n", 1)[0]
    rows = []
    for line in table.splitlines()[2:]:
        keys_cell, default_cell = [c.strip() for c in line.strip("|").split("|")][:2]
        keys = re.findall(r"`([\w.]+)`", keys_cell)
        defaults = [re.sub(r"\s*\(.*\)$", "", d).strip().strip("`") for d in default_cell.split(", ")]
        rows.append((keys, defaults))
    return rows


def test_readme_config_table_names_real_keys_with_their_defaults():
    from edgespec.settings import SECTIONS as DECLARED

    rows = readme_config_rows()
    assert len(rows) >= 10
    wrong = []
    for keys, defaults in rows:
        if len(defaults) == 1:
            defaults = defaults * len(keys)
        assert len(keys) == len(defaults), f"README config table: {keys} against {defaults}"
        for key, documented in zip(keys, defaults):
            section, _, name = key.partition(".")
            if name not in DECLARED.get(section, {}):
                wrong.append(f"{key}: no such key")
            elif _rendered(DECLARED[section][name].default) != documented:
                wrong.append(f"{key}: documented {documented!r}, default {_rendered(DECLARED[section][name].default)!r}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_config_keys_named_in_documents_exist(doc):
    from edgespec.settings import SECTIONS as DECLARED

    named = set(re.findall(r"`((?:" + "|".join(SECTIONS) + r")\.[a-z_]+)`", text(doc)))
    missing = sorted(k for k in named if k.split(".", 1)[1] not in DECLARED[k.split(".", 1)[0]])
    assert not missing, f"{doc.relative_to(ROOT)}: no such config keys {missing}"


def test_controller_defaults_in_controller_md_are_the_code_defaults():
    import dataclasses
    import tomllib

    from edgespec.controller import ControllerConfig

    doc = text(ROOT / "docs/controller.md")
    block = re.search(r"```toml\n(\[controller\]\n.*?)```", doc, flags=re.S)
    assert block, "docs/controller.md: no [controller] TOML block"
    documented = tomllib.loads(block.group(1))["controller"]
    defaults = {f.name: f.default for f in dataclasses.fields(ControllerConfig)}
    assert documented == defaults
    ControllerConfig.from_dict(documented).validate()
