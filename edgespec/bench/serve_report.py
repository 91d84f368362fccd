"""The serving benchmark's renderings: the markdown tables and the plot (tokens/s against
concurrency per system; the long-prompt scenario beside it). The JSON is the report itself."""

from __future__ import annotations

from typing import Any


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{1000 * x:.1f}"


def _f(x: float | None, spec: str = ".1f") -> str:
    return "–" if x is None else format(x, spec)


def _caches(s: dict[str, Any]) -> str:
    """What the servers reuse across requests (settings of older reports lack the keys)."""
    pc, sc = s.get("prompt_cache", False), s.get("suffix_cache", False)
    if isinstance(pc, str):
        prompt = f"Prompt cache {pc}"
    elif pc:
        prompt = "Prompt cache on (the daemon's slots keep their prefill; llama-server `cache_prompt: true`)"
    else:
        prompt = "No prompt cache (every request prefilled in full, llama-server `cache_prompt: false`)"
    suffix = f"suffix cache {sc}" if isinstance(sc, str) else f"suffix cache {'on' if sc else 'off'}"
    return f"{prompt}; {suffix}."


def _length(s: dict[str, Any]) -> str:
    """How long each request runs (settings of older reports lack ignore_eos)."""
    if s.get("ignore_eos"):
        return (f"every request runs to {s['max_tokens']} tokens (ignore_eos sent to both systems: "
                "end-of-generation tokens banned)")
    return f"max {s['max_tokens']} tokens per request (EOS ends earlier)"


def to_markdown(report: dict[str, Any]) -> str:
    out = _main_table(report)
    for section in (_ratios, _warmup, _drafts, _scenario, _servers):
        out += section(report)
    return "\n".join(out) + "\n"


