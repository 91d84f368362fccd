"""The cross-encoder reranker on a real llama.cpp rank-pooling forward: a tiny BERT cross-encoder
GGUF (tests/tiny_cross_encoder.py, written as llama.cpp's converter writes BGE and ms-marco
rerankers) whose score is known by construction: a pair holding the word "paris" scores above
sigmoid(-1), every other pair exactly sigmoid(-1). Through edgespec's Reranker, then through a
daemon's POST /v1/rerank and Inference.Rerank on loopback."""

from __future__ import annotations

import json
import math
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from edgespec.proto.edgespec.v1 import inference_pb2 as pb
from edgespec.server import rerank as rr
from tests.bench.test_bench_serve_e2e import llama_server_bin
from tests.server.test_http import HTTP, raw
from tests.tiny_cross_encoder import BIAS, write_cross_encoder

QUERY = "What is the capital of France?"
DOCS = ("Bananas are rich in potassium.", "Python was created by Guido van Rossum.",
        "Paris is the capital city of France.", "Which fruit is rich in potassium?", "It is a programming language.")
RELEVANT = 2  # the one with "paris"
FLOOR = 1.0 / (1.0 + math.exp(-BIAS))  # the score of a pair without "paris"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """bert: ms-marco style (cls.output only, output labels), no pooling type, as today's converter
    writes it; bert-rank: the same with pooling_type rank; roberta-rank: BGE style (cls, then
    cls.output)."""
    d = tmp_path_factory.mktemp("xenc")
    return {"bert": write_cross_encoder(d / "tiny-bert.gguf", head="bert", rank_pooling=False),
            "bert-rank": write_cross_encoder(d / "tiny-bert-rank.gguf", head="bert"),
            "roberta-rank": write_cross_encoder(d / "tiny-roberta-rank.gguf", head="roberta")}


def reranker(path: Path, kind: str = "auto", flash_attn: bool = True) -> rr.Reranker:
    from edgespec.server.config import RerankConfig

    cfg = RerankConfig(path=str(path), kind=kind, n_ctx=512, n_batch=512, max_documents=16)
    return rr.Reranker(cfg, NS(flash_attn=flash_attn), lambda: None, name=path.stem)


@pytest.mark.parametrize("flavour", ["bert", "bert-rank", "roberta-rank"])
def test_a_gguf_cross_encoder_is_picked_by_auto_and_scores_as_constructed(files, flavour):
    from edgespec import backend
    from edgespec.server.models_api import rerank_kind_of

    path = files[flavour]
    assert path.stat().st_size < 512 << 10
    # picked from the header at start and from the loaded model, whether or not the file says rank pooling
    assert rerank_kind_of(NS(path=str(path), kind="auto", template="")) == "cross-encoder"
    r = reranker(path)
    try:
        assert r.kind == "cross-encoder" and backend.rank_kind(r.model()) == "cross-encoder"
        model = r.model()
        assert (model.bos, model.sep, model.eos) == (101, 102, -1)  # [CLS] query [SEP] document, as llama-server
        scores, tokens = r.score(QUERY, DOCS)
        assert tokens == sum(len(r._pair(model, QUERY, model.tokenize(d, False, False))[0]) for d in DOCS)
        assert rr.ranked(scores, None)[0] == RELEVANT and scores[RELEVANT] > FLOOR + 0.01
        # no "paris": exactly the head's bias, whatever else the pair holds (see tiny_cross_encoder)
        assert [s for i, s in enumerate(scores) if i != RELEVANT] == [FLOOR] * (len(DOCS) - 1)
    finally:
        r.close()


@pytest.mark.parametrize("flash_attn", [True, False])
def test_batched_alone_and_permuted_scores_agree(files, flash_attn):
    """Five pairs in one forward score as each alone, and a permutation of the documents permutes
    the scores. With flash attention (the default, [target] flash_attn) bit for bit: every matmul
    of llama.cpp's BERT graph reduces over channels, never over tokens, and the CPU flash-attention
    kernel skips the cells the mask gives to other sequences. Without it the masked softmax and the
    KQV product run over the whole batch's cells (exact zeros, but other lengths and lane splits of
    the sums), and the scores move by float32 rounding: within 1e-6 of each other."""
    r = reranker(files["roberta-rank"], flash_attn=flash_attn)
    try:
        together, _ = r.score(QUERY, DOCS)
        alone = [r.score(QUERY, [d])[0][0] for d in DOCS]
        perm = [3, 0, 4, 2, 1]
        shuffled = [together[i] for i in perm]
        got, _ = r.score(QUERY, [DOCS[i] for i in perm])
        if flash_attn:
            assert together == alone and got == shuffled
        else:
            assert together == pytest.approx(alone, abs=1e-6, rel=0) and got == pytest.approx(shuffled, abs=1e-6, rel=0)
        assert rr.ranked(got, 1) == [perm.index(RELEVANT)]
        assert r.figures.calls >= 7  # one call per request at least: each score() went through the batcher
    finally:
        r.close()


def test_a_twin_without_the_marker_word_ranks_nothing_first(tmp_path):
    """The order checked above comes from the weights: with no marker word every pair scores the
    bias, and the relevant document is no longer first (ties go to the earlier document)."""
    r = reranker(write_cross_encoder(tmp_path / "blind.gguf", head="bert", markers=()))
    try:
        scores, _ = r.score(QUERY, DOCS)
        assert scores == [FLOOR] * len(DOCS) and rr.ranked(scores, 1) == [0]
    finally:
        r.close()


def test_a_file_without_a_classifier_head_is_refused_as_a_cross_encoder(tmp_path):
    from edgespec.errors import ConfigError
    from edgespec.server.models_api import rerank_kind_of
    from tests.tiny_gguf import write_tiny

    llama = write_tiny(tmp_path / "tiny-llama.gguf")
    assert rerank_kind_of(NS(path=str(llama), kind="auto", template="")) == "causal-query-likelihood"
    with pytest.raises(ConfigError) as e:
        rerank_kind_of(NS(path=str(llama), kind="cross-encoder", template=""))
    assert e.value.key == "rerank.kind"


def test_the_daemon_serves_the_cross_encoder_over_http(make_daemon, files):
    r = make_daemon(http=HTTP, rerank={"path": str(files["bert"]), "name": "tiny-xenc", "n_ctx": 512,
                                       "n_batch": 512, "max_documents": 8})
    status, _, body = raw(r, "GET", "/v1/models")
    listed = {m["id"]: m for m in json.loads(body)["data"]}
    assert status == 200 and listed["tiny-xenc"]["role"] == "rerank" and listed["tiny-xenc"]["kind"] == "cross-encoder"
    status, _, body = raw(r, "POST", "/v1/rerank", {"model": "tiny-xenc", "query": QUERY, "documents": list(DOCS)})
    out = json.loads(body)
    assert status == 200 and out["model"] == "tiny-xenc" and out["usage"]["prompt_tokens"] > 40
    # best first; the tied rest in document order
    assert [x["index"] for x in out["results"]] == [RELEVANT, 0, 1, 3, 4]
    assert [x["relevance_score"] for x in out["results"][1:]] == [FLOOR] * 4
    best = out["results"][0]["relevance_score"]
    assert best > FLOOR + 0.01 and "document" not in out["results"][0]
    status, _, body = raw(r, "POST", "/v1/rerank", {"query": QUERY, "documents": [{"text": d} for d in DOCS],
                                                    "top_n": 2, "return_documents": True})
    top = json.loads(body)["results"]
    assert status == 200 and [(x["index"], x["document"]["text"]) for x in top] == [(RELEVANT, DOCS[RELEVANT]), (0, DOCS[0])]
    assert top[0]["relevance_score"] == best  # the same score with the others in the forward or not
    status, _, body = raw(r, "POST", "/v1/rerank", {"query": QUERY, "documents": [DOCS[RELEVANT]]})
    assert status == 200 and json.loads(body)["results"][0]["relevance_score"] == best
    g = r.inference.Rerank(pb.RerankRequest(model="tiny-xenc", query=QUERY, documents=DOCS, top_n=1), timeout=60)
    assert [(x.index, x.relevance_score) for x in g.results] == [(RELEVANT, pytest.approx(best, abs=1e-7))]
    status, _, body = raw(r, "POST", "/v1/rerank", {"query": QUERY, "documents": ["a"], "top_n": 0})
    assert status == 400 and json.loads(body)["error"]["param"] == "top_n"


@pytest.mark.parametrize("flavour", ["bert", "roberta-rank"])
def test_the_pairs_and_scores_are_llama_servers(files, flavour):
    """Each head through llama.cpp's own llama-server --reranking (the anchor build): the same
    tokens per request and the same head output for each document (edgespec's score is its
    sigmoid), so edgespec assembles and scores the pair as llama.cpp's server does."""
    import httpx

    from edgespec.bench.serve_systems import free_port

    bin_dir = llama_server_bin()
    if bin_dir is None or not (bin_dir / "llama-server").is_file():
        pytest.skip("llama-server not built (tools/llama-anchor.sh build)")
    port = free_port()
    proc = subprocess.Popen([str(bin_dir / "llama-server"), "-m", str(files[flavour]), "--reranking", "--host",
                             "127.0.0.1", "--port", str(port), "-c", "512", "-b", "512", "-ub", "512", "-t", "2",
                             "--no-webui", "-fa", "on"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        out = httpx.post(base + "/v1/rerank", json={"query": QUERY, "documents": list(DOCS)}, timeout=60).json()
    finally:
        proc.terminate()
        proc.wait(10)
    r = reranker(files[flavour])
    try:
        scores, tokens = r.score(QUERY, DOCS)
    finally:
        r.close()
    head = {x["index"]: x["relevance_score"] for x in out["results"]}  # llama-server: the head's raw output
    assert out["usage"]["prompt_tokens"] == tokens
    assert [math.log(s / (1 - s)) for s in scores] == pytest.approx([head[i] for i in range(len(DOCS))], abs=1e-6)
