"""Bench reports: per-category summaries with speedups over plain, the llama.cpp anchor ratios,
the machine description, and the JSON / markdown renderings."""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
from collections.abc import Callable, Iterable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from edgespec.bench.runner import Row, base_mode
from edgespec.controller.cost import CostModel

OVERALL = "overall"

# How the headline finds its two groups in a suite it has never seen: a category is structured /
# drift when a word of its name (lower-cased, split at anything not a letter or digit) starts
# with one of these (drift wins if both match). `edgespec bench --structured/--drift` names them
# outright instead.
STRUCTURED_WORDS = ("code", "json", "legal", "rag", "extract", "sql", "clause", "contract", "schema",
                    "program", "yaml", "csv", "structured")
DRIFT_WORDS = ("drift", "ood", "adversarial", "random", "noise", "wordplay", "gibberish", "symbol")


def classify(category: str) -> str | None:
    """"structured", "drift" or None (a category the headline leaves out: chat, chinese, ...)."""
    name = " ".join(re.split(r"[^a-z0-9]+", category.lower())).strip()
    words = name.split()
    if any(w.startswith(DRIFT_WORDS) for w in words) or "out of domain" in name:
        return "drift"
    if any(w.startswith(STRUCTURED_WORDS) for w in words):
        return "structured"
    return None


def headline_groups(categories: Iterable[str], structured: Sequence[str] | None = None,
                    drift: Sequence[str] | None = None) -> dict[str, list[str]]:
    """{"structured": [...], "drift": [...]}: the categories each headline figure pools. A group
    given explicitly is taken as given; otherwise `classify` picks its members."""
    cats = list(dict.fromkeys(categories))
    return {
        "structured": list(structured) if structured is not None else [c for c in cats if classify(c) == "structured"],
        "drift": list(drift) if drift is not None else [c for c in cats if classify(c) == "drift"],
    }


def _cell(rows: Sequence[Row]) -> dict[str, Any]:
    tokens = sum(r.tokens for r in rows)
    seconds = sum(r.seconds for r in rows)
    forwards = sum(r.target_forwards for r in rows)
    return {
        "n": len(rows),
        "tokens": tokens,
        "seconds": round(seconds, 4),
        "target_forwards": forwards,
        # throughput of the whole category: summed tokens over summed seconds
        "tokens_per_second": round(tokens / seconds, 3) if seconds > 0 else 0.0,
        "mean_tokens_per_second": round(sum(r.tokens_per_second for r in rows) / len(rows), 3),
        "mean_tau": round(sum(r.tau for r in rows) / len(rows), 4),
        # tau of the whole category: summed tokens over summed target forwards
        "tau": round(tokens / forwards, 4) if forwards else 0.0,
        **_validity(rows),
    }


def _validity(rows: Sequence[Row]) -> dict[str, int]:
    """MODE+schema cells: how many answers parse and follow their schema."""
    checked = [r.valid for r in rows if r.valid is not None]
    return {"schema_valid": sum(checked), "schema_checked": len(checked)} if checked else {}


def _categories(rows: Iterable[Row]) -> list[str]:
    seen: dict[str, None] = {}
    for r in rows:
        seen.setdefault(r.category, None)
    return list(seen)


def _modes(rows: Iterable[Row]) -> list[str]:
    seen: dict[str, None] = {}
    for r in rows:
        seen.setdefault(r.mode, None)
    return list(seen)


def summarize(rows: Sequence[Row]) -> dict[str, dict[str, dict[str, Any]]]:
    """{category | "overall": {mode: cell}}, each cell with `speedup` = its tokens_per_second
    (summed tokens / summed seconds) over plain's in the same category (None without plain)."""
    groups = {cat: [r for r in rows if r.category == cat] for cat in _categories(rows)}
    groups[OVERALL] = list(rows)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for cat, cat_rows in groups.items():
        cells = {m: _cell([r for r in cat_rows if r.mode == m]) for m in _modes(cat_rows)}
        plain = cells.get("plain")
        for cell in cells.values():
            cell["speedup"] = (
                round(cell["tokens_per_second"] / plain["tokens_per_second"], 3)
                if plain and plain["tokens_per_second"] > 0
                else None
            )
        out[cat] = cells
    return out


