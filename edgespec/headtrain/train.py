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
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from edgespec.heads.weights import HeadConfig, HeadWeights, config_for_target, read_gguf, write_gguf
from edgespec.headtrain.data import Sequences, package_texts, windows

DRAFT_VOCABS = (1024, 2048, 4096, 8192, 16384, 32768)


@dataclass(frozen=True)
class TrainSpec:
    target: Path
    out: Path  # the head GGUF
    work_dir: Path
    minutes: float = 30.0
    distill_prompts: int = 256  # category prompts answered by the target (self-distillation)
    wide_prompts: int = 0  # prompts built around installed packages' text (heads/wide.py), answered too
    init: Path | None = None  # start from this head GGUF's weights and draft vocabulary (fine-tuning)
    heldout_prompts: int = 16  # prompts never trained on, for the acceptance report
    max_new: int = 160  # answer tokens per prompt
    text_windows: int = 0  # windows of package text the target only scores (prefill, its greedy labels)
    window: int = 256  # tokens per packed training window
    max_windows: int = 0  # train on at most this many windows (0: all)
    draft_vocab: int = 0  # 0: the smallest of DRAFT_VOCABS covering `coverage` of the labels
    coverage: float = 0.95
    n_ff: int = 1536
    ttt_steps: int = 3
    batch: int = 4
    lr: float = 1e-3
    epochs: float = 0.0  # 0: as many as `minutes` allow
    seed: int = 0
    threads: int = 0
    hf_dir: Path | None = None  # also export the public EAGLE-3 HF layout there
    checkpoint_s: float = 60.0
    streams: int = 48  # sequences generated per target forward
    eval_s: float = 120.0  # seconds of training between held-out depth-1 checks
    features: str = "llama"  # who runs the target for the data: "llama" (llama.cpp) or "jax" (target_jax: a GPU)
    sampled: int = 0  # extra answers per training prompt sampled at `sample_temperature` (labels stay greedy)
    sample_temperature: float = 0.8
    max_sampled: int = 0  # --features jax: at most this many sampled answers in all (0: every round whole)
    data_minutes: float = 0.0  # --features jax: stop starting new batches of answers after this (0: no limit)
    precision: str = "auto"  # weight and attention products in training: f32, bf16, auto (`training_precision`)


def _log(msg: str) -> None:
    tqdm.write(msg)


PRECISIONS = ("auto", "f32", "bf16")
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")  # x86 units that multiply bfloat16 natively


