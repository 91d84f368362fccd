"""Daemon config: every problem listed by key, env overrides, the shipped file documents every key."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from edgespec.server.config import InvalidConfig, load
from edgespec.settings import SECTIONS

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_are_valid_and_loopback():
    cfg = load(None, env={})
    assert (cfg.server.host, cfg.server.port, cfg.server.reflection) == ("127.0.0.1", 50051, False)
    assert cfg.engine.target.path.endswith("SmolLM2-135M-Instruct.F32.gguf")
    assert cfg.engine.draft.path.endswith("SmolLM2-135M-Instruct.Q8_0.gguf")
    assert cfg.engine.draft_window == 256


def test_every_problem_is_listed_with_its_key(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text('[server]\nport = 70000\nparallel = "two"\nwat = 1\n[tls]\nkey = "/nonexistent.pem"\n'
                 '[speculation]\npolicy = "sometimes"\n[nosuch]\nx = 1\n[controller]\nwindow = -3\n'
                 '[draft]\nwindow = 8\n')
    with pytest.raises(InvalidConfig) as e:
        load(f, env={})
    keys = [k for k, _ in e.value.problems]
    for key in ("server.port", "server.parallel", "server.wat", "tls.key", "speculation.policy", "nosuch",
                "controller.window", "draft.window"):
        assert key in keys, (key, e.value.problems)
    msgs = dict(e.value.problems)
    assert "[0, 65535]" in msgs["server.port"] and "auto, off" in msgs["speculation.policy"]
    assert "[16, 1048576]" in msgs["draft.window"]


def test_env_then_flags_override_file(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[server]\nport = 1000\nparallel = 3\n")
    cfg = load(f, env={"EDGESPEC_SERVER_PORT": "2000", "EDGESPEC_LOGGING_JSON": "true", "EDGESPEC_HOME": "/x"},
               overrides={"server": {"parallel": 4}})
    assert (cfg.server.port, cfg.server.parallel, cfg.engine.parallel, cfg.logging.json) == (2000, 4, 4, True)
    with pytest.raises(InvalidConfig) as e:
        load(f, env={"EDGESPEC_SERVER_PORT": "many", "EDGESPEC_SERVER_NOPE": "1"})
    assert {k.split(" ")[0] for k, _ in e.value.problems} == {"server.port", "server.nope"}


def test_non_loopback_without_tokens_needs_insecure(tmp_path):
    with pytest.raises(InvalidConfig) as e:
        load(None, env={}, overrides={"server": {"host": "0.0.0.0"}})
    assert e.value.problems[0][0] == "server.host" and "--insecure" in e.value.problems[0][1]
    assert load(None, env={}, overrides={"server": {"host": "0.0.0.0", "insecure": True}}).server.insecure
    tokens = tmp_path / "t"
    tokens.write_text("a" * 64 + "\n")
    assert load(None, env={}, overrides={"server": {"host": "0.0.0.0"}, "auth": {"tokens_file": str(tokens)}})
    tokens.write_text("not-a-hash\n")
    with pytest.raises(InvalidConfig) as e:
        load(None, env={}, overrides={"auth": {"tokens_file": str(tokens)}})
    assert e.value.problems[0][0] == "auth.tokens_file"


def test_shipped_config_documents_every_key_and_validates():
    path = ROOT / "configs" / "edgespec.toml"
    text = path.read_text()
    data = tomllib.loads(text)
    lines = text.splitlines()
    for section, keys in SECTIONS.items():
        if section == "controller":  # the shipped file leaves [controller] at its defaults (docs/configuration.md)
            continue
        assert section in data, section
        for key in keys:
            assert key in data[section], f"{section}.{key} missing from configs/edgespec.toml"
            i = next(n for n, line in enumerate(lines) if line.startswith(f"{key} ="))
            assert lines[i - 1].startswith("#"), f"{section}.{key} has no comment"
    load(path, env={})


def test_non_loopback_metrics_without_tokens_needs_insecure(tmp_path):
    """The gRPC rule, for /metrics too: it answers anyone who can reach it unless tokens are set."""
    with pytest.raises(InvalidConfig) as e:
        load(None, env={}, overrides={"metrics": {"enabled": True, "host": "0.0.0.0"}})
    assert e.value.problems[0][0] == "metrics.host" and "--insecure" in e.value.problems[0][1]
    assert load(None, env={}, overrides={"metrics": {"enabled": True, "host": "0.0.0.0"},
                                         "server": {"insecure": True}}).metrics.host == "0.0.0.0"
    tokens = tmp_path / "t"
    tokens.write_text("a" * 64 + "\n")
    assert load(None, env={}, overrides={"metrics": {"enabled": True, "host": "0.0.0.0"},
                                         "auth": {"tokens_file": str(tokens)}})
    assert load(None, env={}, overrides={"metrics": {"host": "0.0.0.0"}})  # not enabled: nothing listens


def test_one_problem_names_its_field_once():
    with pytest.raises(InvalidConfig) as e:
        load(None, env={}, overrides={"server": {"host": "0.0.0.0"}})
    assert str(e.value).count("server.host") == 1 and str(e.value).startswith("server.host: 0.0.0.0 is not")
    assert e.value.key == "server.host"


def test_limits_section(tmp_path):
    cfg = load(None, env={"EDGESPEC_LIMITS_MAX_MESSAGES": "7"})
    assert (cfg.limits.max_messages, cfg.limits.max_prompt_bytes, cfg.limits.anonymous_rpcs) == (7, 1 << 20, 8)
    with pytest.raises(InvalidConfig) as e:
        load(None, env={}, overrides={"limits": {"max_stop_strings": 17, "anonymous_rpcs": 0}})
    msgs = dict(e.value.problems)
    assert "[0, 16]" in msgs["limits.max_stop_strings"] and "[1, 1024]" in msgs["limits.anonymous_rpcs"]


@pytest.mark.slow
def test_an_impossible_memory_plan_is_a_config_error(demo_pair):
    """n_ctx = 2^20 validated ok and `serve` bound its port, then exited 1 seconds later."""
    env = {"EDGESPEC_TARGET_PATH": str(demo_pair.target), "EDGESPEC_DRAFT_PATH": str(demo_pair.draft)}
    with pytest.raises(InvalidConfig) as e:
        load(None, env={**env, "EDGESPEC_TARGET_N_CTX": str(1 << 20), "EDGESPEC_DRAFT_N_CTX": str(1 << 20),
                        "EDGESPEC_SERVER_PARALLEL": "64"}, check_models=True)
    key, message = e.value.problems[0]
    assert key == "target.n_ctx" and "does NOT fit" in message and "server.parallel = 64" in message
    assert load(None, env=env, check_models=True)  # the demo config fits
    load(None, env={**env, "EDGESPEC_TARGET_N_CTX": str(1 << 20), "EDGESPEC_DRAFT_N_CTX": str(1 << 20),
                    "EDGESPEC_SERVER_PARALLEL": "64"}, check_models=False)  # without models: not checked
def test_rpc_servers_are_host_ports_and_need_offloaded_layers():
    from edgespec.server.config import InvalidConfig, load

    cfg = load(None, env={}, overrides={"target": {"rpc_servers": ["10.0.0.7:50052", "[::1]:50053"], "n_gpu_layers": -1}})
    assert cfg.rpc_servers == ("10.0.0.7:50052", "[::1]:50053")
    with pytest.raises(InvalidConfig, match="target.rpc_servers: must be a list of host:port, got '10.0.0.7'"):
        load(None, env={}, overrides={"target": {"rpc_servers": ["10.0.0.7"], "n_gpu_layers": -1}})
    with pytest.raises(InvalidConfig, match="target.n_gpu_layers: must be -1"):
        load(None, env={}, overrides={"target": {"rpc_servers": ["10.0.0.7:50052"]}})
    with pytest.raises(InvalidConfig, match="draft.rpc_servers: unknown key"):
        load(None, env={}, overrides={"draft": {"rpc_servers": ["10.0.0.7:50052"]}})


def test_engine_errors_name_the_toml_key_a_user_writes():
    """EngineConfig.validate named an [engine] section that does not exist (engine.parallel)."""
    from dataclasses import replace

    from edgespec.errors import ConfigError

    engine = load(None, env={}).engine
    for change, key in (({"parallel": 65}, "server.parallel"), ({"draft_window": 8}, "draft.window"),
                        ({"prompt_cache": "yes"}, "server.prompt_cache"), ({"prefill_share": -1.0}, "server.prefill_share"),
                        ({"max_tree_leaves": 0}, "server.max_tree_leaves"),
                        ({"constraint_share": 1.0}, "limits.constraint_share"),
                        ({"constraint_tick_seconds": 0.0}, "limits.constraint_tick_seconds"),
                        ({"constraint_wait_seconds": 0.0}, "limits.constraint_wait_seconds")):
        with pytest.raises(ConfigError) as e:
            replace(engine, **change).validate()
        assert e.value.key == key and str(e.value).startswith(f"{key}: must be"), (change, str(e.value))
    with pytest.raises(ConfigError, match=r"^draft.n_ctx: must be in \[128, 1048576\], got 64$"):
        replace(engine, draft=replace(engine.draft, n_ctx=64)).validate()


def test_every_default_comes_from_the_one_declaration():
    import inspect

    from edgespec.cli.generate import generate
    from edgespec.controller import ControllerConfig
    from edgespec.server.policy import Policy
    from edgespec.settings import SAMPLING
    from edgespec.types import SpeculationParams

    spec = SECTIONS["speculation"]
    cfg = load(None, env={})
    assert asdict_(cfg.speculation) == {k: s.default for k, s in spec.items()}
    assert asdict_(ControllerConfig()) == {k: s.default for k, s in SECTIONS["controller"].items()}
    assert Policy.from_config(cfg.speculation, cfg.server) == Policy()
    params = inspect.signature(generate).parameters
    for key in ("draft_tokens", "tree_nodes", "tree_depth", "ngram"):
        assert getattr(SpeculationParams(), key) == getattr(Policy(), key) == spec[key].default == params[key].default
    for key in ("temperature", "top_k", "top_p", "min_p", "seed", "max_tokens"):
        assert params[key].default == SAMPLING[key].default
    for key in ("n_ctx", "n_gpu_layers", "threads"):
        assert params[key].default == SECTIONS["target"][key].default == getattr(cfg.engine.target, key)


def asdict_(obj: object) -> dict:
    from dataclasses import asdict

    return asdict(obj)


def test_the_grammar_mask_limits_reach_the_engine_and_are_checked_by_name():
    engine = load(None, env={"EDGESPEC_LIMITS_CONSTRAINT_SHARE": "0.1"},
                  overrides={"limits": {"constraint_burst_seconds": 1.5, "constraint_wait_seconds": 5}}).engine
    assert (engine.constraint_share, engine.constraint_burst_seconds, engine.constraint_wait_seconds) == (0.1, 1.5, 5)
    with pytest.raises(InvalidConfig, match=r"limits.constraint_step_seconds: must be in \(0, 60\], got -1"):
        load(None, env={}, overrides={"limits": {"constraint_step_seconds": -1}})
