"""Reranking for /v1/rerank and Inference.Rerank: the request checked (every field named), each
(query, document) pair scored on a context of its own, and the response in the shape
llama-server, Jina and Cohere clients read (`results: [{index, relevance_score, document?}]`,
best first, and `usage`).

Three kinds of reranker (backend.RankContext):
- cross-encoder: a GGUF with a classifier head and pooling_type rank (BGE, Jina rerankers);
  the pair is `[BOS] query [EOS] [SEP] document [EOS]`, as llama-server writes it.
- causal-yes-no: a causal LM asked whether the document meets the query under a template;
  relevance = p(yes) / (p(yes) + p(no)) at the template's end, as Qwen3-Reranker is read.
  Special tokens are read in the template only, never in the query or a document.
- causal-query-likelihood: a causal LM reads the document and is scored on how likely it finds
  the query as what follows (the query likelihood of Ponte and Croft 1998 under an LM, as UPR
  reranks: Sachan et al. 2022, "Improving Passage Retrieval with Zero-Shot Question Generation",
  arXiv:2204.07496). It needs no yes/no judgement the model was never trained to make, and so
  ranks with a small chat LM where causal-yes-no does not (docs/appliance.md has the figures).

Pairs are tokenised by the caller's thread; one worker thread (batcher.Batcher) scores the
pairs of every request waiting, many per forward, concurrently with the engine's generation."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgespec.errors import BadRequest, ModelError
from edgespec.plan import QUERY_LIKELIHOOD_ROWS
from edgespec.server.batcher import Batcher, BatchFigures
from edgespec.server.embeddings import side_model

KNOWN = ("model", "query", "documents", "top_n", "return_documents", "max_tokens_per_doc", "user")
SYSTEM = ('Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
          'Note that the answer can only be "yes" or "no".')
USER = "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
# causal-query-likelihood: the model reads the document and writes the query (its answer turn)
QL_SYSTEM = "You write the question that a passage answers, in the passage's language."
QL_USER = "Passage: {document}\n\nWrite a question that this passage answers."
_FIELD = re.compile(r"\{(query|document|instruction)\}")


@dataclass(frozen=True)
class RerankRequest:
    query: str
    documents: tuple[str, ...]
    top_n: int | None = None  # None: every document
    return_documents: bool = False
    max_tokens_per_doc: int | None = None  # a longer document is cut to its first tokens
    model: str = ""


def parse_request(body: Any, *, max_documents: int, max_bytes: int) -> RerankRequest:
    """The body llama-server's /v1/rerank and the Jina and Cohere clients send: query, documents
    (strings, or objects with `text`), top_n, return_documents, max_tokens_per_doc (Cohere's),
    model, user (ignored)."""
    if not isinstance(body, Mapping):
        raise BadRequest("body", "must be a JSON object")
    for k in body:
        if k not in KNOWN:
            raise BadRequest(k, f"unknown field (known: {', '.join(KNOWN)})")
    model = body.get("model") or ""
    if not isinstance(model, str):
        raise BadRequest("model", f"must be a string, got {type(model).__name__}")
    query = body.get("query")
    if not isinstance(query, str) or not query.strip():
        raise BadRequest("query", "must be a non-empty string")
    docs = body.get("documents")
    if not isinstance(docs, list) or not docs:
        raise BadRequest("documents", "must be a non-empty list of strings or of objects with `text`")
    if len(docs) > max_documents:
        raise BadRequest("documents", f"at most {max_documents} documents (rerank.max_documents), got {len(docs)}")
    size = _utf8(query, "query")
    texts = []
    for i, d in enumerate(docs):
        text = d.get("text") if isinstance(d, Mapping) else d
        if not isinstance(text, str) or not text:
            raise BadRequest(f"documents[{i}]", "must be a non-empty string or an object with a non-empty `text`")
        size += _utf8(text, f"documents[{i}]")
        if size > max_bytes:
            raise BadRequest(f"documents[{i}]", f"the query and documents together at most {max_bytes} bytes "
                                                "(limits.max_prompt_bytes)")
        texts.append(text)
    top_n = body.get("top_n")
    if top_n is not None and (not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 1):
        raise BadRequest("top_n", f"must be an integer >= 1, got {top_n!r}")
    ret = body.get("return_documents", False)
    if not isinstance(ret, bool):
        raise BadRequest("return_documents", f"must be true or false, got {ret!r}")
    cut = body.get("max_tokens_per_doc")
    if cut is not None and (not isinstance(cut, int) or isinstance(cut, bool) or cut < 1):
        raise BadRequest("max_tokens_per_doc", f"must be an integer >= 1, got {cut!r}")
    return RerankRequest(query, tuple(texts), top_n, ret, cut, model)


def _utf8(text: str, field: str) -> int:
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise BadRequest(field, "must be valid Unicode text (a lone surrogate escape?)") from None


def auto_kind(ranks: bool, name: str) -> str:
    """[rerank] kind = auto: a cross-encoder when the GGUF pools by rank (its classifier head);
    causal-yes-no for a causal LM trained to answer yes or no (its name says reranker, as
    Qwen3-Reranker's does); else causal-query-likelihood, the zero-shot method for a chat LM that
    is no reranker (the target's weights): on the demo's held-out cases it ranked 24 of 24 right
    where yes/no ranked 3 (docs/api.md, "Choosing a reranker")."""
    if ranks:
        return "cross-encoder"
    return "causal-yes-no" if "rerank" in name.lower() else "causal-query-likelihood"


def template_problem(kind: str, template: str) -> str:
    """Why `template` cannot serve a reranker of `kind` ("" when it can): a causal kind needs
    {query} and {document}; query likelihood scores the query where it stands, so it needs the
    query after the document (before it, the model would not have read the document)."""
    if not template or kind not in ("causal-yes-no", "causal-query-likelihood"):
        return ""
    if "{query}" not in template or "{document}" not in template:
        return "needs {query} and {document}"
    if kind == "causal-query-likelihood" and "{query}" not in template.split("{document}", 1)[1]:
        return "causal-query-likelihood needs {query} after {document} (the query is scored given the document)"
    return ""


def ranked(scores: Sequence[float], top_n: int | None) -> list[int]:
    """Document indices, best first (ties: the earlier document first), the first top_n."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    return order[:top_n] if top_n is not None else order


def response_body(req: RerankRequest, scores: Sequence[float], *, model: str, tokens: int, rid: str = "") -> dict:
    results = []
    for i in ranked(scores, req.top_n):
        r: dict[str, Any] = {"index": i, "relevance_score": float(scores[i])}
        if req.return_documents:
            r["document"] = {"text": req.documents[i]}
        results.append(r)
    return {"id": rid, "object": "list", "model": model, "results": results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


class Reranker:
    """The daemon's reranker: `[rerank] path`, or the target's loaded weights (the engine's
    thread-safe encoder) when it is empty."""

    def __init__(self, cfg: Any, target: Any, encoder: Callable[[], Any], name: str = ""):
        self.cfg = cfg  # RerankConfig
        self.target = target  # the target's ModelConfig (flash_attn)
        self.name = name  # its name in /v1/models
        self._encoder = encoder
        self._lock = threading.Lock()
        self._model: Any = None
        self._kind = ""
        self._template: list[tuple[bool, str]] = []  # (is a field, text or field name)
        self._yes_no = (-1, -1)
        self._ctx: Any = None
        self._batcher: Batcher[tuple[list[int], int], Any] = Batcher("rerank", self._run, wait_s=cfg.batch_wait_ms / 1000, budget=cfg.n_batch)

    @property
    def figures(self) -> BatchFigures:
        return self._batcher.figures

    def model(self) -> Any:
        """The loaded model, its kind and template worked out on first use."""
        with self._lock:
            if self._model is not None:
                return self._model
            from edgespec import backend

            model = side_model(self.cfg, self._encoder, "rerank")
            kind = self.cfg.kind
            if kind == "auto":
                name = f"{backend.model_meta(model, 'general.name') or ''} {self.cfg.path}"
                kind = auto_kind(backend.rank_kind(model) == "cross-encoder", name)
            if kind == "causal-yes-no":
                yes, no = model.tokenize("yes", False, False), model.tokenize("no", False, False)
                if not yes or not no:
                    raise ModelError(f"{model.path}: the vocabulary has no tokens for yes and no")
                self._yes_no = (yes[0], no[0])
                text = self.cfg.template or model.chat_prompt([("system", SYSTEM), ("user", USER)])
            elif kind == "causal-query-likelihood":
                text = self.cfg.template or model.chat_prompt([("system", QL_SYSTEM), ("user", QL_USER)]) + "{query}"
                problem = template_problem(kind, text)
                if problem:
                    raise ModelError(f"rerank.template: {problem}")
            if kind != "cross-encoder":
                parts = _FIELD.split(text)  # literal, field, literal, field, ...
                self._template = [(i % 2 == 1, p) for i, p in enumerate(parts) if p]
            self._kind, self._model = kind, model
            return model

    @property
    def kind(self) -> str:
        self.model()
        return self._kind

    def _pair(self, model: Any, query: str, document: Sequence[int]) -> tuple[list[int], int]:
        """The tokens of one (query, document) pair, and how many of its last tokens are scored
        (causal-query-likelihood: the query's; the template's text after it is left out)."""
        if self._kind == "cross-encoder":
            q = model.tokenize(query, False, False)
            head = [model.bos] if model.add_bos and model.bos >= 0 else []
            seps = [t for t in (model.eos, model.sep) if t >= 0]
            return head + q + seps + list(document) + ([model.eos] if model.eos >= 0 else []), 0
        out: list[int] = []
        for is_field, part in self._template:
            if not is_field:
                out += model.tokenize(part, not out, True)  # the template's special tokens read as such
            elif part == "document":
                out += document
            else:
                text = model.tokenize(query if part == "query" else self.cfg.instruction, not out, False)
                out += text
                if part == "query" and self._kind == "causal-query-likelihood":
                    return out, len(text)
        return out, 0

    def _context(self) -> Any:
        if self._ctx is None:
            from edgespec import backend
            from edgespec.config import ModelConfig

            model = self.model()
            mc = ModelConfig(path=str(model.path), n_ctx=self.cfg.n_ctx, n_batch=self.cfg.n_batch,
                             threads=self.cfg.threads, flash_attn=self.target.flash_attn)
            self._ctx = backend.RankContext(model, mc, self._kind, self._yes_no)
        return self._ctx

    def _run(self, pairs: list[tuple[list[int], int]]) -> np.ndarray:
        scored = [m for _, m in pairs] if self._kind == "causal-query-likelihood" else None
        return self._context().score([p for p, _ in pairs], scored)

    def score(self, query: str, documents: Sequence[str], max_tokens_per_doc: int | None = None
              ) -> tuple[list[float], int]:
        """(a relevance in [0, 1] per document, tokens scored). Blocking: a worker thread's.

        causal-query-likelihood: relevance = sigmoid(lp(q | d) - lp(q | empty document)), lp the
        mean log-probability of the query's tokens: 0.5 where the document makes the query no
        likelier than no document does; the order is that of lp(q | d) alone."""
        model = self.model()
        limit = min(self.cfg.n_ctx, self.cfg.n_batch)
        ql = self._kind == "causal-query-likelihood"
        pairs = []
        for i, d in enumerate([*documents, ""] if ql else documents):  # "": the baseline
            ids = model.tokenize(d, False, False)
            if max_tokens_per_doc is not None:
                ids = ids[:max_tokens_per_doc]
            pair, scored = self._pair(model, query, ids)
            if len(pair) > limit:
                raise BadRequest(f"documents[{i}]", f"the query and document are {len(pair)} tokens together; "
                                                    f"at most {limit} (rerank.n_ctx and rerank.n_batch)")
            if scored > QUERY_LIKELIHOOD_ROWS:
                raise BadRequest("query", f"{scored} tokens; a query-likelihood reranker scores at most "
                                          f"{QUERY_LIKELIHOOD_ROWS}")
            pairs.append((pair, scored))
        n = sum(len(p) for p, _ in pairs)
        scores = [float(s) for s in self._batcher.submit(pairs, n)]
        if ql:
            base = scores.pop()
            scores = [float(1.0 / (1.0 + np.exp(base - s))) for s in scores]
        return scores, n

    def close(self) -> None:
        self._batcher.close()
        if self._ctx is not None:
            self._ctx.close()
            self._ctx = None
