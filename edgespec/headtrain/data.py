"""Training data for an EAGLE-3 head, built offline from what the machine has.

Two sources, both run through the target:
- text shipped in installed packages (Python sources, docs, licences, JSON), cut into windows;
- the target's own greedy answers to synthetic chat prompts (self-distillation: the head learns
  what the target says, which is what acceptance measures), generated many sequences per forward.

For every window the target's features (the inputs of the head's three layers) and its greedy
next token at every position are extracted through llama.cpp (FeatureContext) and stored in
shards of `Shard.SIZE` windows (resumable: an existing shard is kept).
"""

from __future__ import annotations

import hashlib
import itertools
import random
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TEXT_SUFFIXES = (".py", ".md", ".rst", ".txt", ".json", ".toml", ".cfg")

TOPICS = [
    "a linked list", "binary search", "HTTP caching", "unit tests", "a REST API", "SQL joins", "Docker",
    "photosynthesis", "the water cycle", "inflation", "a job interview", "time management", "recursion",
    "a CSV parser", "JSON schemas", "password hashing", "the French revolution", "black holes", "vaccines",
    "climate change", "a birthday party", "learning a language", "a budget spreadsheet", "git branches",
    "regular expressions", "sorting algorithms", "a chess opening", "a healthy breakfast", "the solar system",
    "machine learning", "a customer complaint", "a rental contract", "a meeting agenda", "electric cars",
    "the Roman empire", "a poem about autumn", "a haiku about the sea", "prime numbers", "a todo app",
    "Python decorators", "async IO", "memory leaks", "a shell script", "a date parser", "a recipe for soup",
]
TEMPLATES = [
    "Explain {t} in simple terms.", "Write a short paragraph about {t}.", "Give three tips about {t}.",
    "Write a Python function related to {t}.", "What are the pros and cons of {t}?",
    "Summarise {t} in two sentences.", "List five facts about {t}.", "Write a JSON object describing {t}.",
    "Answer briefly: why does {t} matter?", "Write an email about {t}.", "Describe {t} to a child.",
    "Extract the key points about {t} as a bulleted list.",
]


