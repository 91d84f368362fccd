"""A tiny Prometheus text exposition (format 0.0.4) and the daemon's metrics. No dependency:
counters, gauges and histograms with fixed buckets, rendered on GET /metrics by a stdlib HTTP
server thread (loopback by default, off unless configured)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Callable, Iterable

from edgespec.controller.breaker import CLOSED, HALF_OPEN, OPEN
from edgespec.types import GenerationResult

BREAKER_STATES = (CLOSED, OPEN, HALF_OPEN)

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    esc = lambda v: str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")  # noqa: E731
    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in sorted(labels.items())) + "}"


def _num(v: float) -> str:
    v = float(v)
    if v == float("inf"):
        return "+Inf"
    return str(int(v)) if v.is_integer() else repr(v)


class Counter:
    def __init__(self, name: str, doc: str, label: str | None = None):
        self.name, self.doc, self.label = name, doc, label
        self._values: dict[str, float] = {} if label else {"": 0.0}
        self._lock = threading.Lock()

    def inc(self, amount: float = 1.0, label: str = "") -> None:
        with self._lock:
            self._values[label] = self._values.get(label, 0.0) + amount

    def value(self, label: str = "") -> float:
        with self._lock:
            return self._values.get(label, 0.0)

    def values(self) -> dict[str, float]:
        """{label value: count} ({"": count} for an unlabelled counter)."""
        with self._lock:
            return dict(self._values)

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.doc}"
        yield f"# TYPE {self.name} counter"
        with self._lock:
            items = sorted(self._values.items())
        for label, v in items:
            yield f"{self.name}{_labels({self.label: label} if self.label else {})} {_num(v)}"


class Gauge:
    """Read at scrape time from a callback returning {label value: number} (or a number)."""

    def __init__(self, name: str, doc: str, read: Callable[[], float | dict[str, float]], label: str | None = None):
        self.name, self.doc, self.read, self.label = name, doc, read, label

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.doc}"
        yield f"# TYPE {self.name} gauge"
        v = self.read()
        items = v.items() if isinstance(v, dict) else [("", v)]
        for label, x in sorted(items):
            yield f"{self.name}{_labels({self.label: label} if self.label else {})} {_num(x)}"


class ReadCounter(Gauge):
    """A counter read at scrape time (kept elsewhere), rendered as a counter."""

    def render(self) -> Iterable[str]:
        for line in super().render():
            yield line.replace(" gauge", " counter", 1) if line.startswith("# TYPE") else line


class Histogram:
    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]):
        self.name, self.doc = name, doc
        self.buckets = (*buckets, float("inf"))
        self._counts = [0] * len(self.buckets)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, v: float) -> None:
        with self._lock:
            self._sum += v
            for i, b in enumerate(self.buckets):
                if v <= b:
                    self._counts[i] += 1
                    break

    @property
    def count(self) -> int:
        with self._lock:
            return sum(self._counts)

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.doc}"
        yield f"# TYPE {self.name} histogram"
        with self._lock:
            counts, total = list(self._counts), self._sum
        acc = 0
        for b, c in zip(self.buckets, counts):
            acc += c
            yield f'{self.name}_bucket{{le="{_num(b)}"}} {acc}'
        yield f"{self.name}_sum {_num(total)}"
        yield f"{self.name}_count {acc}"


class Metrics:
    """Everything the daemon exports, and the one set of counters: /metrics renders them, Admin.Stats
    reads them through `totals()`. Gauges read live state through `state()` (set by the daemon)."""

    def __init__(self) -> None:
        self.state: Callable[[], dict] = lambda: {}
        # per-caller figures (edgespec.server.callers.CallerLimits.snapshot): labels bounded by [limits] callers
        self.callers: Callable[[], dict[str, dict[str, int]]] = lambda: {}
        self.ttft = Histogram("edgespec_time_to_first_token_seconds", "Time from admission to the first output token.", TTFT_BUCKETS)
        self.tpot = Histogram("edgespec_time_per_output_token_seconds", "Mean time per output token after the first, per request.", TPOT_BUCKETS)
        self.submitted = Counter("edgespec_submitted_requests_total", "Generation requests admitted to the queue.")
        self.requests = Counter("edgespec_requests_total", "Finished generation requests by finish reason.", "finish_reason")
        self.rejected = Counter("edgespec_rejected_requests_total", "Requests rejected before generation by reason.", "reason")
        self.prompt_tokens = Counter("edgespec_prompt_tokens_total", "Prompt tokens processed.")
        self.generated = Counter("edgespec_generated_tokens_total", "Output tokens generated.")
        self.target_forwards = Counter("edgespec_target_forwards_total", "Target model forward passes (speculative steps).")
        self.drafted = Counter("edgespec_drafted_tokens_total", "Draft tokens sent to the target for verification.")
        self.accepted = Counter("edgespec_accepted_tokens_total", "Draft tokens accepted by verification.")
        self.accepted_by_depth = Counter("edgespec_accepted_tokens_by_depth_total", "Accepted draft tokens by tree depth.", "depth")
        self.steps_by_mode = Counter("edgespec_speculation_steps_total", "Engine steps by speculation mode.", "mode")
        self.breaker = Counter("edgespec_breaker_transitions_total", "Speculation circuit-breaker transitions.")
        self.shadow = Counter("edgespec_audit_shadow_checks_total",
                              "Shadow plain decodes of greedy speculative requests ([audit]) by result.", "result")
        self.proposed_by_source = Counter("edgespec_draft_tokens_by_source_total",
                                          "Draft tokens sent for verification, by the source that proposed them "
                                          "(draft, head, prompt_lookup, suffix, forced).", "source")
        self.accepted_by_source = Counter("edgespec_accepted_tokens_by_source_total",
                                          "Draft tokens accepted by verification, by source.", "source")
        self.forward_seconds = Counter("edgespec_forward_seconds_total",
                                       "Seconds inside model forwards by model (target = verification).", "model")
        gauge = lambda key, default=0: (lambda: self.state().get(key, default))  # noqa: E731
        self.gauges = [
            Gauge("edgespec_queue_depth", "Requests waiting for an engine slot.", gauge("queue_depth")),
            Gauge("edgespec_active_requests", "Requests being decoded.", gauge("active_requests")),
            Gauge("edgespec_ready", "1 when both models are loaded and warmed.", lambda: int(bool(self.state().get("ready")))),
            Gauge("edgespec_draining", "1 while draining or shutting down.", lambda: int(bool(self.state().get("draining")))),
            Gauge("edgespec_breaker_state", "Speculation breaker state of the last auto request (1 = current).",
                  self._breaker_state, "state"),
            Gauge("edgespec_caller_in_flight", "Requests running or queued per caller ([limits] callers, else other).",
                  lambda: self._caller("in_flight"), "caller"),
            Gauge("edgespec_goodput_fallback_levels", "Load levels where auto decodes plainly: speculating ticks "
                  "measured fewer tokens per second than plain ones.", lambda: self._tick("goodput_fallback_levels")),
            Gauge("edgespec_goodput_blocked_ticks", "Ticks the goodput guard turned plain since load.",
                  lambda: self._tick("goodput_blocked_ticks")),
            Gauge("edgespec_cost_host_factor", "Measured / calibrated forward seconds now, by model.",
                  lambda: {m: self._tick(f"cost_{m}_host_factor", 1.0) for m in ("target", "draft")}, "model"),
            Gauge("edgespec_suffix_cache_bytes", "Accounted bytes the cross-request suffix cache holds.",
                  lambda: self._suffix("bytes")),
            Gauge("edgespec_suffix_cache_max_bytes", "The suffix cache's bound (speculation.suffix_cache_bytes).",
                  lambda: self._suffix("max_bytes")),
            Gauge("edgespec_suffix_cache_documents", "Finished requests' replies the suffix cache holds.",
                  lambda: self._suffix("documents")),
            Gauge("edgespec_suffix_cache_lookups", "Suffix cache lookups since start (one per speculative step).",
                  lambda: self._suffix("lookups")),
            Gauge("edgespec_suffix_cache_hits", "Suffix cache lookups since start that proposed a continuation.",
                  lambda: self._suffix("hits")),
            Gauge("edgespec_suffix_cache_evictions", "Replies evicted from the suffix cache since start.",
                  lambda: self._suffix("evicted")),
        ]
        self.caller_counters = [
            ReadCounter("edgespec_caller_requests_total", "Generation requests admitted per caller.",
                        lambda: self._caller("requests"), "caller"),
            ReadCounter("edgespec_caller_rejected_total", "Requests refused for being over the caller's own limits.",
                        lambda: self._caller("rejected"), "caller"),
            ReadCounter("edgespec_caller_tokens_total", "Prompt + completion tokens of finished requests per caller.",
                        lambda: self._caller("tokens"), "caller"),
        ]

    def _caller(self, key: str) -> dict[str, float]:
        return {who: f[key] for who, f in self.callers().items()}

    def _tick(self, key: str, default: float = 0.0) -> float:
        return float((self.state().get("tick_totals") or {}).get(key, default))

    def _suffix(self, key: str) -> float:
        return float((self.state().get("suffix_cache") or {}).get(key, 0))

    def _breaker_state(self) -> dict[str, int]:
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
            self.ttft.observe(ttft)
            if n > 1:
                self.tpot.observe(max(0.0, total - ttft) / (n - 1))

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

    def render(self) -> str:
        parts = [self.ttft, self.tpot, self.submitted, self.requests, self.rejected, self.prompt_tokens, self.generated,
                 self.target_forwards, self.drafted, self.accepted, self.accepted_by_depth, self.steps_by_mode,
                 self.proposed_by_source, self.accepted_by_source, self.breaker, self.forward_seconds, self.shadow,
                 *self.gauges, *self.caller_counters]
        return "\n".join(line for p in parts for line in p.render()) + "\n"


def serve_metrics(metrics: Metrics, host: str, port: int,
                  authorize: Callable[[str | None], bool] | None = None) -> http.server.ThreadingHTTPServer:
    """Start the /metrics HTTP server in a daemon thread; returns it (`.server_address`, `.shutdown()`).
    `authorize(Authorization header)`: False answers 401 (the daemon passes its token check when
    auth is configured; None = open)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            if self.path.split("?", 1)[0] not in ("/metrics", "/"):
                self.send_error(404)
                return
            if authorize is not None and not authorize(self.headers.get("Authorization")):
                self.send_response(401)
                self.send_header("WWW-Authenticate", 'Bearer realm="edgespec"')
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            body = metrics.render().encode()
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:  # quiet
            pass

    srv = http.server.ThreadingHTTPServer((host, port), Handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, name="edgespec-metrics", daemon=True).start()
    return srv