def _main_table(report: dict[str, Any]) -> list[str]:
    """The heading, the settings and one row per (concurrency, system)."""
    s, m = report["settings"], report["machine"]
    out = [
        "# edgespec serving benchmark",
        "",
        f"`{report['command']}`",
        "",
        f"Machine: {m.get('cpu')} ({m.get('cores')} cores), GPU: {m.get('gpu') or 'none'}; llama-cpp-python "
        f"{m.get('llama_cpp_python')}. Greedy, {_length(s)}, "
        f"{s['requests']} requests per cell in {s['rounds']} interleaved rounds, {s['threads']} threads, "
        f"suite `{s['suite']}` ({s['prompts']} prompts), per-request context {s['n_ctx']}. "
        f"{_caches(s)}",
        "",
        "Aggregate = all completion tokens / wall time of the round, median over rounds. Per request: "
        "(tokens - 1) / (last token - first token), median. TTFT from submission. ITL per token: a chunk's "
        "tokens arrive together (the first carries the wait, the others 0); TPOT = mean ITL; gap = wait between "
        "deliveries. Latencies in ms, pooled over the cell's requests.",
        "",
        "| N | system | aggregate tok/s | per-request tok/s p50 | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | TPOT "
        "| gap p99 | tau | accepted / drafted | tokens |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for lv in report["levels"]:
        for name, c in lv["systems"].items():
            p = c["pooled"]
            acc = (f"{p['accepted_tokens']} / {p['drafted_tokens']} ({100 * p['acceptance']:.0f} %)"
                   if p.get("drafted_tokens") else "–")
            out.append(f"| {lv['concurrency']} | {name} | {_f(c['tokens_per_second'])} | "
                       f"{_f(p['request_tokens_per_second_p50'])} | {_ms(p['ttft_p50_s'])} | {_ms(p['ttft_p99_s'])} | "
                       f"{_ms(p['itl_p50_s'])} | {_ms(p['itl_p99_s'])} | {_ms(p['tpot_mean_s'])} | "
                       f"{_ms(p['delivery_gap_p99_s'])} | {_f(p.get('tau'), '.2f')} | {acc} | "
                       f"{p['completion_tokens']}{' (' + str(p['errors']) + ' errors)' if p['errors'] else ''} |")
    return out


def _ratios(report: dict[str, Any]) -> list[str]:
    """Aggregate tokens/s ratios per concurrency, with each round's."""
    pairs = list(dict.fromkeys(k for lv in report["levels"] for k in lv["ratios"]))
    if not pairs:
        return []
    out = ["", "Aggregate tokens/s ratios (median of per-round ratios; rounds in brackets):", "",
           "| N | " + " | ".join(pairs) + " |", "|---|" + "---|" * len(pairs)]
    for lv in report["levels"]:
        cells = []
        for k in pairs:
            r = lv["ratios"].get(k)
            cells.append("–" if r is None else f"{_f(r['median'], '.2f')} "
                         f"({', '.join(_f(x, '.2f') for x in r['rounds'])})")
        out.append(f"| {lv['concurrency']} | " + " | ".join(cells) + " |")
    return out


def _warmup(report: dict[str, Any]) -> list[str]:
    """The warm-up curve: ratios over the rounds after N requests of the stream."""
    curves = [(lv["concurrency"], k, pts) for lv in report["levels"] for k, pts in (lv.get("warmup_curve") or {}).items()]
    if not curves:
        return []
    after = list(dict.fromkeys(n for _, _, pts in curves for n in pts))
    out = ["", "Warm-up curve: aggregate tokens/s ratio over the rounds that start after N requests of the "
           "stream (their tokens over their wall time):", "",
           "| N streams | ratio | " + " | ".join(f"after {n}" for n in after) + " |",
           "|---|---|" + "---|" * len(after)]
    for conc, k, pts in curves:
        out.append(f"| {conc} | {k} | " + " | ".join(_f(pts.get(n), ".2f") for n in after) + " |")
    return out


def _drafts(report: dict[str, Any]) -> list[str]:
    """The daemon's drafts by source, its drafter mix, suffix cache and prompt store."""
    drafts = [(lv["concurrency"], lv["drafts"]) for lv in report["levels"] if (lv.get("drafts") or {}).get("by_source")]
    if not drafts:
        return []
    out = ["", "The daemon's drafts by source (tokens verified, accepted):", "",
           "| N | source | proposed | accepted | acceptance |", "|---|---|---|---|---|"]
    for conc, d in drafts:
        for src, f in sorted(d["by_source"].items()):
            out.append(f"| {conc} | {src} | {f['proposed']} | {f['accepted']} | {100 * f['acceptance']:.0f} % |")
        mix = d.get("requests_by_drafter") or {}
        if mix:
            out.append(f"| {conc} | requests by drafter | " + ", ".join(f"{k} {n}" for k, n in sorted(mix.items()))
                       + " | | |")
        sc = d.get("suffix_cache") or {}
        if sc.get("enabled"):
            out.append(f"| {conc} | suffix cache | {int(sc.get('documents', 0))} replies, "
                       f"{int(sc.get('bytes', 0)) >> 10} KiB | {int(sc.get('hits', 0))} hits | "
                       f"of {int(sc.get('lookups', 0))} lookups |")
        ps = d.get("prompt_store") or {}
        if ps:
            out.append(f"| {conc} | prompt store | {int(ps.get('entries', 0))} prefills, "
                       f"{int(ps.get('bytes', 0)) >> 20} MiB | {int(ps.get('hits', 0))} hits | "
                       f"{int(ps.get('restored_tokens', 0))} tokens written back |")
    return out


def _scenario(report: dict[str, Any]) -> list[str]:
    """A long prompt arriving while streams decode: its TTFT and the streams' stalls."""
    sc = report.get("scenario")
    if not sc:
        return []
    ss = sc.get("settings", {})
    out = ["", f"## A {ss.get('prompt_tokens')}-token prompt arriving while {len(sc['streams'])} streams decode", "",
           f"Parallel {len(sc['streams']) + 1}; the streams ask for up to {ss.get('stream_tokens')} tokens; the "
           f"long prompt arrives once each stream has its first {ss.get('warm_tokens')} tokens and asks for "
           f"{ss.get('long_tokens')}. Window = its submission to its first token; the streams' inter-token "
           f"latency per delivery (a chunk's tokens count once) over the gaps overlapping it (a stall across "
           f"the window counts once, whole); 'before' = the same before the long prompt arrived. Medians over "
           f"{ss.get('rounds')} rounds; ms.", "",
           "| system | long prompt tokens | long TTFT | streams' ITL p50 in window | p99 in window | max in "
           "window | ITL p50 before | ITL p99 before | streams decoding throughout |",
           "|---|---|---|---|---|---|---|---|---|"]
    for name, r in sc["systems"].items():
        md = r["median"]
        out.append(f"| {name} | {_f(md.get('long_prompt_tokens'), '.0f')} | {_ms(md.get('long_ttft_s'))} | "
                   f"{_ms(md.get('window_itl_p50_s'))} | {_ms(md.get('window_itl_p99_s'))} | "
                   f"{_ms(md.get('window_itl_max_s'))} | {_ms(md.get('before_itl_p50_s'))} | "
                   f"{_ms(md.get('before_itl_p99_s'))} | {_f(md.get('streams_decoding_throughout'), '.0f')} |")
    return out


def _servers(report: dict[str, Any]) -> list[str]:
    """The daemon's draft per level and the servers' command lines."""
    out: list[str] = []
    drafts = [f"N={lv['concurrency']}: {lv['daemon']['draft']}"
              + (f" and {lv['daemon']['head']} beside it" if lv["daemon"].get("head") else "")
              for lv in report["levels"] if (lv.get("daemon") or {}).get("draft")]
    if drafts:
        out += ["", "The daemon's draft: " + ", ".join(drafts) + "."]
    cmds = report.get("commands") or {}
    if cmds:
        out += ["", "Servers:", ""] + [f"- {k}: `{v}`" for k, v in cmds.items() if isinstance(v, str)]
    return out


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = report["levels"]
    systems = list(dict.fromkeys(n for lv in levels for n in lv["systems"]))
    sc = report.get("scenario")
    panels = 3 if sc else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.2), squeeze=False)
    xs = [lv["concurrency"] for lv in levels]
    for key, ax, title in (("aggregate", axes[0][0], "aggregate tokens/s"),
                           ("request", axes[0][1], "per-request tokens/s (median)")):
        for name in systems:
            ys = [(lv["systems"][name]["tokens_per_second"] if key == "aggregate"
                   else lv["systems"][name]["pooled"]["request_tokens_per_second_p50"])
                  if name in lv["systems"] else None for lv in levels]
            ax.plot(xs, [y if y is not None else float("nan") for y in ys], marker="o", label=name)
        ax.set_xlabel("concurrent requests (N)")
        ax.set_xticks(xs)
        ax.set_ylabel("tokens/s")
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    if sc:
        import numpy as np

        ax = axes[0][2]
        names = list(sc["systems"])
        x = np.arange(len(names))
        vals = {k: [(sc["systems"][n]["median"].get(k) or 0.0) * 1000 for n in names]
                for k in ("window_itl_p99_s", "long_ttft_s")}
        ax.bar(x - 0.2, vals["window_itl_p99_s"], 0.4, label="streams' ITL p99 during the prefill")
        ax.bar(x + 0.2, vals["long_ttft_s"], 0.4, label="long prompt's TTFT")
        ax.set_xticks(x, names, rotation=20, ha="right", fontsize="small")
        ax.set_ylabel("ms")
        ax.set_title(f"a {sc.get('settings', {}).get('prompt_tokens')}-token prompt arrives")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize="small")
    m = report.get("machine", {})
    fig.suptitle(f"edgespec bench-serve — {m.get('cpu')} ({m.get('cores')} cores), max "
                 f"{report['settings']['max_tokens']} tokens, greedy", fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
