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
