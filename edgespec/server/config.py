"""The daemon's configuration: TOML file -> environment (EDGESPEC_<SECTION>_<KEY>) -> CLI flags.

Every key is declared once in SCHEMA (type, default, check, doc); `load()` validates everything
and reports *every* problem with its key name (InvalidConfig.problems), then builds frozen
dataclasses. Each component receives only its own section.
"""

from __future__ import annotations

import ipaddress
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from edgespec.config import KV_TYPES, EngineConfig, ModelConfig, models_dir
from edgespec.errors import ConfigError
from edgespec.sampling import MAX_STOP_STRINGS
from edgespec.types import MAX_DRAFT_TOKENS, MAX_TREE_DEPTH, MAX_TREE_NODES

DEMO_TARGET = "SmolLM2-135M-Instruct.F32.gguf"
DEMO_DRAFT = "SmolLM2-135M-Instruct.Q8_0.gguf"
POLICIES = ("auto", "off")
SPEC_MODES = ("auto", "off", "plain", "chain", "tree")
PASSTHROUGH_SECTIONS = ("controller",)  # validated by their owners


class InvalidConfig(ConfigError):
    """One or more config problems; `problems` is a list of (key, message)."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        self.key = problems[0][0] if len(problems) == 1 else "config"
        # every problem already says its key: no "key: " prefix of ConfigError's (it doubled the field)
        Exception.__init__(self, "; ".join(f"{k}: {m}" for k, m in problems))


# ---- checks: return an error message or None -------------------------------------------------


def _range(lo: float | None, hi: float | None) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            return f"must be in [{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}], got {v!r}"
        return None

    return check


def _one_of(*choices: str) -> Callable[[Any], str | None]:
    return lambda v: None if v in choices else f"must be one of {', '.join(choices)}, got {v!r}"


def _host(v: str) -> str | None:
    if not v:
        return "must not be empty"
    if v == "localhost":
        return None
    try:
        ipaddress.ip_address(v.strip("[]"))
    except ValueError:
        if not all(part and part.replace("-", "").isalnum() for part in v.split(".")):
            return f"is not an IP address or host name: {v!r}"
    return None


def _file_or_empty(v: str) -> str | None:
    if v and not Path(v).expanduser().is_file():
        return f"file not found: {v}"
    return None


def _strings(v: list) -> str | None:
    bad = [x for x in v if not isinstance(x, str) or not x.strip()]
    return f"must be a list of non-empty strings, got {bad[0]!r}" if bad else None


def _endpoints(v: list) -> str | None:
    for x in v:
        host, sep, port = str(x).rpartition(":") if isinstance(x, str) else ("", "", "")
        if not sep or not port.isdigit() or not 0 < int(port) < 65536 or _host(host.strip("[]")):
            return f"must be a list of host:port, got {x!r}"
    return None


def _json_mode(v: Any) -> str | None:
    return None if v in ("auto", True, False) else f"must be \"auto\", true or false, got {v!r}"


# section -> key -> (type(s), default, check, documentation)
Schema = dict[str, dict[str, tuple[tuple[type, ...], Any, Callable[[Any], str | None] | None, str]]]

_MODEL_KEYS = {
    "path": ((str,), "", _file_or_empty, "GGUF file; empty = the demo model from `edgespec models prepare-demo`"),
    "n_gpu_layers": ((int,), 0, _range(-1, None), "layers offloaded to the GPU (-1 = all; CUDA builds only)"),
    "n_ctx": ((int,), 4096, _range(128, 1 << 20), "context length in tokens (prompt + output)"),
    "n_batch": ((int,), 512, _range(1, 1 << 16), "llama.cpp batch size for prompt processing"),
    "threads": ((int,), 0, _range(0, 1024), "CPU threads (0 = all cores)"),
    "flash_attn": ((bool,), True, None, "use flash attention (its logits do not depend on the other requests' cells "
                   "in the shared cache; off: ~1e-2 differences between cache layouts)"),
    "kv_type": ((str,), "f16", _one_of(*KV_TYPES), "KV cache type"),
}

SCHEMA: Schema = {
    "server": {
        "host": ((str,), "127.0.0.1", _host, "address to listen on"),
        "port": ((int,), 50051, _range(0, 65535), "TCP port (0 = pick a free one)"),
        "reflection": ((bool,), False, None, "enable gRPC server reflection"),
        "insecure": ((bool,), False, None, "allow a non-loopback address without auth tokens"),
        "max_message_bytes": ((int,), 4 << 20, _range(1024, 1 << 30), "largest request/response message"),
        "grace_seconds": ((int, float), 30.0, _range(0, 3600), "SIGTERM: time in-flight requests get to finish"),
        "parallel": ((int,), 2, _range(1, 64), "requests decoded at once (engine slots)"),
        "queue_size": ((int,), 16, _range(0, 100000), "requests waiting for a slot; beyond: RESOURCE_EXHAUSTED"),
        "max_tokens": ((int,), 4096, _range(1, 1 << 20), "largest max_tokens a request may ask for"),
        "default_max_tokens": ((int,), 256, _range(1, 1 << 20), "max_tokens when a request leaves it unset"),
        "max_tree_leaves": ((int,), 32, _range(1, 255), "tree leaves a slot may verify at once (sequence ids of "
                            "the shared context; all slots together get at most 256)"),
        "prefill_share": ((int, float), 1.5, _range(0, 100), "a prompt is prefilled in pieces inside the engine "
                          "ticks: beside decoding streams a piece may cost this many times the tick's decode work "
                          "(0 = whole n_batch chunks, the streams wait)"),
        "prompt_cache": ((bool,), True, None, "a slot keeps its last prompt's prefill: a request sharing a "
                         "long prefix prefills only from the last whole n_batch chunk they share; its draft keeps "
                         "(and absorbs while idle) the last context, reusable up to any shared prefix"),
    },
    "target": {
        **_MODEL_KEYS,
        "rpc_servers": ((list,), [], _endpoints, "llama.cpp rpc-servers (host:port) that hold part of the target's "
                        "layers, for a target larger than one box; needs a wheel built with RPC=1 and n_gpu_layers != 0"),
    },
    "draft": {
        **_MODEL_KEYS,
        "enabled": ((bool,), True, None, "false = model-free (n-gram) drafting only"),
        "window": ((int,), 256, _range(16, 1 << 20), "most context tokens the draft absorbs at once: a longer "
                   "prompt is drafted from its last `window` tokens"),
    },
    "speculation": {
        "policy": ((str,), "auto", _one_of(*POLICIES), "auto: honour request modes; off: force plain decoding"),
        "mode": ((str,), "auto", _one_of(*SPEC_MODES), "mode used when a request says AUTO"),
        "draft_tokens": ((int,), 4, _range(1, MAX_DRAFT_TOKENS), "default chain length"),
        "tree_nodes": ((int,), 16, _range(1, MAX_TREE_NODES), "default tree node budget"),
        "tree_depth": ((int,), 6, _range(1, MAX_TREE_DEPTH), "default tree depth"),
        "ngram": ((bool,), True, None, "also draft from prompt n-grams"),
        "max_draft_tokens": ((int,), MAX_DRAFT_TOKENS, _range(1, MAX_DRAFT_TOKENS), "largest draft_tokens a request may ask for"),
        "max_tree_nodes": ((int,), MAX_TREE_NODES, _range(1, MAX_TREE_NODES), "largest tree_nodes a request may ask for"),
        "max_tree_depth": ((int,), MAX_TREE_DEPTH, _range(1, MAX_TREE_DEPTH), "largest tree_depth a request may ask for"),
    },
    "limits": {
        "max_messages": ((int,), 1024, _range(1, 1 << 20), "chat messages in one request (Generate, Tokenize)"),
        "max_prompt_bytes": ((int,), 1 << 20, _range(1, 1 << 30), "largest prompt in UTF-8 bytes: a prompt, "
                             "the chat messages' contents together, or a Tokenize text"),
        "max_stop_strings": ((int,), MAX_STOP_STRINGS, _range(0, MAX_STOP_STRINGS), "stop strings in one request"),
        "max_stop_chars": ((int,), 256, _range(1, 4096), "longest stop string, in characters"),
        "anonymous_rpcs": ((int,), 8, _range(1, 1024), "health calls without a valid token served at once "
                           "(Watch streams included), on threads of their own; beyond: RESOURCE_EXHAUSTED"),
    },
    "auth": {
        "tokens_file": ((str,), "", _file_or_empty, "sha256 hex hashes of bearer tokens, one per line, optionally named: name:hash (`edgespec config hash-token --name N`)"),
        "admin_tokens_file": ((str,), "", _file_or_empty, "hashes of tokens that may also call the Admin service"),
        "admin_subjects": ((list,), [], _strings, "client certificate subjects (\"CN=ops,O=site\") or common names "
                           "that may also call the Admin service (mutual TLS)"),
    },
    "tls": {
        "cert": ((str,), "", _file_or_empty, "server certificate chain (PEM); empty = plaintext"),
        "key": ((str,), "", _file_or_empty, "server private key (PEM)"),
        "client_ca": ((str,), "", _file_or_empty, "CA bundle (PEM) for client certificates; set = mutual TLS required, and a verified certificate is an identity"),
    },
    "http": {
        "enabled": ((bool,), False, None, "serve the OpenAI-compatible HTTP API (same tokens, TLS files and engine as gRPC)"),
        "host": ((str,), "127.0.0.1", _host, "HTTP API address (a non-loopback one needs auth tokens or server.insecure)"),
        "port": ((int,), 8080, _range(0, 65535), "HTTP API port (0 = pick a free one)"),
    },
    "metrics": {
        "enabled": ((bool,), False, None, "serve Prometheus text metrics over HTTP"),
        "host": ((str,), "127.0.0.1", _host, "metrics address (loopback by default)"),
        "port": ((int,), 9464, _range(0, 65535), "metrics port"),
    },
    "logging": {
        "level": ((str,), "info", _one_of("debug", "info", "warning", "error"), "log level"),
        "json": ((str, bool), "auto", _json_mode, "auto: JSON under systemd / without a TTY, console otherwise"),
        "log_text": ((bool,), False, None, "log prompt and output text (off by default)"),
    },
}

POLICY_SECTIONS = ("speculation",)  # what SIGHUP reloads


# ---- frozen sections --------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    reflection: bool = False
    insecure: bool = False
    max_message_bytes: int = 4 << 20
    grace_seconds: float = 30.0
    parallel: int = 2
    queue_size: int = 16
    max_tokens: int = 4096
    default_max_tokens: int = 256
    max_tree_leaves: int = 32
    prefill_share: float = 1.5
    prompt_cache: bool = True

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)


@dataclass(frozen=True)
class SpeculationConfig:
    policy: str = "auto"
    mode: str = "auto"
    draft_tokens: int = 4
    tree_nodes: int = 16
    tree_depth: int = 6
    ngram: bool = True
    max_draft_tokens: int = MAX_DRAFT_TOKENS
    max_tree_nodes: int = MAX_TREE_NODES
    max_tree_depth: int = MAX_TREE_DEPTH


@dataclass(frozen=True)
class LimitsConfig:
    """What one request may ask of the daemon, checked in the gRPC handler before the engine sees it."""

    max_messages: int = 1024
    max_prompt_bytes: int = 1 << 20
    max_stop_strings: int = MAX_STOP_STRINGS
    max_stop_chars: int = 256
    anonymous_rpcs: int = 8


@dataclass(frozen=True)
class AuthConfig:
    tokens_file: str = ""
    admin_tokens_file: str = ""
    admin_subjects: tuple[str, ...] = ()

    @property
    def enabled(self) -> bool:
        return bool(self.tokens_file or self.admin_tokens_file)


@dataclass(frozen=True)
class TlsConfig:
    cert: str = ""
    key: str = ""
    client_ca: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.cert)


@dataclass(frozen=True)
class HttpConfig:
    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = 8080


@dataclass(frozen=True)
class MetricsConfig:
    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = 9464


@dataclass(frozen=True)
class LoggingConfig:
    level: str = "info"
    json: str | bool = "auto"
    log_text: bool = False


@dataclass(frozen=True)
class DaemonConfig:
    server: ServerConfig
    engine: EngineConfig
    speculation: SpeculationConfig
    auth: AuthConfig
    tls: TlsConfig
    metrics: MetricsConfig
    logging: LoggingConfig
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    controller: dict = field(default_factory=dict)  # handed to edgespec.controller as-is
    rpc_servers: tuple[str, ...] = ()  # [target] rpc_servers: registered before the engine loads
    source: str = ""  # the file it came from ("" = defaults only)
    http: HttpConfig = field(default_factory=HttpConfig)


def _check_controller(table: dict[str, Any]) -> list[tuple[str, str]]:
    """The [controller] table belongs to edgespec.controller; ask it (when present) what is wrong."""
    try:
        from edgespec.controller import ControllerConfig
    except ImportError:
        return []
    try:
        ControllerConfig.from_dict(table)
    except ConfigError as exc:
        return [(exc.key, str(exc).split(": ", 1)[-1])]
    except (TypeError, ValueError) as exc:
        return [("controller", str(exc))]
    return []


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# ---- loading ----------------------------------------------------------------------------------


def _coerce_env(raw: str, types: tuple[type, ...]) -> Any:
    """Environment values are strings: convert to the key's type (booleans: 1/0/true/false/yes/no)."""
    if list in types:  # comma-separated
        return [x.strip() for x in raw.split(",") if x.strip()]
    if bool in types:
        low = raw.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        if str in types:
            return raw
        raise ValueError(f"expected a boolean (true/false), got {raw!r}")
    if int in types:
        try:
            return int(raw)
        except ValueError:
            if float in types:
                return float(raw)
            raise ValueError(f"expected an integer, got {raw!r}") from None
    if float in types:
        return float(raw)
    return raw


