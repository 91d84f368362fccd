"""The rerank quality figures (edgespec/bench/rerank.py): the metrics on constructed scores with
known answers, the tie rule that ranks a document-blind scorer last, and the shipped cases'
shape (both languages, kept apart from the tests' queries and the prompts' examples)."""

from __future__ import annotations

import json

import pytest

from edgespec.bench import rerank
from edgespec.server import rerank as rr


def test_rank_and_quality_on_known_scores():
    assert rerank.rank_of_relevant([0.9, 0.1, 0.5]) == 1
    assert rerank.rank_of_relevant([0.4, 0.1, 0.5, 0.7]) == 3
    assert rerank.rank_of_relevant([0.5, 0.5, 0.5]) == 3  # a tie goes against the relevant passage
    q = rerank.quality([1, 2, 4, 1])
    assert (q.cases, q.accuracy_at_1, q.mrr) == (4, 0.5, pytest.approx((1 + 0.5 + 0.25 + 1) / 4))


def test_a_scorer_that_ignores_the_document_scores_as_the_last_place():
    cases = rerank.load_cases()
    blind = rerank.evaluate(lambda q, docs: [len(q)] * len(docs), cases)["all"]
    assert blind.accuracy_at_1 == 0.0 and blind.mrr == pytest.approx(1 / 5)
    # an oracle that knows the relevant passage (it comes first) is perfect, per language too
    oracle = rerank.evaluate(lambda q, docs: [1.0] + [0.0] * (len(docs) - 1), cases)
    assert {k: (v.accuracy_at_1, v.mrr) for k, v in oracle.items()} == {"all": (1.0, 1.0), "en": (1.0, 1.0),
                                                                        "zh": (1.0, 1.0)}


def test_the_shipped_cases_cover_both_languages_and_stay_apart(tmp_path):
    cases = rerank.load_cases()
    assert len(cases) >= 20 and {c.lang for c in cases} == {"en", "zh"}
    assert all(len(c.unrelated) >= 3 and c.relevant not in c.unrelated for c in cases)
    assert len({c.query for c in cases}) == len(cases)
    from tests.server.test_models_rerank import QL_CASES

    shipped = {c.query for c in cases} | {c.relevant for c in cases}
    assert not shipped & ({q for q, _ in QL_CASES} | {d for _, d in QL_CASES})
    assert not any(c.query in rr.SYSTEM + rr.QL_SYSTEM + rr.QL_USER for c in cases)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"query": "q", "relevant": "r", "unrelated": []}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        rerank.load_cases(bad)


def test_template_problems_are_named():
    assert rr.template_problem("causal-query-likelihood", "") == ""  # the default
    assert "after {document}" in rr.template_problem("causal-query-likelihood", "Q: {query}\nPassage: {document}")
    assert rr.template_problem("causal-query-likelihood", "Passage: {document}\nQuestion: {query}") == ""
    assert "needs {query} and {document}" in rr.template_problem("causal-yes-no", "Is it relevant? {query}")
    assert rr.template_problem("causal-yes-no", "{query} {document}") == ""


def test_packing_respects_the_rows_budget():
    from edgespec.backend import packed

    seqs = [[1] * 10] * 5
    assert packed(seqs, 64, 100, "rerank") == [[0, 1, 2, 3, 4]]
    assert packed(seqs, 64, 100, "rerank", [3, 3, 3, 3, 3], 7) == [[0, 1], [2, 3], [4]]
    assert packed(seqs, 2, 100, "rerank", [1] * 5, 100) == [[0, 1], [2, 3], [4]]
