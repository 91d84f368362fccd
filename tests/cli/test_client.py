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


def test_exit_codes_tell_usage_from_a_dead_daemon_from_refused_credentials(make_daemon, tmp_path):
    gone = make_daemon()
    dead = gone.addr
    gone.daemon.shutdown(grace=0)  # a daemon that was there and died: nothing listens on its port
    r = runner.invoke(app, ["client", "generate", "Hi", "--addr", dead, "--timeout", "10"])
    assert r.exit_code == 3 and f"UNAVAILABLE ({dead})" in r.output, r.output
    assert runner.invoke(app, ["health", "--addr", dead]).exit_code == 3
    assert runner.invoke(app, ["stats", "--addr", dead]).exit_code == 3
    r = runner.invoke(app, ["client", "generate", "Hi", "--addr", "127.0.0.1:1,oops"])
    assert r.exit_code == 2 and "--addr: expected host:port" in r.output
    assert runner.invoke(app, ["client", "generate", "Hi", "--ca", str(tmp_path / "none.pem")]).exit_code == 2
    assert runner.invoke(app, ["client", "generate"]).exit_code == 2  # missing argument (click)

    tokens = tmp_path / "tokens"
    tokens.write_text(hash_token("t") + "\n")
    d = make_daemon(auth={"tokens_file": str(tokens)})
    r = runner.invoke(app, ["client", "generate", "Hi", "--addr", d.addr, "--token", "wrong"])
    assert r.exit_code == 4 and "UNAUTHENTICATED" in r.output
    assert runner.invoke(app, ["stats", "--addr", d.addr, "--token", "t"]).exit_code == 4  # not an admin token
    assert runner.invoke(app, ["client", "generate", "Hi", "--addr", d.addr, "--token", "t"]).exit_code == 0
    d.daemon._drain(True)
    assert runner.invoke(app, ["health", "--addr", d.addr]).exit_code == 1  # answered: NOT_SERVING


def test_client_takes_several_addresses(make_daemon):
    """One request per invocation goes to one healthy replica (balancing: test_balancing.py)."""
    a, b = make_daemon(), make_daemon()
    b.daemon._drain(True)  # NOT_SERVING: skipped
    for _ in range(3):
        r = runner.invoke(app, ["client", "generate", "Hi", "--max-tokens", "2", "--addr", f"{b.addr},{a.addr}"])
        assert r.exit_code == 0, r.output
    assert len(a.engine.requests) == 3 and not b.engine.requests


def test_shell_completion_is_available():
    import os
    import subprocess
    import sys
    from pathlib import Path

    exe = Path(sys.executable).parent / "edgespec"
    # the script `--show-completion` prints, asked for by name: `--show-completion` itself detects the
    # shell from the process tree, which under a test runner may hold no shell at all
    r = subprocess.run([exe], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "_EDGESPEC_COMPLETE": "source_bash"})
    assert r.returncode == 0 and "_EDGESPEC_COMPLETE" in r.stdout
    env = {**os.environ, "_EDGESPEC_COMPLETE": "complete_bash", "COMP_WORDS": "edgespec mod", "COMP_CWORD": "1"}
    r = subprocess.run([exe], capture_output=True, text=True, env=env, timeout=60)
    assert "models" in r.stdout.split()