def training_precision(precision: str, backend: str, cpu_flags: frozenset[str] | set[str]) -> str:
    """The precision of the head's weight and attention products (edgespec.headtrain.model_jax.linear,
    einsum). `auto`: bf16 (float32 sums) on an accelerator, and on a CPU with AMX or AVX512-BF16,
    where XLA's bfloat16 products run 2.6x (the whole step) to 5x (a mat-mul alone) faster than
    float32 ones; f32 elsewhere, where bfloat16 would be emulated."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision != "auto":
        return precision
    if backend != "cpu":
        return "bf16"
    return "bf16" if any(f in cpu_flags for f in BF16_CPU_FLAGS) else "f32"


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def target_embeddings(target_gguf: Path) -> np.ndarray:
    """[vocab, n_embd] float32 token embeddings of the target (dequantized if need be)."""
    import gguf

    r = gguf.GGUFReader(str(target_gguf))
    t = next(t for t in r.tensors if t.name == "token_embd.weight")
    data = gguf.quants.dequantize(t.data, t.tensor_type) if t.tensor_type not in (0, 1) else np.asarray(t.data)
    n_embd = int(t.shape[0])
    return np.asarray(data, np.float32).reshape(-1, n_embd)


PROMPTS_PER_SHARD = 96


def build_sequences(spec: TrainSpec, target, layers, log: Callable[[str], None] = _log):
    """The target's greedy answers to the category prompts (edgespec/headtrain/prompts.py), and to
    `wide_prompts` prompts built around installed packages' text (edgespec/headtrain/wide.py), with
    their features captured while generating, in shards of PROMPTS_PER_SHARD prompts under
    work_dir/data (a shard on disk is kept: a rerun resumes, and a larger count adds shards).
    Returns (train Sequences, held-out Sequences): the first `heldout_prompts` prompts of each
    source (round-robin over the categories) are held out, the rest trained on."""
    from edgespec.headtrain.data import Sequences
    from edgespec.headtrain.wide import prompt_sources

    d = spec.work_dir / "data"
    d.mkdir(parents=True, exist_ok=True)
    tag = f"s{spec.seed}-n{spec.max_new}"
    h_n = spec.heldout_prompts
    train, held = [], []
    for prefix, pairs in prompt_sources(h_n, spec.distill_prompts, spec.wide_prompts, spec.seed):
        ps = [p for _, p in pairs]
        h, t = _shards(spec, target, layers, ps[:h_n], ps[h_n:], d, f"{prefix}{tag}", log)
        held.append(h)
        train.extend(t)
    return Sequences.concat(train), Sequences.concat(held)


def _shards(spec: TrainSpec, target, layers, held_p: list[str], train_p: list[str], d: Path, tag: str,
            log: Callable[[str], None]):
    """(held-out Sequences, [train Sequences per shard]) of one prompt source, built or loaded."""
    from edgespec.headtrain.data import Sequences, distill_features

    held_path = d / f"heldout-{tag}-{len(held_p)}.npz"
    _build_once(held_path, lambda: distill_features(target, layers, held_p, spec.max_new, n_seq=spec.streams,
                                                    threads=spec.threads))
    n_sh = (len(train_p) + PROMPTS_PER_SHARD - 1) // PROMPTS_PER_SHARD
    paths = [d / f"train-{tag}-{i:04d}.npz" for i in range(n_sh)]
    chunks = [train_p[i * PROMPTS_PER_SHARD:(i + 1) * PROMPTS_PER_SHARD] for i in range(n_sh)]
    _build_shards(paths, [partial(distill_features, target, layers, c, spec.max_new, n_seq=spec.streams,
                                  threads=spec.threads) for c in chunks],
                  "target answers + features", f"shard {tag}", log)
    return Sequences.load(held_path), [Sequences.load(p) for p in paths]


def _build_shards(paths: list[Path], builds: list[Callable[[], Sequences]], desc: str, what: str,
                  log: Callable[[str], None]) -> None:
    """Every `builds[i]()` saved at `paths[i]` unless it is there. Several processes may build one
    work directory (one core each): a shard being built by a live process is skipped, then
    waited for (or built, if its builder died)."""
    t0, done = time.time(), 0
    for i in tqdm(range(len(paths)), desc=desc, unit="shard"):
        if paths[i].is_file() or not _claim(paths[i]):
            continue
        sq = builds[i]()
        sq.save(paths[i])
        paths[i].with_suffix(".lock").unlink(missing_ok=True)
        done += len(sq.tokens)
        log(f"{what} {i}: {len(sq.tokens)} rows, {done / (time.time() - t0):.1f} rows/s in this process")
    for p, build in zip(paths, builds):
        _build_once(p, build)


def _build_once(path: Path, build: Callable[[], Sequences]) -> None:
    """`build()` saved at `path` unless it is there, by one of the processes sharing the work
    directory (the others wait for it)."""
    while not path.is_file():
        if _claim(path):
            build().save(path)
            path.with_suffix(".lock").unlink(missing_ok=True)
        else:
            time.sleep(5)


def _claim(path: Path) -> bool:
    """Take the lock of a shard to build (False: a live process holds it)."""
    lock = path.with_suffix(".lock")
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                pid = int(lock.read_text() or 0)
                os.kill(pid, 0)
                return False
            except (ValueError, ProcessLookupError, FileNotFoundError):
                lock.unlink(missing_ok=True)  # stale: its process is gone
                continue
            except PermissionError:
                return False
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        return True
    return False


def choose_draft_vocab(labels: np.ndarray, n_vocab: int, size: int, coverage: float) -> tuple[np.ndarray, list[tuple[int, float]]]:
    """The most frequent target tokens among the labels: (d2t, [(size, coverage)] measured)."""
    counts = np.bincount(labels.ravel(), minlength=n_vocab)
    order = np.argsort(-counts, kind="stable")
    cum = np.cumsum(counts[order]) / max(1, counts.sum())
    table = [(v, float(cum[min(v, n_vocab) - 1])) for v in DRAFT_VOCABS if v <= n_vocab]
    if not size:
        size = next((v for v, c in table if c >= coverage), table[-1][0])
    return np.sort(order[:size]).astype(np.int64), table


TEXT_WINDOWS_PER_SHARD = 64


def text_windows(target, n: int, length: int, seed: int) -> list[list[int]]:
    """The first `n` windows of `length` tokens of installed packages' text, at most two per file,
    files in `package_texts`' deterministic order (every file it finds: the windows of a smaller
    `n` are the first ones of a larger `n`)."""
    wins: list[list[int]] = []
    for text in package_texts(max_files=1 << 30, seed=seed):
        if len(wins) >= n:
            break
        toks = target.tokenize(text[:20_000], add_special=False)
        wins.extend(list(windows(toks, length))[:2])
    return wins[:n]


def scored_text(spec: TrainSpec, target, layers, log: Callable[[str], None] = _log) -> Sequences | None:
    """Windows of package text the target merely scores (one prefill per 512 tokens of windows,
    no generation): every position labelled with the target's greedy next token. Built in shards of
    TEXT_WINDOWS_PER_SHARD windows under work_dir/data, as the answers are (`_build_shards`): a
    shard on disk is kept, a larger `text_windows` adds shards, and several processes may build
    one work directory at once."""
    from edgespec.headtrain.data import Sequences, extract

    if not spec.text_windows:
        return None
    d = spec.work_dir / "data"
    d.mkdir(parents=True, exist_ok=True)
    wins = text_windows(target, spec.text_windows, spec.window, spec.seed)
    per = TEXT_WINDOWS_PER_SHARD
    chunks = [wins[i:i + per] for i in range(0, len(wins), per)]
    paths = [d / f"text-s{spec.seed}-{spec.window}-{i:04d}-{len(c)}.npz" for i, c in enumerate(chunks)]

    def build(c: list[list[int]]) -> Sequences:
        sh = extract(target, layers, c, threads=spec.threads)
        n, T = sh.tokens.shape
        return Sequences(sh.tokens.ravel(), sh.labels.ravel(), sh.features.reshape(n * T, -1),
                         np.arange(0, n * T + 1, T, dtype=np.int64), np.ones(n, np.int32))

    _build_shards(paths, [partial(build, c) for c in chunks], "scored text + features", "text shard", log)
    return Sequences.concat([Sequences.load(p) for p in paths])


def choose_vocab_measured(data: Sequences, n_vocab: int, size: int, coverage: float, seed: int):
    """The draft vocabulary from the training labels; its size the smallest of DRAFT_VOCABS whose
    coverage of labels it was NOT chosen from (5 % of the sequences, held back) reaches `coverage`.
    Returns (d2t over all labels, [(size, measured coverage)])."""
    S = len(data.starts) - 1
    back = np.zeros(len(data.tokens), bool)
    rng = np.random.default_rng(seed + 1)
    for s in rng.choice(S, max(1, S // 20), replace=False):
        back[data.starts[s]:data.starts[s + 1]] = True
    ok = data.labels >= 0
    fit_l, val_l = data.labels[ok & ~back], data.labels[ok & back]
    counts = np.bincount(fit_l, minlength=n_vocab)
    order = np.argsort(-counts, kind="stable")
    rank = np.empty(n_vocab, np.int64)
    rank[order] = np.arange(n_vocab)
    vr = rank[val_l]
    table = [(v, float(np.mean(vr < v)) if len(vr) else 1.0) for v in DRAFT_VOCABS if v <= n_vocab]
    if not size:
        size = next((v for v, c in table if c >= coverage), table[-1][0])
    d2t, _ = choose_draft_vocab(data.labels[ok], n_vocab, size, coverage)
    return d2t, table


def train(spec: TrainSpec, log: Callable[[str], None] = _log, command: str | None = None) -> dict:
    """Build the data, fit the head (resuming from its checkpoint), write its GGUF (and the HF
    layout when asked) from the checkpoint of best held-out depth-1 agreement, measure held-out
    acceptance through llama.cpp; the report is also written to work_dir (with `command`, the
    command line that ran it, for the card)."""
    if spec.threads == 1 and "XLA_FLAGS" not in os.environ:  # before jax starts its CPU client
        os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    from edgespec.headtrain.data import Sequences, pack

    t_start = time.time()
    probe = config_for_target(spec.target, 1, n_ff=spec.n_ff)
    if spec.features == "jax":
        from edgespec.headtrain.target_jax import build_sequences_jax

        target = None
        data, held, n_vocab = build_sequences_jax(spec, probe.layers, log)
        text = None
    else:
        from edgespec.backend import Model

        target = Model(spec.target)
        n_vocab = target.n_vocab
        data, held = build_sequences(spec, target, probe.layers, log)
        text = scored_text(spec, target, probe.layers, log)
    t_data = time.time() - t_start
    embed = target_embeddings(spec.target)
    head, d2t, cov_table = _initial_head(spec, data, n_vocab, embed, log)
    if text is not None:
        data = Sequences.concat([data, text])
    t2d = np.full(n_vocab, -1, np.int32)
    t2d[d2t] = np.arange(len(d2t))
    rows, inp, lab, seg = pack(data, spec.window, spec.seed)
    if spec.max_windows:
        rows, inp, lab, seg = rows[:spec.max_windows], inp[:spec.max_windows], lab[:spec.max_windows], seg[:spec.max_windows]
    lab_d = np.where(lab >= 0, t2d[np.maximum(lab, 0)], -1).astype(np.int32)
    fit = _fit(spec, head, embed, data.features, rows, inp, lab_d, seg, _heldout_batch(held, t2d), log)
    write_gguf(head, spec.out, spec.target)
    if spec.hf_dir is not None:
        from edgespec.heads.hf import write_hf

        write_hf(head, spec.hf_dir, n_vocab)
    n_held = len(held.starts) - 1
    held_seqs = [held.sequence(i) for i in range(n_held)]
    held_starts = [int(x) for x in held.prompt_len]
    (spec.work_dir / "heldout.json").write_text(json.dumps({"sequences": held_seqs, "prompt_len": held_starts}))
    try:
        import llama_cpp  # noqa: F401
    except ImportError:  # an accelerator box without llama.cpp: measure later (`edgespec models eval-head`)
        hm, acc = None, None
    else:
        from edgespec.backend import Model
        from edgespec.headtrain.evaluate import acceptance

        target = target or Model(spec.target)
        hm = Model(spec.out)  # llama.cpp's eagle3 loader accepts it (or this raises)
        with tqdm(total=n_held, desc="held-out acceptance", unit="prompt") as bar2:
            acc = acceptance(target, hm, held_seqs, held_starts, depth=3, threads=spec.threads, progress=bar2.update)
    n = len(rows)
    if target is not None and hm is not None:  # the tensors' bytes, as llama.cpp loads them
        head_bytes, target_bytes = hm.size_bytes, target.size_bytes
    else:  # the files' (eval-head puts llama.cpp's in)
        head_bytes, target_bytes = spec.out.stat().st_size, spec.target.stat().st_size
    report = {
        "head": str(spec.out), "head_bytes": head_bytes, "target_bytes": target_bytes,
        "head_fraction_of_target": head_bytes / target_bytes,
        "head_params": head.n_params, "draft_vocab": len(d2t), "coverage": cov_table,
        "train_windows": int(n), "train_tokens": int((lab >= 0).sum()), "window": spec.window,
        "train_sequences": int(len(data.starts) - 1), "steps": fit.steps, "epochs": fit.steps * spec.batch / max(1, n),
        "train_minutes": fit.trained_s / 60, "data_minutes": t_data / 60, "final_loss": fit.loss,
        "train_tokens_per_s": fit.tokens_per_s, "precision": fit.precision, "train_acc_by_step": [float(a) for a in fit.accs],
        "best_step": fit.best_step, "heldout_curve": fit.curve,
        "heldout_positions": acc.positions if acc else None, "acceptance_by_depth": acc.rates if acc else None,
        "chain3_tau": acc.tau if acc else None, "data_rows": int(len(data.tokens)),
        "device": _device_kind(), "command": command,
        "spec": {k: str(v) for k, v in asdict(spec).items()},
    }
    (spec.work_dir / "report.json").write_text(json.dumps(report, indent=2))
    if hm is not None:
        hm.close()
    return report


def _training_sequences(spec: TrainSpec, log: Callable[[str], None]) -> tuple:
    """(target Model or None, training sequences, held-out sequences, target vocabulary, scored
    text sequences or None): the target's features from jax (`features = "jax"`) or llama.cpp."""
    probe = config_for_target(spec.target, 1, n_ff=spec.n_ff)
    if spec.features == "jax":
        from edgespec.headtrain.target_jax import build_sequences_jax

        data, held, n_vocab = build_sequences_jax(spec, probe.layers, log)
        return None, data, held, n_vocab, None
    from edgespec.backend import Model

    target = Model(spec.target)
    data, held = build_sequences(spec, target, probe.layers, log)
    return target, data, held, target.n_vocab, scored_text(spec, target, probe.layers, log)