def synthetic_prompts(n: int, seed: int = 0) -> list[str]:
    pairs = list(itertools.product(TEMPLATES, TOPICS))
    random.Random(seed).shuffle(pairs)
    return [tmpl.format(t=topic) for tmpl, topic in (pairs * (n // len(pairs) + 1))[:n]]


def package_texts(roots: Sequence[Path] | None = None, max_files: int = 4000, seed: int = 0) -> Iterator[str]:
    """Texts of files shipped in installed packages, in a deterministic shuffled order."""
    return (text for _, text in package_files(roots, max_files, seed))


def package_files(roots: Sequence[Path] | None = None, max_files: int = 4000,
                  seed: int = 0) -> Iterator[tuple[str, str]]:
    """(file name, text) of files shipped in installed packages, in a deterministic shuffled
    order."""
    roots = list(roots) if roots else sorted({Path(p) for p in sys.path if p.endswith("-packages")})
    files = []
    for root in roots:
        if root.is_dir():
            for p in root.rglob("*"):
                if (p.suffix in TEXT_SUFFIXES or p.name.startswith(("LICENSE", "COPYING", "README"))) and p.is_file():
                    files.append(p)
    files.sort(key=lambda p: hashlib.sha1(f"{seed}:{p}".encode()).hexdigest())
    for p in files[:max_files]:
        try:
            if p.stat().st_size > 200_000:
                continue
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if len(text) > 200:
            yield p.name, text


def windows(tokens: Sequence[int], length: int) -> Iterator[list[int]]:
    for s in range(0, len(tokens) - length + 1, length):
        yield list(tokens[s:s + length])


def self_distill(target, prompts: Sequence[str], max_new: int, n_seq: int = 40, threads: int = 0,
                 progress=None) -> list[list[int]]:
    """The target's greedy answers (chat template applied; prompt + answer tokens), `n_seq`
    sequences per forward."""
    from edgespec.backend import Context
    from edgespec.config import ModelConfig

    seqs = [target.tokenize(target.chat_prompt([("user", p)]), add_special=True, parse_special=True) for p in prompts]
    n_ctx = n_seq * (max(len(s) for s in seqs) + max_new + 2)
    ctx = Context(target, ModelConfig(path=str(target.path), n_ctx=n_ctx, n_batch=512, threads=threads), n_seq_max=n_seq)
    out: list[list[int]] = []
    try:
        for start in range(0, len(seqs), n_seq):
            group = [list(s) for s in seqs[start:start + n_seq]]
            ctx.clear()
            for i, s in enumerate(group):  # prefill: one decode per prompt
                ctx.decode_seq(s, 0, (i,), last_logits=True)
                s.append(int(np.argmax(ctx.logits(-1))))
            live = [i for i, s in enumerate(group) if not target.is_eog(s[-1])]
            for _ in range(max_new - 1):
                if not live:
                    break
                ctx.decode([group[i][-1] for i in live], [len(group[i]) - 1 for i in live], [(i,) for i in live],
                           [True] * len(live))
                rows = ctx.logits_rows(len(live))
                nxt = np.argmax(rows, axis=1)
                for j, i in enumerate(live):
                    group[i].append(int(nxt[j]))
                live = [i for i in live if not target.is_eog(group[i][-1])]
            out.extend(group)
            if progress is not None:
                progress(len(group), sum(len(s) for s in group))
    finally:
        ctx.close()
    return out


@dataclass
class Shard:
    """Windows of one shard: tokens [n, T] int32, the target's greedy next token at each position
    labels [n, T] int32, features [n, T, 3 * n_embd] float16."""

    SIZE = 32

    tokens: np.ndarray
    labels: np.ndarray
    features: np.ndarray

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, tokens=self.tokens, labels=self.labels, features=self.features)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> Shard:
        z = np.load(path)
        return cls(z["tokens"], z["labels"], z["features"])


def extract(target, layers: Sequence[int], wins: Sequence[Sequence[int]], threads: int = 0) -> Shard:
    """Run the target over each window (several windows per forward, one seq each): its features
    and greedy next tokens."""
    from edgespec.backend import FeatureContext
    from edgespec.config import ModelConfig

    T = len(wins[0])
    per = max(1, 512 // T)
    ctx = FeatureContext(target, ModelConfig(path=str(target.path), n_ctx=per * T + 8, n_batch=per * T, threads=threads),
                         layers, n_seq_max=per)
    n = len(wins)
    toks = np.asarray(wins, np.int32)
    labels = np.empty((n, T), np.int32)
    feats = np.empty((n, T, ctx.n_features), np.float16)
    try:
        for s in range(0, n, per):
            group = wins[s:s + per]
            ctx.clear()
            flat = [t for w in group for t in w]
            ctx.decode(flat, [p for _ in group for p in range(T)], [(i,) for i, _ in enumerate(group) for _ in range(T)],
                       [True] * len(flat))
            lg = ctx.logits_rows(len(flat))
            am = np.argmax(lg, axis=1).reshape(len(group), T)
            f = ctx.features().reshape(len(group), T, -1)
            labels[s:s + len(group)] = am
            feats[s:s + len(group)] = f
    finally:
        ctx.close()
    return Shard(toks, labels, feats)


@dataclass
class Sequences:
    """Whole sequences (prompt + the target's greedy answer) with the target's features, flat:
    tokens [N] int32, labels [N] int32 (the target's greedy token after each position; -1 inside
    the prompt, where it is not trained on), features [N, 3 * n_embd] float16, starts [S + 1]
    int64 (sequence s is rows starts[s]:starts[s+1]), prompt_len [S] int32."""

    tokens: np.ndarray
    labels: np.ndarray
    features: np.ndarray
    starts: np.ndarray
    prompt_len: np.ndarray

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, tokens=self.tokens, labels=self.labels, features=self.features, starts=self.starts,
                 prompt_len=self.prompt_len)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> Sequences:
        z = np.load(path)
        return cls(z["tokens"], z["labels"], z["features"], z["starts"], z["prompt_len"])

    @classmethod
    def concat(cls, parts: Sequence[Sequences]) -> Sequences:
        offs = np.cumsum([0] + [len(p.tokens) for p in parts])
        starts = np.concatenate([[0]] + [p.starts[1:] + o for p, o in zip(parts, offs)])
        return cls(np.concatenate([p.tokens for p in parts]), np.concatenate([p.labels for p in parts]),
                   np.concatenate([p.features for p in parts]), starts.astype(np.int64),
                   np.concatenate([p.prompt_len for p in parts]))

    def sequence(self, s: int) -> list[int]:
        return [int(t) for t in self.tokens[self.starts[s]:self.starts[s + 1]]]


def distill_features(target, layers: Sequence[int], prompts: Sequence[str], max_new: int, n_seq: int = 48,
                     threads: int = 0) -> Sequences:
    """The target's greedy answers to `prompts` (chat template applied), `n_seq` sequences per
    forward, with the features of every decoded token taken from the generating forwards
    themselves (no second pass over the text): one batched prefill of all prompts, then one
    forward per answer token for every live sequence."""
    from edgespec.backend import FeatureContext
    from edgespec.config import ModelConfig

    seqs = [target.tokenize(target.chat_prompt([("user", p)]), add_special=True, parse_special=True) for p in prompts]
    n_ctx = n_seq * (max(len(s) for s in seqs) + max_new + 2)
    ctx = FeatureContext(target, ModelConfig(path=str(target.path), n_ctx=n_ctx, n_batch=512, threads=threads),
                         layers, n_seq_max=n_seq)
    parts = []
    try:
        for g0 in range(0, len(seqs), n_seq):
            group = [list(s) for s in seqs[g0:g0 + n_seq]]
            plen = [len(s) for s in group]
            ctx.clear()
            toks = [t for s in group for t in s]
            pos = [p for s in group for p in range(len(s))]
            sid = [(i,) for i, s in enumerate(group) for _ in s]
            last = [p == len(s) - 1 for s in group for p in range(len(s))]
            lg = ctx.decode_rows(toks, pos, sid, last)
            pf = ctx.collected().astype(np.float16)
            feats: list[list[np.ndarray]] = []
            o = 0
            for i, s in enumerate(group):
                feats.append([pf[o:o + len(s)]])
                o += len(s)
                s.append(int(np.argmax(lg[i])))
            live = [i for i, s in enumerate(group) if not target.is_eog(s[-1])]
            for _ in range(max_new - 1):
                if not live:
                    break
                lg = ctx.decode_rows([group[i][-1] for i in live], [len(group[i]) - 1 for i in live],
                                     [(i,) for i in live], [True] * len(live))
                f = ctx.collected().astype(np.float16)
                nxt = np.argmax(lg, axis=1)
                for j, i in enumerate(live):
                    feats[i].append(f[j:j + 1])
                    group[i].append(int(nxt[j]))
                live = [i for i in live if not target.is_eog(group[i][-1])]
            # a sequence's last token was never decoded: rows are tokens[:-1], labels tokens[1:]
            t_all, l_all, f_all, st = [], [], [], [0]
            for i, s in enumerate(group):
                n = len(s) - 1
                lab = np.asarray(s[1:], np.int32)
                lab[:plen[i] - 1] = -1
                t_all.append(np.asarray(s[:-1], np.int32))
                l_all.append(lab)
                f_all.append(np.concatenate(feats[i])[:n])
                st.append(st[-1] + n)
            parts.append(Sequences(np.concatenate(t_all), np.concatenate(l_all), np.concatenate(f_all),
                                   np.asarray(st, np.int64), np.asarray(plen, np.int32)))
    finally:
        ctx.close()
    return Sequences.concat(parts)


def pack(data: Sequences, window: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Training windows packed from whole sequences, no padding lost between them: at row t the
    head reads token[t+1] and g = fc(features[t]) and is trained on label[t+1] (the target's greedy
    token after token[t+1]); rows where t+1 starts another sequence get label -1. Returns
    (feature row index [W, T] into data.features, input tokens [W, T], labels [W, T], segment ids
    [W, T]: attention stays inside a sequence). Sequences are shuffled with `seed` first."""
    S = len(data.starts) - 1
    order = np.random.default_rng(seed).permutation(S)
    rows = np.concatenate([np.arange(data.starts[s], data.starts[s + 1]) for s in order])
    seg = np.concatenate([np.full(data.starts[s + 1] - data.starts[s], k, np.int32) for k, s in enumerate(order)])
    nxt = np.minimum(rows + 1, len(data.tokens) - 1)
    same = np.append(seg[1:] == seg[:-1], False)
    inp = np.where(same, data.tokens[nxt], 0).astype(np.int32)
    lab = np.where(same, data.labels[nxt], -1).astype(np.int32)
    W = len(rows) // window
    cut = W * window
    return (rows[:cut].reshape(W, window), inp[:cut].reshape(W, window), lab[:cut].reshape(W, window),
            seg[:cut].reshape(W, window))
