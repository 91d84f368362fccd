"""`edgespec models train-head`: train an EAGLE-3 head for a target GGUF (optional extra [train])."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from edgespec.cli.common import fail, user_errors


def register(models_app: typer.Typer) -> None:
    models_app.command("train-head")(train_head)
    models_app.command("eval-head")(eval_head)
    models_app.command("head-cost")(head_cost)


def train_head(
    ctx: typer.Context,
    out: Annotated[Path, typer.Argument(help="the head GGUF to write")],
    target: Annotated[Path | None, typer.Option(help="target GGUF (default: the demo target)")] = None,
    work_dir: Annotated[Path | None, typer.Option(help="data shards and checkpoints (default: OUT + '.work')")] = None,
    minutes: Annotated[float, typer.Option(help="training time budget (data building not included)")] = 30.0,
    epochs: Annotated[float, typer.Option(help="stop after this many epochs instead (0: use --minutes)")] = 0.0,
    distill_prompts: Annotated[int, typer.Option(help="category prompts the target answers (self-distillation; "
                                                 "code, JSON, legal, RAG, chat, Chinese)")] = 256,
    wide_prompts: Annotated[int, typer.Option(help="prompts built around installed packages' text (functions, "
                                              "documentation, licences) and open topic lists, answered by the "
                                              "target too (edgespec/headtrain/wide.py)")] = 0,
    init: Annotated[Path | None, typer.Option(help="start from this head GGUF (its weights and draft vocabulary): "
                                                 "fine-tune a head on new data")] = None,
    max_new: Annotated[int, typer.Option(help="answer tokens per prompt")] = 160,
    text_windows: Annotated[int, typer.Option(help="windows of installed packages' text the target only scores")] = 0,
    heldout_prompts: Annotated[int, typer.Option(help="prompts kept out of training for the report")] = 16,
    window: Annotated[int, typer.Option(help="tokens per packed training window")] = 256,
    max_windows: Annotated[int, typer.Option(help="train on at most this many windows (0: all)")] = 0,
    draft_vocab: Annotated[int, typer.Option(help="reduced draft vocabulary size (0: smallest covering --coverage)")] = 0,
    coverage: Annotated[float, typer.Option(help="coverage of held-back labels the automatic draft vocabulary "
                                            "must reach")] = 0.95,
    ttt_steps: Annotated[int, typer.Option(help="training-time-test steps (head fed its own outputs)")] = 3,
    batch: Annotated[int, typer.Option(help="windows per optimiser step")] = 4,
    streams: Annotated[int, typer.Option(help="sequences the target answers per forward while building data")] = 48,
    eval_s: Annotated[float, typer.Option(help="training seconds between held-out depth-1 checks")] = 120.0,
    lr: float = 1e-3,
    n_ff: Annotated[int, typer.Option(help="the head's FFN width")] = 1536,
    hf_dir: Annotated[Path | None, typer.Option(help="also export the public EAGLE-3 HF layout here")] = None,
    threads: Annotated[int, typer.Option(help="llama.cpp threads (0: all cores)")] = 0,
    seed: int = 0,
    features: Annotated[str, typer.Option(help="who runs the target to build the data: llama (llama.cpp, the CPU) or jax "
                                          "(edgespec/headtrain/target_jax.py: a GPU when jax has one)")] = "llama",
    sampled: Annotated[int, typer.Option(help="extra answers per training prompt, sampled (the labels stay the target's "
                                         "greedy tokens); --features jax")] = 0,
    sample_temperature: Annotated[float, typer.Option(help="temperature of the --sampled answers")] = 0.8,
    max_sampled: Annotated[int, typer.Option(help="at most this many --sampled answers in all, shortest prompts "
                                             "first (0: every round whole)")] = 0,
    data_minutes: Annotated[float, typer.Option(help="--features jax: start no new batch of answers after this "
                                                "many minutes (0: no limit)")] = 0.0,
    precision: Annotated[str, typer.Option(help="the head's weight and attention products in training: f32, bf16 "
                                           "(float32 weights, sums and optimiser), or auto: bf16 on a GPU and on a "
                                           "CPU with AMX or AVX512-BF16, else f32")] = "auto",
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Train an EAGLE-3 head on the target's own answers and package text; write a GGUF that
    llama.cpp's eagle3 loader reads, and report held-out acceptance at depth 1, 2, 3."""
    with user_errors():
        try:
            from edgespec.headtrain.train import PRECISIONS, TrainSpec, train
        except ImportError as e:  # pragma: no cover
            fail(f"train-head needs the [train] extra (pip install 'edgespec[train]'): {e}")
        target = _checked_target(target)
        _check_options(features, precision, PRECISIONS, sampled, init, minutes, epochs)
        spec = TrainSpec(target=target, out=out, work_dir=work_dir or Path(str(out) + ".work"), minutes=minutes,
                         epochs=epochs, distill_prompts=distill_prompts, wide_prompts=wide_prompts, init=init,
                         max_new=max_new, text_windows=text_windows,
                         heldout_prompts=heldout_prompts, window=window, max_windows=max_windows,
                         draft_vocab=draft_vocab, coverage=coverage, ttt_steps=ttt_steps, batch=batch, lr=lr,
                         n_ff=n_ff, hf_dir=hf_dir, threads=threads, seed=seed, streams=streams, eval_s=eval_s,
                         features=features, sampled=sampled, sample_temperature=sample_temperature,
                         max_sampled=max_sampled, data_minutes=data_minutes, precision=precision)
        from edgespec.heap import keep_training_heap

        keep_training_heap()  # this process trains and exits: each step's memory is the next one's
        rep = train(spec, command=_command(ctx))
        if rep["acceptance_by_depth"] is None:  # no llama.cpp here: the card waits for `models eval-head`
            typer.echo(json.dumps(rep) if as_json else f"head: {rep['head']}; held-out acceptance not measured (no "
                       f"llama.cpp here): edgespec models eval-head {spec.out} --work-dir {spec.work_dir}")
            return
        _write_card(spec, rep)
        typer.echo(json.dumps(rep) if as_json else _summary(rep))


