"""The daemon's configuration: TOML file -> environment (EDGESPEC_<SECTION>_<KEY>) -> CLI flags.

Every key is declared once, in edgespec.settings (type, default, range, help); `load()` validates
everything and reports *every* problem with its key name (InvalidConfig.problems), then builds the
frozen sections derived from that declaration. Each component receives only its own section.
`documented_defaults()` (`edgespec config defaults`) and `reference()` (`edgespec config
reference`, docs/configuration.md) are written from the same declaration.
"""

from __future__ import annotations

import ipaddress
import os
import tomllib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from edgespec.config import ENGINE_KEYS, EngineConfig, ModelConfig, models_dir
from edgespec.errors import ConfigError
from edgespec.server import chat_config
from edgespec.server.chat_config import ChatEntry
from edgespec.settings import SECTION_HELP, SECTIONS, Setting, defaults, section_class

DEMO_TARGET = "SmolLM2-135M-Instruct.F32.gguf"
DEMO_DRAFT = "SmolLM2-135M-Instruct.Q8_0.gguf"


class InvalidConfig(ConfigError):
    """One or more config problems; `problems` is a list of (key, message)."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        self.key = problems[0][0] if len(problems) == 1 else "config"
        # every problem already says its key: no "key: " prefix of ConfigError's (it doubled the field)
        Exception.__init__(self, "; ".join(f"{k}: {m}" for k, m in problems))


# ---- frozen sections, one field per declared key --------------------------------------------


def _loopback(self) -> bool:
    return is_loopback(self.host)


def _auth_enabled(self) -> bool:
    return bool(self.tokens_file or self.admin_tokens_file)


def _tls_enabled(self) -> bool:
    return bool(self.cert)


if TYPE_CHECKING:  # made at run time from the declaration table, one field per key: opaque to mypy
    ServerConfig: TypeAlias = Any
    SpeculationConfig: TypeAlias = Any
    LimitsConfig: TypeAlias = Any
    AuthConfig: TypeAlias = Any
    TlsConfig: TypeAlias = Any
    HttpConfig: TypeAlias = Any
    EmbeddingConfig: TypeAlias = Any
    RerankConfig: TypeAlias = Any
    MetricsConfig: TypeAlias = Any
    LoggingConfig: TypeAlias = Any
    AuditConfig: TypeAlias = Any
    ModelsConfig: TypeAlias = Any
else:
    ServerConfig = section_class("ServerConfig", "server", "[server]", __name__,
                                 namespace={"loopback": property(_loopback)})
    SpeculationConfig = section_class("SpeculationConfig", "speculation", "[speculation]: what SIGHUP reloads", __name__)
    LimitsConfig = section_class("LimitsConfig", "limits", "[limits]: what one request may ask of the daemon, checked "
                                 "in the gRPC and HTTP handlers before the engine sees it", __name__, tuples=("callers",))
    AuthConfig = section_class("AuthConfig", "auth", "[auth]", __name__, tuples=("admin_subjects",),
                               namespace={"enabled": property(_auth_enabled)})
    TlsConfig = section_class("TlsConfig", "tls", "[tls]", __name__, namespace={"enabled": property(_tls_enabled)})
    HttpConfig = section_class("HttpConfig", "http", "[http]", __name__)
    EmbeddingConfig = section_class("EmbeddingConfig", "embedding", "[embedding]", __name__)
    RerankConfig = section_class("RerankConfig", "rerank", "[rerank]", __name__)
    MetricsConfig = section_class("MetricsConfig", "metrics", "[metrics]", __name__)
    LoggingConfig = section_class("LoggingConfig", "logging", "[logging]", __name__)
    AuditConfig = section_class("AuditConfig", "audit", "[audit]: shadow decodes that check exactness on live traffic",
                                __name__)
    ModelsConfig = section_class("ModelsConfig", "models", "[models]: the memory the chat models share, keep_alive",
                                 __name__)


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
    chat_template: str = ""  # [target] chat_template: the file's text ("" = the GGUF's own)
    tool_format: str = "auto"  # [target] tool_format: the call format (auto = the template's)
    reasoning_format: str = "auto"  # [target] reasoning_format: think, none, or auto (the template's)
    source: str = ""  # the file it came from ("" = defaults only)
    http: HttpConfig = field(default_factory=HttpConfig)
    embedding: EmbeddingConfig = field(default_factory=EmbeddingConfig)
    rerank: RerankConfig = field(default_factory=RerankConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)
    models: ModelsConfig = field(default_factory=ModelsConfig)
    chat: tuple[ChatEntry, ...] = ()  # the [[chat]] entries: chat models beside the default one

    def chat_entries(self) -> tuple[ChatEntry, ...]:
        """Every chat model, the default one ([target], [draft], [speculation]) first."""
        from edgespec.server.models_api import model_name

        default = ChatEntry(model_name(self.engine.target.path), self.engine, self.speculation,
                            chat_template=self.chat_template, tool_format=self.tool_format,
                            reasoning_format=self.reasoning_format, load="start",
                            keep_alive=float(self.models.keep_alive))
        return (default, *self.chat)


def _check_controller(values: dict[str, Any]) -> list[tuple[str, str]]:
    """[controller]'s checks across keys (min_depth <= max_depth, ...) belong to ControllerConfig."""
    from edgespec.controller import ControllerConfig

    try:
        ControllerConfig(**values).validate()
    except ConfigError as exc:
        return [(exc.key, str(exc).split(": ", 1)[-1])]
    return []


