"""Assemble and run the daemon: gRPC server (+ health, optional reflection), the OpenAI-compatible
HTTP API ([http], edgespec.server.http_api), engine thread, metrics endpoint, signals
(SIGTERM/SIGINT: graceful shutdown of both APIs; SIGHUP: reload token files, TLS certificate/key
files and [speculation], without dropping a request) and systemd notifications (through
edgespec.notify when present)."""

from __future__ import annotations

import dataclasses
import os
import signal
import ssl
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from edgespec import notify
from edgespec.errors import BadRequest, ConfigError, NotReady
from edgespec.logs import get_logger
from edgespec.proto.edgespec.v1 import admin_pb2, admin_pb2_grpc, inference_pb2, inference_pb2_grpc
from edgespec.server import convert
from edgespec.server.auth import TokenAuth
from edgespec.server.config import DaemonConfig, check_memory, reload_config
from edgespec.server.engine_loop import EngineLoop, LoopEngine
from edgespec.server.metrics import Metrics, serve_metrics
from edgespec.server.policy import Policy
from edgespec.server.servicers import AdminServicer, InferenceServicer
from edgespec.server.status import ServerInterceptor

if TYPE_CHECKING:
    from prometheus_client.exposition import ThreadingWSGIServer

    from edgespec.config import EngineConfig
    from edgespec.server.http_server import HttpServer

log = get_logger("edgespec.server")

INFERENCE = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
ADMIN = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name
SPARE_THREADS = 32  # handler threads beyond parallel + queue_size (health, admin, tokenize, rejections)


class _Systemd:
    """sd_notify through edgespec.notify; never fails the daemon."""

    def __init__(self) -> None:
        self._watchdog = notify.Watchdog()

    def __call__(self, name: str, *args: Any) -> None:
        try:
            getattr(notify, name)(*args)
        except Exception as exc:
            log.debug("notify_failed", call=name, error=str(exc))

    def kick(self) -> None:
        """WATCHDOG=1 (rate-limited) from the engine loop: it made progress or is idle-healthy."""
        try:
            self._watchdog.kick()
        except Exception:
            pass


def stop_timeout_seconds(grace: float) -> float:
    """The longest `shutdown(grace)` takes: gRPC's stop waits grace + 5 s, HTTP's join as long
    again and 5 s more to force its exit, then the suffix cache's save and the engine's stop
    (30 s allowed). Sent to systemd as the drain starts (EXTEND_TIMEOUT_USEC), so that a
    grace_seconds beyond the unit's TimeoutStopSec never has the drain SIGKILLed."""
    return 2 * (grace + 5) + 5 + 30


STARTUP_SECONDS_PER_MODEL = 300.0  # mapping, warm-up and the first forwards of one model
STARTUP_DISK_BYTES_PER_SECOND = 25 << 20  # a slow disk: 25 MiB/s


def startup_timeout_seconds(cfg: DaemonConfig) -> float:
    """How long systemd should wait for READY=1: for each model the daemon loads at start (the
    target, the draft, a head beside it, and those of [[chat]] entries loaded at start), a fixed
    allowance plus its file read at a slow disk's speed, so a large model on a slow disk is not
    killed while it loads."""
    engines = [cfg.engine, *(e.engine for e in cfg.chat if e.load == "start")]  # [[chat]] entries loaded at start
    paths = [m.path for eng in engines for m in (eng.target, eng.draft, eng.head) if m is not None]
    total = 0.0
    for path in paths:
        try:
            size = os.path.getsize(path)
        except OSError:
            size = 0
        total += STARTUP_SECONDS_PER_MODEL + size / STARTUP_DISK_BYTES_PER_SECOND
    return total


def default_engine_factory(cfg: DaemonConfig, entry: Any = None) -> Callable[[], Any]:
    """The engine of the default chat model, or of the [[chat]] `entry` (its own target, draft and
    speculation section; the memory plan of all of them is kept by chat_models.ChatModels)."""
    if entry is not None:
        return _entry_engine_factory(cfg, entry)

    def load() -> Any:
        from edgespec.engine import Engine

        controller_cfg = None
        if cfg.controller:
            from edgespec.controller import ControllerConfig

            controller_cfg = ControllerConfig.from_dict(dict(cfg.controller))
        if cfg.rpc_servers:  # the target's layers go to other boxes: this box's memory plan does not apply
            from edgespec import backend

            devs = backend.add_rpc_servers(cfg.rpc_servers)
            log.info("rpc_servers", servers=list(cfg.rpc_servers),
                     devices=[{"name": d.name, "free_bytes": d.free_bytes} for d in devs])
        elif not cfg.chat:  # with [[chat]] entries, the daemon's one plan covers them all
            check_memory(cfg.engine, cfg.embedding, cfg.rerank)
        engine = Engine.load(cfg.engine, controller_cfg=controller_cfg)
        if cfg.speculation.suffix_cache_persist:
            _load_suffix(engine)
        return engine

    return load