MAX_DEPTH_SHOWN = 8


def time_split(rows: Sequence[Row]) -> dict[str, dict[str, Any]]:
    """{mode: where its time went}, pooled over `rows`: ms per emitted token inside the target's
    forwards (verification), inside the draft's, and outside both (Python: trees, verification,
    sampling, bookkeeping); draft forwards per token; and acceptance by depth: the share of steps
    (target forwards) that accepted at least d drafted tokens, d = 1, 2, ..."""
    out: dict[str, dict[str, Any]] = {}
    for mode in _modes(rows):
        mine = [r for r in rows if r.mode == mode]
        tokens = sum(r.tokens for r in mine)
        steps = sum(r.target_forwards for r in mine)
        if not tokens or not steps:
            continue
        seconds = sum(r.seconds for r in mine)
        tgt = sum(r.target_seconds for r in mine)
        dft = sum(r.draft_seconds for r in mine)
        depth = [0] * max((len(r.accepted_per_depth) for r in mine), default=0)
        for r in mine:
            for d, n in enumerate(r.accepted_per_depth):
                depth[d] += n
        out[mode] = {
            "tau": round(tokens / steps, 3),
            "target_ms_per_token": round(tgt / tokens * 1e3, 3),
            "draft_ms_per_token": round(dft / tokens * 1e3, 3),
            "other_ms_per_token": round(max(0.0, seconds - tgt - dft) / tokens * 1e3, 3),
            "target_ms_per_forward": round(tgt / steps * 1e3, 3),
            "draft_forwards_per_token": round(sum(r.draft_forwards for r in mine) / tokens, 3),
            "accepted_at_least": [round(n / steps, 3) for n in depth[:MAX_DEPTH_SHOWN]],
        }
    return out


# ---- what the measured costs allow --------------------------------------------------------------

CEILING_DEPTHS = (1, 2, 3, 4, 6, 8, 12, 16)


def plain_forward_seconds(rows: Sequence[Row]) -> float | None:
    """Seconds per target forward of this run's plain rows (inside llama_decode), or None."""
    mine = [r for r in rows if r.mode == "plain" and r.target_forwards]
    forwards, seconds = sum(r.target_forwards for r in mine), sum(r.target_seconds for r in mine)
    return seconds / forwards if forwards and seconds > 0 else None


def ceiling(costs: dict[str, Any], depths: Sequence[int] = CEILING_DEPTHS,
            plain_seconds: float | None = None) -> dict[str, Any] | None:
    """The most a chain of k drafts could make of this run's measured forward costs, over plain
    (Python excluded from both). A draft that is always right emits k + 1 tokens per step for one
    draft forward over 2 tokens (the previous step's last draft and its bonus token), k - 1 over
    one token, and one verification over k + 1; plain emits one token per 1-token target forward:

        perfect_draft(k) = (k + 1) T(1) / (D(2) + (k - 1) D(1) + T(k + 1))
        free_draft(k)    = (k + 1) T(1) / T(k + 1)           (drafting free: verification's bound)

    A draft model of this cost cannot beat `perfect_draft` (a deeper tree needs a draft forward
    per level, and a tree's extra branches are waste when the chain is always right): when its best
    is under a goal, the goal is out of reach with this draft on this machine, whatever the
    controller does. Only model-free drafts (prompt lookup grafts) push toward `free_draft`.

    T(1) is `plain_seconds` when given: what this run's plain rows measured, the same forwards its
    speedups are over. The cost table is the cost model at the run's end (EWMA), and this host's
    memory-bound 1-token forward changes speed within a minute while the compute-bound forwards
    (verification of several tokens, the draft) barely move (docs/benchmarks, item 5), so a table
    refined during a fast last minute would put the bound under what a slow run measured. T(n),
    n >= 2, is the table's but never under T(1), which keeps the result an upper bound. Costs are
    at the calibration context (longer contexts make verification dearer still)."""
    tables = {k: {int(n): float(s) for n, s in (costs.get(f"{k}_seconds") or {}).items()} for k in ("target", "draft")}
    if not tables["target"] or not tables["draft"]:
        return None
    cm = CostModel.from_tables(tables["target"], tables["draft"])
    table_plain = cm.verify_seconds(1)
    plain = table_plain if plain_seconds is None else plain_seconds

    def verify(n: int) -> float:
        return max(cm.verify_seconds(n), plain)

    chain = {}
    for k in depths:
        drafting = cm.draft_seconds(2) + (k - 1) * cm.draft_seconds(1)
        chain[str(k)] = {"perfect_draft": round((k + 1) * plain / (drafting + verify(k + 1)), 3),
                         "free_draft": round((k + 1) * plain / verify(k + 1), 3)}
    best = max(chain, key=lambda k: chain[k]["perfect_draft"])
    return {
        "target_ms": round(plain * 1e3, 3),
        "target_ms_from": "cost table" if plain_seconds is None else "plain rows",
        "table_target_ms": round(table_plain * 1e3, 3),
        "draft_ms": round(cm.draft_seconds(1) * 1e3, 3),
        "draft_over_target": round(cm.draft_seconds(1) / plain, 3),
        "chain": chain,
        "best_depth": int(best),
        "best_perfect_draft": chain[best]["perfect_draft"],
    }


