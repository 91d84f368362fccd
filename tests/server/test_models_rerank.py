"""Models by name and role (/v1/models, Inference.ListModels, routing by `model`), reranking
(/v1/rerank, Inference.Rerank) and the batcher the embedding and rerank models share.

The pure parts first; then a daemon on loopback whose chat engine is the fake one and whose
embedding and rerank models are the real demo draft (Q8_0, small): real llama.cpp forwards, real
HTTP and gRPC clients."""

from __future__ import annotations

import json
import os
import threading
import time

import grpc
import numpy as np
import openai
import pytest

from edgespec.errors import BadRequest, ConfigError, UnknownModel
from edgespec.proto.edgespec.v1 import inference_pb2 as pb
from edgespec.server import rerank as rr
from edgespec.server.batcher import Batcher
from edgespec.server.models_api import Registry, ServedModel
from tests.server.test_http import HTTP, MODEL, raw

# ---- pure ----------------------------------------------------------------------------------------


def registry() -> Registry:
    return Registry([ServedModel("chat-a", "chat"), ServedModel("emb", "embedding", aliases=("chat-a",)),
                     ServedModel("rr", "rerank", detail="causal-yes-no")], created=1)


def test_routing_by_name_and_role():
    reg = registry()
    assert reg.resolve("chat", "").id == "chat-a" and reg.resolve("rerank", "").id == "rr"
    assert reg.resolve("embedding", "chat-a").id == "emb"  # a context on the chat model's weights
    with pytest.raises(BadRequest) as e:  # another role's model: refused by name, not answered
        reg.resolve("chat", "rr")
    assert e.value.field == "model" and not isinstance(e.value, UnknownModel)
    assert "rerank model" in str(e.value) and "chat-a" in str(e.value)
    with pytest.raises(UnknownModel) as u:
        reg.resolve("embedding", "gpt-4")
    assert "chat-a, emb, rr" in str(u.value)
    assert reg.resolve("chat", "gpt-4", strict=False) is None  # [http] strict = false: the default answers
    with pytest.raises(ConfigError):
        Registry([ServedModel("x", "chat"), ServedModel("x", "rerank")])
    assert [(m["id"], m["role"]) for m in reg.listing()] == [("chat-a", "chat"), ("emb", "embedding"), ("rr", "rerank")]


@pytest.mark.parametrize("body, field", [
    ({"query": "", "documents": ["a"]}, "query"), ({"query": "q"}, "documents"),
    ({"query": "q", "documents": []}, "documents"), ({"query": "q", "documents": ["a"] * 5}, "documents"),
    ({"query": "q", "documents": ["a", 3]}, "documents[1]"), ({"query": "q", "documents": [{"txt": "a"}]}, "documents[0]"),
    ({"query": "q", "documents": ["a", "x" * 200]}, "documents[1]"), ({"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
    ({"query": "q", "documents": ["a"], "return_documents": "yes"}, "return_documents"),
    ({"query": "q", "documents": ["a"], "rank_fields": ["x"]}, "rank_fields"), ({"query": 1, "documents": ["a"]}, "query"),
])
def test_bad_rerank_fields_are_named(body, field):
    with pytest.raises(BadRequest) as e:
        rr.parse_request(body, max_documents=4, max_bytes=100)
    assert e.value.field == field


def test_rerank_response_is_best_first_with_top_n_and_documents():
    req = rr.parse_request({"query": "q", "documents": ["a", {"text": "b"}, "c"], "top_n": 2, "return_documents": True},
                           max_documents=4, max_bytes=100)
    body = rr.response_body(req, [0.2, 0.9, 0.2], model="m", tokens=12)
    assert body["results"] == [{"index": 1, "relevance_score": 0.9, "document": {"text": "b"}},
                               {"index": 0, "relevance_score": 0.2, "document": {"text": "a"}}]
    assert body["usage"] == {"prompt_tokens": 12, "total_tokens": 12} and body["model"] == "m"


def test_the_batcher_puts_concurrent_requests_in_one_call():
    calls: list[int] = []
    gate = threading.Event()

    def run(items):
        gate.wait(5)  # the first call holds the worker while the others queue up
        calls.append(len(items))
        return [x * 2 for x in items]

    b = Batcher("t", run, wait_s=0.05, budget=1000)
    out: dict[int, list] = {}
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, b.submit([i, i + 100], 2))) for i in range(8)]
    for t in threads:
        t.start()
        time.sleep(0.005)
    gate.set()
    for t in threads:
        t.join(10)
    b.close()
    assert out == {i: [2 * i, 2 * (i + 100)] for i in range(8)}  # each request gets its own results back
    assert len(calls) < 8 and sum(calls) == 16  # shared calls


