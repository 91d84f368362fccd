"""Reranking quality: accuracy@1 and mean reciprocal rank of the relevant passage among
unrelated ones, over cases of one query, one relevant passage and several unrelated ones
(edgespec/bench/suites/rerank.jsonl, English and Chinese, or a site's own file of the same shape).

A scorer is any function (query, documents) -> scores, higher better: a reranker in-process, or
POST /v1/rerank on a running daemon (`http_scorer`). Used by `edgespec bench-rerank`
(edgespec/cli/bench_rerank.py) and by the tests that hold the shipped reranker to an ordering."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

SUITE = Path(__file__).parent / "suites" / "rerank.jsonl"
Scorer = Callable[[str, Sequence[str]], Sequence[float]]


@dataclass(frozen=True)
class Case:
    id: str
    lang: str
    query: str
    relevant: str
    unrelated: tuple[str, ...]


def load_cases(path: str | Path = SUITE) -> list[Case]:
    """One JSON object a line: id, lang, query, relevant, unrelated (a list of at least one)."""
    out = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        d = json.loads(line)
        if not d.get("query") or not d.get("relevant") or not d.get("unrelated"):
            raise ValueError(f"{path}:{n}: a case needs query, relevant and a non-empty unrelated list")
        out.append(Case(str(d.get("id", n)), str(d.get("lang", "")), d["query"], d["relevant"], tuple(d["unrelated"])))
    return out


def rank_of_relevant(scores: Sequence[float]) -> int:
    """The relevant passage's rank (1 = first) when it is scores[0]; a tie ranks it below the
    passages it ties with, so a scorer that ignores the document ranks it last."""
    return 1 + sum(s >= scores[0] for s in scores[1:])


@dataclass(frozen=True)
class Quality:
    cases: int
    accuracy_at_1: float  # share of cases whose relevant passage ranks first
    mrr: float  # mean of 1 / rank


def quality(ranks: Iterable[int]) -> Quality:
    rs = list(ranks)
    if not rs:
        return Quality(0, 0.0, 0.0)
    return Quality(len(rs), sum(r == 1 for r in rs) / len(rs), sum(1 / r for r in rs) / len(rs))


def evaluate(score: Scorer, cases: Sequence[Case]) -> dict[str, Quality]:
    """Quality over all cases ("all") and per language; each case scored in one call, the
    relevant passage first (rank_of_relevant breaks ties against it)."""
    ranks: dict[str, list[int]] = {"all": []}
    for c in cases:
        r = rank_of_relevant(list(score(c.query, [c.relevant, *c.unrelated])))
        ranks["all"].append(r)
        ranks.setdefault(c.lang or "?", []).append(r)
    return {k: quality(v) for k, v in ranks.items()}


def http_scorer(base_url: str, model: str = "", timeout: float = 300.0) -> Scorer:
    """POST {base_url}/v1/rerank; the scores back in the documents' order."""

    def score(query: str, documents: Sequence[str]) -> list[float]:
        body = json.dumps({"query": query, "documents": list(documents), **({"model": model} if model else {})})
        req = urllib.request.Request(f"{base_url.rstrip('/')}/v1/rerank", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            out = json.loads(resp.read())
        scores = [0.0] * len(documents)
        for r in out["results"]:
            scores[r["index"]] = float(r["relevance_score"])
        return scores

    return score