# ---- the llama.cpp anchor ---------------------------------------------------------------------

# edgespec mode -> the llama.cpp run it is set beside
ANCHOR_MODE = {"plain": "plain", "chain": "speculative", "tree": "speculative", "auto": "speculative"}


def anchor_ratios(rows: Sequence[Row], anchor: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """{category | "overall": {edgespec mode: {edgespec_tps, llama_cpp_mode, llama_cpp_tps, ratio}}}
    over the prompt ids both runs have."""
    arows = [anchor_row(r) for r in anchor["results"]]
    ids = {r.id for r in arows}
    mine = [r for r in rows if r.id in ids]
    ids &= {r.id for r in mine}
    arows = [r for r in arows if r.id in ids]
    ours, theirs = summarize(mine), summarize(arows)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for cat, cells in ours.items():
        for mode, cell in cells.items():
            other = theirs.get(cat, {}).get(ANCHOR_MODE.get(mode, ""))
            if not other:
                continue
            out.setdefault(cat, {})[mode] = {
                "edgespec_tokens_per_second": cell["tokens_per_second"],
                "llama_cpp_mode": ANCHOR_MODE[mode],
                "llama_cpp_tokens_per_second": other["tokens_per_second"],
                "ratio": round(cell["tokens_per_second"] / other["tokens_per_second"], 3)
                if other["tokens_per_second"] > 0
                else None,
            }
    return out


def anchor_row(r: dict[str, Any]) -> Row:
    """A row of the anchor's JSON (tools/llama-anchor.sh) as a bench Row."""
    return Row(
        id=r["id"],
        category=r["category"],
        mode=r["mode"],
        tokens=int(r["tokens"]),
        seconds=float(r["seconds"]),
        tokens_per_second=float(r["tokens_per_second"]),
        tau=float(r.get("tau") or 0.0),
        target_forwards=int(r.get("target_forwards") or 0),
    )


# ---- headline figures against the issue's goals ------------------------------------------------


def headline(summary: dict, ratios: dict | None, groups: dict[str, list[str]]) -> dict[str, Any]:
    """The figures the README quotes: best speculative speedup and tree tau on the structured
    categories, auto over plain on drift prompts, and auto over llama.cpp's speculation. `groups`
    (headline_groups) says which categories are structured and which drift; each figure pools
    its group's tokens and seconds."""
    spec_modes = ("chain", "tree", "auto")

    def pooled(cats: Sequence[str], mode: str) -> dict[str, float] | None:
        cells = [summary[c][mode] for c in cats if c in summary and mode in summary[c]]
        if not cells:
            return None
        tokens = sum(c["tokens"] for c in cells)
        seconds = sum(c["seconds"] for c in cells)
        forwards = sum(c["target_forwards"] for c in cells)
        return {"tps": tokens / seconds if seconds else 0.0, "tau": tokens / forwards if forwards else 0.0}

    out: dict[str, Any] = {"structured_categories": groups["structured"], "drift_categories": groups["drift"]}
    plain = pooled(groups["structured"], "plain")
    if plain and plain["tps"] > 0:
        best = {m: p["tps"] / plain["tps"] for m in spec_modes if (p := pooled(groups["structured"], m))}
        if best:
            mode = max(best, key=lambda m: best[m])
            out["structured_best_mode"] = mode
            out["structured_best_speedup"] = round(best[mode], 3)
    tree = pooled(groups["structured"], "tree")
    if tree:
        out["structured_tree_tau"] = round(tree["tau"], 3)
    drift_plain, drift_auto = pooled(groups["drift"], "plain"), pooled(groups["drift"], "auto")
    if drift_plain and drift_auto and drift_plain["tps"] > 0:
        out["drift_auto_speedup"] = round(drift_auto["tps"] / drift_plain["tps"], 3)
    if ratios and "auto" in ratios.get(OVERALL, {}):
        out["auto_over_llama_cpp_speculative"] = ratios[OVERALL]["auto"]["ratio"]
    if ratios and "plain" in ratios.get(OVERALL, {}):
        out["plain_over_llama_cpp_plain"] = ratios[OVERALL]["plain"]["ratio"]
    return out


# ---- machine description -----------------------------------------------------------------------


def machine_info(backend: str | None = None) -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "llama_cpp_python": _version("llama-cpp-python"),
        "edgespec": _version("edgespec"),
        "gpu": _gpu(),
    }
    if backend:
        info["backend"] = backend
    return info


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _gpu() -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