def systemd_network(cfg: DaemonConfig) -> str:
    """IPAddressDeny=/IPAddressAllow= lines for the unit, where systemd can express what the
    config allows: every listener on loopback (gRPC, HTTP when enabled, metrics when enabled) ->
    only localhost, plus the hosts of target.rpc_servers given as IP addresses. A listener on
    another address serves clients the config does not list: nothing is written then."""
    import ipaddress

    hosts = [cfg.server.host, *([cfg.http.host] if cfg.http.enabled else []),
             *([cfg.metrics.host] if cfg.metrics.enabled else [])]
    if not all(is_loopback(h) for h in hosts):
        return ""
    allow = ["localhost"]
    for endpoint in cfg.rpc_servers:
        host = endpoint.rpartition(":")[0].strip("[]")
        try:
            allow.append(str(ipaddress.ip_address(host)))
        except ValueError:
            return ""  # a host name: systemd allows addresses only
    return "IPAddressDeny=any\n" + "".join(f"IPAddressAllow={a}\n" for a in allow)


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
    """EDGESPEC_<SECTION>_<KEY>=value for the declared sections (other EDGESPEC_* vars are ignored)."""
    out: dict[str, dict[str, Any]] = {}
    problems: list[tuple[str, str]] = []
    for name, raw in env.items():
        if not name.startswith("EDGESPEC_"):
            continue
        rest = name[len("EDGESPEC_") :].lower()
        section, _, key = rest.partition("_")
        if section not in SECTIONS or not key:
            continue
        where = f"{section}.{key} (env {name})"
        if key not in SECTIONS[section]:
            problems.append((where, "unknown key"))
            continue
        try:
            out.setdefault(section, {})[key] = _coerce_env(raw, SECTIONS[section][key].types)
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
    """Type- and range-check every key against its declaration; unknown sections/keys are problems too."""
    values = {section: defaults(section) for section in SECTIONS}
    for section, table in raw.items():
        if section not in SECTIONS:
            problems.append((section, f"unknown section (known: {', '.join(SECTIONS)})"))
            continue
        if not isinstance(table, Mapping):
            problems.append((section, "must be a table"))
            continue
        for key, value in table.items():
            s = SECTIONS[section].get(key)
            if s is None:
                problems.append((f"{section}.{key}", f"unknown key (known: {', '.join(SECTIONS[section])})"))
                continue
            msg = s.problem(value)
            if msg:
                problems.append((s.name, msg))
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