def _checked_target(target: Path | None) -> Path:
    """The target GGUF (the demo target when not given), which must exist."""
    if target is None:
        from edgespec.models import default_pair

        target = default_pair().target
    if not target.is_file():
        fail(f"target model not found: {target}")
    return target


def _check_options(features: str, precision: str, precisions: tuple[str, ...], sampled: int, init: Path | None,
                   minutes: float, epochs: float) -> None:
    """train-head's options that only make sense together, each refused naming the flag."""
    if features not in ("llama", "jax"):
        fail(f"--features must be llama or jax, got {features!r}")
    if precision not in precisions:
        fail(f"--precision must be one of {', '.join(precisions)}, got {precision!r}")
    if sampled and features != "jax":
        fail("--sampled needs --features jax")
    if init is not None and not init.is_file():
        fail(f"--init: head not found: {init}")
    if minutes <= 0 and epochs <= 0:
        fail(f"--minutes must be > 0 (or --epochs > 0), got {minutes}")


def _summary(rep: dict) -> str:
    """The trained head's size, training and held-out acceptance, for a terminal."""
    return "\n".join([
        f"head: {rep['head']} ({rep['head_fraction_of_target']:.1%} of the target's bytes, "
        f"draft vocabulary {rep['draft_vocab']})",
        f"trained {rep['train_minutes']:.1f} min, {rep['epochs']:.1f} epochs over {rep['train_tokens']} tokens",
        "held-out acceptance (greedy chain, through llama.cpp): "
        + ", ".join(f"depth {d + 1}: {a:.3f}" for d, a in enumerate(rep["acceptance_by_depth"])),
    ])


def _path_or_none(v: str) -> Path | None:
    """A path field of a report's spec, as str() wrote it."""
    return None if v == "None" else Path(v)


def _command(ctx: typer.Context) -> str:
    """The train-head command line of this run: OUT, then every option away from its default
    (output switches left out), in declaration order; what the card records."""
    import shlex

    args: list[str] = []
    for p in ctx.command.params:
        v = ctx.params.get(p.name)
        if p.param_type_name == "argument":
            args.append(str(v))
        elif p.name != "as_json" and v is not None and v != p.default:
            args += [p.opts[0], str(v)]
    return shlex.join(["edgespec", "models", "train-head", *args])