def env_overrides(env: Mapping[str, str]) -> tuple[dict[str, dict[str, Any]], list[tuple[str, str]]]:
    """EDGESPEC_<SECTION>_<KEY>=value for the sections in SCHEMA (other EDGESPEC_* vars are ignored)."""
    out: dict[str, dict[str, Any]] = {}
    problems: list[tuple[str, str]] = []
    for name, raw in env.items():
        if not name.startswith("EDGESPEC_"):
            continue
        rest = name[len("EDGESPEC_") :].lower()
        section, _, key = rest.partition("_")
        if section not in SCHEMA or not key:
            continue
        where = f"{section}.{key} (env {name})"
        if key not in SCHEMA[section]:
            problems.append((where, "unknown key"))
            continue
        try:
            out.setdefault(section, {})[key] = _coerce_env(raw, SCHEMA[section][key][0])
        except ValueError as exc:
            problems.append((where, str(exc)))
    return out, problems


def read_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path).expanduser()
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise InvalidConfig([(str(path), "file not found")]) from None
    except tomllib.TOMLDecodeError as exc:
        raise InvalidConfig([(str(path), f"not valid TOML: {exc}")]) from None


def _check_sections(raw: Mapping[str, Any], problems: list[tuple[str, str]]) -> dict[str, dict[str, Any]]:
    """Type- and range-check every key; unknown sections/keys are problems too."""
    values: dict[str, dict[str, Any]] = {s: {k: spec[1] for k, spec in keys.items()} for s, keys in SCHEMA.items()}
    for section, table in raw.items():
        if section in PASSTHROUGH_SECTIONS:
            continue
        if section not in SCHEMA:
            problems.append((section, f"unknown section (known: {', '.join([*SCHEMA, *PASSTHROUGH_SECTIONS])})"))
            continue
        if not isinstance(table, Mapping):
            problems.append((section, "must be a table"))
            continue
        for key, value in table.items():
            name = f"{section}.{key}"
            spec = SCHEMA[section].get(key)
            if spec is None:
                problems.append((name, f"unknown key (known: {', '.join(SCHEMA[section])})"))
                continue
            types, _default, check, _doc = spec
            ok_type = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
            if not ok_type:
                want = " or ".join(t.__name__ for t in types)
                problems.append((name, f"must be {want}, got {type(value).__name__} {value!r}"))
                continue
            msg = check(value) if check else None
            if msg:
                problems.append((name, msg))
                continue
            values[section][key] = value
    return values


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in base.items()}
    for section, table in over.items():
        if isinstance(table, Mapping) and isinstance(out.get(section), dict):
            out[section].update(table)
        else:
            out[section] = dict(table) if isinstance(table, Mapping) else table
    return out


