"""Embeddings for /v1/embeddings and Inference.Embed: the request checked (every field named),
the vectors computed on a context of their own (the [embedding] model, or the target's weights),
and OpenAI's response body (float lists or base64 of little-endian float32, as the `openai`
client asks by default).

The embedding context is made on the first request by the embedding model's own worker thread
(the engine thread is never involved); the inputs of requests that arrive together share one
forward (edgespec.server.batcher)."""

from __future__ import annotations

import base64
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgespec.errors import BadRequest, ModelError, NotReady
from edgespec.server.batcher import Batcher, BatchFigures

Input = str | tuple[int, ...]


def side_model(cfg: Any, encoder: Callable[[], Any], purpose: str) -> Any:
    """The model an [embedding] or [rerank] section serves (a backend.Model): its own file's,
    loaded now, or the target's (`encoder()`, None while the engine loads)."""
    from edgespec import backend

    if cfg.path:
        return backend.Model(cfg.path, n_gpu_layers=cfg.n_gpu_layers)
    model = encoder()
    if model is None:
        raise NotReady("the models are still loading")
    if not isinstance(model, backend.Model):
        raise ModelError(f"this engine has no model to {purpose} with")
    return model


@dataclass(frozen=True)
class EmbeddingRequest:
    inputs: tuple[Input, ...]
    encoding_format: str = "float"  # float | base64
    model: str = ""


def parse_request(body: Any, *, models: Sequence[str] | None, max_inputs: int, max_bytes: int) -> EmbeddingRequest:
    """OpenAI's embeddings body: input (a string, a list of strings, a token-id list or a list of
    token-id lists), model, encoding_format, dimensions (the model's own only), user (ignored).
    `models`: the names `model` may take (None: any string; the registry routes it)."""
    if not isinstance(body, Mapping):
        raise BadRequest("body", "must be a JSON object")
    for k in body:
        if k not in ("input", "model", "encoding_format", "dimensions", "user"):
            raise BadRequest(k, "unknown field (known: input, model, encoding_format, dimensions, user)")
    model = body.get("model") or ""
    if not isinstance(model, str):
        raise BadRequest("model", f"must be a string, got {type(model).__name__}")
    if model and models is not None and model not in models:
        raise BadRequest("model", f"unknown model {model!r} (served: {', '.join(models)})")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise BadRequest("encoding_format", f"must be float or base64, got {fmt!r}")
    if body.get("dimensions") is not None:
        raise BadRequest("dimensions", "is not supported (the model's own size is returned)")
    v = body.get("input")
    if isinstance(v, str):
        items: list[Any] = [v]
    elif isinstance(v, list) and v and all(_is_int(t) for t in v):
        items = [v]
    elif isinstance(v, list) and v:
        items = v
    else:
        raise BadRequest("input", "must be a non-empty string, list of strings, token ids or lists of token ids")
    if len(items) > max_inputs:
        raise BadRequest("input", f"at most {max_inputs} inputs (embedding.max_inputs), got {len(items)}")
    out: list[Input] = []
    size = 0
    for i, it in enumerate(items):
        if isinstance(it, str):
            if not it:
                raise BadRequest(f"input[{i}]", "must not be empty")
            try:
                size += len(it.encode("utf-8"))
            except UnicodeEncodeError:
                raise BadRequest(f"input[{i}]", "must be valid Unicode text (a lone surrogate escape?)") from None
            out.append(it)
        elif isinstance(it, list) and it and all(_is_int(t) for t in it):
            size += 4 * len(it)
            out.append(tuple(it))
        else:
            raise BadRequest(f"input[{i}]", "must be a non-empty string or a non-empty list of token ids")
        if size > max_bytes:
            raise BadRequest(f"input[{i}]", f"the inputs together at most {max_bytes} bytes (limits.max_prompt_bytes)")
    return EmbeddingRequest(tuple(out), fmt, model)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def response_body(vectors: np.ndarray, *, model: str, prompt_tokens: int, encoding_format: str) -> dict:
    data = []
    for i, v in enumerate(vectors):
        emb: Any = base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode() if encoding_format == "base64" \
            else [float(x) for x in v]
        data.append({"object": "embedding", "index": i, "embedding": emb})
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


class Embedder:
    """The daemon's embedding model: `[embedding] path`, or the target's loaded weights (the
    engine's thread-safe encoder, a backend.Model) when it is empty. Requests are tokenised by
    their callers; the vectors are computed by one worker thread (batcher.Batcher) on a context of
    its own, the inputs of requests that arrive together in one forward."""

    def __init__(self, cfg: Any, target: Any, encoder: Callable[[], Any], name: str = ""):
        self.cfg = cfg  # EmbeddingConfig
        self.target = target  # the target's ModelConfig (flash_attn, kv_type)
        self.name = name  # its name in /v1/models
        self._encoder = encoder
        self._lock = threading.Lock()
        self._ctx: Any = None
        self._model: Any = None
        self._batcher: Batcher[list[int], Any] = Batcher("embedding", self._run, wait_s=cfg.batch_wait_ms / 1000, budget=cfg.n_batch)

    @property
    def figures(self) -> BatchFigures:
        return self._batcher.figures

    def model(self) -> Any:
        """The loaded model (a backend.Model): its file's, loaded on first use, or the target's."""
        with self._lock:
            if self._model is not None:
                return self._model
            self._model = side_model(self.cfg, self._encoder, "embed")
            return self._model

    def _context(self) -> Any:
        """The embedding context, made by the worker thread on its first call."""
        if self._ctx is None:
            from edgespec import backend
            from edgespec.config import ModelConfig

            model = self.model()
            mc = ModelConfig(path=str(model.path), n_ctx=self.cfg.n_ctx, n_batch=self.cfg.n_batch,
                             threads=self.cfg.threads, flash_attn=self.target.flash_attn)
            self._ctx = backend.EmbeddingContext(model, mc, self.cfg.pooling, n_seq_max=64)
        return self._ctx

    def _run(self, seqs: list[list[int]]) -> np.ndarray:
        return self._context().embed(seqs)

    def embed(self, inputs: Sequence[Input]) -> tuple[np.ndarray, int]:
        """(vectors [n, n_embd] of unit length, prompt tokens). Blocking: a worker thread's."""
        model = self.model()
        limit = min(self.cfg.n_ctx, self.cfg.n_batch)
        seqs = []
        for i, it in enumerate(inputs):
            if isinstance(it, str):
                ids = model.tokenize(it, True, False)
            else:
                bad = next((t for t in it if not 0 <= t < model.n_vocab), None)
                if bad is not None:
                    raise BadRequest(f"input[{i}]", f"token ids must be in [0, {model.n_vocab - 1}], got {bad}")
                ids = list(it)
            if not ids:
                raise BadRequest(f"input[{i}]", "has no tokens")
            if len(ids) > limit:
                raise BadRequest(f"input[{i}]", f"{len(ids)} tokens; at most {limit} "
                                                "(embedding.n_ctx and embedding.n_batch)")
            seqs.append(ids)
        n = sum(len(s) for s in seqs)
        return np.asarray(self._batcher.submit(seqs, n), dtype=np.float32), n

    def close(self) -> None:
        self._batcher.close()
        if self._ctx is not None:
            self._ctx.close()
            self._ctx = None
