"""The llama-server client's reading of an SSE stream, against a stdlib HTTP server on loopback
that answers as llama-server's /completion does (one event per token, a final event with the
count, the stop type and the draft statistics)."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from edgespec.bench.serve_clients import LlamaServerClient

EVENTS = [
    {"content": "Hel", "tokens": [10], "stop": False},
    {"content": "", "tokens": [], "stop": False},  # a held-back partial character: no token
    {"content": "lo", "tokens": [11], "stop": False},
    {"content": "", "tokens": [], "stop": True, "tokens_predicted": 2, "tokens_evaluated": 3, "stop_type": "limit",
     "timings": {"draft_n": 4, "draft_n_accepted": 3}},
]


class Handler(BaseHTTPRequestHandler):
    bodies: list = []

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"{}")

    def do_POST(self):
        Handler.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        if Handler.bodies[-1]["n_predict"] == 0:
            self.send_response(400)
            self.end_headers()
            self.wfile.write(b'{"error": "bad"}')
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for e in EVENTS:
            self.wfile.write(b"data: " + json.dumps(e).encode() + b"\n\n")
            self.wfile.flush()


@pytest.fixture()
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


def test_stream_is_read_token_by_token(server):
    c = LlamaServerClient(server, "llama-server-draft")
    assert c.health() == 200
    seen = []
    tr = c.stream("p", "", 2, tokens=[1, 2, 3], on_chunk=lambda t: seen.append(len(t.arrivals)))
    assert tr.error is None
    assert [n for _, n in tr.arrivals] == [1, 1] and seen == [1, 2]
    assert tr.tokens == 2 and tr.prompt_tokens == 3 and tr.finish_reason == "length"
    assert tr.speculation == {"drafted_tokens": 4, "accepted_tokens": 3}
    body = Handler.bodies[-1]
    assert body["prompt"] == [1, 2, 3] and body["stream"] is True and body["cache_prompt"] is False
    assert body["temperature"] == 0.0 and body["n_predict"] == 2


def test_the_prompt_cache_is_asked_for_when_the_run_has_one(server):
    c = LlamaServerClient(server, "llama-server", cache_prompt=True)
    assert c.stream("p", "", 2, tokens=[1, 2, 3]).error is None
    assert Handler.bodies[-1]["cache_prompt"] is True


def test_eos_is_no_completion_token(server, monkeypatch):
    # llama-server streams the EOS token and counts it; edgespec does neither
    events = EVENTS[:3] + [{"content": "", "tokens": [2], "stop": False},
                           {**EVENTS[3], "tokens_predicted": 3, "stop_type": "eos"}]
    monkeypatch.setattr(f"{__name__}.EVENTS", events)
    tr = LlamaServerClient(server, "llama-server").stream("p", "", 8, tokens=[1])
    assert tr.finish_reason == "eos" and tr.tokens == 2 and [n for _, n in tr.arrivals] == [1, 1]


def test_http_error_is_recorded(server):
    tr = LlamaServerClient(server, "llama-server").stream("p", "", 0, tokens=[1])
    assert tr.error.startswith("HTTP 400") and not tr.arrivals


def test_tokens_are_required():
    with pytest.raises(ValueError):
        LlamaServerClient(1, "x").stream("p", "text", 4)


def test_ignore_eos_reaches_both_systems_requests(server):
    """--ignore-eos: llama-server's /completion body and the daemon's GenerateRequest both carry
    it (equal work: every request of both runs to max tokens); off by default in both."""
    from edgespec.bench.serve_clients import EdgespecClient

    for flag in (False, True):
        assert LlamaServerClient(server, "llama-server", ignore_eos=flag).stream("p", "", 2, tokens=[1]).error is None
        assert Handler.bodies[-1]["ignore_eos"] is flag
        c = EdgespecClient("127.0.0.1:1", "auto", ignore_eos=flag)  # the channel connects lazily: no daemon needed
        try:
            req = c.request("hi", 7)
        finally:
            c.close()
        assert req.sampling.HasField("ignore_eos") is flag and req.sampling.ignore_eos is flag
        assert req.sampling.max_tokens == 7 and req.sampling.temperature == 0.0
