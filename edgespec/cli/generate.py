"""`edgespec generate`: local generation, no daemon."""

from __future__ import annotations

import json
import sys
from typing import Annotated, cast

import typer

from edgespec.cli.common import engine_config, user_errors
from edgespec.settings import SAMPLING, SECTIONS, Setting

# the options' defaults and ranges are the declared ones: the [speculation] and [target] keys, and
# the request fields every API checks the same way
_SPEC, _MODEL = SECTIONS["speculation"], SECTIONS["target"]


def _help(s: Setting) -> str:
    return f"{s.help} ({s.range_text()})" if s.range_text() else s.help


def register(app: typer.Typer) -> None:
    app.command("generate")(generate)


def generate(
    prompt: Annotated[str, typer.Argument(help="The prompt (a user message unless --raw).")],
    mode: Annotated[str, typer.Option(help="plain | chain | tree | auto")] = "auto",
    draft_tokens: Annotated[int, typer.Option(help=_help(_SPEC["draft_tokens"]))] = _SPEC["draft_tokens"].default,
    tree_nodes: Annotated[int, typer.Option(help=_help(_SPEC["tree_nodes"]))] = _SPEC["tree_nodes"].default,
    tree_depth: Annotated[int, typer.Option(help=_help(_SPEC["tree_depth"]))] = _SPEC["tree_depth"].default,
    temperature: Annotated[float, typer.Option(help=_help(SAMPLING["temperature"]))] = SAMPLING["temperature"].default,
    top_k: Annotated[int, typer.Option(help=_help(SAMPLING["top_k"]))] = SAMPLING["top_k"].default,
    top_p: Annotated[float, typer.Option(help=_help(SAMPLING["top_p"]))] = SAMPLING["top_p"].default,
    min_p: Annotated[float, typer.Option(help=_help(SAMPLING["min_p"]))] = SAMPLING["min_p"].default,
    seed: Annotated[int | None, typer.Option(help=_help(SAMPLING["seed"]))] = SAMPLING["seed"].default,
    max_tokens: Annotated[int, typer.Option(help=_help(SAMPLING["max_tokens"]))] = SAMPLING["max_tokens"].default,
    stop: Annotated[list[str] | None, typer.Option(help="stop string (repeatable)")] = None,
    ignore_eos: Annotated[bool, typer.Option(help=_help(SAMPLING["ignore_eos"]))] = SAMPLING["ignore_eos"].default,
    raw: Annotated[bool, typer.Option(help="no chat template")] = False,
    ngram: Annotated[bool, typer.Option(help=_help(_SPEC["ngram"]))] = _SPEC["ngram"].default,
    target: Annotated[str | None, typer.Option(help="target GGUF (default: demo F32)")] = None,
    draft: Annotated[str | None, typer.Option(help="draft GGUF; none = model-free drafting (default: the demo Q8_0 for the demo target, else none)")] = None,
    n_ctx: Annotated[int, typer.Option(help=_help(_MODEL["n_ctx"]))] = _MODEL["n_ctx"].default,
    n_gpu_layers: Annotated[int, typer.Option(help=_help(_MODEL["n_gpu_layers"]))] = _MODEL["n_gpu_layers"].default,
    threads: Annotated[int, typer.Option(help=_help(_MODEL["threads"]))] = _MODEL["threads"].default,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """Generate text locally with plain, chain, tree or adaptive (auto) speculative decoding."""
    with user_errors():
        from edgespec.sampling import SamplingParams
        from edgespec.types import Mode, SpeculationParams

        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                                  max_tokens=max_tokens, stop=tuple(stop or ()), ignore_eos=ignore_eos)
        # SpeculationParams checks the mode against MODES
        spec = SpeculationParams(mode=cast(Mode, mode), draft_tokens=draft_tokens, tree_nodes=tree_nodes,
                                 tree_depth=tree_depth, ngram=ngram)
        cfg = engine_config(target, draft, n_ctx=n_ctx, n_gpu_layers=n_gpu_layers, threads=threads,
                            no_draft=False)
        from edgespec.engine import Engine
        from edgespec.types import GenerationRequest

        engine = Engine.load(cfg)
        tokens = engine.tokenize(prompt) if raw else engine.encode_chat([("user", prompt)])
        sess = engine.open_session(GenerationRequest(tuple(tokens), sampling, spec))
        try:
            while not sess.done:
                chunk = sess.step()
                if not as_json and chunk.text:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
            res = sess.result()
            summary = sess.controller_summary()
        finally:
            sess.close()
        if as_json:
            stats = res.stats.as_dict()
            if summary is not None:
                stats["controller"] = summary
            typer.echo(json.dumps({"text": res.text, "tokens": res.token_ids, "finish_reason": res.finish_reason,
                                   "stats": stats}))
        else:
            sys.stdout.write("\n")
            st = res.stats
            typer.echo(f"[{res.finish_reason}] {st.emitted_tokens} tokens, {st.target_forwards} target forwards, "
                       f"tau {st.tau:.2f}, {st.tokens_per_second:.1f} tok/s", err=True)
