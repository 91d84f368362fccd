"""The daemon's metrics, exported through prometheus_client (the maintained client library: its
exposition escapes label values, negotiates OpenMetrics from the scraper's Accept header and
writes histograms and counters by the conventions, which a hand-written text format kept
re-deriving). Each Metrics owns a CollectorRegistry of its own, never the library's global one:
several daemons run in one test process.

Counters and histograms the daemon itself counts are the library's Counter and Histogram;
values read from live state at scrape time (the engine loop's stats, per-caller figures, the
breaker's state) come from one custom Collector. GET /metrics is served on the metrics port by a
WSGI server thread (loopback by default, off unless configured) and, when the HTTP API is on, by
its route; both take the daemon's token check."""

from __future__ import annotations

import copy
import socket
import threading
import wsgiref.simple_server
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import prometheus_client
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer, choose_encoder
from prometheus_client.registry import Collector

from edgespec.controller.breaker import CLOSED, HALF_OPEN, OPEN
from edgespec.types import GenerationResult

BREAKER_STATES = (CLOSED, OPEN, HALF_OPEN)

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class Counter:
    """A prometheus_client Counter in the daemon's registry with a `model` label (the chat model
    whose engine counted) and at most one label more, read back (Admin.Stats' totals) through the
    library's own samples. `model` None: counts under "" and reads every model's together;
    `for_model(name)` is the same counter seen from one model."""

    def __init__(self, registry: prometheus_client.CollectorRegistry | None, name: str, doc: str,
                 label: str | None = None, *, model: str | None = None, counter: Any = None):
        self.name, self.label, self.model = name, label, model
        self._counter = counter if counter is not None else prometheus_client.Counter(
            name, doc, ["model", *([label] if label else [])], registry=registry)

    def for_model(self, model: str) -> Counter:
        return Counter(None, self.name, "", self.label, model=model, counter=self._counter)

    def inc(self, amount: float = 1.0, label: str = "") -> None:
        self._counter.labels(self.model or "", *([label] if self.label else [])).inc(amount)

    def values(self) -> dict[str, float]:
        """{label value: count} ({"": count} for a counter without a label of its own), of this
        counter's model (every model's summed when it has none)."""
        out: dict[str, float] = {}
        for family in self._counter.collect():
            for s in family.samples:
                if s.name.endswith("_total") and (self.model is None or s.labels["model"] == self.model):
                    key = s.labels[self.label] if self.label else ""
                    out[key] = out.get(key, 0.0) + s.value
        return out

    def value(self, label: str = "") -> float:
        return self.values().get(label, 0.0)


Labels = str | tuple[str, ...] | None


class _Read:
    """A family read at scrape time: `read(metrics)` returns a number, or {label value: number};
    with a tuple of label names, {tuple of their values: number}."""

    def __init__(self, kind: type[GaugeMetricFamily | CounterMetricFamily], name: str, doc: str,
                 read: Callable[[Metrics], float | dict],
                 label: Labels = None):
        self.kind, self.name, self.doc, self.read = kind, name, doc, read
        self.labels = list(label) if isinstance(label, tuple) else [label] if label else []

    def family(self, metrics: Metrics | None) -> Metric:
        """The family; with its samples read from `metrics` (None: the name only)."""
        fam = self.kind(self.name, self.doc, labels=self.labels)
        if metrics is not None:
            v = self.read(metrics)
            for key, x in sorted(v.items() if isinstance(v, dict) else [("", v)]):
                fam.add_metric([] if not self.labels else list(key) if isinstance(key, tuple) else [key], float(x))
        return fam


def gauge(name: str, doc: str, read: Callable[[Metrics], Any], label: Labels = None) -> _Read:
    return _Read(GaugeMetricFamily, name, doc, read, label)


def read_counter(name: str, doc: str, read: Callable[[Metrics], Any], label: Labels = None) -> _Read:
    """A counter kept elsewhere (the per-caller figures), exported as a counter."""
    return _Read(CounterMetricFamily, name, doc, read, label)


def _state(key: str) -> Callable[[Metrics], Any]:
    return lambda m: m.state().get(key, 0)


def _flag(key: str) -> Callable[[Metrics], int]:
    return lambda m: int(bool(m.state().get(key)))


def _tick(key: str) -> Callable[[Metrics], float]:
    return lambda m: m.tick_total(key)


def _caller(key: str) -> Callable[[Metrics], dict[str, float]]:
    return lambda m: m.caller_figure(key)


def _suffix(key: str) -> Callable[[Metrics], float]:
    return lambda m: m.suffix_figure(key)


