"""The models the daemon serves, by name and role (chat, embedding, rerank): what /v1/models and
Inference.ListModels list, and how a request's `model` picks one.

A request names a model of its endpoint's role, or none (the role's default). A name served in
another role is a 400 naming `model` and the names of the role asked for; a name not served at
all is UnknownModel (HTTP 404, gRPC NOT_FOUND) listing every served name, except on the chat
routes under `[http] strict = false`, where the default chat model answers it (and the
response's x-edgespec-warning header says so), as OpenAI clients that send a fixed name expect.

The registry holds a list per role: the chat models are the default one ([target]) and the
[[chat]] entries (chat_models.py loads and routes them); one embedding and one rerank model."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROLES = ("chat", "embedding", "rerank")


@dataclass(frozen=True)
class ServedModel:
    id: str  # the name in /v1/models and in requests' `model`
    role: str  # chat | embedding | rerank
    path: str = ""  # its GGUF ("" when it is the target's weights under another role)
    aliases: tuple[str, ...] = ()  # other names routed to it (the chat model's, for a context on its weights)
    detail: str = ""  # how it serves (the reranker's kind, ...)


class Registry:
    def __init__(self, models: Sequence[ServedModel], created: int | None = None):
        ids = [m.id for m in models]
        dup = next((i for i in ids if ids.count(i) > 1), None)
        if dup is not None:
            from edgespec.errors import ConfigError

            raise ConfigError("name", f"two served models are named {dup!r} (set [embedding] name or [rerank] name)")
        for m in models:
            if m.role not in ROLES:
                raise ValueError(f"unknown role {m.role!r}")
        self.models = tuple(models)
        self.created = int(time.time()) if created is None else created

    def of(self, role: str) -> tuple[ServedModel, ...]:
        return tuple(m for m in self.models if m.role == role)

    def names(self, role: str | None = None) -> str:
        return ", ".join(m.id for m in self.models if role is None or m.role == role) or "none"

    def resolve(self, role: str, name: str, *, strict: bool = True) -> ServedModel | None:
        """The model of `role` that `name` picks (empty: the role's first). None: `name` is not
        served at all and `strict` is false (the caller answers with its default, and says so)."""
        from edgespec.errors import BadRequest, UnknownModel

        mine = self.of(role)
        if not mine:
            raise UnknownModel("model", f"no {role} model is served here (served: {self.names()})")
        if not name:
            return mine[0]
        for m in mine:
            if name == m.id or name in m.aliases:
                return m
        other = next((m for m in self.models if m.id == name), None)
        if other is not None:
            raise BadRequest("model", f"{name!r} is a{'n' if other.role[0] in 'aeiou' else ''} {other.role} model, "
                                      f"not a {role} model ({role} models: {self.names(role)})")
        if not strict:
            return None
        raise UnknownModel("model", f"unknown model {name!r} (served: {self.names()})")

    def pick(self, role: str, name: str) -> ServedModel:
        """resolve() for the routes that answer no name they do not serve (all but chat's)."""
        m = self.resolve(role, name)
        assert m is not None  # strict: an unknown name raised
        return m

    def listing(self) -> list[dict[str, Any]]:
        """/v1/models' data: OpenAI's model objects, with the role (and the reranker's kind)."""
        return [{"id": m.id, "object": "model", "created": self.created, "owned_by": "edgespec", "role": m.role,
                 **({"kind": m.detail} if m.detail else {})} for m in self.models]


def rerank_kind_of(cfg: Any) -> str:
    """The reranker [rerank] configures: with kind auto, cross-encoder when the GGUF's
    `<arch>.pooling_type` is rank (4, llama.cpp's LLAMA_POOLING_TYPE_RANK) or it carries a
    classifier head (backend.has_classifier_head: what llama.cpp's converter writes for BGE and
    ms-marco rerankers, without a pooling type), read from the header, nothing loaded; else as
    `rerank.auto_kind` reads the name (the target's weights: causal-query-likelihood). A
    cross-encoder asked of a file with neither is a ConfigError naming rerank.kind (llama.cpp
    would abort the process on its first forward); a template the kind cannot use, one naming
    rerank.template."""
    ranks, name = False, ""
    if cfg.path:
        from gguf import GGUFReader

        from edgespec.backend import has_classifier_head

        try:
            reader = GGUFReader(cfg.path)
            fields = reader.fields
            arch = fields["general.architecture"].contents()
            pooling = fields.get(f"{arch}.pooling_type")
            ranks = (pooling is not None and int(pooling.contents()) == 4) \
                or has_classifier_head(t.name for t in reader.tensors)
            name = f"{fields['general.name'].contents() if 'general.name' in fields else ''} {cfg.path}"
        except Exception:
            return str(cfg.kind)
    from edgespec.errors import ConfigError
    from edgespec.server.rerank import auto_kind, template_problem

    kind = str(cfg.kind) if cfg.kind != "auto" else auto_kind(ranks, name)
    if kind == "cross-encoder" and not ranks:
        raise ConfigError("rerank.kind", f"cross-encoder needs a GGUF with a classifier head (or rank pooling); "
                                         f"{cfg.path or 'the target'} has none: use causal-yes-no or "
                                         "causal-query-likelihood")
    problem = template_problem(kind, getattr(cfg, "template", ""))
    if problem:
        raise ConfigError("rerank.template", problem)
    return kind


def model_name(path: str) -> str:
    return Path(path).name.removesuffix(".gguf")


def build_registry(chat_id: str, embedding: Any = None, rerank: Any = None, *, rerank_kind: str = "",
                   created: int | None = None, more_chat: Sequence[str] = ()) -> Registry:
    """The served models: the chat model (and the `more_chat` ones after it: [[chat]] entries),
    and the [embedding] and [rerank] models when enabled (sections with `enabled`, `path`, `name`).
    A context on the target's weights is named `<chat>-embedding` / `<chat>-rerank` unless named,
    and answers to the chat model's name too."""
    models = [ServedModel(chat_id, "chat"), *(ServedModel(name, "chat") for name in more_chat)]
    for role, sec in (("embedding", embedding), ("rerank", rerank)):
        if sec is None or not sec.enabled:
            continue
        shared = not sec.path
        name = sec.name or (f"{chat_id}-{role}" if shared else model_name(sec.path))
        models.append(ServedModel(name, role, sec.path, aliases=(chat_id,) if shared else (),
                                  detail=rerank_kind if role == "rerank" else ""))
    return Registry(models, created)


class ModelRoutes:
    """The HTTP routes of the models beside the chat model: GET /v1/models, POST /v1/embeddings
    and POST /v1/rerank (with llama-server's /rerank and /v2/rerank). Built by HttpApi;
    `read_json` reads a body within the size limit, `run` runs a blocking call on a worker
    thread, `admit` holds the caller's place under its limits while a request runs."""

    def __init__(self, registry: Registry, *, reranker: Any, max_prompt_bytes: int,
                 read_json: Callable[[Any], Awaitable[Any]], run: Callable[..., Awaitable[Any]],
                 admit: Callable[[], Any], record: Callable[[str, str, int, float], None] | None = None,
                 embedder: Any = None):
        self.registry = registry
        self.reranker = reranker  # an edgespec.server.rerank.Reranker, None when [rerank] is off
        self.embedder = embedder  # an edgespec.server.embeddings.Embedder, None when [embedding] is off
        self.max_prompt_bytes = max_prompt_bytes
        self.read_json, self.run, self.admit = read_json, run, admit
        self.record = record or (lambda model, role, items, seconds: None)

    async def models(self, request: Any, rid: str) -> Any:
        from starlette.responses import JSONResponse

        return JSONResponse({"object": "list", "data": self.registry.listing()})

    async def embeddings(self, request: Any, rid: str) -> Any:
        from starlette.responses import JSONResponse

        from edgespec.server import embeddings as emb

        body = await self.read_json(request)
        if self.embedder is None:
            from edgespec.errors import UnknownModel

            raise UnknownModel("model", "embeddings are off on this server ([embedding] enabled = false)")
        req = emb.parse_request(body, models=None, max_inputs=self.embedder.cfg.max_inputs,
                                max_bytes=self.max_prompt_bytes)
        served = self.registry.pick("embedding", req.model)
        started = time.monotonic()
        with self.admit() as place:  # runs at once, outside the engine's slots
            vectors, n = await self.run(self.embedder.embed, req.inputs)
            place.used(n)
        self.record(served.id, "embedding", len(req.inputs), time.monotonic() - started)
        return JSONResponse(emb.response_body(vectors, model=served.id, prompt_tokens=n,
                                              encoding_format=req.encoding_format))

    async def rerank(self, request: Any, rid: str) -> Any:
        from starlette.responses import JSONResponse

        from edgespec.server import rerank as rr

        body = await self.read_json(request)
        if self.reranker is None:
            from edgespec.errors import UnknownModel

            raise UnknownModel("model", "reranking is off on this server ([rerank] enabled = false)")
        req = rr.parse_request(body, max_documents=self.reranker.cfg.max_documents,
                               max_bytes=self.max_prompt_bytes)
        served = self.registry.pick("rerank", req.model)
        started = time.monotonic()
        with self.admit() as place:  # runs at once, outside the engine's slots
            scores, n = await self.run(self.reranker.score, req.query, req.documents, req.max_tokens_per_doc)
            place.used(n)
        self.record(served.id, "rerank", len(req.documents), time.monotonic() - started)
        return JSONResponse(rr.response_body(req, scores, model=served.id, tokens=n, rid="rerank-" + rid))