# ---- renderings --------------------------------------------------------------------------------


def build_report(
    rows: Sequence[Row],
    *,
    command: str,
    machine: dict[str, Any],
    settings: dict[str, Any],
    anchor: dict[str, Any] | None = None,
    costs: dict[str, Any] | None = None,
    structured: Sequence[str] | None = None,
    drift: Sequence[str] | None = None,
) -> dict[str, Any]:
    """`costs`: the engine's cost model after the run (CostModel.as_dict: seconds per forward by
    batch size, calibrated at load and refined online), reported beside the time split.
    `structured` / `drift`: the categories the headline pools (default: by name, `classify`)."""
    summary = summarize(rows)
    groups = headline_groups((r.category for r in rows), structured, drift)
    report: dict[str, Any] = {
        "command": command,
        "machine": machine,
        "settings": settings,
        "results": [r.as_dict() for r in rows],
        "summary": summary,
    }
    structured_rows = [r for r in rows if r.category in groups["structured"]]
    report["time_split"] = {"structured": time_split(structured_rows)} if structured_rows else {}
    report["time_split"][OVERALL] = time_split(rows)
    if costs is not None:
        report["costs"] = costs
        if (bound := ceiling(costs, plain_seconds=plain_forward_seconds(rows))) is not None:
            report["ceiling"] = bound
    ratios = None
    if anchor is not None:
        ratios = anchor_ratios(rows, anchor)
        report["anchor"] = {
            "command": anchor.get("command"),
            "settings": anchor.get("settings"),
            "summary": summarize([anchor_row(r) for r in anchor["results"]]),
            "edgespec_over_llama_cpp": ratios,
            "interleaved": bool((anchor.get("settings") or {}).get("interleaved")),
            "results": anchor["results"],
        }
    report["headline"] = headline(summary, ratios, groups)
    if (curve := warmup_curve(rows)):
        report["warmup_curve"] = curve
    if (sources := by_source(rows)):
        report["by_source"] = sources
    if (so := structured_output(summary)):
        report["structured_output"] = so
        report["headline"]["schema_valid"] = {m: f"{c['valid']}/{c['checked']}" for m, c in so.items()}
        report["headline"]["schema_over_free"] = {m: c["over_free"] for m, c in so.items()}
    if "ceiling" in report:
        report["headline"]["perfect_draft_ceiling"] = report["ceiling"]["best_perfect_draft"]
    return report


