"""`edgespec bench-serve`: the serving benchmark. Real servers on loopback (an edgespec daemon
per concurrency level, or one given with --addr; llama.cpp's llama-server beside it with
--llama-server-bin), N concurrent streaming clients, interleaved rounds; JSON / markdown / PNG."""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import typer

from edgespec.cli.common import user_errors

DEFAULT_N_CTX = 2048


def _ints(field: str, text: str) -> list[int]:
    from edgespec.errors import BadRequest

    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BadRequest(field, f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(not 1 <= v <= 64 for v in vals) or len(set(vals)) != len(vals):
        raise BadRequest(field, f"expected distinct integers in [1, 64], got {text!r}")
    return vals


def _systems(modes: str, llama: str, with_llama: bool) -> list[str]:
    from edgespec.bench.serve_clients import EDGESPEC_MODES
    from edgespec.errors import BadRequest

    names = []
    for m in (x.strip() for x in modes.split(",") if x.strip()):
        if m not in EDGESPEC_MODES:
            raise BadRequest("modes", f"must be among {', '.join(EDGESPEC_MODES)}, got {m!r}")
        names.append(f"edgespec-{m}")
    if with_llama:
        for m in (x.strip() for x in llama.split(",") if x.strip()):
            if m not in ("plain", "draft"):
                raise BadRequest("llama_server_modes", f"must be among plain, draft, got {m!r}")
            names.append("llama-server" if m == "plain" else "llama-server-draft")
    if not names or len(set(names)) != len(names):
        raise BadRequest("modes", f"need at least one system, each once (got {names})")
    return names


def bench_serve(
    concurrency: str = typer.Option("1,2,4", help="comma-separated concurrency levels N (client threads; "
                                    "the daemon's parallel and llama-server's -np)"),
    modes: str = typer.Option("auto,plain", help="edgespec speculation modes (plain = mode OFF)"),
    suite: str = typer.Option("structured", help="prompt suite (a shipped name or a JSONL file)"),
    limit: int | None = typer.Option(None, help="first N prompts of each suite file"),
    requests: int = typer.Option(16, help="requests per system and concurrency level"),
    rounds: int = typer.Option(2, help="interleaved rounds the requests are split into (systems rotate)"),
    max_tokens: int = typer.Option(128, "--max-tokens", help="max tokens per request (EOS ends earlier)"),
    target: str | None = typer.Option(None, help="target GGUF (default: the demo F32 target)"),
    draft: str | None = typer.Option(None, help="draft GGUF (default: the Q8_0 demo draft; llama-server gets "
                                        "the Q8_0 draft in any case); none: the daemon drafts model-free "
                                        "(no llama-server-draft system)"),
    chat_template: Path | None = typer.Option(None, "--chat-template", help="a Jinja chat template file for a "
                                              "target whose GGUF has none: the daemon's [target] chat_template "
                                              "and llama-server's --chat-template-file"),
    head: str | None = typer.Option(None, help="the daemon's `[draft] head`: an EAGLE-3 head GGUF loaded beside "
                                       "the draft (each request chooses), or none; default: without --draft the "
                                       "head installed for the demo target (the daemon's own default), else none"),
    threads: int = typer.Option(0, help="CPU threads of every server (0 = all cores)"),
    n_ctx: int = typer.Option(DEFAULT_N_CTX, "--n-ctx", help="context per request (edgespec n_ctx per slot; "
                              "llama-server -c = N x this)"),
    n_gpu_layers: int = typer.Option(0, "--n-gpu-layers", help="-1 = all layers on the GPU (CUDA builds)"),
    flash_attn: bool = typer.Option(True, "--flash-attn/--no-flash-attn", help="flash attention in every server's "
                                    "models (off for a CUDA build without its flash-attention kernels, "
                                    "GGML_CUDA_FA=OFF)"),
    addr: str | None = typer.Option(None, "--addr", help="use this running edgespec daemon (host:port) "
                                       "instead of starting one per level"),
    llama_server_bin: Path | None = typer.Option(None, "--llama-server-bin", help="directory with llama.cpp's "
                                                    "llama-server (tools/llama-anchor.sh build): run it beside edgespec"),
    llama_server_modes: str = typer.Option("plain,draft", help="llama-server without / with the draft model"),
    draft_max: int = typer.Option(4, "--draft-max", help="llama-server --spec-draft-n-max"),
    scenario: bool = typer.Option(True, help="also run the long-prompt scenario (3 streams + one long prompt)"),
    scenario_tokens: int = typer.Option(2000, "--scenario-tokens", help="the long prompt's tokens"),
    scenario_stream_tokens: int = typer.Option(256, "--scenario-stream-tokens", help="max tokens of the 3 streams"),
    scenario_long_tokens: int = typer.Option(16, "--scenario-long-tokens", help="max tokens of the long request"),
    scenario_rounds: int = typer.Option(2, "--scenario-rounds"),
    workdir: Path | None = typer.Option(None, "--workdir", help="where configs and server logs go "
                                           "(default: a new temporary directory)"),
    json_out: Path | None = typer.Option(None, "--json"),
    markdown_out: Path | None = typer.Option(None, "--markdown"),
    plot_out: Path | None = typer.Option(None, "--plot"),
    suffix_cache: bool = typer.Option(False, "--suffix-cache", help="the daemon drafts from its cross-request "
                                      "suffix cache too (auto requests read and feed it): with a repetitive suite "
                                      "and many rounds, each round's edgespec-auto / edgespec-plain ratio is the "
                                      "warm-up curve"),
    prompt_cache: bool = typer.Option(False, "--prompt-cache", help="the daemon keeps each slot's last prefill "
                                      "(its [server] prompt_cache, on by default in a deployment) and llama-server "
                                      "reuses its slot's prefix (cache_prompt: true): a prompt sharing a prefix "
                                      "with an earlier one prefills only what follows it, in both"),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="every request runs to --max-tokens: edgespec "
                                    "and llama-server both get ignore_eos (end-of-generation tokens banned), so "
                                    "both systems generate the same number of tokens"),
    pad_forwards: str = typer.Option("auto", "--pad-forwards", help="the daemon's [speculation] pad_forwards: "
                                     "auto (on with a target on a GPU), true or false; compare a level's auto / "
                                     "plain ratio with padding on and off"),
    progress: bool = typer.Option(True, help="progress bar on stderr"),
) -> None:
    """Serving benchmark: tokens/s, TTFT and inter-token latency at N concurrent streams, edgespec's
    daemon (auto, plain) beside llama.cpp's llama-server (plain, draft), interleaved."""
    with user_errors():
        _bench_serve(SimpleNamespace(**locals()))


