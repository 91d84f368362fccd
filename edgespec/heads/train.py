"""`edgespec models train-head`: data -> features -> an EAGLE-3 head -> GGUF (+ HF layout) -> a
held-out acceptance report measured through llama.cpp.

Everything lives in a work directory and is resumable: data shards that exist are kept, and
training resumes from its last checkpoint (`checkpoint.npz`, written every `checkpoint_s`).
`minutes` bounds the training loop; data building is bounded by the sizes asked for.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from edgespec.heads.data import Shard, extract, package_texts, self_distill, synthetic_prompts, windows
from edgespec.heads.weights import HeadWeights, config_for_target, write_gguf

DRAFT_VOCABS = (1024, 2048, 4096, 8192, 16384, 32768)


@dataclass(frozen=True)
class TrainSpec:
    target: Path
    out: Path  # the head GGUF
    work_dir: Path
    minutes: float = 30.0
    distill_prompts: int = 256  # synthetic prompts answered by the target (self-distillation)
    heldout_prompts: int = 16  # prompts never trained on, for the acceptance report
    max_new: int = 160  # answer tokens per prompt
    text_windows: int = 64  # windows of package text
    window: int = 128  # tokens per training window
    max_windows: int = 0  # train on at most this many windows (0: all)
    draft_vocab: int = 0  # 0: the smallest of DRAFT_VOCABS covering `coverage` of the labels
    coverage: float = 0.97
    n_ff: int = 1536
    ttt_steps: int = 3
    batch: int = 8
    lr: float = 1e-3
    epochs: float = 0.0  # 0: as many as `minutes` allow
    seed: int = 0
    threads: int = 0
    hf_dir: Path | None = None  # also export the public EAGLE-3 HF layout there
    checkpoint_s: float = 60.0


def _log(msg: str) -> None:
    tqdm.write(msg)


def target_embeddings(target_gguf: Path) -> np.ndarray:
    """[vocab, n_embd] float32 token embeddings of the target (dequantized if need be)."""
    import gguf

    r = gguf.GGUFReader(str(target_gguf))
    t = next(t for t in r.tensors if t.name == "token_embd.weight")
    data = gguf.quants.dequantize(t.data, t.tensor_type) if t.tensor_type not in (0, 1) else np.asarray(t.data)
    n_embd = int(t.shape[0])
    return np.asarray(data, np.float32).reshape(-1, n_embd)


def build_data(spec: TrainSpec, target, layers) -> tuple[list[Path], list[list[int]], list[int]]:  # noqa: ANN001
    """Train shards, plus the held-out sequences (prompt + greedy answer) and their answer starts."""
    wd = spec.work_dir
    (wd / "data").mkdir(parents=True, exist_ok=True)
    prompts = synthetic_prompts(spec.distill_prompts + spec.heldout_prompts, spec.seed)
    train_prompts, held_prompts = prompts[:spec.distill_prompts], prompts[spec.distill_prompts:]
    seq_file = wd / "distilled.json"
    if seq_file.is_file():
        seqs = json.loads(seq_file.read_text())
    else:
        seqs = {}
    for name, ps in (("train", train_prompts), ("heldout", held_prompts)):
        if name in seqs and len(seqs[name]) == len(ps):
            continue
        with tqdm(total=len(ps), desc=f"target answers ({name})", unit="prompt") as bar:
            seqs[name] = self_distill(target, ps, spec.max_new, threads=spec.threads,
                                      progress=lambda n, t: bar.update(n))
        seq_file.write_text(json.dumps(seqs))
    held_starts = [len(target.tokenize(target.chat_prompt([("user", p)]), add_special=True, parse_special=True))
                   for p in held_prompts]
    T = spec.window
    stream = [t for s in seqs["train"] for t in s]
    wins = list(windows(stream, T))
    text_wins: list[list[int]] = []
    for text in package_texts(seed=spec.seed):
        if len(text_wins) >= spec.text_windows:
            break
        toks = target.tokenize(text[:20_000], add_special=False)
        text_wins.extend(list(windows(toks, T))[:2])
    wins += text_wins[:spec.text_windows]
    order = np.random.default_rng(spec.seed).permutation(len(wins))
    wins = [wins[i] for i in order]
    shards = []
    n_sh = (len(wins) + Shard.SIZE - 1) // Shard.SIZE
    with tqdm(total=n_sh, desc="target features", unit="shard") as bar:
        for i in range(n_sh):
            path = wd / "data" / f"train-{T}-{i:04d}.npz"
            if not path.is_file():
                extract(target, layers, wins[i * Shard.SIZE:(i + 1) * Shard.SIZE], threads=spec.threads).save(path)
            shards.append(path)
            bar.update(1)
    return shards, seqs["heldout"], held_starts


def choose_draft_vocab(labels: np.ndarray, n_vocab: int, size: int, coverage: float) -> tuple[np.ndarray, list[tuple[int, float]]]:
    """The most frequent target tokens among the labels: (d2t, [(size, coverage)] measured)."""
    counts = np.bincount(labels.ravel(), minlength=n_vocab)
    order = np.argsort(-counts, kind="stable")
    cum = np.cumsum(counts[order]) / max(1, counts.sum())
    table = [(v, float(cum[min(v, n_vocab) - 1])) for v in DRAFT_VOCABS if v <= n_vocab]
    if not size:
        size = next((v for v, c in table if c >= coverage), table[-1][0])
    return np.sort(order[:size]).astype(np.int64), table


def train(spec: TrainSpec, log: Callable[[str], None] = _log) -> dict:
    """Build the data, fit the head (resuming from its checkpoint), write its GGUF (and the HF
    layout when asked), measure held-out acceptance; the report is also written to work_dir."""
    if spec.threads == 1 and "XLA_FLAGS" not in os.environ:  # before jax starts its CPU client
        os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    from edgespec.backend import Model

    t_start = time.time()
    target = Model(spec.target)
    probe = config_for_target(spec.target, 1, n_ff=spec.n_ff)
    shards, held, held_starts = build_data(spec, target, probe.layers)
    t_data = time.time() - t_start
    data = [Shard.load(p) for p in shards]
    keep = spec.max_windows or None
    tokens = np.concatenate([d.tokens for d in data])[:keep]
    labels = np.concatenate([d.labels for d in data])[:keep]
    feats = np.concatenate([d.features for d in data])[:keep]
    d2t, cov_table = choose_draft_vocab(labels, target.n_vocab, spec.draft_vocab, spec.coverage)
    log("draft vocabulary coverage of the target's greedy tokens: " + ", ".join(f"{v}: {c:.3f}" for v, c in cov_table)
        + f" -> {len(d2t)}")
    cfg = config_for_target(spec.target, len(d2t), n_ff=spec.n_ff)
    t2d = np.full(target.n_vocab, -1, np.int32)
    t2d[d2t] = np.arange(len(d2t))
    embed = target_embeddings(spec.target)
    head = HeadWeights.init(cfg, d2t, np.random.default_rng(spec.seed), embed=embed)
    # at position t the head reads token[t+1] and predicts the target's greedy token after it
    fit = _fit(spec, head, embed, tokens[:, 1:], t2d[labels[:, 1:]], feats[:, :-1], log)
    write_gguf(head, spec.out, spec.target)
    if spec.hf_dir is not None:
        from edgespec.heads.hf import write_hf

        write_hf(head, spec.hf_dir, target.n_vocab)
    from edgespec.heads.evaluate import acceptance

    hm = Model(spec.out)  # llama.cpp's eagle3 loader accepts it (or this raises)
    with tqdm(total=len(held), desc="held-out acceptance", unit="prompt") as bar2:
        acc = acceptance(target, hm, held, held_starts, depth=3, threads=spec.threads, progress=bar2.update)
    n = fit.windows
    report = {
        "head": str(spec.out), "head_bytes": hm.size_bytes, "target_bytes": target.size_bytes,
        "head_fraction_of_target": hm.size_bytes / target.size_bytes,
        "head_params": head.n_params, "draft_vocab": len(d2t), "coverage": cov_table,
        "train_windows": int(n), "train_tokens": int(n * (spec.window - 1)), "window": spec.window,
        "steps": fit.steps, "epochs": fit.steps * spec.batch / n, "train_minutes": fit.trained_s / 60,
        "data_minutes": t_data / 60, "final_loss": fit.loss, "train_acc_by_step": [float(a) for a in fit.accs],
        "heldout_positions": acc.positions, "acceptance_by_depth": acc.rates, "chain3_tau": acc.tau,
        "spec": {k: str(v) for k, v in asdict(spec).items()},
    }
    (spec.work_dir / "report.json").write_text(json.dumps(report, indent=2))
    hm.close()
    return report


@dataclass
class _Fit:
    windows: int  # training windows
    steps: int  # optimiser steps, a resumed run's earlier ones included
    trained_s: float  # seconds in training steps, likewise
    loss: float  # the last step's (nan when a resumed run had nothing left to train)
    accs: np.ndarray  # [ttt_steps] the last step's accuracy at each training-time-test step


def _fit(spec: TrainSpec, head: HeadWeights, embed: np.ndarray, inp: np.ndarray, lab: np.ndarray, f_in: np.ndarray,
         log: Callable[[str], None]) -> _Fit:
    """Adam with warm-up and cosine decay for spec.epochs (or spec.minutes of training), from the
    work directory's checkpoint when it is for the same draft vocabulary; head.w ends trained."""
    import jax.numpy as jnp

    from edgespec.heads import model_jax as mj

    ckpt = spec.work_dir / "checkpoint.npz"
    params, opt, step_i, trained_s = _resume(ckpt, head, log)
    train_step = mj.make_train_step(head.cfg, spec.ttt_steps)
    embed_j = jnp.asarray(embed)
    n = len(inp)
    steps_per_epoch = max(1, n // spec.batch)
    max_steps = int(spec.epochs * steps_per_epoch) if spec.epochs else None
    budget = spec.minutes * 60.0

    def save() -> None:
        arrs = {f"p.{k}": np.asarray(v) for k, v in params.items()}
        arrs |= {f"m.{k}": np.asarray(v) for k, v in opt["m"].items()}
        arrs |= {f"v.{k}": np.asarray(v) for k, v in opt["v"].items()}
        tmp = ckpt.with_suffix(".tmp.npz")
        np.savez(tmp, **arrs, t=np.asarray(opt["t"]), step=step_i, trained_s=trained_s, d2t=head.d2t)
        tmp.replace(ckpt)

    last_save = time.time()
    accs = np.zeros(spec.ttt_steps)
    loss = float("nan")
    bar = tqdm(total=max_steps if max_steps else int(budget), initial=step_i if max_steps else int(trained_s),
               desc="training", unit="step" if max_steps else "s")
    while (step_i < max_steps) if max_steps is not None else (trained_s < budget):
        t0 = time.time()
        epoch_rng = np.random.default_rng(spec.seed + step_i // steps_per_epoch)
        perm = epoch_rng.permutation(n)
        idx = perm[(step_i % steps_per_epoch) * spec.batch:][:spec.batch]
        frac = (step_i / max_steps) if max_steps else (trained_s / budget)
        lr = spec.lr * min(1.0, (step_i + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * min(1.0, frac))))
        params, opt, loss_j, accs_j = train_step(params, opt, embed_j, jnp.asarray(f_in[idx], jnp.float32),
                                                 jnp.asarray(inp[idx]), jnp.asarray(lab[idx]), jnp.float32(lr))
        loss, accs = float(loss_j), np.asarray(accs_j)
        step_i += 1
        dt = time.time() - t0
        trained_s += dt
        bar.update(1 if max_steps else dt)
        bar.set_postfix(loss=f"{loss:.3f}", acc="/".join(f"{a:.2f}" for a in accs), epoch=f"{step_i / steps_per_epoch:.2f}")
        if time.time() - last_save > spec.checkpoint_s:
            save()
            last_save = time.time()
    bar.close()
    save()
    head.w = {k: np.asarray(v) for k, v in params.items()}
    return _Fit(windows=n, steps=step_i, trained_s=trained_s, loss=loss, accs=accs)


def _resume(ckpt: Path, head: HeadWeights, log: Callable[[str], None]):  # noqa: ANN202
    """(params, Adam state, step, seconds trained): the checkpoint's when it is for this draft
    vocabulary, else the head's initial weights at step 0."""
    import jax.numpy as jnp

    from edgespec.heads import model_jax as mj

    params = {k: jnp.asarray(v) for k, v in head.w.items()}
    if ckpt.is_file():
        z = np.load(ckpt)
        if z["d2t"].shape == head.d2t.shape and np.array_equal(z["d2t"], head.d2t):
            params = {k: jnp.asarray(z[f"p.{k}"]) for k in head.w}
            opt = {"m": {k: jnp.asarray(z[f"m.{k}"]) for k in head.w}, "v": {k: jnp.asarray(z[f"v.{k}"]) for k in head.w},
                   "t": jnp.asarray(z["t"])}
            step_i, trained_s = int(z["step"]), float(z["trained_s"])
            log(f"resuming from {ckpt} at step {step_i} ({trained_s / 60:.1f} min trained)")
            return params, opt, step_i, trained_s
    return params, mj.adam_init(params), 0, 0.0
