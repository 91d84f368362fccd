"""`edgespec selftest`: prove exactness on this appliance's own models.

Statistical checks: real target/draft next-token distributions (temperature 1, restricted to
their top tokens and renormalised) go through the production verifier for chains and trees,
>= 100k trials each, chi-square goodness of fit at alpha = 1e-3 (edgespec.selftest). End-to-end
check: greedy tree decoding reproduces plain decoding token for token. With `--addr`, the
token-for-token checks run through a live daemon instead (edgespec.selftest_live): every mode,
alone and several requests at once, against the daemon's own plain decoding, on built-in prompts
or the site's own (`--suite FILE`), at the stream counts asked for, as many times as asked:

    edgespec selftest --addr HOST:PORT --suite my-prompts.jsonl --concurrency 1,4,8 --repeat 2
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Annotated

import numpy as np
import typer

from edgespec.cli.common import engine_config, user_errors

PROMPTS = (
    "Write a Python function that returns the factorial of n.",
    "Extract the name and the city as JSON: Maria Lopez moved to Lisbon in 2019.",
    "Continue the clause: The Supplier shall indemnify the Buyer against",
)


def register(app: typer.Typer) -> None:
    app.command("selftest")(selftest)


def model_dists(engine, prompts=PROMPTS, support: int = 8) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(name, p, q) per prompt: target and draft next-token distributions at temperature 1 over
    the union of their top-`support` tokens, renormalised."""
    out = []
    for i, prompt in enumerate(prompts):
        tl, dl = engine.next_logits(engine.encode_chat([("user", prompt)]))
        if dl is None:
            dl = tl
        idx = np.union1d(np.argsort(-tl)[:support], np.argsort(-dl)[:support])
        p = np.exp(tl[idx] - tl[idx].max())
        q = np.exp(dl[idx] - dl[idx].max())
        out.append((f"prompt{i}", p / p.sum(), q / q.sum()))
    return out


def selftest(
    target: Annotated[str | None, typer.Option(help="target GGUF (default: demo F32)")] = None,
    draft: Annotated[str | None, typer.Option(help="draft GGUF (default: demo Q8_0)")] = None,
    trials: Annotated[int, typer.Option(help="trials per statistical check")] = 100_000,
    alpha: Annotated[float, typer.Option(help="significance level")] = 1e-3,
    seed: int = 0,
    n_gpu_layers: int = 0,
    as_json: Annotated[bool, typer.Option("--json")] = False,
    addr: Annotated[str, typer.Option("--addr", help="HOST:PORT of a running daemon: check it instead of "
                                      "loading the models here")] = "",
    token: Annotated[str, typer.Option("--token", envvar="EDGESPEC_TOKEN", help="bearer token (with --addr)")] = "",
    ca: Annotated[str, typer.Option("--ca", help="CA certificate (PEM): TLS (with --addr)")] = "",
    cert: Annotated[str, typer.Option("--cert", help="client certificate (PEM) for mutual TLS")] = "",
    key: Annotated[str, typer.Option("--key", help="client key (PEM) for mutual TLS")] = "",
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="tokens per live check")] = 48,
    suite: Annotated[str, typer.Option("--suite", help="with --addr: the prompts, a shipped bench suite or a JSONL "
                                       "file of {id, category, prompt} (default: six built-in prompts)")] = "",
    limit: Annotated[int | None, typer.Option("--limit", help="with --suite: the first N prompts of each file")] = None,
    concurrency: Annotated[str, typer.Option("--concurrency", help="with --addr: streams at once, comma-separated "
                                             "(one at a time is always checked)")] = "4",
    modes: Annotated[str, typer.Option("--modes", help="with --addr: speculative modes checked against plain")] =
        "auto,chain,tree",
    repeat: Annotated[int, typer.Option("--repeat", min=1, help="with --addr: every check this many times (the "
                                        "daemon's history differs each time)")] = 1,
) -> None:
    """Run the exactness checks against the given models, or a running daemon (--addr); exit 1 if
    any fails."""
    if addr:
        _live(addr, token, ca, cert, key, as_json, _LiveRun.parse(max_tokens, suite, limit, concurrency, modes, repeat))
        return
    with user_errors():
        from edgespec.engine import Engine
        from edgespec.sampling import SamplingParams
        from edgespec.selftest import run_statistical_checks
        from edgespec.types import GenerationRequest, SpeculationParams

        engine = Engine.load(engine_config(target, draft, n_ctx=2048, n_gpu_layers=n_gpu_layers), calibrate=False)
        dists = model_dists(engine)
        checks = [
            {"name": r.name, "p_value": float(r.p_value), "passed": bool(r.passed)}
            for r in run_statistical_checks(dists, trials=trials, seed=seed, alpha=alpha)
        ]
        prompt = tuple(engine.encode_chat([("user", PROMPTS[0])]))
        runs = {
            m: engine.generate(GenerationRequest(prompt, SamplingParams(max_tokens=48), SpeculationParams(mode=m)))
            for m in ("plain", "tree")
        }
        same = runs["plain"].token_ids == runs["tree"].token_ids
        checks.append({"name": "greedy_tree_equals_plain", "p_value": 1.0 if same else 0.0, "passed": same})
        _report(checks, as_json, lambda c: f"p={c['p_value']:.4g}")


