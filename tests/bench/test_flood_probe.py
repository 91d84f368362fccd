"""The flood probe (python -m edgespec.bench.flood_probe): its floods hold their size while the
server closes sockets, its slow sockets keep trickling header lines, and its report counts a
legitimate caller's answers within 2 s and its failures. Against a small threaded HTTP server on
loopback with a header timeout (the full-size run against a daemon: docs/benchmarks/results/)."""

from __future__ import annotations

import http.server
import threading
import time

import httpx

from edgespec.bench.flood_probe import Flood, probe, render


class _Handler(http.server.BaseHTTPRequestHandler):
    timeout = 0.5  # a header timeout: idle and slow sockets are closed, and the flood reopens them

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: object) -> None:
        pass


def test_the_flood_holds_its_size_and_the_report_counts_the_callers_answers():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        flood = Flood(port, idle=6, slow=6, kind="http", trickle_seconds=0.1)
        calls = {"n": 0}

        def sometimes_wrong() -> bool:
            calls["n"] += 1
            if calls["n"] == 2:
                raise TimeoutError("no answer")
            return True

        t0 = time.monotonic()
        report = probe({"health": lambda: httpx.get(f"http://127.0.0.1:{port}/", timeout=2).status_code == 200,
                        "flaky": sometimes_wrong}, {"http": flood}, seconds=1.5, interval=0.25)
        assert time.monotonic() - t0 < 5
    finally:
        server.shutdown()
        server.server_close()
    health, flaky = report["checks"]["health"], report["checks"]["flaky"]
    assert health["answered"] == health["tries"] == health["within_2s"] >= 4
    assert flaky["answered"] == flaky["tries"] - 1 and flaky["failures"] == ["TimeoutError: no answer"]
    # the server's header timeout closed sockets; the flood opened them again and stayed at 12
    assert report["floods"]["http"]["sockets"] == 12 and report["floods"]["http"]["reopened_after_server_close"] >= 12
    assert all(s is None or s.fileno() == -1 for s in flood.socks)  # all closed at the end
    assert "| health |" in render(report)