def _bench_serve(a: SimpleNamespace) -> None:
    """`edgespec bench-serve` with its options `a`: check them, run the levels and the scenario,
    write the reports."""
    from edgespec.bench import serve_report
    from edgespec.bench.report import machine_info, write_outputs
    from edgespec.bench.serve_run import default_threads, run_levels, workdir_default
    from edgespec.bench.suite import load_suite
    from edgespec.errors import BadRequest

    levels = _ints("concurrency", a.concurrency)
    systems = _systems(a.modes, a.llama_server_modes, a.llama_server_bin is not None)
    _check(a)
    prompts = load_suite(a.suite, limit=a.limit)
    target_path, draft_path = _models(a.target, a.draft)
    if draft_path is None and "llama-server-draft" in systems:
        raise BadRequest("llama_server_modes", "draft needs a draft model (not --draft none)")
    if a.chat_template is not None and not a.chat_template.is_file():
        raise BadRequest("chat_template", f"{a.chat_template}: no such file")
    t = default_threads(a.threads)
    commands: dict[str, str] = {}
    starter = _Starter(addr=a.addr, target=target_path, draft=draft_path, daemon_default_draft=a.draft is None,
                       head=a.head,
                       threads=t, n_gpu_layers=a.n_gpu_layers, flash_attn=a.flash_attn,
                       max_tokens=max(a.max_tokens, a.scenario_stream_tokens), systems=systems,
                       llama_bin=a.llama_server_bin, draft_max=a.draft_max, workdir=a.workdir or workdir_default(),
                       commands=commands, suffix_cache=a.suffix_cache, prompt_cache=a.prompt_cache,
                       ignore_eos=a.ignore_eos,
                       chat_template=str(a.chat_template) if a.chat_template else None,
                       pad_forwards={"true": True, "false": False}.get(a.pad_forwards, a.pad_forwards))
    level_results = run_levels(lambda n: starter.start(n, a.n_ctx, prompts, a.max_tokens), systems, prompts, levels,
                               requests=a.requests, rounds=a.rounds, max_tokens=a.max_tokens, progress=a.progress,
                               log=_log)
    scen = _scenario(a, starter, systems) if a.scenario else None
    report = {
        "command": _command_line(),
        "settings": {"concurrency": levels, "systems": systems, "suite": a.suite, "prompts": len(prompts),
                     "requests": a.requests, "rounds": a.rounds, "max_tokens": a.max_tokens, "temperature": 0.0,
                     "threads": t, "n_ctx": a.n_ctx, "n_gpu_layers": a.n_gpu_layers, "flash_attn": a.flash_attn,
                     "target": target_path,
                     "draft": draft_path, "draft_max": a.draft_max, "addr": a.addr,
                     "prompt_cache": a.prompt_cache if a.addr is None else "as the attached daemon",
                     "ignore_eos": a.ignore_eos,
                     "suffix_cache": a.suffix_cache if a.addr is None else "as the attached daemon",
                     "pad_forwards": a.pad_forwards if a.addr is None else "as the attached daemon"},
        "machine": machine_info(),
        "commands": commands,
        "levels": level_results,
        **({"scenario": scen} if scen else {}),
    }
    md = serve_report.to_markdown(report)
    write_outputs(report, md, json_out=a.json_out, markdown_out=a.markdown_out, plot_out=a.plot_out,
                  plot=serve_report.plot)
    typer.echo(md)