def _entry_engine_factory(cfg: DaemonConfig, entry: Any) -> Callable[[], Any]:
    def load() -> Any:
        from edgespec.controller import ControllerConfig
        from edgespec.engine import Engine

        controller_cfg = ControllerConfig.from_dict(dict(cfg.controller)) if cfg.controller else None
        engine = Engine.load(entry.engine, controller_cfg=controller_cfg)
        if entry.speculation.suffix_cache_persist:
            _load_suffix(engine, entry.name)
        return engine

    return load


def suffix_model(engine: Any) -> str:
    """The identity a suffix-cache snapshot records: the target file's name and size and its
    vocabulary's size (a snapshot of another model's token ids is discarded at load)."""
    path = Path(engine.cfg.target.path) if getattr(engine, "cfg", None) is not None else None
    try:
        size = path.stat().st_size if path is not None else 0
    except OSError:
        size = 0
    return f"{path.name if path else ''}:{size}:{getattr(engine.target, 'n_vocab', 0)}"


def _load_suffix(engine: Any, model: str = "") -> None:
    """Load the suffix cache's snapshot (speculation.suffix_cache_persist) of the default model, or
    of the [[chat]] model named `model`; a missing one is normal, a bad one is logged and ignored
    (the cache starts empty)."""
    from edgespec.drafters.suffix import snapshot_limit, snapshot_path

    path = snapshot_path(model)
    if not path.is_file():
        return
    try:
        n = engine.suffix_cache.load(path, max_file_bytes=snapshot_limit(engine.suffix_cache.max_bytes),
                                     model=suffix_model(engine), n_vocab=getattr(engine.target, "n_vocab", None))
        log.info("suffix_cache_loaded", path=str(path), documents=n, bytes=engine.suffix_cache.bytes)
    except (OSError, ValueError) as exc:
        engine.suffix_cache.clear()
        log.warning("suffix_cache_load_failed", path=str(path), error=str(exc))


def _tls_files(cfg: DaemonConfig) -> tuple[bytes, bytes, bytes | None]:
    """(certificate chain, key, client CA) read and checked: the key must match the certificate
    (ssl.SSLError otherwise), so a reload never installs a pair no handshake could use."""
    t = cfg.tls
    cert, key = Path(t.cert).expanduser(), Path(t.key).expanduser()
    try:
        # password: never prompt on a terminal for an encrypted key (gRPC cannot use one anyway)
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key, password=lambda: b"")
    except ssl.SSLError as exc:
        raise ConfigError("tls.key", f"{key} is not the private key of {cert} or not PEM ({exc.reason or exc})") from None
    ca = Path(t.client_ca).expanduser().read_bytes() if t.client_ca else None
    if ca is not None:
        try:
            ssl.create_default_context(cadata=ca.decode("ascii", "replace"))
        except (ssl.SSLError, ValueError) as exc:
            raise ConfigError("tls.client_ca", f"{t.client_ca}: no PEM certificate ({exc})") from None
    return cert.read_bytes(), key.read_bytes(), ca


def _model_digests(engine: EngineConfig) -> dict[str, tuple[str, str]]:
    """role -> (manifest name, SHA-256) of one chat model's files; ("", "") for a file no manifest
    lists (hashing it here would delay the start by the time it takes to read the whole file)."""
    from edgespec.models import manifest_entry_for

    out = {}
    for role, m in (("target", engine.target), ("draft", engine.draft), ("head", engine.head)):
        if m is not None:
            out[role] = manifest_entry_for(m.path) or ("", "")
    return out


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


