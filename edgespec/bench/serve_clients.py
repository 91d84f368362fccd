"""The serving benchmark's clients: one streamed, greedy request to a system, recorded as a
`Trace` (submission time, every chunk's arrival time and token count, the server's own stats).

- edgespec: the daemon's gRPC `GenerateStream`, the prompt sent as a chat message (the daemon
  applies the target's chat template), speculation mode AUTO or OFF (plain decoding).
- llama-server: its HTTP `/completion` with `stream: true`, the prompt sent as the very token ids
  the edgespec daemon's `Tokenize` gives for that chat message, `cache_prompt` as the run's
  prompt cache (false unless `--prompt-cache`), temperature 0, `n_predict` = max tokens.

EOS ends a request in both, unless the run sets `ignore_eos` (`--ignore-eos`): then both get
`ignore_eos: true` (the daemon's `sampling.ignore_eos`, llama-server's own field), both ban the
end-of-generation tokens, and every request runs to max tokens: equal work in both systems.

Both read their stream on the calling thread; one client object serves many threads.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

from edgespec.bench.serve_stats import Trace

EDGESPEC_MODES = ("auto", "plain")
OnChunk = Callable[[Trace], None]  # called on the reading thread after each chunk with tokens


class EdgespecClient:
    """Streams from an edgespec daemon at `addr` (loopback, plaintext)."""

    def __init__(self, addr: str, mode: str, *, timeout: float = 600.0, token: str = "", ignore_eos: bool = False):
        if mode not in EDGESPEC_MODES:
            raise ValueError(f"mode must be one of {EDGESPEC_MODES}, got {mode!r}")
        from edgespec.proto.edgespec.v1 import inference_pb2_grpc
        from edgespec.server.channel import ClientOptions, open_channel

        self.options = ClientOptions(addr=addr, token=token)
        self.channel = open_channel(self.options)
        self.stub = inference_pb2_grpc.InferenceStub(self.channel)
        self.mode = mode
        self.timeout = timeout
        self.system = f"edgespec-{mode}"
        self.ignore_eos = ignore_eos

    def close(self) -> None:
        self.channel.close()

    def wait_ready(self, timeout: float) -> None:
        import grpc

        grpc.channel_ready_future(self.channel).result(timeout=timeout)

    def model_info(self) -> dict[str, Any]:
        from google.protobuf.json_format import MessageToDict

        from edgespec.proto.edgespec.v1 import inference_pb2 as pb

        r = self.stub.ModelInfo(pb.ModelInfoRequest(), timeout=30, metadata=self.options.metadata)
        return MessageToDict(r, preserving_proto_field_name=True)

    def draft_stats(self) -> dict[str, Any]:
        """What the daemon's drafts did so far (Admin.Stats): tokens proposed and accepted by
        source, the suffix cache's and the prompt store's figures."""
        from edgespec.proto.edgespec.v1 import admin_pb2, admin_pb2_grpc

        r = admin_pb2_grpc.AdminStub(self.channel).Stats(admin_pb2.StatsRequest(), timeout=30,
                                                         metadata=self.options.metadata)

        def ticks(prefix: str) -> dict[str, float]:
            return {k.removeprefix(prefix): v for k, v in r.tick_totals.items() if k.startswith(prefix)}

        return {"proposed_by_source": dict(r.proposed_by_source), "accepted_by_source": dict(r.accepted_by_source),
                "suffix_cache": dict(r.suffix_cache), "requests_by_drafter": ticks("drafter_requests_"),
                "prompt_store": ticks("prompt_store_")}

    def chat_tokens(self, prompt: str) -> list[int]:
        """The prompt as the daemon tokenizes a user chat message (template applied)."""
        from edgespec.proto.edgespec.v1 import inference_pb2 as pb

        req = pb.TokenizeRequest()
        req.messages.add(role="user", content=prompt)
        return list(self.stub.Tokenize(req, timeout=60, metadata=self.options.metadata).token_ids)

    def request(self, prompt: str, max_tokens: int) -> Any:
        """The GenerateRequest of one benchmark request: greedy, the run's mode and ignore_eos."""
        from edgespec.proto.edgespec.v1 import inference_pb2 as pb

        req = pb.GenerateRequest()
        req.messages.add(role="user", content=prompt)
        req.sampling.temperature = 0.0
        req.sampling.max_tokens = max_tokens
        if self.ignore_eos:
            req.sampling.ignore_eos = True
        req.speculation.mode = pb.AUTO if self.mode == "auto" else pb.OFF
        return req

    def stream(self, prompt_id: str, prompt: str, max_tokens: int, tokens: Sequence[int] = (),
               on_chunk: OnChunk | None = None) -> Trace:
        import grpc

        from edgespec.proto.edgespec.v1 import inference_pb2 as pb

        req = self.request(prompt, max_tokens)
        tr = Trace(system=self.system, prompt_id=prompt_id, submitted=time.perf_counter())
        try:
            for chunk in self.stub.GenerateStream(req, timeout=self.timeout, metadata=self.options.metadata):
                now = time.perf_counter()
                if chunk.token_ids:
                    tr.arrivals.append((now, len(chunk.token_ids)))
                    if on_chunk is not None:
                        on_chunk(tr)
                if chunk.finish_reason:
                    tr.finish_reason = pb.FinishReason.Name(chunk.finish_reason).lower()
                    tr.completion_tokens = chunk.usage.completion_tokens
                    tr.prompt_tokens = chunk.usage.prompt_tokens
                    s = chunk.speculation
                    tr.speculation = {"tau": s.tau, "target_forwards": s.target_forwards,
                                      "draft_forwards": s.draft_forwards, "drafted_tokens": s.drafted_tokens,
                                      "accepted_tokens": s.accepted_tokens}
        except grpc.RpcError as exc:
            tr.error = f"{exc.code().name}: {exc.details()}"
        except ValueError as exc:  # the channel closed under a running client (the bench was interrupted)
            tr.error = str(exc)
        return tr