@dataclass(frozen=True)
class _LiveRun:
    max_tokens: int
    prompts: tuple[str, ...]
    concurrency: tuple[int, ...]
    modes: tuple[str, ...]
    repeat: int

    @staticmethod
    def parse(max_tokens: int, suite: str, limit: int | None, concurrency: str, modes: str,
              repeat: int) -> _LiveRun:
        """The options as a run, each bad one a usage error naming it."""
        from edgespec.selftest_live import MODES, PROMPTS

        with user_errors():
            if suite:
                from edgespec.bench.suite import load_suite
                prompts = tuple(p.prompt for p in load_suite(suite, limit))
            else:
                prompts = PROMPTS
        try:
            levels = tuple(sorted({int(x) for x in concurrency.split(",") if x.strip()}))
        except ValueError:
            raise typer.BadParameter(f"not comma-separated integers: {concurrency!r}", param_hint="--concurrency") from None
        if not levels or min(levels) < 1 or max(levels) > 64:
            raise typer.BadParameter("levels from 1 to 64", param_hint="--concurrency")
        picked = tuple(m.strip().upper() for m in modes.split(",") if m.strip())
        if not picked or any(m not in MODES for m in picked):
            raise typer.BadParameter(f"a comma-separated subset of {','.join(MODES).lower()}", param_hint="--modes")
        return _LiveRun(max_tokens, prompts, levels, picked, repeat)


def _live(addr: str, token: str, ca: str, cert: str, key: str, as_json: bool, run: _LiveRun) -> None:
    import grpc
    from tqdm import tqdm

    from edgespec.cli.client import _options, _rpc_error
    from edgespec.proto.edgespec.v1 import inference_pb2_grpc
    from edgespec.selftest_live import live_requests, run_live_checks
    from edgespec.server.channel import open_channel

    opts = _options(addr, token, ca, cert, key, "")
    total = live_requests(len(run.prompts), run.concurrency, run.modes, run.repeat)
    with open_channel(opts) as channel, tqdm(total=total, desc="selftest", unit="req", file=sys.stderr,
                                             dynamic_ncols=True, disable=None) as bar:
        try:
            checks = run_live_checks(inference_pb2_grpc.InferenceStub(channel), opts.metadata,
                                     max_tokens=run.max_tokens, concurrency=run.concurrency, prompts=run.prompts,
                                     modes=run.modes, repeat=run.repeat, progress=bar.update)
        except grpc.RpcError as exc:
            _rpc_error(exc, addr)  # exits with the CLI's code for the status
    _report([{"name": c.name, "passed": c.passed, "detail": c.detail} for c in checks], as_json,
            lambda c: c["detail"], addr=addr, prompts=len(run.prompts), requests=total)


def _report(checks: list[dict], as_json: bool, detail, **extra) -> None:
    """Print the checks (a line each, or one JSON object with `extra`); exit 1 if any failed."""
    passed = all(c["passed"] for c in checks)
    if as_json:
        typer.echo(json.dumps({"passed": passed, **extra, "checks": checks}))
    else:
        for c in checks:
            typer.echo(f"{'PASS' if c['passed'] else 'FAIL'}  {c['name']:<36} {detail(c)}")
        typer.echo("selftest passed" if passed else "selftest FAILED")
    if not passed:
        raise typer.Exit(1)
