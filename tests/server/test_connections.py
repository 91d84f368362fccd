"""Idle and slow-header connections cannot deny service (edgespec/server/connections.py, the
/metrics server's bound, gRPC's connection options): with hundreds of such sockets open to the
HTTP API, gRPC and /metrics at once, /health and real requests on every port still answer within
2 s; a socket that never finishes its headers is closed after http.header_timeout_seconds. On
loopback, over the fake engine, in a few seconds."""

from __future__ import annotations

import http.client
import json
import socket

from grpc_health.v1 import health_pb2, health_pb2_grpc

from edgespec.proto.edgespec.v1 import inference_pb2 as pb
from edgespec.server import metrics
from tests.server.floods import PARTIAL, closed_within, flood, timed

IDLE, SLOW = 200, 200  # per listener


def _get(port: int, path: str, body: dict | None = None) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        if body is None:
            conn.request("GET", path)
        else:
            conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def test_floods_of_idle_and_slow_header_sockets_leave_every_listener_serving(make_daemon):
    r = make_daemon(http={"enabled": True, "port": 0}, metrics={"enabled": True, "port": 0})
    d = r.daemon
    health = health_pb2_grpc.HealthStub(r.channel)
    rq = pb.GenerateRequest(prompt="Hello")
    rq.sampling.max_tokens = 4
    with flood(d.http_port, IDLE, SLOW, "http"), flood(d.port, IDLE, SLOW, "grpc"), \
            flood(d.metrics_port, IDLE, SLOW, "http"):
        checks = {
            "http /health": lambda: _get(d.http_port, "/health"),
            "http completion": lambda: _get(d.http_port, "/v1/completions", {"prompt": "Hi", "max_tokens": 4}),
            "grpc health": lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=2).status,
            "grpc generate": lambda: r.inference.Generate(rq, timeout=2).usage.completion_tokens,
            "/metrics": lambda: _get(d.metrics_port, "/metrics"),
        }
        for _ in range(3):  # while the floods are held, again and again
            for name, check in checks.items():
                seconds, out = timed(check)
                assert seconds < 2, f"{name}: {seconds:.2f} s"
                assert out in (200, health_pb2.HealthCheckResponse.SERVING, 4), f"{name}: {out}"
        assert len(d.http.guard) <= d.cfg.http.max_connections
    assert d._metrics_server.evicted >= IDLE + SLOW - metrics.METRICS_CONNECTIONS


def test_a_connection_that_never_finishes_its_headers_is_closed(make_daemon):
    r = make_daemon(http={"enabled": True, "port": 0, "header_timeout_seconds": 0.5, "max_connections": 16})
    port = r.daemon.http_port
    idle = socket.create_connection(("127.0.0.1", port))
    slow = socket.create_connection(("127.0.0.1", port))
    slow.sendall(PARTIAL["http"])
    assert closed_within(idle, 10) and closed_within(slow, 10)
    # one past max_connections closes the oldest idle one, never a request in flight
    with flood(port, 16, 0) as socks:
        assert _get(port, "/health") == 200
        assert sum(closed_within(s, 0.05) for s in socks[:2]) >= 1
    stats = r.daemon.http.guard.stats
    assert stats["timed_out"] >= 2 and stats["evicted"] >= 1