WARMUP_AFTER = (0, 10, 30, 100)  # the warm-up curve's points: requests of the stream before


def warmup_curve(rows: Sequence[Row], after: Sequence[int] = WARMUP_AFTER) -> dict[str, dict[str, Any]]:
    """The speedup over plain of each mode, after a warm-up of N requests of the stream: over the
    prompts with index in [N, next N) (the last: N and beyond), summed tokens over summed seconds,
    each mode over plain on the same prompts. Empty without a plain mode or a +suffix mode."""
    modes = _modes(rows)
    if "plain" not in modes or not any(m.endswith("+suffix") for m in modes):
        return {}
    out: dict[str, dict[str, Any]] = {}
    bounds: list[int | None] = [*after, None]
    for lo, hi in zip(after, bounds[1:]):
        window = [r for r in rows if r.index >= lo and (hi is None or r.index < hi)]
        if not window:
            continue
        plain = _cell([r for r in window if r.mode == "plain"])
        point: dict[str, Any] = {"requests": plain["n"], "plain_tokens_per_second": plain["tokens_per_second"]}
        for m in modes:
            if m == "plain":
                continue
            c = _cell([r for r in window if r.mode == m])
            point[m] = round(c["tokens_per_second"] / plain["tokens_per_second"], 3) \
                if plain["tokens_per_second"] else None
        out[str(lo)] = point
    return out


def by_source(rows: Sequence[Row]) -> dict[str, dict[str, dict[str, int]]]:
    """{mode: {source: {proposed, accepted}}}: the draft tokens each source put in the
    verifications and how many were accepted."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    for r in rows:
        acc = dict(r.accepted_by_source)
        for src, n in r.proposed_by_source:
            cell = out.setdefault(r.mode, {}).setdefault(src, {"proposed": 0, "accepted": 0})
            cell["proposed"] += n
            cell["accepted"] += acc.get(src, 0)
    return out


def structured_output(summary: dict) -> dict[str, dict[str, Any]]:
    """{MODE+schema: {valid, checked, tokens_per_second, free_tokens_per_second, over_free}} over
    all prompts: the constrained mode's answers that validate, and its throughput over the same
    mode without the schema (same prompts, same rotation)."""
    cells = summary.get(OVERALL, {})
    out = {}
    for mode, c in cells.items():
        if "schema_checked" not in c:
            continue
        free = cells.get(base_mode(mode))
        tps = free["tokens_per_second"] if free else None
        out[mode] = {"valid": c["schema_valid"], "checked": c["schema_checked"],
                     "tokens_per_second": c["tokens_per_second"], "free_tokens_per_second": tps,
                     "over_free": round(c["tokens_per_second"] / tps, 3) if tps else None}
    return out


def _plain_source(bound: dict[str, Any]) -> str:
    """Where the ceiling's 1-token target forward came from, when it differs from the cost table."""
    if bound.get("target_ms_from") != "plain rows":
        return ""
    table = bound.get("table_target_ms")
    if table and abs(bound["target_ms"] - table) > 0.05 * table:
        return (f": this run's plain forwards; the cost table at the run's end says {table:.1f}, the host "
                "changed speed during the run")
    return ": this run's plain forwards"


def write_json(report: dict[str, Any], path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, ensure_ascii=False)
        f.write("\n")


def write_outputs(report: dict[str, Any], markdown: str, *, json_out: Path | None, markdown_out: Path | None,
                  plot_out: Path | None = None, plot: Callable[[dict[str, Any], str], None] | None = None) -> None:
    """A bench command's report where it was asked for: JSON, markdown, a PNG through `plot`."""
    if json_out:
        write_json(report, str(json_out))
    if markdown_out:
        markdown_out.write_text(markdown, encoding="utf-8")
    if plot_out and plot is not None:
        plot(report, str(plot_out))