def _head(values: dict[str, Any], target: str) -> ModelConfig | None:
    """The head beside the draft model ([draft] head): a file, or with `auto` and [draft] path
    unset the head installed for the demo target (edgespec.models.installed_head); None: none."""
    choice = values["head"]
    if choice == "none" or (choice == "auto" and values["path"]):
        return None
    if choice == "auto":
        from edgespec.models import installed_head

        found = installed_head(target)
        if found is None:
            return None
        choice = str(found)
    return _model({**values, "path": choice}, DEMO_DRAFT)


def is_demo_target(target_path: str) -> bool:
    """Whether [target] path names the demo target (unset, or its file name)."""
    return not target_path or Path(target_path).expanduser().name == DEMO_TARGET


def _draft(values: dict[str, Any]) -> ModelConfig | None:
    """[draft]: the file named, or with `path` unset the demo draft, which belongs to the demo
    target alone (a site's own target with no draft named serves with model-free drafting)."""
    d = values["draft"]
    if not d["enabled"] or (not d["path"] and not is_demo_target(values["target"]["path"])):
        return None
    return _model(d, DEMO_DRAFT)


def _model(values: dict[str, Any], demo_name: str) -> ModelConfig:
    path = values["path"] or str(models_dir() / demo_name)
    return ModelConfig(path=str(Path(path).expanduser()),
                       **{k: v for k, v in values.items() if k in SECTIONS["target"] and k not in ("path", "rpc_servers", "chat_template", "tool_format", "reasoning_format", "fast_kernels")})


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
    chat_raw = chat_config.raw_entries(merged.pop("chat", None), problems)
    values = _check_sections(merged, problems)
    problems += _cross_checks(values, problems)
    engine = _engine(values, check_models, problems, memory=not chat_raw)
    chat = _chat_entries(chat_raw, values, check_models, problems)
    if problems:
        raise InvalidConfig(problems)
    controller = merged.get("controller", {})
    return DaemonConfig(
        server=ServerConfig(**{**values["server"], "grace_seconds": float(values["server"]["grace_seconds"])}),
        engine=engine,
        speculation=SpeculationConfig(**values["speculation"]),
        auth=AuthConfig(**{**values["auth"], "admin_subjects": tuple(values["auth"]["admin_subjects"])}),
        tls=TlsConfig(**values["tls"]),
        metrics=MetricsConfig(**values["metrics"]),
        logging=LoggingConfig(**values["logging"]),
        limits=LimitsConfig(**{**values["limits"], "callers": tuple(values["limits"]["callers"])}),
        controller={k: values["controller"][k] for k in controller},
        source=str(path or ""),
        http=HttpConfig(**values["http"]),
        embedding=EmbeddingConfig(**{**values["embedding"],
                                     "path": str(Path(values["embedding"]["path"]).expanduser())
                                     if values["embedding"]["path"] else ""}),
        rerank=RerankConfig(**{**values["rerank"], "path": str(Path(values["rerank"]["path"]).expanduser())
                               if values["rerank"]["path"] else ""}),
        audit=AuditConfig(**values["audit"]),
        models=ModelsConfig(**{**values["models"], "keep_alive": float(values["models"]["keep_alive"]),
                               "load_wait_seconds": float(values["models"]["load_wait_seconds"])}),
        chat=chat,
        rpc_servers=tuple(values["target"]["rpc_servers"]),
        chat_template=_chat_template(values["target"]["chat_template"]),
        tool_format=values["target"]["tool_format"],
        reasoning_format=values["target"]["reasoning_format"],
    )