# gRPC connections: a socket that has not finished its HTTP/2 handshake within 10 s is closed,
# one with no call for 5 minutes too, and any after an hour (GOAWAY: clients reconnect, the
# calls it carries finish first); keepalive pings find dead peers, and a client may ping an
# idle connection at most every 10 s (more often and the server closes it)
GRPC_CONNECTION_OPTIONS = (
    ("grpc.server_handshake_timeout_ms", 10_000),
    ("grpc.max_connection_idle_ms", 300_000),
    ("grpc.max_connection_age_ms", 3_600_000),
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 2),
    ("grpc.max_concurrent_streams", 100),
)
# what a connection past its age is given for its running calls beyond the drain's grace: a
# long generation (a few thousand tokens at a few tokens per second on a CPU)
MAX_REQUEST_SECONDS = 3600


def auth_from_config(cfg: DaemonConfig) -> TokenAuth:
    return TokenAuth.from_files(cfg.auth.tokens_file, cfg.auth.admin_tokens_file,
                                client_certs=bool(cfg.tls.client_ca), admin_subjects=cfg.auth.admin_subjects,
                                metrics_tokens_file=cfg.auth.metrics_tokens_file)


class Daemon:
    def __init__(self, cfg: DaemonConfig, engine_factory: Callable[[], Any] | None = None):
        self.cfg = cfg
        # the policy in force = the config file's, with the admin's SetPolicy overrides on top;
        # SIGHUP replaces the first and keeps the second (until SetPolicy(reset))
        self._file_policy = Policy.from_config(cfg.speculation, cfg.server)
        self._overrides: dict[str, object] = {}
        self._policy = self._file_policy
        self._policy_lock = threading.Lock()
        self.metrics = Metrics()
        self.auth = auth_from_config(cfg)
        self.health = health.HealthServicer(experimental_non_blocking=True)
        self.systemd = _Systemd()
        from edgespec.server.callers import CallerLimits
        from edgespec.server.embeddings import Embedder

        self.callers = CallerLimits(cfg.limits)  # per-caller limits and figures, for gRPC and HTTP alike
        self.metrics.callers = self.callers.snapshot

        from edgespec.server.models_api import build_registry, model_name, rerank_kind_of
        from edgespec.server.rerank import Reranker

        # the served models by name and role (/v1/models, Inference.ListModels; a request's `model`)
        target_path = cfg.engine.target.path
        try:
            created = int(Path(target_path).stat().st_mtime)
        except OSError:
            created = 0
        entries = cfg.chat_entries()
        self.registry = build_registry(model_name(target_path), cfg.embedding, cfg.rerank,
                                       rerank_kind=rerank_kind_of(cfg.rerank) if cfg.rerank.enabled else "",
                                       created=created, more_chat=[e.name for e in entries[1:]])
        # each made on its first request (its own context and worker thread), on the target's
        # weights unless its section's path is set
        self.metrics.served = tuple((m.id, m.role) for m in self.registry.models)
        self.embedder = Embedder(cfg.embedding, cfg.engine.target, lambda: self.loop.encoder,
                                 name=self.registry.of("embedding")[0].id) if cfg.embedding.enabled else None
        self.reranker = Reranker(cfg.rerank, cfg.engine.target, lambda: self.loop.encoder,
                                 name=self.registry.of("rerank")[0].id) if cfg.rerank.enabled else None
        # the chat models, the default first: each its own engine loop while loaded, one memory plan
        self._entry_policies = {e.name: Policy.from_config(e.speculation, cfg.server) for e in entries[1:]}
        self.chat_models = self._chat_models(entries, engine_factory)
        self.loop: Any = self.chat_models.default  # the default model's loop (an EngineLoop's surface)
        self.metrics.chat_loaded = self.chat_models.loaded_figures
        # Admin.Stats and the gauges: with several chat models, all of them (ChatModels.stats)
        self.all_models: Any = self.loop if len(self.chat_models.models) == 1 else \
            _AllModels(self.chat_models, self.metrics.totals)
        self.metrics.state = self.all_models.stats
        # each chat model's files' manifest names and digests (ModelInfo); the default's are logged at start
        self.digests = {e.name: _model_digests(e.engine) for e in entries}
        self.model_digests = self.digests[entries[0].name]
        self.started = time.monotonic()
        self.server: grpc.Server | None = None
        self.port = 0
        self._metrics_server: ThreadingWSGIServer | None = None
        self.http: HttpServer | None = None  # when [http] is enabled
        self._stopped = threading.Event()
        self._interceptor: ServerInterceptor | None = None
        self._tls_lock = threading.Lock()
        self._tls_pending: Any = None
        self.last_reload: dict[str, Any] | None = None

    def _chat_models(self, entries: Sequence[Any], engine_factory: Callable[[], Any] | None) -> Any:
        """The chat models (chat_models.ChatModels) with the memory plan of all of them: planned
        from their GGUF headers when [[chat]] entries are configured (one model alone: the
        budget is the start's memory check, as it always was)."""
        from edgespec.server.chat_models import ChatModel, ChatModels

        cfg = self.cfg

        def maker(i: int, entry: Any) -> Callable[[bool], EngineLoop]:
            factory = (engine_factory or default_engine_factory(cfg)) if i == 0 else default_engine_factory(cfg, entry)
            return lambda first: EngineLoop(
                factory, parallel=cfg.server.parallel, queue_size=cfg.server.queue_size,
                metrics=self.metrics.for_model(entry.name), on_ready=self._on_ready if i == 0 and first else None,
                on_heartbeat=self.systemd.kick, log_text=cfg.logging.log_text,
                shadow_fraction=cfg.audit.shadow_fraction, shadow_queue=cfg.audit.shadow_queue)

        if len(entries) == 1:
            return ChatModels([ChatModel(entries[0], maker(0, entries[0]), 0)], budget_bytes=1 << 62)
        if any(side.enabled and not side.path for side in (cfg.embedding, cfg.rerank)):
            # an embedding or rerank context on the default model's weights holds them: it stays loaded
            entries = [dataclasses.replace(entries[0], keep_alive=-1.0), *entries[1:]]
        from edgespec.server.chat_plan import models_plan

        plan = models_plan(cfg.engine, entries[1:], cfg.models.memory_bytes, cfg.embedding, cfg.rerank,
                           default_name=entries[0].name)
        log.info("models_plan", lines=plan.lines())
        return ChatModels([ChatModel(e, maker(i, e), plan.need(e.name)) for i, e in enumerate(entries)],
                          budget_bytes=plan.budget_bytes, side_bytes=plan.side_bytes,
                          load_wait=cfg.models.load_wait_seconds, on_unload=self._save_suffix_of)

    # ---- policy ----------------------------------------------------------------------------

    def policy(self) -> Policy:
        with self._policy_lock:
            return self._policy

    def policy_of(self, name: str) -> Callable[[], Policy]:
        """The policy in force for chat model `name`: its [speculation] (the default model's, or its
        [[chat]] entry's), with the admin's SetPolicy overrides on top."""
        if name not in self._entry_policies:
            return self.policy

        def current() -> Policy:
            with self._policy_lock:
                return convert.with_overrides(self._entry_policies[name], self._overrides)

        return current

    def update_policy(self, changes: dict[str, object], reset: bool = False) -> Policy:
        """Admin.SetPolicy: `changes` become overrides of the file's values (after dropping the
        earlier ones when `reset`); returns the policy now in force."""
        with self._policy_lock:
            overrides = {} if reset else dict(self._overrides)
            overrides.update(changes)
            p = convert.with_overrides(self._file_policy, overrides)
            self._overrides, self._policy = overrides, p
        log.info("policy_set", speculation=p.speculation, max_draft_tokens=p.max_draft_tokens,
                 max_tree_nodes=p.max_tree_nodes, max_tree_depth=p.max_tree_depth, max_tokens=p.max_tokens,
                 reset=reset, admin_overrides=sorted(overrides))
        return p

    def reload(self) -> bool:
        """SIGHUP: re-read the config file's [auth], [tls] and [speculation] (and the token and
        certificate files they name), validate all of it, then swap it in: RPCs already running
        keep what they started with, new RPCs and new TLS handshakes get the new. A reload that
        fails validation changes nothing and says why (log, Admin.Stats last_reload). Admin
        overrides (SetPolicy) stay on top of the new [speculation] until SetPolicy(reset)."""
        try:
            new = reload_config(self.cfg)
            auth = auth_from_config(new)
            tls = _tls_files(new) if new.tls.enabled else None
            if tls is not None and self.http is not None:  # before anything is swapped: a bad pair changes nothing
                self.http.reload_tls(new.tls)
            file_policy = Policy.from_config(new.speculation, new.server) if new.source else None
            entry_policies = {e.name: Policy.from_config(e.speculation, new.server) for e in new.chat}
            if file_policy is not None:
                with self._policy_lock:  # the admin overrides must still apply on top of it
                    convert.with_overrides(file_policy, self._overrides)
        except (ConfigError, BadRequest, OSError, ssl.SSLError, ValueError) as exc:
            self.last_reload = {"ok": False, "unix_time": time.time(), "error": str(exc), "source": self.cfg.source}
            log.error("reload_failed", error=str(exc), source=self.cfg.source)
            return False
        self.auth = auth
        if self._interceptor is not None:
            self._interceptor.auth = auth
        reloaded = ["auth"]
        if tls is not None:
            with self._tls_lock:
                self._tls_pending = grpc.ssl_server_certificate_configuration([(tls[1], tls[0])], root_certificates=tls[2])
            reloaded.append("tls")
        if new.speculation.suffix_cache != self.cfg.speculation.suffix_cache and self.loop.ready:
            try:  # [speculation] suffix_cache: false turns the cache off and empties it; true back on
                on = new.speculation.suffix_cache
                self.loop.call(lambda engine: engine.suffix_control(enabled=on))
            except Exception as exc:
                log.warning("suffix_cache_reload_failed", error=str(exc))
        self.cfg = new
        kept: dict[str, object] = {}
        if file_policy is not None:
            # the file's [speculation] replaces the old file values; admin overrides (SetPolicy)
            # stay on top of it until SetPolicy(reset)
            with self._policy_lock:
                self._file_policy = file_policy
                self._entry_policies = entry_policies
                self._policy = convert.with_overrides(file_policy, self._overrides)
                kept = dict(self._overrides)
            reloaded.append("speculation")
        p = self.policy()
        self.last_reload = {"ok": True, "unix_time": time.time(), "error": "", "source": new.source,
                            "reloaded": reloaded}
        log.info("config_reloaded", source=new.source, reloaded=reloaded, auth=auth.enabled,
                 tokens=len(auth.tokens) + len(auth.admin_tokens), speculation=p.speculation,
                 max_tokens=p.max_tokens, admin_overrides_kept=kept)
        return True

    def _fetch_tls(self) -> Any:
        """grpc's certificate-config fetcher, asked at every new TLS handshake: a new
        configuration once after a reload, else None (keep the current one)."""
        with self._tls_lock:
            pending, self._tls_pending = self._tls_pending, None
        return pending

    # ---- lifecycle -------------------------------------------------------------------------

    def _set_health(self, status: int) -> None:
        for name in ("", INFERENCE, ADMIN):
            self.health.set(name, status)

    def _on_ready(self) -> None:
        if self._stopped.is_set() or self.loop.draining:
            return
        self._set_health(health_pb2.HealthCheckResponse.SERVING)
        addr = format_address(self.cfg.server.host, self.port)
        log.info("serving", address=addr, tls=self.cfg.tls.enabled, mtls=bool(self.cfg.tls.client_ca),
                 auth=self.auth.enabled, reflection=self.cfg.server.reflection,
                 **{f"{role}_sha256": sha or "not in manifest" for role, (_, sha) in self.model_digests.items()})
        print(f"SERVING {addr}", flush=True)  # a line for scripts and tests
        self.systemd("ready", f"serving on {addr}")

    def _save_suffix(self) -> None:
        """speculation.suffix_cache_persist: write each loaded chat model's suffix cache snapshot
        (callers' text) into the state directory, on its engine thread between ticks."""
        for m in self.chat_models.models:
            self._save_suffix_of(m, m.loop)

    def _suffix_path(self, m: Any) -> Path:
        from edgespec.drafters.suffix import snapshot_path

        return snapshot_path("" if m is self.chat_models.default else m.name)

    def _save_suffix_of(self, m: Any, loop: Any) -> None:
        """Chat model `m`'s snapshot from its engine loop `loop` (also as it unloads: a model loaded
        again on demand finds its cache as it left it). A drain and a stop save it too: `loaded`,
        not `ready`, which is False once draining."""
        persist = (self.cfg.speculation if m is self.chat_models.default else m.entry.speculation).suffix_cache_persist
        if not persist or loop is None or not loop.loaded or loop.stopped:
            return
        path = self._suffix_path(m)

        def save(engine: LoopEngine) -> int:
            return engine.suffix_cache.save(path, model=suffix_model(engine))

        try:
            n = loop.call(save, timeout=60.0)
            log.info("suffix_cache_saved", model=m.name, path=str(path), bytes=n)
        except Exception as exc:  # an optimisation: never fail a drain, a stop or an unload on it
            log.warning("suffix_cache_save_failed", model=m.name, path=str(path), error=str(exc))

    def _clear_suffix(self, name: str) -> Callable[[], None]:
        """Admin.SetPolicy clear_suffix_cache: what empties the suffix cache of chat model `name`,
        or of every chat model (""): a loaded one's on its engine thread, an unloaded one's
        snapshot removed (it would come back at its next load). An unknown name raises here,
        before the caller changes anything."""
        chosen = self.chat_models.models
        if name:
            chosen = (self.chat_models.find(self.registry.pick("chat", name).id),)

        def clear() -> None:
            for m in chosen:
                try:
                    m.call(lambda engine: engine.suffix_control(clear=True))
                except NotReady:  # not loaded
                    self._suffix_path(m).unlink(missing_ok=True)
        return clear

    def _drain(self, on: bool) -> None:
        self.chat_models.drain(on)
        if on:
            self._save_suffix()
            self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        elif self.loop.ready:
            self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("drain", draining=on)

    def start(self) -> int:
        """Bind and start serving (health NOT_SERVING), then load the engine in its thread."""
        s = self.cfg.server
        workers = s.parallel + s.queue_size + SPARE_THREADS
        anonymous = self.cfg.limits.anonymous_rpcs
        options = [
            ("grpc.max_receive_message_length", s.max_message_bytes),
            ("grpc.max_send_message_length", s.max_message_bytes),
            ("grpc.so_reuseport", 0),
            *GRPC_CONNECTION_OPTIONS,
            # a connection may live this long, then it is asked to go (GOAWAY); its running
            # requests get the drain's grace and the longest a request may take to finish
            ("grpc.max_connection_age_grace_ms", int(1000 * (s.grace_seconds + MAX_REQUEST_SECONDS))),
        ]
        # anonymous health calls (limits.anonymous_rpcs) run on the interceptor's own pool and
        # count on top of authorised work's `workers`, as do their momentary refusals
        self._interceptor = ServerInterceptor(self.auth, anonymous_rpcs=anonymous)
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="edgespec-rpc"),
            interceptors=[self._interceptor],
            options=options,
            maximum_concurrent_rpcs=workers + 2 * anonymous,
        )
        inference_pb2_grpc.add_InferenceServicer_to_server(self._inference(), server)
        admin_pb2_grpc.add_AdminServicer_to_server(
            AdminServicer(self.all_models, self.policy, self.update_policy, self._drain, self.started,
                          last_reload=lambda: self.last_reload, callers=self.callers,
                          clear_suffix=self._clear_suffix), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if s.reflection:
            from grpc_reflection.v1alpha import reflection

            reflection.enable_server_reflection(
                (INFERENCE, ADMIN, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
                server,
            )
        addr = format_address(s.host, s.port)
        try:
            if self.cfg.tls.enabled:
                cert, key, ca = _tls_files(self.cfg)
                initial = grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)
                creds = grpc.dynamic_ssl_server_credentials(initial, self._fetch_tls,
                                                            require_client_authentication=ca is not None)
                self.port = server.add_secure_port(addr, creds)
            else:
                self.port = server.add_insecure_port(addr)
        except RuntimeError as exc:
            raise ConfigError("server.port", f"cannot listen on {addr}: {exc}") from None
        if not self.port:
            raise ConfigError("server.port", f"cannot listen on {addr}")
        server.start()
        self.server = server
        log.info("listening", address=format_address(s.host, self.port), workers=workers)
        if self.cfg.http.enabled:
            from edgespec.server.http_server import HttpServer, http_address

            http = self.http = HttpServer(self.cfg, self.loop, self.policy, lambda: self.auth,  # the tokens in force
                                   embedder=self.embedder, callers=self.callers,
                                   metrics=self.metrics.exposition if self.cfg.metrics.enabled else None,
                                   registry=self.registry, reranker=self.reranker,
                                   record=self.metrics.model_request,
                                   chat=(self.chat_models, self.policy_of) if len(self.chat_models.models) > 1 else None)
            http.start()
            print(f"HTTP {http.scheme}://{http_address(self.cfg.http.host, http.port)}", flush=True)
        if self.cfg.metrics.enabled:
            m = self.cfg.metrics
            metrics_server = self._metrics_server = serve_metrics(self.metrics, m.host, m.port,
                                                                  authorize=self._metrics_authorized)
            log.info("metrics_listening", address=format_address(m.host, metrics_server.server_address[1]))
        self.systemd("status", "loading models")
        self.systemd("extend_timeout", startup_timeout_seconds(self.cfg))
        self.chat_models.start()
        return self.port

    def _inference(self) -> Any:
        """Inference's servicer: the default model's, or with [[chat]] entries one per chat model
        behind a router that picks by the request's `model` (chat_routing.RoutingServicer)."""
        s = self.cfg.server
        servicers = {m.name: InferenceServicer(
            m, self.policy_of(m.name), parallel=s.parallel, limits=self.cfg.limits,
            digests=self.digests[m.name].copy,
            chat_template=m.entry.chat_template, tool_format=m.entry.tool_format,
            reasoning_format=m.entry.reasoning_format, embedder=self.embedder, callers=self.callers,
            registry=self.registry, reranker=self.reranker, record=self.metrics.model_request)
            for m in self.chat_models.models}
        if len(servicers) == 1:
            return servicers[self.chat_models.default.name]
        from edgespec.server.chat_routing import RoutingServicer

        return RoutingServicer(self.chat_models, servicers, self.registry)

    def _metrics_authorized(self, authorization: str | None) -> str | None:
        """/metrics's scope for a scrape (TokenAuth.scrape): a metrics or admin token whenever
        token files are configured (plain HTTP carries no client certificate: mutual TLS alone
        leaves it to the loopback rule of config validation)."""
        return self.auth.scrape(authorization)

    @property
    def http_port(self) -> int:
        return self.http.port if self.http is not None else 0

    @property
    def metrics_port(self) -> int:
        return self._metrics_server.server_address[1] if self._metrics_server else 0

    def shutdown(self, grace: float | None = None) -> None:
        """Health NOT_SERVING, stop accepting, give in-flight requests `grace` seconds, stop the engine."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        grace = self.cfg.server.grace_seconds if grace is None else grace
        log.info("shutting_down", grace_seconds=grace, **{k: v for k, v in self.loop.stats().items()
                                                           if k in ("active_requests", "queue_depth")})
        self.systemd("stopping", "draining")
        self.systemd("extend_timeout", stop_timeout_seconds(grace))
        self.health.enter_graceful_shutdown()
        self.chat_models.drain(True)
        if self.http is not None:
            self.http.stop(grace)  # both APIs drain at once
        if self.server is not None:
            self.server.stop(grace).wait(grace + 5)
        if self.http is not None:
            self.http.join(grace + 5)
        self._save_suffix()
        self.chat_models.stop()
        for side in (self.embedder, self.reranker):  # their worker threads and contexts
            if side is not None:
                side.close()
        if self._interceptor is not None:
            self._interceptor.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        log.info("stopped")


class _AllModels:
    """What Admin and the gauges read of the engine loop, over every chat model."""

    def __init__(self, models: Any, totals: Callable[[], dict[str, int]]):
        self.models, self.totals = models, totals

    def stats(self) -> dict[str, Any]:
        return dict(self.models.stats(self.totals))

    def call(self, fn: Callable[[Any], Any], timeout: float | None = 60.0) -> Any:
        return self.models.call(fn, timeout)


def _raise_open_files() -> None:
    """The soft limit on open files up to the hard one: a login shell's soft 1,024 would cap the
    three listeners' connections together (the unit's LimitNOFILE sets both)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else max(soft, 65536), hard))
    except (ImportError, ValueError, OSError):
        pass


def run(cfg: DaemonConfig, engine_factory: Callable[[], Any] | None = None) -> int:
    """The `edgespec serve` main loop. Returns the exit code (0 on SIGTERM/SIGINT)."""
    _raise_open_files()
    daemon = Daemon(cfg, engine_factory)
    stop = threading.Event()
    reload = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    if hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, lambda *_: reload.set())
    daemon.start()
    code = 0
    while not stop.wait(0.2):
        if reload.is_set():
            reload.clear()
            daemon.reload()
        if daemon.loop.stopped:
            err = daemon.loop.error
            log.error("engine_failed", error=str(err) if err else "stopped")
            print(f"error: the engine failed: {err}", file=sys.stderr, flush=True)
            code = 1
            break
    daemon.shutdown()
    return code
