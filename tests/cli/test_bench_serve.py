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


def test_without_draft_the_daemon_loads_the_installed_head_beside_the_q8_draft(monkeypatch, tmp_path):
    """No --draft: each level's daemon gets the Q8_0 draft and, as `[draft] head`, what the daemon
    would load with [draft] path unset (the head installed for the target); --draft alone: no
    head; --head wins either way."""
    import edgespec.models as M
    from edgespec.bench.serve_systems import daemon_sections
    from edgespec.cli.bench_serve import _Starter

    monkeypatch.setattr(M, "installed_head", lambda target, directory=None: tmp_path / M.HEAD_NAME)
    common = dict(addr=None, target=str(tmp_path / "t.gguf"), draft=str(tmp_path / "d.gguf"), threads=2,
                  n_gpu_layers=0, max_tokens=16, systems=["edgespec-auto"], llama_bin=None, draft_max=4, workdir=tmp_path)
    assert _Starter(**common, daemon_default_draft=True).daemon_head() == str(tmp_path / M.HEAD_NAME)
    assert _Starter(**common).daemon_head() == "none"
    assert _Starter(**common, head="h.gguf").daemon_head() == "h.gguf"
    sections = daemon_sections(target="t", draft="d", parallel=1, n_ctx=512, threads=1, max_tokens=8, head="h.gguf")
    assert sections["draft"]["head"] == "h.gguf"
