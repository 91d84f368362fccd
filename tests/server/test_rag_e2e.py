"""The whole RAG stack from one `edgespec serve` on the demo models (its default config: the chat
model, an embedding entry and a rerank entry on the same weights): embeddings, reranking and
chat at once, and a LangChain pipeline with only the base URL changed. Slow: CI runs it."""

from __future__ import annotations

import threading

import httpx
import numpy as np
import pytest

from tests.server.test_http_e2e import KEY, MODEL, server  # noqa: F401 - the module's daemon

pytestmark = pytest.mark.slow
EMBED, RERANK = f"{MODEL}-embedding", f"{MODEL}-rerank"
CORPUS = ["The Eiffel Tower is in Paris and was finished in 1889.",
          "Photosynthesis turns sunlight, water and carbon dioxide into sugar.",
          "The invoice must be paid within thirty days of delivery.",
          "长城是中国古代的军事防御工程。"]


def rerank(base: str, query: str, documents: list[str]) -> dict:
    r = httpx.post(base + "/v1/rerank", json={"model": RERANK, "query": query, "documents": documents},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_embeddings_rerank_and_chat_at_once_leave_greedy_chat_unchanged(server):  # noqa: F811
    c = server.client()
    msgs = [{"role": "user", "content": "Name three colours."}]

    def chat() -> str:
        return c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0).choices[0].message.content

    alone = chat()
    got: dict[str, object] = {}
    errors: list[BaseException] = []

    def run(name: str, fn) -> None:
        try:
            got[name] = fn()
        except BaseException as exc:
            errors.append(exc)

    work = {"chat": chat,
            "embed": lambda: c.embeddings.create(model=EMBED, input=CORPUS, encoding_format="float"),
            "rerank": lambda: rerank(server.base, "Where is the Eiffel Tower?", CORPUS),
            "embed2": lambda: c.embeddings.create(model=EMBED, input="a second caller", encoding_format="float")}
    threads = [threading.Thread(target=run, args=item) for item in work.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    assert got["chat"] == alone  # greedy: the same reply while the other models worked
    assert len(got["embed"].data) == len(CORPUS) and len(got["rerank"]["results"]) == len(CORPUS)


def test_a_langchain_rag_pipeline_with_only_the_base_url_changed(server):  # noqa: F811
    """Embed a corpus (langchain_openai.OpenAIEmbeddings), retrieve by cosine (langchain_core's
    InMemoryVectorStore), rerank the retrieved passages through /v1/rerank, answer with
    ChatOpenAI. LangChain has no client for an OpenAI-style /v1/rerank outside langchain-community
    (whose Jina/Cohere rerankers call the vendors' fixed URLs), so the rerank step is one httpx call.
    `check_embedding_ctx_length=False`: else OpenAIEmbeddings sends tiktoken's token ids, which
    are OpenAI's vocabulary, not the served model's."""
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.vectorstores import InMemoryVectorStore

    base = server.base + "/v1"
    emb = lc.OpenAIEmbeddings(model=EMBED, base_url=base, api_key=KEY, check_embedding_ctx_length=False)
    store = InMemoryVectorStore.from_texts(CORPUS, emb)
    query = "When was the Eiffel Tower finished?"
    hits = store.similarity_search(query, k=3)
    assert len(hits) == 3 and all(h.page_content in CORPUS for h in hits)
    ranked = rerank(server.base, query, [h.page_content for h in hits])["results"]
    scores = [x["relevance_score"] for x in ranked]
    assert scores == sorted(scores, reverse=True)
    context = hits[ranked[0]["index"]].page_content
    # the default reranker (query likelihood on the chat model's weights) puts the passage that
    # answers first, over the whole corpus too
    assert rerank(server.base, query, CORPUS)["results"][0]["index"] == 0
    llm = lc.ChatOpenAI(model=MODEL, base_url=base, api_key=KEY, temperature=0, max_tokens=32, max_retries=0)
    answer = llm.invoke(f"Context: {context}\n\nQuestion: {query}\nAnswer briefly.")
    assert isinstance(answer.content, str) and answer.content.strip()
    # the vectors the store holds are the server's: unit length, the query's nearest by cosine first
    v = np.array(emb.embed_documents(CORPUS))
    q = np.array(emb.embed_query(query))
    assert np.allclose(np.linalg.norm(v, axis=1), 1, atol=1e-4)
    assert CORPUS[int(np.argmax(v @ q))] == hits[0].page_content