# The families read from live state when scraped, in exposition order.
LIVE: tuple[_Read, ...] = (
    gauge("edgespec_served_model_info", "1 per model served, by name and role (chat, embedding, rerank).",
          lambda m: {pair: 1 for pair in m.served}, ("model", "role")),
    gauge("edgespec_chat_model_loaded", "1 per chat model loaded now, 0 per one unloaded (loaded on its next "
          "request).", lambda m: m.chat_loaded(), "model"),
    gauge("edgespec_queue_depth", "Requests waiting for an engine slot.", _state("queue_depth")),
    gauge("edgespec_active_requests", "Requests being decoded.", _state("active_requests")),
    gauge("edgespec_ready", "1 when both models are loaded and warmed.", _flag("ready")),
    gauge("edgespec_draining", "1 while draining or shutting down.", _flag("draining")),
    gauge("edgespec_breaker_state", "Speculation breaker state of the last auto request (1 = current).",
          lambda m: m.breaker_states(), "state"),
    gauge("edgespec_caller_in_flight", "Requests running or queued per caller ([limits] callers, else other).",
          _caller("in_flight"), "caller"),
    gauge("edgespec_caller_running", "Requests in engine slots per caller (limits.caller_concurrent).",
          _caller("running"), "caller"),
    gauge("edgespec_caller_queued", "Requests waiting for a slot per caller (limits.caller_queued).",
          _caller("queued"), "caller"),
    gauge("edgespec_goodput_fallback_levels", "Load levels where auto decodes plainly: speculating ticks "
          "measured fewer tokens per second than plain ones.", _tick("goodput_fallback_levels")),
    gauge("edgespec_goodput_blocked_ticks", "Ticks the goodput guard turned plain since load.",
          _tick("goodput_blocked_ticks")),
    gauge("edgespec_cost_host_factor", "Measured / calibrated forward seconds now, by model.",
          lambda m: m.host_factors(), "model"),
    gauge("edgespec_drafter_estimated_speedup", "With a head beside the draft model: each drafter's "
          "estimated speed-up at the last request's load (controller/drafter_choice.py).",
          lambda m: m.tick_totals("drafter_estimate_"), "drafter"),
    gauge("edgespec_suffix_cache_bytes", "Accounted bytes the cross-request suffix cache holds.", _suffix("bytes")),
    gauge("edgespec_suffix_cache_max_bytes", "The suffix cache's bound (speculation.suffix_cache_bytes).",
          _suffix("max_bytes")),
    gauge("edgespec_suffix_cache_documents", "Finished requests' replies the suffix cache holds.",
          _suffix("documents")),
    gauge("edgespec_suffix_cache_lookups", "Suffix cache lookups since start (one per speculative step).",
          _suffix("lookups")),
    gauge("edgespec_suffix_cache_hits", "Suffix cache lookups since start that proposed a continuation.",
          _suffix("hits")),
    gauge("edgespec_suffix_cache_evictions", "Replies evicted from the suffix cache since start.",
          _suffix("evicted")),
    gauge("edgespec_prompt_cache_bytes", "Bytes of kept prefills in host memory beyond the slots "
          "(server.prompt_cache_bytes).", _tick("prompt_store_bytes")),
    gauge("edgespec_prompt_cache_entries", "Kept prefills in host memory beyond the slots.",
          _tick("prompt_store_entries")),
    gauge("edgespec_prompt_cache_hits", "Requests since start whose prompt began with a kept prefill "
          "written back from host memory.", _tick("prompt_store_hits")),
    gauge("edgespec_prompt_cache_restored_tokens", "Prompt tokens since start not prefilled again because "
          "their cells came back from host memory.", _tick("prompt_store_restored_tokens")),
    # counters kept elsewhere: the drafter choice's, the callers' limits'
    read_counter("edgespec_drafter_requests_total", "With a head beside the draft model: requests that "
                 "drafted with each (draft, head).", lambda m: m.tick_totals("drafter_requests_"), "drafter"),
    read_counter("edgespec_caller_requests_total", "Generation requests admitted per caller.",
                 _caller("requests"), "caller"),
    read_counter("edgespec_caller_rejected_total", "Requests refused for being over the caller's own limits, "
                 "by reason (concurrent, queued, tokens).", lambda m: m.caller_rejected(), ("caller", "reason")),
    read_counter("edgespec_caller_tokens_total", "Prompt + completion tokens of finished requests per caller.",
                 _caller("tokens"), "caller"),
)