def _chat_entries(raw: list, values: dict[str, dict[str, Any]], check_models: bool,
                  problems: list[tuple[str, str]]) -> tuple[ChatEntry, ...]:
    """The [[chat]] entries, each checked as the top-level sections are (problems named
    `chat[i].section.key`); with `check_models`, every chat model together in one memory plan."""
    def build(merged: dict[str, dict[str, Any]], where: str) -> ChatEntry | None:
        found: list[tuple[str, str]] = []
        engine = _engine(merged, check_models, found, memory=False)
        try:
            template = _chat_template(merged["target"]["chat_template"], f"{where}.target.chat_template")
        except InvalidConfig as exc:
            found += exc.problems
        problems.extend((k if k.startswith(where) else f"{where}.{k}", m) for k, m in found)
        if found:
            return None
        return ChatEntry("", engine, SpeculationConfig(**merged["speculation"]), chat_template=template,
                         tool_format=merged["target"]["tool_format"],
                         reasoning_format=merged["target"]["reasoning_format"])

    if not raw or problems:
        return ()
    entries = [e for i, r in enumerate(raw) if (e := chat_config.parse_entry(i, r, values, problems, build))]
    if problems:
        return ()
    from edgespec.server.models_api import model_name

    chat_config.check_names(model_name(_model(values["target"], DEMO_TARGET).path), entries, problems)
    if check_models and not problems and not values["target"]["rpc_servers"]:
        from edgespec.server.chat_plan import check_models_memory

        try:
            check_models_memory(_engine(values, False, [], memory=False), entries, values["models"]["memory_bytes"],
                                _side(values, "embedding"), _side(values, "rerank"))
        except ConfigError as exc:
            problems.append((exc.key, str(exc).split(": ", 1)[-1]))
    return tuple(entries)


def _side(values: dict[str, dict[str, Any]], section: str) -> Any:
    sec = values[section]
    cls = EmbeddingConfig if section == "embedding" else RerankConfig
    return cls(**{**sec, "path": str(Path(sec["path"]).expanduser()) if sec["path"] else ""})


def _chat_template(path: str, key: str = "target.chat_template") -> str:
    """[target] chat_template's text, checked to compile (ConfigError naming the key)."""
    if not path:
        return ""
    from edgespec.chat import ChatTemplate

    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidConfig([(key, f"cannot read {path}: {exc}")]) from None
    try:
        ChatTemplate(text, origin=key)
    except ConfigError as exc:
        raise InvalidConfig([(exc.key, str(exc).split(": ", 1)[-1])]) from None
    return text


