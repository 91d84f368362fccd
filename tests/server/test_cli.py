"""`edgespec config ...` and the client commands against a fake-engine daemon."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from edgespec.cli.main import app
from edgespec.server.auth import hash_token

runner = CliRunner()


def test_config_validate(tmp_path):
    ok = runner.invoke(app, ["config", "validate", "configs/edgespec.toml", "--no-check-models"])
    assert ok.exit_code == 0, ok.output
    bad = tmp_path / "bad.toml"
    bad.write_text("[server]\nport = -1\nqueue_size = -2\n")
    r = runner.invoke(app, ["config", "validate", str(bad), "--no-check-models"])
    assert r.exit_code == 2
    assert "2 problem(s)" in r.output and "server.port" in r.output and "server.queue_size" in r.output


def test_hash_token():
    r = runner.invoke(app, ["config", "hash-token", "s3cret"])
    assert r.exit_code == 0 and r.output.strip() == hash_token("s3cret")


def test_client_commands(make_daemon):
    d = make_daemon()
    addr = ["--addr", d.addr]
    r = runner.invoke(app, ["health", *addr])
    assert r.exit_code == 0 and "SERVING" in r.output
    r = runner.invoke(app, ["client", "generate", "Hi", "--max-tokens", "3", *addr])
    assert r.exit_code == 0 and "alpha beta gamma" in r.output
    r = runner.invoke(app, ["client", "stream", "Hi", "--chat", "--max-tokens", "3", *addr])
    assert r.exit_code == 0 and "alpha beta gamma" in r.output
    r = runner.invoke(app, ["client", "generate", "Hi", "--temperature", "-1", *addr])
    assert r.exit_code == 2 and "INVALID_ARGUMENT: sampling.temperature" in r.output
    r = runner.invoke(app, ["stats", *addr])
    assert r.exit_code == 0 and '"generated_tokens_total": "6"' in r.output
    r = runner.invoke(app, ["policy", "--speculation", "off", *addr])
    assert r.exit_code == 0 and "SPECULATION_POLICY_OFF" in r.output
    r = runner.invoke(app, ["policy", "--reset", *addr])  # the config's values again
    assert r.exit_code == 0 and "SPECULATION_POLICY_AUTO" in r.output


def test_serve_names_a_bad_field_once_and_exits_2():
    r = runner.invoke(app, ["serve", "--host", "0.0.0.0", "--port", "0"])
    assert r.exit_code == 2
    assert r.output.count("server.host") == 1 and "error: server.host: 0.0.0.0 is not" in r.output


@pytest.mark.slow
def test_config_validate_refuses_a_plan_that_does_not_fit(tmp_path, demo_pair):
    """Exit 2 naming the field, before anything binds (serve runs the same check first)."""
    cfg = tmp_path / "huge.toml"
    cfg.write_text(f'[server]\nparallel = 64\n[target]\npath = "{demo_pair.target}"\nn_ctx = 1048576\n'
                   f'[draft]\npath = "{demo_pair.draft}"\nn_ctx = 1048576\n')
    r = runner.invoke(app, ["config", "validate", str(cfg)])
    assert r.exit_code == 2 and "target.n_ctx: with server.parallel = 64, the memory plan does NOT fit" in r.output
    s = runner.invoke(app, ["serve", "--config", str(cfg), "--port", "0"])
    assert s.exit_code == 2 and "target.n_ctx" in s.output and "SERVING" not in s.output