def _model(values: dict[str, Any], demo_name: str) -> ModelConfig:
    path = values["path"] or str(models_dir() / demo_name)
    return ModelConfig(
        path=str(Path(path).expanduser()),
        n_gpu_layers=values["n_gpu_layers"],
        n_ctx=values["n_ctx"],
        n_batch=values["n_batch"],
        threads=values["threads"],
        flash_attn=values["flash_attn"],
        kv_type=values["kv_type"],
    )


def load(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    check_models: bool = False,
) -> DaemonConfig:
    """Build the config from file, env and flag overrides; raise InvalidConfig listing every problem.

    `overrides` are CLI flags ({"server": {"port": 1234}}); unset flags must be left out.
    `check_models`: also require the model files to exist and the memory plan to fit the device (the
    daemon does, before it binds its port; `config validate` too).
    """
    problems: list[tuple[str, str]] = []
    raw: dict[str, Any] = read_toml(path) if path else {}
    env_vals, env_problems = env_overrides(os.environ if env is None else env)
    problems += env_problems
    merged = _merge(_merge(raw, env_vals), overrides or {})
    values = _check_sections(merged, problems)
    controller = merged.get("controller", {})
    if not isinstance(controller, Mapping):
        problems.append(("controller", "must be a table"))
        controller = {}
    elif controller:
        problems += _check_controller(dict(controller))

    s = values["server"]
    if s["default_max_tokens"] > s["max_tokens"]:
        problems.append(("server.default_max_tokens", f"must be <= server.max_tokens ({s['max_tokens']})"))
    sp = values["speculation"]
    for dflt, cap in (("draft_tokens", "max_draft_tokens"), ("tree_nodes", "max_tree_nodes"), ("tree_depth", "max_tree_depth")):
        if sp[dflt] > sp[cap]:
            problems.append((f"speculation.{dflt}", f"must be <= speculation.{cap} ({sp[cap]})"))
    tls = values["tls"]
    if bool(tls["cert"]) != bool(tls["key"]):
        problems.append(("tls.key" if tls["cert"] else "tls.cert", "tls.cert and tls.key must be set together"))
    if tls["client_ca"] and not tls["cert"]:
        problems.append(("tls.client_ca", "mutual TLS needs tls.cert and tls.key"))
    auth = AuthConfig(**{**values["auth"], "admin_subjects": tuple(values["auth"]["admin_subjects"])})
    if not (auth.enabled or tls["client_ca"]) and not is_loopback(s["host"]) and not s["insecure"]:
        problems.append(
            ("server.host", f"{s['host']} is not a loopback address and no authentication is configured: "
             "set auth.tokens_file, or tls.client_ca (mutual TLS), or start with --insecure")
        )
    h = values["http"]
    if h["enabled"] and not auth.enabled and not is_loopback(h["host"]) and not s["insecure"]:
        problems.append(
            ("http.host", f"{h['host']} is not a loopback address and no auth tokens are configured: "
             "set auth.tokens_file, or start with --insecure")
        )
    m = values["metrics"]
    if m["enabled"] and not auth.enabled and not is_loopback(m["host"]) and not s["insecure"]:
        problems.append(
            ("metrics.host", f"{m['host']} is not a loopback address and no auth tokens are configured: /metrics "
             "would answer anyone; set auth.tokens_file (scrapers then send a bearer token), or start with --insecure")
        )
    if auth.admin_subjects and not tls["client_ca"]:
        problems.append(("auth.admin_subjects", "certificate subjects need mutual TLS (tls.client_ca)"))
    for key in ("tokens_file", "admin_tokens_file"):
        if values["auth"][key] and not any(problems_key == f"auth.{key}" for problems_key, _ in problems):
            from edgespec.server.auth import read_hashes

            try:
                read_hashes(values["auth"][key])
            except ConfigError as exc:
                problems.append((f"auth.{key}", str(exc).split(": ", 1)[-1]))

    target = _model(values["target"], DEMO_TARGET)
    if values["target"]["rpc_servers"] and values["target"]["n_gpu_layers"] == 0:
        problems.append(("target.n_gpu_layers", "must be -1 (all) or > 0 to place layers on target.rpc_servers"))
    draft_vals = values["draft"]
    draft = _model(draft_vals, DEMO_DRAFT) if draft_vals["enabled"] else None
    if check_models:
        for name, m in (("target", target), ("draft", draft)):
            if m is not None and not Path(m.path).is_file():
                hint = " (run `edgespec models prepare-demo`)" if not values[name]["path"] else ""
                problems.append((f"{name}.path", f"model file not found: {m.path}{hint}"))
    engine = EngineConfig(target=target, draft=draft, parallel=s["parallel"], max_tree_leaves=s["max_tree_leaves"],
                          draft_window=draft_vals["window"], prompt_cache=s["prompt_cache"],
                          prefill_share=float(s["prefill_share"]))
    try:
        engine.validate()
    except ConfigError as exc:
        problems.append((exc.key, str(exc).split(": ", 1)[-1]))
    # the memory plan covers this box only: with rpc_servers the target's layers go to other boxes
    if check_models and not problems and not values["target"]["rpc_servers"]:
        try:
            check_memory(engine)
        except ConfigError as exc:
            problems.append(("target.n_ctx", f"with server.parallel = {engine.parallel}, the memory plan "
                             + str(exc).split(": ", 1)[-1]))

    if problems:
        raise InvalidConfig(problems)
    return DaemonConfig(
        server=ServerConfig(**{**s, "grace_seconds": float(s["grace_seconds"])}),
        engine=engine,
        speculation=SpeculationConfig(**sp),
        auth=auth,
        tls=TlsConfig(**tls),
        metrics=MetricsConfig(**values["metrics"]),
        logging=LoggingConfig(**values["logging"]),
        limits=LimitsConfig(**values["limits"]),
        controller=dict(controller),
        source=str(path or ""),
        http=HttpConfig(**h),
        rpc_servers=tuple(values["target"]["rpc_servers"]),
    )