def _log(msg: str) -> None:
    typer.echo(msg, err=True)


def _check(a: SimpleNamespace) -> None:
    """The numeric options and --llama-server-bin, each error naming its option."""
    from edgespec.errors import BadRequest

    if a.llama_server_bin is not None and not (a.llama_server_bin / "llama-server").is_file():
        raise BadRequest("llama_server_bin", f"{a.llama_server_bin / 'llama-server'} not found "
                                             "(tools/llama-anchor.sh build prints the directory)")
    if a.pad_forwards not in ("auto", "true", "false"):
        raise BadRequest("pad_forwards", f"must be one of auto, true, false, got {a.pad_forwards!r}")
    for name, lo in (("max_tokens", 1), ("requests", 1), ("rounds", 1), ("scenario_tokens", 16),
                     ("scenario_rounds", 1), ("draft_max", 1), ("n_ctx", 128)):
        v = getattr(a, name)
        if v < lo:
            raise BadRequest(name, f"must be >= {lo}, got {v}")
    if a.rounds > a.requests:
        raise BadRequest("rounds", f"must be <= requests ({a.requests}), got {a.rounds}")


def _scenario(a: SimpleNamespace, starter: _Starter, systems: list[str]) -> dict:
    """The long-prompt scenario: 3 streams and one long prompt, on a context that holds them."""
    from edgespec.bench.serve_run import STREAM_PROMPTS, run_scenarios

    need = a.scenario_tokens + max(a.scenario_stream_tokens, a.scenario_long_tokens) + 64
    ctx = max(a.n_ctx, -(-need // 256) * 256)
    scen = run_scenarios(lambda n: starter.start(n, ctx, list(STREAM_PROMPTS), a.scenario_stream_tokens,
                                                 long_tokens=a.scenario_tokens),
                         systems, rounds=a.scenario_rounds, stream_tokens=a.scenario_stream_tokens,
                         long_tokens=a.scenario_long_tokens, log=_log)
    scen["settings"] = {"prompt_tokens": a.scenario_tokens, "stream_tokens": a.scenario_stream_tokens,
                        "long_tokens": a.scenario_long_tokens, "rounds": a.scenario_rounds, "warm_tokens": 4,
                        "n_ctx": ctx, "parallel": len(STREAM_PROMPTS) + 1}
    return scen


@dataclass
class _Starter:
    """Starts one level's servers (the daemon unless attached, the llama-servers) and their clients."""

    addr: str | None
    target: str
    draft: str | None  # None: the daemon drafts model-free
    threads: int
    n_gpu_layers: int
    max_tokens: int  # the daemon's max_tokens limit: the largest any request of the run asks for
    systems: list[str]
    llama_bin: Path | None
    draft_max: int
    workdir: Path
    commands: dict = field(default_factory=dict)  # what the report lists under "commands"
    suffix_cache: bool = False  # the daemon's speculation.suffix_cache
    prompt_cache: bool = False  # the daemon's server.prompt_cache and llama-server's cache_prompt
    ignore_eos: bool = False  # every request's ignore_eos (both systems): it runs to max_tokens
    pad_forwards: str | bool = "auto"  # the daemon's speculation.pad_forwards
    daemon_default_draft: bool = False  # the daemon drafts with its own default (no --draft)
    head: str | None = None  # --head: the daemon's [draft] head
    flash_attn: bool = True  # every server's models
    chat_template: str | None = None  # --chat-template: every server's template file

    def daemon_head(self) -> str:
        """The daemon's `[draft] head`: --head, else without --draft the head installed for the
        target (what the daemon loads beside the Q8_0 draft when [draft] path is unset), else none."""
        if self.head is not None:
            return self.head
        if self.daemon_default_draft:
            from edgespec.models import installed_head

            found = installed_head(self.target)
            return str(found) if found is not None else "none"
        return "none"

    def start(self, n: int, ctx: int, prompts, max_tokens: int, long_tokens: int | None = None):
        from edgespec.bench import serve_systems as ss
        from edgespec.bench.serve_clients import EdgespecClient, LlamaServerClient
        from edgespec.bench.serve_run import Level, check_fits, drafts_since, long_prompt
        from edgespec.bench.suite import load_suite
        from edgespec.types import SpeculationParams

        procs: list[ss.Process] = []
        clients: dict = {}
        info: dict = {}

        def stop() -> None:
            for c in clients.values():
                c.close()
            for p in reversed(procs):
                p.stop()

        try:
            addr = self.addr
            if addr is None:
                draft, head = self.draft, self.daemon_head()
                info["daemon_draft"] = Path(draft).name if draft else "none"
                info["daemon_head"] = Path(head).name if head != "none" else None
                sections = ss.daemon_sections(target=self.target, draft=draft, head=head, parallel=n, n_ctx=ctx,
                                              threads=self.threads, max_tokens=self.max_tokens,
                                              n_gpu_layers=self.n_gpu_layers, suffix_cache=self.suffix_cache,
                                              prompt_cache=self.prompt_cache, flash_attn=self.flash_attn,
                                              chat_template=self.chat_template, pad_forwards=self.pad_forwards)
                d = ss.start_daemon(self.workdir, sections)
                procs.append(d)
                addr = d.addr
                self.commands.setdefault("edgespec", f"edgespec serve --config {d.command[-1]}")
                self.commands.setdefault("edgespec_config", {k: dict(v) for k, v in sections.items()})
                self.commands["edgespec_config"]["server"]["parallel"] = "N"
            tok = EdgespecClient(addr, "auto")
            clients["_tokenizer"] = tok
            info["daemon"] = {k: v for k, v in tok.model_info().items() if k in ("parallel", "n_ctx", "backend")}
            if "daemon_draft" in info:
                info["daemon"]["draft"] = info.pop("daemon_draft")
            head_name = info.pop("daemon_head", None)
            if head_name:
                info["daemon"]["head"] = head_name
            prompts = list(prompts)
            if long_tokens is not None:
                lp = long_prompt(tok.chat_tokens, load_suite("long"), long_tokens)
                info["long_prompt"] = lp
                prompts.append(lp)
            tokens = {p.id: tok.chat_tokens(p.prompt) for p in prompts}
            check_fits(tokens, max_tokens, ctx, SpeculationParams().context_headroom)
            info["tokens"] = tokens
            info["prompt_tokens"] = {pid: len(ids) for pid, ids in tokens.items()}
            for name in self.systems:
                if name.startswith("edgespec-"):
                    clients[name] = EdgespecClient(addr, name.split("-", 1)[1], ignore_eos=self.ignore_eos)
                else:
                    with_draft = name == "llama-server-draft"
                    assert self.llama_bin is not None  # checked with the arguments: llama systems need it
                    p = ss.start_llama_server(self.llama_bin, self.workdir, name, target=self.target,
                                              draft=self.draft if with_draft else None, parallel=n, n_ctx=ctx,
                                              threads=self.threads, draft_max=self.draft_max,
                                              n_gpu_layers=self.n_gpu_layers, flash_attn=self.flash_attn,
                                              chat_template=self.chat_template)
                    procs.append(p)
                    self.commands.setdefault(name, shlex.join(p.command))
                    clients[name] = LlamaServerClient(int(p.addr.rsplit(":", 1)[1]), name,
                                                      cache_prompt=self.prompt_cache, ignore_eos=self.ignore_eos)
            try:  # what the daemon's drafts did before the level (an attached daemon's history)
                base = tok.draft_stats()
            except Exception:  # Admin.Stats refused (an attached daemon's admin auth): no drafts figures
                base = None
        except BaseException:
            stop()
            raise

        def draft_stats() -> dict:
            return drafts_since(tok.draft_stats(), base or {})  # only called when there is a base

        return Level(clients=clients, stop=stop, info=info, draft_stats=draft_stats if base is not None else None)


def _models(target: str | None, draft: str | None) -> tuple[str, str | None]:
    """The target and draft files (the demo pair's by default); draft None for `--draft none`."""
    from edgespec.models import default_pair

    pair = default_pair()
    t = target or str(pair.target)
    d = None if draft == "none" else draft or str(pair.draft)
    for p in (t, d):
        if p is not None and not Path(p).is_file():
            raise FileNotFoundError(2, "model not found (run `edgespec models prepare-demo`)", p)
    return t, d


def _command_line() -> str:
    args = sys.argv[1:]
    if args[:1] == ["bench-serve"]:
        args = args[1:]
    return "edgespec bench-serve " + shlex.join(args)


def register(app: typer.Typer) -> None:
    app.command("bench-serve")(bench_serve)
