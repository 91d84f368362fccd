"""The live exactness checks (`edgespec selftest --addr`) report a daemon whose speculative
output differs from its plain output, naming the prompt and the first differing token."""

from __future__ import annotations

from types import SimpleNamespace

from edgespec.proto.edgespec.v1 import inference_pb2 as pb
from edgespec.selftest_live import run_live_checks


class Stub:
    """Greedy outputs per prompt; `broken_mode` flips one token of its output for prompt 1."""

    def __init__(self, broken_mode=None):
        self.broken_mode = broken_mode
        self.calls = []

    def Generate(self, req, timeout=None, metadata=()):  # noqa: N802 - the gRPC method name
        prompt = req.messages[0].content
        mode = pb.SpeculationMode.Name(req.speculation.mode)
        self.calls.append((prompt, mode, req.sampling.temperature))
        out = [len(prompt) % 97, 5, 6, 7]
        if mode == self.broken_mode and prompt.startswith("Extract"):
            out[2] = 99
        return SimpleNamespace(token_ids=out)


def test_a_faithful_daemon_passes_every_check():
    stub = Stub()
    checks = run_live_checks(stub)
    assert all(c.passed for c in checks) and len(checks) == 6
    assert {m for _, m, _ in stub.calls} == {"OFF", "AUTO", "CHAIN", "TREE"}
    assert all(t == 0.0 for _, _, t in stub.calls)


def test_a_daemon_whose_tree_mode_drifts_fails_naming_the_token():
    checks = run_live_checks(Stub(broken_mode="TREE"))
    failed = [c for c in checks if not c.passed]
    assert {c.name for c in failed} == {"greedy_tree_equals_plain_x1", "greedy_tree_equals_plain_x4"}
    assert all("prompt 1 differs from token 2" in c.detail for c in failed)