def _decoding(settings: dict[str, Any]) -> str:
    t = settings.get("temperature") or 0.0
    if not t:
        return "greedy"
    knobs = ", ".join(f"{k} {settings[k]}" for k in ("top_k", "top_p", "min_p") if k in settings
                      and settings[k] != {"top_k": 0, "top_p": 1.0, "min_p": 0.0}[k])
    return f"sampled (temperature {t}{', ' + knobs if knobs else ''}; seed {settings.get('seed', 0)} + prompt index)"


def _fmt(x: Any, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def _cells(table: dict[str, dict[str, dict]], row: Callable[[str, str, dict], str]) -> list[str]:
    """One markdown row per (category, mode) cell of a {category: {mode: cell}} table."""
    return [row(cat, mode, c) for cat, cells in table.items() for mode, c in cells.items()]


def to_markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    s = report["settings"]
    lines = [
        "# edgespec bench",
        "",
        f"- machine: {m.get('cpu')} ({m.get('cores')} cores), GPU: {m.get('gpu') or 'none'}, "
        f"llama-cpp-python {m.get('llama_cpp_python')}",
        f"- target: `{s.get('target')}`, draft: `{s.get('draft')}`, max tokens {s.get('max_tokens')}, "
        f"{_decoding(s)}, modes interleaved per prompt",
        f"- command: `{report['command']}`",
        "",
        "| category | mode | prompts | tokens | tok/s | speedup vs plain | tau |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    lines += _cells(report["summary"], lambda cat, mode, c: (
        f"| {cat} | {mode} | {c['n']} | {c['tokens']} | {c['tokens_per_second']:.1f} | "
        f"{_fmt(c['speedup'], '.2f')} | {c['tau']:.2f} |"))
    lines += _time_split_markdown(report)
    if report.get("structured_output"):
        lines += ["", "## Structured output (each prompt's JSON schema as the constraint)", "",
                  "| mode | answers valid | tok/s | without the schema | ratio |", "|---|---:|---:|---:|---:|"]
        for mode, c in report["structured_output"].items():
            lines.append(f"| {mode} | {c['valid']}/{c['checked']} | {c['tokens_per_second']:.1f} | "
                         f"{_fmt(c['free_tokens_per_second'], '.1f')} | {_fmt(c['over_free'], '.2f')} |")
    if report.get("warmup_curve"):
        curve = report["warmup_curve"]
        modes = [k for k in next(iter(curve.values())) if k not in ("requests", "plain_tokens_per_second")]
        lines += ["", "## Warm-up curve (speedup over plain after N requests of the stream)", "",
                  "| after | requests | plain tok/s | " + " | ".join(modes) + " |",
                  "|---|---:|---:|" + "---:|" * len(modes)]
        for name, pt in curve.items():
            lines.append(f"| {name} | {pt['requests']} | {pt['plain_tokens_per_second']:.1f} | "
                         + " | ".join(_fmt(pt.get(m), '.2f') for m in modes) + " |")
    if report.get("by_source"):
        lines += ["", "## Draft tokens by source (verified / accepted)", "",
                  "| mode | source | proposed | accepted | rate |", "|---|---|---:|---:|---:|"]
        for mode, srcs in report["by_source"].items():
            for src, c in sorted(srcs.items()):
                rate = c["accepted"] / c["proposed"] if c["proposed"] else 0.0
                lines.append(f"| {mode} | {src} | {c['proposed']} | {c['accepted']} | {rate:.2f} |")
    anchor = report.get("anchor")
    if anchor:
        lines += [
            "",
            "## edgespec over llama.cpp (same models, prompts, token budget)",
            "",
            f"llama.cpp command: `{anchor.get('command')}`",
            "",
            "llama.cpp's binaries ran inside this run's rotation, prompt by prompt (`--anchor-bin`): the "
            "ratios are as drift-free as the bench's own." if anchor.get("interleaved") else
            "llama.cpp's binaries ran in a separate run (`--anchor`): the ratios carry the machine's drift "
            "between the two runs (compare plain with plain).",
            "",
        ]
        if not anchor["edgespec_over_llama_cpp"]:
            lines.append("No prompt ids in common with the anchor run: run both on the same suite.")
        else:
            lines += [
                "| category | edgespec mode | edgespec tok/s | llama.cpp | llama.cpp tok/s | ratio |",
                "|---|---|---:|---|---:|---:|",
            ]
        lines += _cells(anchor["edgespec_over_llama_cpp"], lambda cat, mode, c: (
            f"| {cat} | {mode} | {c['edgespec_tokens_per_second']:.1f} | {c['llama_cpp_mode']} | "
            f"{c['llama_cpp_tokens_per_second']:.1f} | {_fmt(c['ratio'], '.2f')} |"))
    h = report.get("headline") or {}
    if h:
        lines += ["", "## Headline", ""]
        lines += [f"- {k}: {', '.join(v) or '(none: name them with --structured / --drift)'}" if isinstance(v, list)
                  else f"- {k}: {v}" for k, v in h.items()]
    return "\n".join(lines) + "\n"