class _LiveCollector(Collector):
    """The LIVE families, read from one Metrics' live state when scraped."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def describe(self) -> Iterable[Metric]:  # the names, for the registry's duplicate check; reads nothing
        return [f.family(None) for f in LIVE]

    def collect(self) -> Iterator[Metric]:
        for f in LIVE:
            yield f.family(self.metrics)


class Metrics:
    """Everything the daemon exports, and the one set of counters: /metrics renders them, Admin.Stats
    reads them through `totals()`. Gauges read live state through `state()` (set by the daemon)."""

    def __init__(self) -> None:
        self.registry = prometheus_client.CollectorRegistry()  # this daemon's own
        r = self.registry
        # the served models by name and role ((model, role) pairs, set by the daemon): the generation
        # figures are the chat model's (one per daemon); the embedding and rerank figures carry theirs
        self.served: tuple[tuple[str, str], ...] = ()
        # the models beside the chat model: requests, inputs (texts embedded, documents scored), seconds
        self._model_requests = prometheus_client.Counter(
            "edgespec_model_requests_total", "Embedding and rerank requests answered, per served model.",
            ["model", "role"], registry=r)
        self._model_items = prometheus_client.Counter(
            "edgespec_model_items_total", "Inputs embedded and documents scored, per served model.",
            ["model", "role"], registry=r)
        self._model_seconds = prometheus_client.Histogram(
            "edgespec_model_request_seconds", "Time to answer an embedding or rerank request, per served model.",
            ["model", "role"], buckets=TTFT_BUCKETS, registry=r)
        # the process's own figures (process_cpu_seconds_total, process_resident_memory_bytes,
        # open fds, start time; Linux /proc) and the Python runtime's (python_info, gc)
        prometheus_client.ProcessCollector(registry=r)
        prometheus_client.PlatformCollector(registry=r)
        prometheus_client.GCCollector(registry=r)
        self.state: Callable[[], dict] = lambda: {}
        # per-caller figures (edgespec.server.callers.CallerLimits.snapshot): labels bounded by [limits] callers
        self.callers: Callable[[], dict[str, dict[str, Any]]] = lambda: {}
        self.model = ""  # the chat model this view counts for (for_model); "" the daemon's whole
        self.chat_loaded: Callable[[], dict[str, int]] = lambda: {}  # chat model -> 1 loaded, 0 not
        self.ttft = prometheus_client.Histogram("edgespec_time_to_first_token_seconds",
                                                "Time from admission to the first output token.", ["model"],
                                                buckets=TTFT_BUCKETS, registry=r)
        self.tpot = prometheus_client.Histogram("edgespec_time_per_output_token_seconds",
                                                "Mean time per output token after the first, per request.",
                                                ["model"], buckets=TPOT_BUCKETS, registry=r)
        self.submitted = Counter(r, "edgespec_submitted_requests_total", "Generation requests admitted to the queue.")
        self.requests = Counter(r, "edgespec_requests_total", "Finished generation requests by finish reason.", "finish_reason")
        self.rejected = Counter(r, "edgespec_rejected_requests_total", "Requests rejected before generation by reason.", "reason")
        self.prompt_tokens = Counter(r, "edgespec_prompt_tokens_total", "Prompt tokens processed.")
        self.generated = Counter(r, "edgespec_generated_tokens_total", "Output tokens generated.")
        self.target_forwards = Counter(r, "edgespec_target_forwards_total", "Target model forward passes (speculative steps).")
        self.drafted = Counter(r, "edgespec_drafted_tokens_total", "Draft tokens sent to the target for verification.")
        self.accepted = Counter(r, "edgespec_accepted_tokens_total", "Draft tokens accepted by verification.")
        self.accepted_by_depth = Counter(r, "edgespec_accepted_tokens_by_depth_total", "Accepted draft tokens by tree depth.", "depth")
        self.steps_by_mode = Counter(r, "edgespec_speculation_steps_total", "Engine steps by speculation mode.", "mode")
        self.breaker = Counter(r, "edgespec_breaker_transitions_total", "Speculation circuit-breaker transitions.")
        self.shadow = Counter(r, "edgespec_audit_shadow_checks_total",
                              "Shadow plain decodes of greedy speculative requests ([audit]) by result.", "result")
        self.proposed_by_source = Counter(r, "edgespec_draft_tokens_by_source_total",
                                          "Draft tokens sent for verification, by the source that proposed them "
                                          "(draft, head, prompt_lookup, suffix, forced).", "source")
        self.accepted_by_source = Counter(r, "edgespec_accepted_tokens_by_source_total",
                                          "Draft tokens accepted by verification, by source.", "source")
        self.forward_seconds = Counter(r, "edgespec_forward_seconds_total",
                                       "Seconds inside model forwards by chat model and part (target = verification, "
                                       "draft).", "part")
        r.register(_LiveCollector(self))

    GENERATION = ("submitted", "requests", "rejected", "prompt_tokens", "generated", "target_forwards", "drafted",
                  "accepted", "accepted_by_depth", "steps_by_mode", "breaker", "shadow", "proposed_by_source",
                  "accepted_by_source", "forward_seconds")

    def for_model(self, model: str) -> Metrics:
        """This daemon's metrics as one chat model's engine counts them: the generation counters and
        histograms under its `model` label, the same registry (one /metrics for every model)."""
        view = copy.copy(self)
        view.model = model
        for name in self.GENERATION:
            setattr(view, name, getattr(self, name).for_model(model))
        return view

    # -- live state, as the LIVE families read it ---------------------------------------------
    def caller_figure(self, key: str) -> dict[str, float]:
        return {who: f[key] for who, f in self.callers().items()}

    def caller_rejected(self) -> dict[tuple[str, str], float]:
        return {(who, reason): n for who, f in self.callers().items() for reason, n in f["rejected_by_reason"].items()}

    def tick_total(self, key: str, default: float = 0.0) -> float:
        return float((self.state().get("tick_totals") or {}).get(key, default))

    def host_factors(self) -> dict[str, float]:
        """Per model: the target's and the draft's always, a head's beside the draft when loaded."""
        totals = self.state().get("tick_totals") or {}
        return {m: float(totals.get(f"cost_{m}_host_factor", 1.0)) for m in ("target", "draft", "head")
                if m != "head" or "cost_head_host_factor" in totals}

    def tick_totals(self, prefix: str) -> dict[str, float]:
        """tick_totals entries named prefix + label, by label."""
        totals = self.state().get("tick_totals") or {}
        return {k[len(prefix):]: float(v) for k, v in totals.items() if k.startswith(prefix)}

    def suffix_figure(self, key: str) -> float:
        return float((self.state().get("suffix_cache") or {}).get(key, 0))

    def breaker_states(self) -> dict[str, int]:
        """Every state, 1 for the current one; nothing until an auto request has run."""
        current = self.state().get("breaker_state", "")
        return {s: int(s == current) for s in BREAKER_STATES} if current else {}

    def on_finish(self, result: GenerationResult, ttft: float | None, total: float) -> None:
        st = result.stats
        n = len(result.token_ids)
        self.requests.inc(label=result.finish_reason)
        self.prompt_tokens.inc(result.prompt_tokens)
        self.generated.inc(n)
        self.target_forwards.inc(st.target_forwards)
        self.drafted.inc(st.drafted_tokens)
        self.accepted.inc(st.accepted_tokens)
        for depth, c in enumerate(st.accepted_per_depth, 1):
            if c:
                self.accepted_by_depth.inc(c, label=str(depth))
        for mode, c in st.steps_per_mode.items():
            self.steps_by_mode.inc(c, label=mode)
        self.breaker.inc(st.breaker_transitions)
        for src, c in st.proposed_by_source.items():
            self.proposed_by_source.inc(c, label=src)
        for src, c in st.accepted_by_source.items():
            self.accepted_by_source.inc(c, label=src)
        self.forward_seconds.inc(st.target_seconds, label="target")
        self.forward_seconds.inc(st.draft_seconds, label="draft")
        if ttft is not None:
            self.ttft.labels(self.model).observe(ttft)
            if n > 1:
                self.tpot.labels(self.model).observe(max(0.0, total - ttft) / (n - 1))

    def totals(self) -> dict[str, int]:
        """The counters under Admin.Stats' names: requests_total, rejected_<reason>_total,
        finished_<reason>, generated_tokens_total, target_forwards_total, drafted_tokens_total,
        accepted_tokens_total, breaker_transitions_total."""
        out = {
            "requests_total": self.submitted.value(), "generated_tokens_total": self.generated.value(),
            "target_forwards_total": self.target_forwards.value(), "drafted_tokens_total": self.drafted.value(),
            "accepted_tokens_total": self.accepted.value(), "breaker_transitions_total": self.breaker.value(),
            "audit_shadow_checks_total": sum(self.shadow.values().values()),
            "audit_shadow_mismatches_total": self.shadow.value("mismatch"),
            **{f"rejected_{reason}_total": v for reason, v in self.rejected.values().items()},
            **{f"finished_{reason}": v for reason, v in self.requests.values().items()},
        }
        return {k: int(v) for k, v in out.items()}

    def model_request(self, model: str, role: str, items: int, seconds: float) -> None:
        """An embedding or rerank request answered by `model`."""
        self._model_requests.labels(model, role).inc()
        self._model_items.labels(model, role).inc(items)
        self._model_seconds.labels(model, role).observe(seconds)

    def render(self) -> str:
        """The Prometheus text (format 0.0.4) of every family."""
        return prometheus_client.generate_latest(self.registry).decode()

    def exposition(self, accept: str | None, per_caller: bool = True) -> tuple[bytes, str]:
        """(body, Content-Type) in the format the scraper's Accept header asks for: OpenMetrics
        for `application/openmetrics-text`, else Prometheus text. `per_caller` False leaves out
        the edgespec_caller_* families (a metrics token's scrape: TokenAuth.scrape)."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry if per_caller else _Shared(self.registry)), content_type


# /metrics is a thread per connection (wsgiref): every read and write on a scrape's socket must
# finish within this long, and at most METRICS_CONNECTIONS are open; one more closes the oldest that
# is still sending its request line and headers (an idle or slow-header socket), never a scrape
METRICS_TIMEOUT_SECONDS = 5.0
METRICS_CONNECTIONS = 32


class _QuietHandler(wsgiref.simple_server.WSGIRequestHandler):
    timeout = METRICS_TIMEOUT_SECONDS  # socketserver.StreamRequestHandler: the socket's timeout

    def log_message(self, format: str, *args: Any) -> None:  # the access line is not logged
        pass

    def parse_request(self) -> bool:  # reads the request line's headers
        ok = super().parse_request()
        self.server.headers_read(self.connection)  # type: ignore[attr-defined]
        return ok


class _BoundedServer(ThreadingWSGIServer):
    """ThreadingWSGIServer with at most METRICS_CONNECTIONS connections (threads) open."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._reading: dict[socket.socket, None] = {}  # still sending their request, oldest first
        self.evicted = 0
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            if len(self._open) >= METRICS_CONNECTIONS:
                victim = next(iter(self._reading), None)
                if victim is None:  # every connection is being answered: this one is refused
                    request.close()
                    return
                del self._reading[victim]
                self._open.discard(victim)  # counted no more, though its thread takes a moment to end
                self.evicted += 1
                try:
                    victim.shutdown(socket.SHUT_RDWR)  # its thread's read ends; it closes the socket
                except OSError:
                    pass
            self._open.add(request)
            self._reading[request] = None
        super().process_request(request, client_address)

    def headers_read(self, request: socket.socket) -> None:
        with self._lock:
            self._reading.pop(request, None)

    def shutdown_request(self, request: Any) -> None:
        with self._lock:
            self._open.discard(request)
            self._reading.pop(request, None)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a timed-out, evicted or reset connection: nothing to report