class LlamaServerClient:
    """Streams from llama.cpp's llama-server at http://127.0.0.1:`port`."""

    def __init__(self, port: int, system: str, *, timeout: float = 600.0, cache_prompt: bool = False,
                 ignore_eos: bool = False):
        self.port = port
        self.system = system
        self.timeout = timeout
        # llama-server reuses the prefix its slot already holds (`cache_prompt`), as the daemon's
        # prompt cache does
        self.cache_prompt = cache_prompt
        self.ignore_eos = ignore_eos  # llama-server bans the end-of-generation tokens (its logit_bias_eog)

    def close(self) -> None:
        pass

    def health(self) -> int:
        """HTTP status of GET /health (200 once the model is loaded; 503 while loading)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("GET", "/health")
            r = conn.getresponse()
            r.read()
            return r.status
        finally:
            conn.close()

    def body(self, tokens: Sequence[int], max_tokens: int) -> dict[str, Any]:
        """The /completion body of one benchmark request: greedy, the run's cache_prompt and ignore_eos."""
        return {"prompt": list(tokens), "n_predict": max_tokens, "stream": True, "cache_prompt": self.cache_prompt,
                "temperature": 0.0, "seed": 0, "ignore_eos": self.ignore_eos}

    def stream(self, prompt_id: str, prompt: str, max_tokens: int, tokens: Sequence[int] = (),
               on_chunk: OnChunk | None = None) -> Trace:
        if not tokens:
            raise ValueError("llama-server requests take the prompt as token ids (the edgespec daemon's Tokenize)")
        body = json.dumps(self.body(tokens, max_tokens)).encode()
        tr = Trace(system=self.system, prompt_id=prompt_id, submitted=time.perf_counter(), prompt_tokens=len(tokens))
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
        try:
            conn.request("POST", "/completion", body=body, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                tr.error = f"HTTP {resp.status}: {resp.read()[:300].decode(errors='replace')}"
                return tr
            for raw in resp:
                now = time.perf_counter()
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                event = json.loads(payload)
                n = len(event.get("tokens") or ())
                if n and not event.get("stop"):
                    tr.arrivals.append((now, n))
                    if on_chunk is not None:
                        on_chunk(tr)
                if event.get("stop"):
                    _final(tr, event)
                    break
        except (OSError, http.client.HTTPException, json.JSONDecodeError) as exc:
            tr.error = f"{type(exc).__name__}: {exc}"
        finally:
            conn.close()
        return tr


def _final(tr: Trace, event: dict[str, Any]) -> None:
    """llama-server's last event: its token count, why it stopped, its draft statistics.
    llama-server streams the EOS token as an event and counts it in `tokens_predicted`; edgespec
    emits no token for EOS, so the EOS event and its count are left out here, as there."""
    tr.completion_tokens = int(event.get("tokens_predicted", 0))
    tr.prompt_tokens = int(event.get("tokens_evaluated", tr.prompt_tokens or 0))
    stop = event.get("stop_type", "")
    tr.finish_reason = {"eos": "eos", "limit": "length", "word": "stop"}.get(stop, stop)
    if tr.finish_reason == "eos" and tr.completion_tokens > 0:
        tr.completion_tokens -= 1
        if tr.arrivals:
            at, n = tr.arrivals.pop()
            if n > 1:
                tr.arrivals.append((at, n - 1))
    timings = event.get("timings") or {}
    if timings.get("draft_n"):
        tr.speculation = {"drafted_tokens": int(timings["draft_n"]),
                          "accepted_tokens": int(timings.get("draft_n_accepted", 0))}