def eval_head(
    head: Annotated[Path, typer.Argument(help="a head GGUF written by train-head")],
    work_dir: Annotated[Path | None, typer.Option(help="the training's work directory (its report.json and "
                                                     "heldout.json); the card is written")] = None,
    suite: Annotated[str | None, typer.Option(help="measure on the target's answers to this prompt suite instead "
                                                 "(a shipped suite name, e.g. all, or a JSONL file of id, category, "
                                                 "prompt), by category; no card is written")] = None,
    max_new: Annotated[int, typer.Option(help="--suite: answer tokens per prompt")] = 64,
    target: Annotated[Path | None, typer.Option(help="target GGUF (default: the demo target)")] = None,
    threads: Annotated[int, typer.Option(help="llama.cpp threads (0: all cores)")] = 0,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Measure a trained head's held-out acceptance through llama.cpp on the real target (for a
    head trained where llama.cpp is not installed, e.g. `train-head --features jax` on a GPU
    box), then write its card beside it; or, with --suite, its acceptance on your own prompts."""
    with user_errors():
        from edgespec.backend import Model, check_head
        from edgespec.headtrain.evaluate import acceptance
        from edgespec.headtrain.train import TrainSpec

        if target is None:
            from edgespec.models import default_pair

            target = default_pair().target
        if (work_dir is None) == (suite is None):
            fail("give --work-dir (the training's held-out answers; writes the card) or --suite (your prompts)")
        for p in (head, target):
            if not p.is_file():
                fail(f"not found: {p}")
        if suite is not None:
            _eval_suite(head, target, suite, max_new, threads, as_json)
            return
        assert work_dir is not None  # exactly one of the two
        for p in (work_dir / "report.json", work_dir / "heldout.json"):
            if not p.is_file():
                fail(f"not found: {p}")
        rep = json.loads((work_dir / "report.json").read_text())
        held = json.loads((work_dir / "heldout.json").read_text())
        t, h = Model(target), Model(head)
        check_head(t, h)
        acc = acceptance(t, h, held["sequences"], held["prompt_len"], depth=3, threads=threads)
        rep.update(head=str(head), head_bytes=h.size_bytes, target_bytes=t.size_bytes,
                   head_fraction_of_target=h.size_bytes / t.size_bytes, heldout_positions=acc.positions,
                   acceptance_by_depth=acc.rates, chain3_tau=acc.tau)
        (work_dir / "report.json").write_text(json.dumps(rep, indent=2))
        fields = TrainSpec.__dataclass_fields__
        conv: dict[str, Callable[[str], Any]] = {"target": Path, "out": Path, "work_dir": Path,
                                                 "hf_dir": _path_or_none, "init": _path_or_none}
        kw = {k: conv.get(k, type(fields[k].default))(v) for k, v in rep["spec"].items() if k in fields}
        spec = TrainSpec(**{**kw, "out": head, "target": target, "work_dir": work_dir})
        _write_card(spec, rep)
        if as_json:
            typer.echo(json.dumps(rep))
        else:
            typer.echo("held-out acceptance (greedy chain, through llama.cpp): "
                       + ", ".join(f"depth {d + 1}: {a:.3f}" for d, a in enumerate(acc.rates)))


def _eval_suite(head: Path, target: Path, suite: str, max_new: int, threads: int, as_json: bool) -> None:
    """Depth-1..3 acceptance of `head` on the target's greedy answers to a suite's prompts, per
    category and overall."""
    from tqdm import tqdm

    from edgespec.backend import Model, check_head
    from edgespec.bench.suite import load_suite
    from edgespec.headtrain.evaluate import Acceptance, suite_acceptance

    if max_new < 2:
        fail(f"--max-new must be >= 2, got {max_new}")
    prompts = load_suite(suite)
    t, h = Model(target), Model(head)
    check_head(t, h)
    cats = sorted({p.category for p in prompts})
    by_cat: dict[str, Acceptance] = {}
    with tqdm(total=len(prompts), desc="acceptance on the suite", unit="prompt") as bar:
        for c in cats:
            by_cat[c] = suite_acceptance(t, h, [p.prompt for p in prompts if p.category == c], max_new, depth=3,
                                         threads=threads, progress=bar.update)
    total = Acceptance(3, sum(a.positions for a in by_cat.values()),
                       [sum(a.hits[d] for a in by_cat.values()) for d in range(3)])
    rows = {**by_cat, "overall": total}
    out = {"head": str(head), "suite": suite, "prompts": len(prompts), "max_new": max_new,
           "by_category": {c: {"positions": a.positions, "acceptance_by_depth": a.rates, "chain3_tau": a.tau}
                           for c, a in rows.items()}}
    if as_json:
        typer.echo(json.dumps(out))
        return
    typer.echo(f"{'category':<10} {'positions':>9}  depth 1  depth 2  depth 3  chain-of-3 tau")
    for c, a in rows.items():
        typer.echo(f"{c:<10} {a.positions:>9}  " + "  ".join(f"{r:7.3f}" for r in a.rates) + f"  {a.tau:14.2f}")


def _write_card(spec, rep: dict) -> None:
    """OUT.json beside the head: how it was trained (the command line), its data seed, the
    held-out figures and its SHA-256 (the file `edgespec models` checks a shipped head against)."""
    from edgespec.models import sha256_file

    acc = rep["acceptance_by_depth"]
    card = {
        "head": spec.out.name, "sha256": sha256_file(spec.out), "size": spec.out.stat().st_size,
        "target": spec.target.name, "target_sha256": sha256_file(spec.target),
        "command": rep.get("command"),  # the train-head command line (edgespec.headtrain.train)
        "seed": spec.seed,
        "data": {"distill_prompts": spec.distill_prompts, "heldout_prompts": spec.heldout_prompts, "max_new": spec.max_new,
                 "wide_prompts": spec.wide_prompts, "text_windows": spec.text_windows, "train_tokens": rep["train_tokens"],
                 "train_sequences": rep["train_sequences"], "data_minutes": round(rep["data_minutes"], 1)},
        "training": {"minutes": round(rep["train_minutes"], 1), "steps": rep["steps"], "epochs": round(rep["epochs"], 2),
                     "best_step": rep["best_step"], "tokens_per_s": None if rep["train_tokens_per_s"] != rep["train_tokens_per_s"] else round(rep["train_tokens_per_s"], 1),
                     "draft_vocab": rep["draft_vocab"], "coverage": rep["coverage"], "window": spec.window,
                     "batch": spec.batch, "ttt_steps": spec.ttt_steps, "lr": spec.lr, "n_ff": spec.n_ff,
                     "precision": rep.get("precision")},
        "heldout": {"positions": rep["heldout_positions"], "depth1": round(acc[0], 4),
                    "by_depth": [round(a, 4) for a in acc], "chain3_tau": round(rep["chain3_tau"], 3),
                    "curve": rep["heldout_curve"]},
    }
    if spec.init is not None:  # fine-tuned: the head it started from (its own card says how that was made)
        card["init"] = {"head": spec.init.name, "sha256": sha256_file(spec.init)}
    path = spec.out.with_suffix(".json")
    old = json.loads(path.read_text()) if path.is_file() else {}
    if old.get("sha256") == card["sha256"] and "bench" in old:
        card["bench"] = old["bench"]  # measured speed-ups of this very file are kept
    path.write_text(json.dumps(card, indent=2) + "\n")


def head_cost(
    head: Annotated[Path, typer.Argument(help="an EAGLE-3 head GGUF")],
    target: Annotated[Path | None, typer.Option(help="target GGUF (default: the demo target)")] = None,
    context: Annotated[int, typer.Option(help="context tokens before the timed forwards")] = 256,
    rounds: int = 40,
    threads: Annotated[int, typer.Option(help="llama.cpp threads")] = 1,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """A head's bytes and forward time as fractions of its target's (timed in one process, interleaved)."""
    with user_errors():
        from edgespec.backend import Model, check_head
        from edgespec.headtrain.evaluate import forward_costs

        if target is None:
            from edgespec.models import default_pair

            target = default_pair().target
        t, h = Model(target), Model(head)
        check_head(t, h)
        c = forward_costs(t, h, context=context, rounds=rounds, threads=threads)
        rep = {"head_bytes": h.size_bytes, "target_bytes": t.size_bytes, "bytes_fraction": h.size_bytes / t.size_bytes,
               "target_forward_s": c.target_s, "head_forward_s": c.head_s, "head_forward_fraction": c.ratio,
               "head_catchup_2_s": c.head_catchup_s, "context": context, "rounds": rounds, "threads": threads}
        if as_json:
            typer.echo(json.dumps(rep))
        else:
            typer.echo(f"bytes: head {h.size_bytes / 2**20:.1f} MiB = {rep['bytes_fraction']:.1%} of the target's")
            typer.echo(f"forward (1 token after {context}): target {c.target_s * 1e3:.2f} ms, head {c.head_s * 1e3:.2f} ms "
                       f"= {c.ratio:.3f} of a target forward; encode + 2-token catch-up {c.head_catchup_s * 1e3:.2f} ms")
