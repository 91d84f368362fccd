"""The live exactness checks (`edgespec selftest --addr`) report a daemon whose speculative
output differs from its plain output, naming the prompt and the first differing token."""

from __future__ import annotations

from types import SimpleNamespace

from edgespec.proto.edgespec.v1 import inference_pb2 as pb
from edgespec.selftest_live import live_requests, run_live_checks


class Stub:
    """Greedy outputs per prompt; `broken_mode` flips one token of its output for prompt 1."""

    def __init__(self, broken_mode=None):
        self.broken_mode = broken_mode
        self.calls = []

    def Generate(self, req, timeout=None, metadata=()):  # the gRPC method name
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


def test_levels_modes_and_repeats_each_make_a_check_and_plain_runs_once_per_prompt():
    stub = Stub()
    seen = []
    prompts = ("alpha", "Extract this", "gamma")
    checks = run_live_checks(stub, prompts=prompts, concurrency=(4, 8), modes=("AUTO", "TREE"), repeat=2,
                             progress=seen.append)
    names = [c.name for c in checks]
    assert len(names) == 2 * 2 * 3 and len(set(names)) == len(names)  # repeats x modes x levels {1, 4, 8}
    assert "greedy_tree_equals_plain_x8_r2" in names
    assert sum(1 for _, m, _ in stub.calls if m == "OFF") == len(prompts)
    assert sum(seen) == len(stub.calls) == live_requests(len(prompts), (4, 8), ("AUTO", "TREE"), 2)


def test_a_drift_in_one_repeat_only_fails_that_repeat():
    class Flaky(Stub):
        def Generate(self, req, timeout=None, metadata=()):
            out = super().Generate(req, timeout, metadata)
            if len(self.calls) > 3 + 3 * 2:  # after plain (3) and the first repeat (3 prompts x 2 levels)
                out.token_ids[1] = 42
            return out

    checks = run_live_checks(Flaky(), prompts=("a", "b", "c"), concurrency=2, modes=("CHAIN",), repeat=2)
    assert [c.passed for c in checks] == [True, True, False, False]
    assert "prompt 0 differs from token 1" in checks[2].detail


def test_the_cli_names_a_bad_option_before_calling_the_daemon():
    from typer.testing import CliRunner

    from edgespec.cli.main import app

    runner = CliRunner()
    for args, name in ((["--concurrency", "1,x"], "--concurrency"), (["--modes", "auto,warp"], "--modes"),
                       (["--concurrency", "0"], "--concurrency")):
        out = runner.invoke(app, ["selftest", "--addr", "127.0.0.1:9", *args])
        assert out.exit_code == 2 and name in out.output, out.output
    out = runner.invoke(app, ["selftest", "--addr", "127.0.0.1:9", "--suite", "no-such-suite"])
    assert out.exit_code != 0 and "suite" in out.output
