"""`edgespec bench-rerank`: how well a running daemon's reranker orders a relevant passage above
unrelated ones (accuracy@1, MRR), on the shipped English and Chinese cases or a site's own
(edgespec/bench/rerank.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer

from edgespec.cli.common import fail, user_errors


def bench_rerank(
    url: str = typer.Option("http://127.0.0.1:8080", "--url", help="the daemon's HTTP API"),
    model: str = typer.Option("", "--model", help="the reranker's name (empty: the served reranker)"),
    cases: Path | None = typer.Option(None, "--cases", help="JSON lines of {query, relevant, unrelated: [...], "
                                                           "lang?, id?} (default: the shipped cases)"),
    out: Path | None = typer.Option(None, "--out", help="also write the figures here as JSON"),
) -> None:
    """Accuracy@1 and MRR of the relevant passage among unrelated ones, through POST /v1/rerank."""
    import urllib.error

    from edgespec.bench import rerank

    with user_errors():
        loaded = rerank.load_cases(cases or rerank.SUITE)
        t0 = time.perf_counter()
        try:
            figures = rerank.evaluate(rerank.http_scorer(url, model), loaded)
        except (urllib.error.URLError, OSError) as exc:
            fail(f"{url}/v1/rerank: {exc}")
        seconds = time.perf_counter() - t0
    lines = ["| cases | n | accuracy@1 | MRR |", "|---|---:|---:|---:|"]
    lines += [f"| {k} | {q.cases} | {q.accuracy_at_1:.2f} | {q.mrr:.3f} |" for k, q in figures.items()]
    typer.echo("\n".join(lines) + f"\n\n{len(loaded)} requests in {seconds:.1f} s")
    if out is not None:
        out.write_text(json.dumps({"url": url, "model": model, "seconds": seconds,
                                   **{k: vars(q) for k, q in figures.items()}}, indent=2) + "\n")


def register(app: typer.Typer) -> None:
    app.command("bench-rerank")(bench_rerank)
