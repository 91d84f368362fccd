"""The bench plot: tokens/s and tau by category x mode (and edgespec over llama.cpp when the
anchor was merged). matplotlib's Agg backend: no display needed."""

from __future__ import annotations

from typing import Any


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    summary = {c: cells for c, cells in report["summary"].items()}
    cats = list(summary)
    modes: list[str] = []
    for cells in summary.values():
        modes += [m for m in cells if m not in modes]
    ratios = (report.get("anchor") or {}).get("edgespec_over_llama_cpp")
    panels = 3 if ratios else 2
    fig, axes = plt.subplots(panels, 1, figsize=(max(8, 1.3 * len(cats) + 3), 3.6 * panels), squeeze=False)
    x = np.arange(len(cats))
    width = 0.8 / max(1, len(modes))

    def bars(ax, key: str, ylabel: str, title: str) -> None:
        top = 0.0
        for i, mode in enumerate(modes):
            vals = [summary[c].get(mode, {}).get(key, 0.0) or 0.0 for c in cats]
            top = max([top, *vals])
            ax.bar(x + (i - (len(modes) - 1) / 2) * width, vals, width, label=mode)
        ax.set_ylim(0, (top or 1.0) * 1.25)  # headroom for the legend
        ax.set_xticks(x, cats)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(ncols=len(modes), fontsize="small")

    s = report.get("settings", {})
    bars(axes[0][0], "tokens_per_second", "tokens/s", f"decode throughput (max {s.get('max_tokens')} tokens, greedy)")
    bars(axes[1][0], "tau", "tau (tokens / target forward)", "tokens per target forward")
    if ratios:
        ax = axes[2][0]
        rcats = list(ratios)
        rmodes = [m for m in modes if any(m in ratios[c] for c in rcats)]
        rx = np.arange(len(rcats))
        w = 0.8 / max(1, len(rmodes))
        top = 1.0
        for i, mode in enumerate(rmodes):
            vals = [(ratios[c].get(mode) or {}).get("ratio") or 0.0 for c in rcats]
            top = max([top, *vals])
            ax.bar(rx + (i - (len(rmodes) - 1) / 2) * w, vals, w, label=f"{mode} / llama.cpp {'plain' if mode == 'plain' else 'spec'}")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_ylim(0, top * 1.35)
        ax.set_xticks(rx, rcats)
        ax.set_ylabel("edgespec / llama.cpp tok/s")
        ax.set_title("edgespec over llama.cpp's own binaries (same models, prompts, tokens)")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize="small", ncols=2, loc="upper left")
    m = report.get("machine", {})
    fig.suptitle(f"edgespec bench — {m.get('cpu')} ({m.get('cores')} cores), GPU: {m.get('gpu') or 'none'}", fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