def test_a_failing_call_fails_every_request_in_it():
    b = Batcher("t", lambda items: (_ for _ in ()).throw(RuntimeError("boom")), wait_s=0, budget=1)
    with pytest.raises(RuntimeError, match="boom"):
        b.submit([1], 1)
    b.close()


# ---- a daemon with real embedding and rerank models ---------------------------------------------


@pytest.fixture(scope="module")
def small_model(demo_pair):
    return str(demo_pair.draft)  # Q8_0: the smallest real model at hand


def served(make_daemon, path: str, **http):
    return make_daemon(http={**HTTP, **http},
                       embedding={"path": path, "name": "demo-embed", "n_ctx": 512, "n_batch": 512},
                       rerank={"path": path, "name": "demo-rerank", "n_ctx": 1024, "n_batch": 1024,
                               "max_documents": 8})


def post(r, path: str, body: dict) -> tuple[int, dict]:
    status, _, out = raw(r, "POST", path, body)
    return status, json.loads(out)


def test_models_are_listed_with_their_roles_and_requests_route_by_name(make_daemon, small_model):
    r = served(make_daemon, small_model)
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{r.daemon.http_port}/v1", api_key="none", max_retries=0, timeout=60)
    listed = {m.id: m.role for m in c.models.list()}
    assert listed == {MODEL: "chat", "demo-embed": "embedding", "demo-rerank": "rerank"}
    assert [(m.id, m.role, m.kind) for m in r.inference.ListModels(pb.ListModelsRequest(), timeout=5).models] == \
        [(MODEL, "chat", ""), ("demo-embed", "embedding", ""), ("demo-rerank", "rerank", "causal-query-likelihood")]
    v = c.embeddings.create(model="demo-embed", input=["a cat", "a dog"], encoding_format="float")
    assert v.model == "demo-embed" and len(v.data) == 2
    # another role's name: a 400 naming the field; an unknown name: a 404 listing the served ones
    with pytest.raises(openai.BadRequestError) as e:
        c.embeddings.create(model="demo-rerank", input="x")
    assert e.value.body["param"] == "model" and "rerank model" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError) as nf:
        c.embeddings.create(model="nomic-embed-text", input="x")
    assert "demo-embed" in nf.value.body["message"] and "demo-rerank" in nf.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="demo-embed", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert e.value.body["param"] == "model"
    status, out = post(r, "/v1/rerank", {"model": "demo-embed", "query": "q", "documents": ["a"]})
    assert status == 400 and out["error"]["param"] == "model"
    status, out = post(r, "/v1/rerank", {"model": "bge-reranker", "query": "q", "documents": ["a"]})
    assert status == 404 and MODEL in out["error"]["message"]
    # an unknown chat model is answered under [http] strict = false (named in the warning header) ...
    ok = c.chat.completions.with_raw_response.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=2)
    assert "gpt-4o" in ok.headers["x-edgespec-warning"]
    # ... and a 404 listing every served model under strict = true
    strict = served(make_daemon, small_model, strict=True)
    status, _, body = raw(strict, "POST", "/v1/chat/completions",
                          {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert status == 404 and "demo-rerank" in json.loads(body)["error"]["message"]
    with pytest.raises(grpc.RpcError) as g:
        r.inference.Rerank(pb.RerankRequest(model="nope", query="q", documents=["a"]), timeout=60)
    assert g.value.code() == grpc.StatusCode.NOT_FOUND


def test_rerank_over_http_aliases_and_grpc_agree_and_batching_changes_no_score(make_daemon, small_model):
    r = served(make_daemon, small_model)
    docs = ["Paris is the capital of France.", "Bananas are rich in potassium.", "巴黎是法国的首都。"]
    query = "What is the capital of France?"
    status, out = post(r, "/v1/rerank", {"query": query, "documents": docs, "return_documents": True})
    assert status == 200 and out["model"] == "demo-rerank" and out["usage"]["prompt_tokens"] > 30
    scores = [x["relevance_score"] for x in out["results"]]
    assert scores == sorted(scores, reverse=True) and all(0 < s < 1 for s in scores)
    assert sorted(x["index"] for x in out["results"]) == [0, 1, 2]
    assert all(x["document"]["text"] == docs[x["index"]] for x in out["results"])
    by_index = {x["index"]: x["relevance_score"] for x in out["results"]}
    # a document scored alone gets the score it got beside others (one sequence each in the forward)
    alone = post(r, "/rerank", {"query": query, "documents": [docs[1]]})[1]["results"][0]["relevance_score"]
    assert alone == pytest.approx(by_index[1], abs=1e-4)
    top = post(r, "/v2/rerank", {"query": query, "documents": [{"text": d} for d in docs], "top_n": 1})[1]
    assert [x["index"] for x in top["results"]] == [out["results"][0]["index"]] and "document" not in top["results"][0]
    g = r.inference.Rerank(pb.RerankRequest(query=query, documents=docs, top_n=2, return_documents=True), timeout=60)
    assert [(x.index, x.document) for x in g.results] == [(x["index"], docs[x["index"]]) for x in out["results"][:2]]
    assert [x.relevance_score for x in g.results] == pytest.approx(scores[:2], abs=1e-4)
    # bad input: 400 naming the field; a pair longer than the context: the document named
    for body, field in (({"query": " ", "documents": docs}, "query"), ({"query": "q", "documents": ["a"] * 9}, "documents"),
                        ({"query": "q", "documents": ["a", "word " * 1500]}, "documents[1]")):
        status, out = post(r, "/v1/rerank", body)
        assert status == 400 and out["error"]["param"] == field, out
    with pytest.raises(grpc.RpcError) as e:
        r.inference.Rerank(pb.RerankRequest(query="", documents=docs), timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "query" in e.value.details()


def test_concurrent_embeddings_share_forwards_and_get_their_own_vectors(make_daemon, small_model):
    r = served(make_daemon, small_model)
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{r.daemon.http_port}/v1", api_key="none", max_retries=0, timeout=120)
    texts = [f"sentence number {i} about {w}" for i, w in enumerate(["cats", "tax", "rain", "code", "tea", "jazz"])]
    alone = np.array([c.embeddings.create(model="demo-embed", input=t, encoding_format="float").data[0].embedding
                      for t in texts[:2]])
    got: dict[int, list] = {}

    def ask(i: int) -> None:
        got[i] = c.embeddings.create(model="demo-embed", input=texts[i], encoding_format="float").data[0].embedding

    calls_before = r.daemon.embedder.figures.calls
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    fig = r.daemon.embedder.figures
    assert len(got) == len(texts) and fig.calls - calls_before < len(texts)  # some requests shared a forward
    for i in range(2):
        assert float(np.dot(got[i], alone[i])) > 0.9999  # its own vector, whatever it shared the forward with


@pytest.mark.skipif(not os.environ.get("EDGESPEC_TEST_RERANKER"),
                    reason="set EDGESPEC_TEST_RERANKER to a reranker GGUF (a cross-encoder, or a Qwen3-Reranker); "
                           "the demo model is held to its ordering by query likelihood below")
def test_a_real_reranker_puts_the_relevant_passage_first(make_daemon):
    r = make_daemon(http=HTTP, rerank={"path": os.environ["EDGESPEC_TEST_RERANKER"], "name": "rr"})
    docs = ["The capital of France is Paris.", "Bananas are rich in potassium.",
            "Python was created by Guido van Rossum.", "香蕉富含钾。", "巴黎是法国的首都。"]
    for query, best in (("What is the capital of France?", {0, 4}), ("Who created Python?", {2}),
                        ("哪种水果富含钾？", {1, 3}), ("法国的首都是哪里？", {0, 4})):
        status, out = post(r, "/v1/rerank", {"query": query, "documents": docs})
        assert status == 200 and out["results"][0]["index"] in best, (query, out)


# Queries of no tuning: neither in edgespec/bench/suites/rerank.jsonl (where the scorer was
# chosen) nor in any prompt. Each query's relevant passage is its own; the others' are unrelated.
QL_CASES = (
    ("How do bees make honey?", "Bees collect nectar from flowers, pass it to hive bees, and fan their wings "
                                "over the cells until the water evaporates and the nectar thickens into honey."),
    ("What is the speed of light?", "Light travels through a vacuum at about 299,792 kilometres per second, "
                                    "faster than anything else can move."),
    ("How can I lower my electricity bill?", "Switching to LED bulbs, unplugging idle chargers and washing clothes "
                                             "on a cold cycle all cut a household's electricity use."),
    ("如何学好英语口语？", "想提高英语口语，每天坚持跟读原声材料，多和外国人交流，大胆开口，不要害怕犯错。"),
    ("太阳系有几颗行星？", "太阳系共有八颗行星，由近到远依次是水星、金星、地球、火星、木星、土星、天王星和海王星。"),
    ("怎样做红烧肉？", "红烧肉要先把五花肉切块焯水，再用冰糖炒出糖色，加入酱油、料酒和姜片，小火炖一个小时。"),
)


def ranks_of_relevant(score, cases=QL_CASES) -> list[int]:
    """For each case, the rank (1 = first) `score` gives its relevant passage among the next
    three cases' passages (ties against it: a scorer blind to the documents ranks it last)."""
    from edgespec.bench.rerank import rank_of_relevant

    n = len(cases)
    return [rank_of_relevant(list(score(q, [d] + [cases[(i + k) % n][1] for k in (1, 2, 3)])))
            for i, (q, d) in enumerate(cases)]


@pytest.mark.slow
def test_the_demo_reranker_puts_the_relevant_passage_first_and_broken_twins_do_not(make_daemon, demo_pair):
    """The shipped demo reranker (configs/demo.toml: query likelihood on the demo target) ranks
    each query's own passage first among unrelated ones, English and Chinese; the same check
    rejects a twin blind to the documents and a twin that reads each score off the wrong one."""
    from edgespec.bench.rerank import http_scorer

    r = make_daemon(http=HTTP, rerank={"path": str(demo_pair.target), "name": "demo-rerank",
                                       "kind": "causal-query-likelihood", "n_ctx": 1024, "n_batch": 1024})
    score = http_scorer(f"http://127.0.0.1:{r.daemon.http_port}", timeout=600)
    seen: dict[tuple, list[float]] = {}

    def real(q, ds):
        seen[(q, *ds)] = score(q, ds)
        return seen[(q, *ds)]

    assert ranks_of_relevant(real) == [1] * len(QL_CASES)
    query, own = QL_CASES[0]
    first = seen[(query, own, *[d for _, d in QL_CASES[1:4]])]
    assert first[0] > 0.5 > min(first)  # its own passage makes the query likelier than no passage does
    assert score(query, [QL_CASES[2][1]])[0] == pytest.approx(first[2], abs=1e-4)  # alone as beside others
    blind = ranks_of_relevant(lambda q, ds: score(q, ds[:1]) * len(ds))  # one document's score for all
    assert blind == [4] * len(QL_CASES)
    shifted = ranks_of_relevant(lambda q, ds: (lambda s: s[1:] + s[:1])(seen[(q, *ds)]))  # the wrong document's
    assert shifted != [1] * len(QL_CASES)
    status, out = post(r, "/v1/rerank", {"query": "word " * 300, "documents": ["a"]})
    assert status == 400 and out["error"]["param"] == "query", out


def test_default_names_and_the_reranker_kind_come_from_the_config(small_model):
    from types import SimpleNamespace as NS

    from edgespec.server.models_api import build_registry, rerank_kind_of

    on_target = NS(enabled=True, path="", name="", kind="auto")
    reg = build_registry("chat", on_target, NS(enabled=True, path=small_model, name="", kind="auto"),
                         rerank_kind=rerank_kind_of(on_target))
    assert [(m.id, m.role, m.aliases) for m in reg.models] == [
        ("chat", "chat", ()), ("chat-embedding", "embedding", ("chat",)),
        ("SmolLM2-135M-Instruct.Q8_0", "rerank", ())]
    # a chat LM (no rank pooling, not named a reranker): scored by query likelihood
    assert rerank_kind_of(NS(path=small_model, kind="auto", template="")) == "causal-query-likelihood"
    assert rerank_kind_of(on_target) == "causal-query-likelihood"
    with pytest.raises(ConfigError) as e:  # refused at start, not by llama.cpp aborting on a forward
        rerank_kind_of(NS(path=small_model, kind="cross-encoder"))
    assert e.value.key == "rerank.kind"
    assert rerank_kind_of(NS(path="", kind="causal-query-likelihood", template="")) == "causal-query-likelihood"
    with pytest.raises(ConfigError) as e:  # the query read before the document: refused at start
        rerank_kind_of(NS(path="", kind="causal-query-likelihood", template="{query}\n{document}"))
    assert e.value.key == "rerank.template" and "after {document}" in str(e.value)
    assert len(build_registry("chat", NS(enabled=False), None).models) == 1