class _Shared:
    """A registry's families but the per-caller ones (edgespec_caller_*), for a metrics token."""

    def __init__(self, registry: prometheus_client.CollectorRegistry):
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        return (m for m in self.registry.collect() if not m.name.startswith("edgespec_caller_"))


def serve_metrics(metrics: Metrics, host: str, port: int,
                  authorize: Callable[[str | None], str | None] | None = None) -> ThreadingWSGIServer:
    """Start the /metrics HTTP server (prometheus_client's WSGI app: OpenMetrics when asked, gzip
    when accepted) in a daemon thread; returns it (`.server_address`, `.shutdown()`).
    `authorize(Authorization header)`: the scrape's scope (TokenAuth.scrape: "all", "shared"
    without the per-caller families, None answers 401); no `authorize` = "all". Paths other than
    /metrics and / are 404."""
    exporters = {"all": prometheus_client.make_wsgi_app(metrics.registry),
                 "shared": prometheus_client.make_wsgi_app(_Shared(metrics.registry))}

    def app(environ: dict, start_response: Callable) -> list[bytes]:
        if environ.get("PATH_INFO", "/") not in ("/metrics", "/"):
            start_response("404 Not Found", [("Content-Length", "0")])
            return [b""]
        scope = "all" if authorize is None else authorize(environ.get("HTTP_AUTHORIZATION"))
        if scope is None:
            start_response("401 Unauthorized", [("WWW-Authenticate", 'Bearer realm="edgespec"'), ("Content-Length", "0")])
            return [b""]
        return exporters[scope](environ, start_response)

    class Server(_BoundedServer):
        request_queue_size = 128  # the listen backlog (socketserver's 5 dropped a burst's SYNs)
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    srv = wsgiref.simple_server.make_server(host.strip("[]"), port, app, Server, handler_class=_QuietHandler)
    threading.Thread(target=srv.serve_forever, name="edgespec-metrics", daemon=True).start()
    return srv