def check_memory(engine_cfg: EngineConfig) -> None:
    """Refuse, with the memory plan's explanation, a configuration that does not fit the device it
    would run on (GPU memory when layers are offloaded to a GPU, else RAM)."""
    from edgespec.plan import check_fits, plan_for_config, system_memory_bytes

    gpus = []
    if engine_cfg.target.n_gpu_layers != 0:
        from edgespec import backend

        gpus = [d for d in backend.devices() if d.kind == "gpu"]
    plan = plan_for_config(engine_cfg, gpu=bool(gpus))
    if gpus:
        check_fits(plan, gpus[0].total_bytes, device=gpus[0].name)
    else:
        check_fits(plan, system_memory_bytes(), device="RAM")


RELOADED_SECTIONS = ("auth", "tls", "speculation")  # what SIGHUP re-reads; the rest needs a restart


def reload_config(cfg: DaemonConfig, env: Mapping[str, str] | None = None) -> DaemonConfig:
    """SIGHUP: `cfg` with [auth], [tls] and [speculation] re-read from its config file (validated
    as at start, against the running [server] section); without a file, `cfg` itself (the caller
    re-reads the token and certificate files it names). Turning TLS or mutual TLS on or off needs
    a restart (the listening socket's credentials are fixed)."""
    if not cfg.source:
        return cfg
    new = load(cfg.source, env=env, overrides={"server": asdict(cfg.server)})
    if new.tls.enabled != cfg.tls.enabled or bool(new.tls.client_ca) != bool(cfg.tls.client_ca):
        raise ConfigError("tls", "turning TLS or mutual TLS on or off needs a restart, not a reload")
    return replace(cfg, auth=new.auth, tls=new.tls, speculation=new.speculation)


def documented_defaults() -> str:
    """A TOML document listing every key with its default and documentation (configs/edgespec.toml)."""
    lines: list[str] = []
    for section, keys in SCHEMA.items():
        lines.append(f"[{section}]")
        for key, (_types, default, _check, doc) in keys.items():
            lines.append(f"# {doc}")
            lines.append(f"{key} = {_toml_value(default)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    return repr(v)
