"""`edgespec bench-serve` argument errors: one line, exit 2, before any server starts."""

import pytest
from typer.testing import CliRunner

from edgespec.cli.main import app


@pytest.fixture()
def invoke():
    runner = CliRunner()

    def _invoke(*args):
        return runner.invoke(app, ["bench-serve", *args])

    return _invoke


def test_registered(invoke):
    res = invoke("--help")
    assert res.exit_code == 0 and "--concurrency" in res.output and "--llama-server-bin" in res.output


@pytest.mark.parametrize("args, needle", [
    (("--concurrency", "1,x"), "concurrency: expected comma-separated integers"),
    (("--concurrency", "0,2"), "concurrency: expected distinct integers in [1, 64]"),
    (("--modes", "auto,tree"), "modes: must be among auto, plain, got 'tree'"),
    (("--requests", "2", "--rounds", "3"), "rounds: must be <= requests (2), got 3"),
    (("--max-tokens", "0"), "max_tokens: must be >= 1, got 0"),
])
def test_bad_arguments(invoke, args, needle):
    res = invoke(*args)
    assert res.exit_code == 2 and needle in res.output


def test_llama_server_bin_needs_the_binary(invoke, tmp_path):
    res = invoke("--llama-server-bin", str(tmp_path))
    assert res.exit_code == 2 and "llama-server not found" in res.output and "tools/llama-anchor.sh build" in res.output


def test_without_draft_the_daemon_drafts_with_its_own_default_at_each_level(monkeypatch, tmp_path):
    """No --draft: each level's daemon gets what the daemon would pick with [draft] path unset
    (the shipped head where its card measured it faster at that parallelism); --draft wins."""
    import edgespec.models as M
    from edgespec.cli.bench_serve import _Starter

    monkeypatch.setattr(M, "choose_default_draft", lambda target, n, directory=None: M.HEAD_NAME if n == 1 else None)
    common = dict(addr=None, target=str(tmp_path / "t.gguf"), draft=str(tmp_path / "d.gguf"), threads=2,
                  n_gpu_layers=0, max_tokens=16, systems=["edgespec-auto"], llama_bin=None, draft_max=4, workdir=tmp_path)
    s = _Starter(**common, daemon_default_draft=True)
    assert s.daemon_draft(1) == str(tmp_path / M.HEAD_NAME) and s.daemon_draft(4) == str(tmp_path / "d.gguf")
    assert _Starter(**common).daemon_draft(1) == str(tmp_path / "d.gguf")