def _initial_head(spec: TrainSpec, data: Any, n_vocab: int, embed: np.ndarray,
                  log: Callable[[str], None]) -> tuple[HeadWeights, np.ndarray, list[tuple[int, float]]]:
    """(head, its draft vocabulary, [(vocabulary size, label coverage)]): `spec.init`'s when
    fine-tuning (its coverage measured), else a fresh head on a vocabulary chosen from `data`."""
    if spec.init is not None:  # fine-tuning: the head's own draft vocabulary, its coverage measured
        head = read_gguf(spec.init)
        d2t = head.d2t
        cfg = config_for_target(spec.target, len(d2t), n_ff=head.cfg.n_ff, layers=head.cfg.layers)
        if replace(head.cfg, n_ctx_train=cfg.n_ctx_train) != cfg:
            raise ValueError(f"--init {spec.init}: the head is not shaped for this target ({head.cfg} vs {cfg})")
        ok = data.labels >= 0
        cov_table = [(len(d2t), float(np.isin(data.labels[ok], d2t).mean()) if ok.any() else 1.0)]
        log(f"draft vocabulary of {spec.init.name}: {len(d2t)} tokens, covering {cov_table[0][1]:.3f} of the labels")
        return head, d2t, cov_table
    d2t, cov_table = choose_vocab_measured(data, n_vocab, spec.draft_vocab, spec.coverage, spec.seed)
    log("draft vocabulary coverage of the target's greedy tokens (measured on sequences it was not chosen from): "
        + ", ".join(f"{v}: {c:.3f}" for v, c in cov_table) + f" -> {len(d2t)}")
    cfg = config_for_target(spec.target, len(d2t), n_ff=spec.n_ff)
    return HeadWeights.init(cfg, d2t, np.random.default_rng(spec.seed), embed=embed), d2t, cov_table