def _cross_checks(values: dict[str, dict[str, Any]], found: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Checks that span keys: defaults within their caps, TLS files in pairs, authentication
    for a non-loopback address, the token files' contents, the controller's own rules. `found`:
    the problems so far (a key already wrong is not checked again)."""
    problems: list[tuple[str, str]] = []
    s, sp, tls = values["server"], values["speculation"], values["tls"]
    if s["default_max_tokens"] > s["max_tokens"]:
        problems.append(("server.default_max_tokens", f"must be <= server.max_tokens ({s['max_tokens']})"))
    for dflt, cap in (("draft_tokens", "max_draft_tokens"), ("tree_nodes", "max_tree_nodes"), ("tree_depth", "max_tree_depth")):
        if sp[dflt] > sp[cap]:
            problems.append((f"speculation.{dflt}", f"must be <= speculation.{cap} ({sp[cap]})"))
    if bool(tls["cert"]) != bool(tls["key"]):
        problems.append(("tls.key" if tls["cert"] else "tls.cert", "tls.cert and tls.key must be set together"))
    if tls["client_ca"] and not tls["cert"]:
        problems.append(("tls.client_ca", "mutual TLS needs tls.cert and tls.key"))
    problems += _exposure(values)
    if values["auth"]["admin_subjects"] and not tls["client_ca"]:
        problems.append(("auth.admin_subjects", "certificate subjects need mutual TLS (tls.client_ca)"))
    for key in ("tokens_file", "admin_tokens_file", "metrics_tokens_file"):
        if values["auth"][key] and not any(k == f"auth.{key}" for k, _ in found):
            from edgespec.server.auth import read_hashes

            try:
                read_hashes(values["auth"][key])
            except ConfigError as exc:
                problems.append((f"auth.{key}", str(exc).split(": ", 1)[-1]))
    if values["target"]["rpc_servers"] and values["target"]["n_gpu_layers"] == 0:
        problems.append(("target.n_gpu_layers", "must be -1 (all) or > 0 to place layers on target.rpc_servers"))
    if not any(k.startswith("controller.") or k == "controller" for k, _ in found):
        problems += _check_controller(values["controller"])
    return problems


def _exposure(values: dict[str, dict[str, Any]]) -> list[tuple[str, str]]:
    """A listener on a non-loopback address needs authentication, unless server.insecure."""
    s, h, m = values["server"], values["http"], values["metrics"]
    tokens = bool(values["auth"]["tokens_file"] or values["auth"]["admin_tokens_file"])
    if s["insecure"]:
        return []
    problems = []
    if not (tokens or values["tls"]["client_ca"]) and not is_loopback(s["host"]):
        problems.append(("server.host", f"{s['host']} is not a loopback address and no authentication is "
                         "configured: set auth.tokens_file, or tls.client_ca (mutual TLS), or start with --insecure"))
    if h["enabled"] and not tokens and not is_loopback(h["host"]):
        problems.append(("http.host", f"{h['host']} is not a loopback address and no auth tokens are configured: "
                         "set auth.tokens_file, or start with --insecure"))
    if m["enabled"] and not tokens and not is_loopback(m["host"]):
        problems.append(("metrics.host", f"{m['host']} is not a loopback address and no auth tokens are "
                         "configured: /metrics would answer anyone; set auth.tokens_file (scrapers then send a "
                         "bearer token), or start with --insecure"))
    return problems


def _engine(values: dict[str, dict[str, Any]], check_models: bool, problems: list[tuple[str, str]],
            memory: bool = True) -> EngineConfig:
    """The engine's section, from [server], [target] and [draft]; with `check_models`, the model
    files must exist and (with `memory`: one chat model) the memory plan must fit this box
    (appends to `problems`)."""
    target = _model(values["target"], DEMO_TARGET)
    draft = _draft(values)
    head = _head(values["draft"], target.path) if draft is not None else None
    if check_models:
        for name, m, demo in (("target.path", target, not values["target"]["path"]),
                              ("draft.path", draft, not values["draft"]["path"]), ("draft.head", head, False)):
            if m is not None and not Path(m.path).is_file():
                hint = " (run `edgespec models prepare-demo`)" if demo else ""
                problems.append((name, f"model file not found: {m.path}{hint}"))
    engine = EngineConfig(target=target, draft=draft, head=head,
                          **{attr: values[section][key] for attr, (section, key) in ENGINE_KEYS.items()})
    engine = replace(engine, prefill_share=float(engine.prefill_share))
    try:
        engine.validate()
    except ConfigError as exc:
        problems.append((exc.key, str(exc).split(": ", 1)[-1]))
    # the memory plan covers this box only: with rpc_servers the target's layers go to other boxes
    if check_models and memory and not problems and not values["target"]["rpc_servers"]:
        try:
            check_memory(engine, _side(values, "embedding"), _side(values, "rerank"))
        except ConfigError as exc:
            problems.append(("target.n_ctx", f"with server.parallel = {engine.parallel}, the memory plan "
                             + str(exc).split(": ", 1)[-1]))
    return engine


def check_memory(engine_cfg: EngineConfig, embedding: Any = None, rerank: Any = None) -> None:
    """Refuse, with the memory plan's explanation, a configuration that does not fit the device it
    would run on (GPU memory when layers are offloaded to a GPU, else RAM)."""
    from edgespec.backend import device_memory
    from edgespec.plan import check_fits, plan_for_config

    total, name, gpu = device_memory(gpu=engine_cfg.target.n_gpu_layers != 0)
    plan = plan_for_config(engine_cfg, gpu=gpu, embedding=embedding, rerank=rerank)
    check_fits(plan, total, device=name)


RELOADED_SECTIONS = ("auth", "tls", "speculation")  # what SIGHUP re-reads; the rest needs a restart


def reload_config(cfg: DaemonConfig, env: Mapping[str, str] | None = None) -> DaemonConfig:
    """SIGHUP: `cfg` with [auth], [tls], [speculation] and each [[chat]] entry's [chat.speculation]
    re-read from its config file (validated
    as at start, against the running [server] section); without a file, `cfg` itself (the caller
    re-reads the token and certificate files it names). Turning TLS or mutual TLS on or off needs
    a restart (the listening socket's credentials are fixed)."""
    if not cfg.source:
        return cfg
    new = load(cfg.source, env=env, overrides={"server": asdict(cfg.server)})
    if new.tls.enabled != cfg.tls.enabled or bool(new.tls.client_ca) != bool(cfg.tls.client_ca):
        raise ConfigError("tls", "turning TLS or mutual TLS on or off needs a restart, not a reload")
    # each [[chat]] entry's [chat.speculation] too (the entries themselves need a restart)
    spec = {e.name: e.speculation for e in new.chat}
    chat = tuple(replace(e, speculation=spec.get(e.name, e.speculation)) for e in cfg.chat)
    return replace(cfg, auth=new.auth, tls=new.tls, speculation=new.speculation, chat=chat)


SHIPPED_HEADER = """\
# edgespec daemon configuration. Every key is listed with its default and meaning.
# Generated from the declaration (edgespec/settings.py): `edgespec config defaults > configs/edgespec.toml`.
# Precedence: this file < environment EDGESPEC_<SECTION>_<KEY> (e.g. EDGESPEC_SERVER_PORT=50052)
#             < `edgespec serve` flags (--host, --port, --http-port, --reflection, --insecure, --parallel,
#               --log-level).
# Check a file with `edgespec config validate FILE` (lists every problem, exit 2 if any).
# SIGHUP (systemctl reload edgespec) re-reads [auth], [tls] (and the files they name) and [speculation]
# without dropping requests; the other sections need a restart. Values set with `edgespec policy`
# (Admin.SetPolicy) stay on top of the file's [speculation] until `edgespec policy --reset`.
"""


def documented_defaults() -> str:
    """A TOML document listing every key with its default and documentation: configs/edgespec.toml
    is this text (tests/server/test_config_reference.py fails when the file is stale)."""
    lines: list[str] = [SHIPPED_HEADER]
    for section, keys in SECTIONS.items():
        if section in SECTION_HELP:
            lines.append(f"# {SECTION_HELP[section]}")
        lines.append(f"[{section}]")
        for key, s in keys.items():
            lines.append(f"# {s.help}")
            lines.append(f"{key} = {_toml_value(s.default)}")
        lines.append("")
    lines += chat_config.EXAMPLE
    return "\n".join(lines)


def reference() -> str:
    """docs/configuration.md: every key with its type, default, range and meaning, as Markdown
    (`edgespec config reference`; tests/server/test_config_reference.py fails when the file is stale)."""
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated by `edgespec config reference > docs/configuration.md` from edgespec/settings.py;"
        " do not edit by hand. -->",
        "",
        "`edgespec serve --config FILE` reads a TOML file; each key may be overridden by the environment "
        "variable `EDGESPEC_<SECTION>_<KEY>` (e.g. `EDGESPEC_SERVER_PORT=50052`; booleans 1/0/true/false, "
        "lists comma-separated), then by `serve`'s flags. `edgespec config validate FILE` lists every "
        "problem, each named `section.key`; `edgespec config defaults` prints every key at its default "
        f"as TOML. SIGHUP re-reads {', '.join(f'[{s}]' for s in RELOADED_SECTIONS)}; the other sections "
        "need a restart.",
        "",
    ]
    for section, keys in SECTIONS.items():
        lines += [f"## [{section}]", "", SECTION_HELP[section], "",
                  "| key | type | default | range | what it does |", "| --- | --- | --- | --- | --- |"]
        lines += [_reference_row(s) for s in keys.values()]
        lines.append("")
    lines += chat_config.reference_rows()
    return "\n".join(lines)


def _reference_row(s: Setting) -> str:
    cells = [f"`{s.key}`", s.type_text, f"`{_toml_value(s.default)}`", s.range_text(), s.help]
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    return repr(v)