def _time_split_markdown(report: dict[str, Any]) -> list[str]:
    split = report.get("time_split") or {}
    if not any(split.values()):
        return []
    lines = [
        "",
        "## Where the time goes",
        "",
        "ms per emitted token inside the target's forwards (verification), inside the draft's, and "
        "outside both; acceptance by depth = share of steps that accepted at least d drafted tokens.",
        "",
        "| prompts | mode | tau | target ms/token | draft ms/token | other ms/token | target ms/forward "
        "| draft forwards/token | accepted >= d, d = 1, 2, ... |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for group, modes in split.items():
        for mode, c in modes.items():
            depth = " ".join(f"{x:.2f}" for x in c["accepted_at_least"]) or "–"
            lines.append(
                f"| {group} | {mode} | {c['tau']:.2f} | {c['target_ms_per_token']:.2f} | {c['draft_ms_per_token']:.2f} | "
                f"{c['other_ms_per_token']:.2f} | {c['target_ms_per_forward']:.2f} | "
                f"{c['draft_forwards_per_token']:.2f} | {depth} |"
            )
    costs = report.get("costs")
    if costs:
        sizes = sorted({int(n) for kind in ("target_seconds", "draft_seconds") for n in costs.get(kind, {})})
        lines += [
            "",
            "Cost of one forward by tokens in it (ms; calibrated at load, refined online during the run):",
            "",
            "| model | " + " | ".join(str(n) for n in sizes) + " |",
            "|---|" + "---:|" * len(sizes),
        ]
        for kind in ("target_seconds", "draft_seconds"):
            table = {int(n): v for n, v in costs.get(kind, {}).items()}
            if table:
                cells = " | ".join(_fmt(table[n] * 1e3 if n in table else None, ".1f") for n in sizes)
                lines.append(f"| {kind.split('_')[0]} | {cells} |")
    bound = report.get("ceiling")
    if bound:
        depths = list(bound["chain"])
        lines += [
            "",
            "## The ceiling these costs allow",
            "",
            f"A draft forward costs {bound['draft_over_target']:.2f} of a target forward "
            f"({bound['draft_ms']:.1f} vs {bound['target_ms']:.1f} ms{_plain_source(bound)}). Speedup over plain that a chain of k "
            "drafts could reach with these costs if every draft were accepted (and with drafting free), "
            "Python excluded. No controller, and no draft model of this cost however well it agrees, passes the "
            "first row; only model-free drafts (prompt lookup) reach toward the second.",
            "",
            "| chain of k | " + " | ".join(depths) + " |",
            "|---|" + "---:|" * len(depths),
            "| draft always right | " + " | ".join(f"{bound['chain'][k]['perfect_draft']:.2f}" for k in depths) + " |",
            "| ... and drafting free | " + " | ".join(f"{bound['chain'][k]['free_draft']:.2f}" for k in depths) + " |",
        ]
    return lines