def _heldout_acceptance(spec: TrainSpec, target: Any, held_seqs: list, held_starts: list[int]) -> tuple:
    """(target Model, head Model, held-out acceptance) through llama.cpp; (target, None, None) on
    an accelerator box without llama.cpp: measured later (`edgespec models eval-head`)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return target, None, None
    from edgespec.backend import Model
    from edgespec.headtrain.evaluate import acceptance

    target = target or Model(spec.target)
    hm = Model(spec.out)  # llama.cpp's eagle3 loader accepts it (or this raises)
    with tqdm(total=len(held_seqs), desc="held-out acceptance", unit="prompt") as bar2:
        acc = acceptance(target, hm, held_seqs, held_starts, depth=3, threads=spec.threads, progress=bar2.update)
    return target, hm, acc


def _device_kind() -> str:
    import jax

    d = jax.devices()[0]
    return f"{d.platform}: {getattr(d, 'device_kind', '')} x{len(jax.devices())}"


def _heldout_batch(held, t2d: np.ndarray):
    """The held-out sequences as one padded batch for the training-time depth-1 check: (feature
    rows [S, L], input tokens, draft-vocab labels (-1: not scored), scored (the target's label
    exists, inside the draft vocabulary or not))."""
    S = len(held.starts) - 1
    L = int(max(held.starts[1:] - held.starts[:-1]))
    rows = np.zeros((S, L), np.int64)
    inp = np.zeros((S, L), np.int32)
    lab = np.full((S, L), -1, np.int32)
    scored = np.zeros((S, L), bool)
    for s in range(S):
        a, b = int(held.starts[s]), int(held.starts[s + 1])
        n = b - a - 1  # head positions: row t reads token t+1
        rows[s, :n] = np.arange(a, a + n)
        inp[s, :n] = held.tokens[a + 1:b]
        lt = held.labels[a + 1:b]
        lab[s, :n] = np.where(lt >= 0, t2d[np.maximum(lt, 0)], -1)
        scored[s, :n] = lt >= 0
    return held.features, rows, inp, lab, scored


@dataclass
class _Fit:
    steps: int  # optimiser steps, a resumed run's earlier ones included
    trained_s: float  # seconds in training steps, likewise
    loss: float  # the last step's (nan when a resumed run had nothing left to train)
    accs: np.ndarray  # [ttt_steps] the last step's accuracy at each training-time-test step
    tokens_per_s: float  # training tokens (window rows) per second of training steps
    best_step: int  # the step whose weights were kept (best held-out depth-1)
    curve: list  # [(step, training tokens seen, seconds trained, held-out depth-1)]
    precision: str  # of the weight and attention products (training_precision)


def _fit(spec: TrainSpec, head: HeadWeights, embed: np.ndarray, feats: np.ndarray, rows: np.ndarray, inp: np.ndarray,
         lab: np.ndarray, seg: np.ndarray, heldout, log: Callable[[str], None]) -> _Fit:
    """Adam with warm-up and cosine decay for spec.epochs (or spec.minutes of training), from the
    work directory's checkpoint when it is for the same draft vocabulary. Every `eval_s` seconds
    of training the held-out depth-1 agreement (the target's real features, teacher-forced) is
    measured and the best weights kept; head.w ends as those."""
    import jax
    import jax.numpy as jnp

    from edgespec.headtrain import model_jax as mj

    ckpt = spec.work_dir / "checkpoint.npz"
    params, opt, step_i, trained_s, best, curve = _resume(ckpt, head, log)
    precision = training_precision(spec.precision, jax.default_backend(), cpu_flags())
    log(f"training precision: {precision} (weight and attention products; float32 weights, sums and optimiser)")
    train_step = mj.make_train_step(head.cfg, spec.ttt_steps, packed=True, precision=precision)
    embed_j = jnp.asarray(embed)
    n = len(inp)
    steps_per_epoch = max(1, n // spec.batch)
    max_steps = int(spec.epochs * steps_per_epoch) if spec.epochs else None
    budget = spec.minutes * 60.0
    depth1 = _depth1(head.cfg, embed_j, heldout)
    batch_features = _feature_gather(feats)

    def save() -> None:
        _save_checkpoint(ckpt, head.d2t, params, opt, best, step_i, trained_s, curve)

    def evaluate() -> None:
        acc = float(depth1(params))
        curve.append((step_i, step_i * spec.batch * spec.window, trained_s, acc))
        if acc >= best["acc"]:
            best.update(p=dict(params), step=step_i, acc=acc)
        log(f"step {step_i} ({trained_s / 60:.1f} min, {step_i * spec.batch * spec.window} tokens): held-out depth-1 "
            f"{acc:.3f} (best {best['acc']:.3f} at step {best['step']})")

    if step_i == 0 and spec.init is not None:
        evaluate()  # the starting head's figure: fine-tuning keeps it unless a step beats it
    last_save = last_eval = time.time()
    accs = np.zeros(spec.ttt_steps)
    loss = float("nan")
    t_run, steps_run = 0.0, 0
    bar = tqdm(total=max_steps if max_steps else int(budget), initial=step_i if max_steps else int(trained_s),
               desc="training", unit="step" if max_steps else "s")
    while (step_i < max_steps) if max_steps is not None else (trained_s < budget):
        t0 = time.time()
        epoch_rng = np.random.default_rng(spec.seed + step_i // steps_per_epoch)
        perm = epoch_rng.permutation(n)
        idx = np.sort(perm[(step_i % steps_per_epoch) * spec.batch:][:spec.batch])
        frac = (step_i / max_steps) if max_steps else (trained_s / budget)
        lr = spec.lr * min(1.0, (step_i + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * min(1.0, frac))))
        f = batch_features(rows[idx])
        params, opt, loss_j, accs_j = train_step(params, opt, embed_j, f, jnp.asarray(inp[idx]),
                                                 jnp.asarray(lab[idx]), jnp.float32(lr), jnp.asarray(seg[idx]))
        loss, accs = float(loss_j), np.asarray(accs_j)
        step_i += 1
        dt = time.time() - t0
        trained_s += dt
        if steps_run:  # the first step compiles
            t_run += dt
        steps_run += 1
        bar.update(1 if max_steps else dt)
        bar.set_postfix(loss=f"{loss:.3f}", acc="/".join(f"{a:.2f}" for a in accs), epoch=f"{step_i / steps_per_epoch:.2f}")
        if time.time() - last_eval > spec.eval_s:
            evaluate()
            last_eval = time.time()
        if time.time() - last_save > spec.checkpoint_s:
            save()
            last_save = time.time()
    bar.close()
    if steps_run:
        evaluate()
    save()
    head.w = {k: np.asarray(v) for k, v in (best["p"] if best["step"] >= 0 else params).items()}
    tps = (steps_run - 1) * spec.batch * spec.window / t_run if t_run > 0 else float("nan")
    return _Fit(steps=step_i, trained_s=trained_s, loss=loss, accs=accs, tokens_per_s=tps, best_step=int(best["step"]),
                curve=[list(c) for c in curve], precision=precision)


def _depth1(cfg: HeadConfig, embed_j: Any, heldout: tuple) -> Callable[[dict], Any]:
    """The jitted held-out depth-1 agreement of weights `p` (_heldout_batch's rows, teacher-forced
    on the target's real features): hits over scored positions."""
    import jax
    import jax.numpy as jnp

    from edgespec.headtrain import model_jax as mj

    hf, hrows, hinp, hlab, hscored = heldout
    hf_j = jnp.asarray(hf[hrows].astype(np.float32))
    hinp_j, hlab_j, hsc_j = jnp.asarray(hinp), jnp.asarray(hlab), jnp.asarray(hscored)

    @jax.jit
    def depth1(p: dict) -> Any:
        emb = embed_j[hinp_j]
        g = hf_j @ p["fc"].T
        _, logits, _ = mj.step(p, cfg, emb, g, [], 0)
        hit = (jnp.argmax(logits, -1) == hlab_j) & (hlab_j >= 0) & hsc_j
        return jnp.sum(hit) / jnp.maximum(jnp.sum(hsc_j), 1)

    return depth1


def _feature_gather(feats: np.ndarray) -> Callable[[np.ndarray], Any]:
    """rows -> their feature rows as float32 on the training device. On an accelerator the
    features live in its memory, gathered there each step; on a CPU the host gather is the same
    memory."""
    import jax
    import jax.numpy as jnp

    if jax.default_backend() == "cpu":
        return lambda rows: jnp.asarray(feats[rows].astype(np.float32))
    feats_dev = jax.device_put(feats)
    gather = jax.jit(lambda f, r: f[r].astype(jnp.float32))
    return lambda rows: gather(feats_dev, jnp.asarray(rows))


def _save_checkpoint(ckpt: Path, d2t: np.ndarray, params: dict, opt: dict, best: dict, step_i: int,
                     trained_s: float, curve: list) -> None:
    """Weights, Adam state, the best weights so far and the held-out curve, written atomically."""
    arrs: dict[str, Any] = {f"p.{k}": np.asarray(v) for k, v in params.items()}
    arrs |= {f"m.{k}": np.asarray(v) for k, v in opt["m"].items()}
    arrs |= {f"v.{k}": np.asarray(v) for k, v in opt["v"].items()}
    arrs |= {f"b.{k}": np.asarray(v) for k, v in best["p"].items()}
    tmp = ckpt.with_suffix(".tmp.npz")
    np.savez(tmp, **arrs, t=np.asarray(opt["t"]), step=step_i, trained_s=trained_s, d2t=d2t,
             best_step=best["step"], best_acc=best["acc"], curve=np.asarray(curve, np.float64).reshape(-1, 4))
    tmp.replace(ckpt)


def _resume(ckpt: Path, head: HeadWeights, log: Callable[[str], None]):
    """(params, Adam state, step, seconds trained, best {p, step, acc}, held-out curve): the
    checkpoint's when it is for this draft vocabulary, else the head's initial weights at step 0."""
    import jax.numpy as jnp

    from edgespec.headtrain import model_jax as mj

    params = {k: jnp.asarray(v) for k, v in head.w.items()}
    if ckpt.is_file():
        z = np.load(ckpt)
        if z["d2t"].shape == head.d2t.shape and np.array_equal(z["d2t"], head.d2t) and "best_step" in z:
            params = {k: jnp.asarray(z[f"p.{k}"]) for k in head.w}
            opt = {"m": {k: jnp.asarray(z[f"m.{k}"]) for k in head.w}, "v": {k: jnp.asarray(z[f"v.{k}"]) for k in head.w},
                   "t": jnp.asarray(z["t"])}
            step_i, trained_s = int(z["step"]), float(z["trained_s"])
            best = {"p": {k: jnp.asarray(z[f"b.{k}"]) for k in head.w}, "step": int(z["best_step"]),
                    "acc": float(z["best_acc"])}
            curve = [tuple(r) for r in z["curve"].tolist()]
            log(f"resuming from {ckpt} at step {step_i} ({trained_s / 60:.1f} min trained, best held-out depth-1 "
                f"{best['acc']:.3f} at step {best['step']})")
            return params, opt, step_i, trained_s, best, curve
    return params, mj.adam_init(params), 0, 0.0, {"p": params, "step": -1, "acc": -1.0}, []
