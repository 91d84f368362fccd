"""Held-out acceptance of a head, measured through llama.cpp: the real target's features, the
head GGUF run by llama.cpp's eagle3 graph, drafting with Eagle3Drafter exactly as serving does."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from edgespec.backend import FeatureContext, HeadContext, Model, target_layer_ids
from edgespec.config import ModelConfig
from edgespec.drafters.eagle3 import Eagle3Drafter
from edgespec.sampling import SamplingParams
from edgespec.shape import Shape
from edgespec.tree import DraftTree


@dataclass
class Acceptance:
    depth: int
    positions: int = 0
    hits: list[int] = field(default_factory=list)  # [depth] chains whose first d+1 tokens all match

    @property
    def rates(self) -> list[float]:
        """P(the first d drafted tokens all equal the target's greedy ones), d = 1..depth."""
        return [h / max(1, self.positions) for h in self.hits]

    @property
    def tau(self) -> float:
        """Tokens per target forward a greedy chain of `depth` would make (1 + expected accepted)."""
        return 1.0 + sum(self.rates)


def acceptance(target: Model, head: Model, sequences: Sequence[Sequence[int]], starts: Sequence[int],
               depth: int = 3, threads: int = 0, progress=None,
               positions: list[tuple[int, float, int, int]] | None = None) -> Acceptance:
    """For every position p >= starts[i] of each sequence (the target's own greedy text: answer
    tokens after the prompt), draft a greedy chain of `depth` from context seq[:p+1] and count how
    many leading tokens equal the target's greedy continuation. `positions`, when given, gets
    (sequence index, the target's top-1 probability, leading tokens right, the target's greedy
    token) for every position."""
    n_ctx = max(len(s) for s in sequences) + depth + 8
    cfg = ModelConfig(path=str(target.path), n_ctx=n_ctx, n_batch=min(512, n_ctx), threads=threads)
    tctx = FeatureContext(target, cfg, target_layer_ids(head))
    hctx = HeadContext(head, tctx, cfg)
    drafter = Eagle3Drafter(hctx)
    shape = Shape(mode="chain", depth=depth, width=1, nodes=depth)
    greedy = SamplingParams()
    rng = np.random.default_rng(0)
    res = Acceptance(depth, 0, [0] * depth)
    try:
        for i, (seq, start) in enumerate(zip(sequences, starts)):
            seq = list(seq)
            tctx.clear()
            feats, labels, tops = [], [], []
            for s in range(0, len(seq), cfg.n_batch):
                chunk = seq[s:s + cfg.n_batch]
                tctx.decode(chunk, range(s, s + len(chunk)), [(0,)] * len(chunk), [True] * len(chunk))
                feats.append(tctx.features())
                lg = tctx.logits_rows(len(chunk))
                labels.append(np.argmax(lg, axis=1))
                if positions is not None:  # softmax's largest entry: 1 / sum(exp(logits - max))
                    tops.append(1.0 / np.exp(lg - lg.max(axis=1, keepdims=True)).sum(axis=1))
            f, lab = np.concatenate(feats), np.concatenate(labels)
            top = np.concatenate(tops) if tops else None
            drafter.begin(seq[:1])
            drafter.add_features(f[:start])
            for p in range(start, len(seq) - 1):
                ctx_tokens = seq[:p + 1]
                tree = DraftTree.root(seq[p])
                drafter.propose(tree, ctx_tokens, shape, greedy, rng)
                drafted = tree.tokens[1:]
                ok = 0
                for k, t in enumerate(drafted):
                    # the chain continues only where the text is the target's greedy continuation
                    if p + k >= len(seq) or t != lab[p + k] or (k > 0 and seq[p + k] != lab[p + k - 1]):
                        break
                    ok += 1
                res.positions += 1
                if positions is not None and top is not None:  # top is read whenever positions are
                    positions.append((i, float(top[p]), ok, int(lab[p])))
                for d in range(ok):
                    res.hits[d] += 1
                drafter.accept(tree, [], ctx_tokens)
                drafter.add_features(f[p:p + 1])
            if progress is not None:
                progress(1)
    finally:
        hctx.close()
        tctx.close()
    return res


def suite_acceptance(target: Model, head: Model, prompts: Sequence[str], max_new: int = 64, depth: int = 3,
                     threads: int = 0, progress=None) -> Acceptance:
    """`acceptance` over the target's greedy answers (`max_new` tokens) to `prompts` in its chat
    template: how the head does on a caller's own prompts rather than on held-out siblings of the
    prompts it was trained on."""
    seqs, starts = suite_answers(target, prompts, max_new, threads)
    return acceptance(target, head, seqs, starts, depth=depth, threads=threads, progress=progress)


def suite_answers(target: Model, prompts: Sequence[str], max_new: int = 64,
                  threads: int = 0) -> tuple[list[list[int]], list[int]]:
    """The target's greedy answers (`max_new` tokens) to `prompts` in its chat template, as whole
    sequences, and where each answer starts."""
    from edgespec.headtrain.data import self_distill

    seqs = self_distill(target, prompts, max_new, n_seq=min(16, len(prompts)), threads=threads)
    starts = [len(target.tokenize(target.chat_prompt([("user", p)]), add_special=True, parse_special=True))
              for p in prompts]
    return seqs, starts


@dataclass
class Costs:
    target_s: float  # median seconds of one target forward of 1 token (a plain decoding step)
    head_s: float  # median seconds of one head forward of 1 token (a draft level of one node)
    head_catchup_s: float  # median seconds of encode + head forward of 2 tokens (after a verification)
    context: int

    @property
    def ratio(self) -> float:
        return self.head_s / self.target_s


def forward_costs(target: Model, head: Model, context: int = 256, rounds: int = 40, threads: int = 1) -> Costs:
    """Head vs target forward time, measured in one process, interleaved round by round (a
    neighbour's load hits both alike), medians; both after `context` tokens of context."""
    import time

    cfg = ModelConfig(path=str(target.path), n_ctx=context + rounds * 4 + 16, n_batch=512, threads=threads)
    tctx = FeatureContext(target, cfg, target_layer_ids(head))
    hctx = HeadContext(head, tctx, cfg)
    try:
        toks = [int(t) for t in np.random.default_rng(0).integers(100, 20000, context)]
        tctx.decode_seq(toks, 0)
        f = tctx.features()
        hctx.decode(toks[1:], range(context - 1), [(0,)] * (context - 1), hctx.encode(f[:context - 1]),
                    [False] * (context - 2) + [True])
        g = hctx.hidden(-1).copy()
        t_s, h_s, c_s = [], [], []
        for r in range(rounds):
            p = context + r  # the target's next position; the head is one behind (hp)
            hp = p - 1
            t0 = time.perf_counter()
            tctx.decode([toks[r % context]], [p], [(0,)], [True])
            tctx.logits(0)
            t1 = time.perf_counter()
            hctx.decode([toks[r % context]], [hp], [(0,)], g[None], [True])
            hctx.logits(0)
            t2 = time.perf_counter()
            hctx.seq_rm(0, hp, -1)
            gg = hctx.encode(np.repeat(f[-1:], 2, axis=0))
            hctx.decode(toks[:2], [hp, hp + 1], [(0,), (0,)], gg, [False, True])
            hctx.logits(-1)
            t3 = time.perf_counter()
            hctx.seq_rm(0, hp, -1)
            hctx.decode([toks[r % context]], [hp], [(0,)], g[None], [False])  # the head stays one behind the target
            t_s.append(t1 - t0)
            h_s.append(t2 - t1)
            c_s.append(t3 - t2)
        return Costs(float(np.median(t_s)), float(np.median(h_s)), float(np.median(c_s)), context)
    finally:
        hctx.close()
        tctx.close()
