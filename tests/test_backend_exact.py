"""Batched forwards of the F32 demo target are bit-identical to one-token forwards.

This is what tools/patches/ggml-cpu-f32-small-batch.patch buys (stock ggml differs by up to
~0.01 in the logits and flips the argmax at near-ties): greedy speculation then reproduces plain
greedy decoding exactly. A stock llama-cpp-python build fails these tests."""

from __future__ import annotations

import numpy as np
import pytest

from edgespec import backend
from edgespec.config import ModelConfig

pytestmark = pytest.mark.slow

TEXT = "The quick brown fox jumps over the lazy dog. " * 6 + "def fibonacci(n):\n    return"


@pytest.fixture(scope="module")
def target_ctx(demo_pair):
    model = backend.Model(demo_pair.target)
    ctx = backend.Context(model, ModelConfig(path=str(demo_pair.target), n_ctx=1024, threads=2), n_seq_max=8)
    yield model, ctx
    ctx.close()
    model.close()


def one_by_one(ctx, tokens, start, seq=0) -> np.ndarray:
    rows = []
    for i, t in enumerate(tokens):
        ctx.decode([t], [start + i], [[seq]], [True])
        rows.append(ctx.logits(0).copy())
    return np.array(rows)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 9, 17, 32])
def test_chain_batch_equals_one_token_forwards(target_ctx, n):
    model, ctx = target_ctx
    toks = model.tokenize(TEXT)
    p = len(toks) - 1
    ctx.clear()
    ctx.decode_seq(toks[:p], 0, last_logits=False)
    batch_toks = [toks[p]] + toks[1:n]
    ctx.decode(batch_toks, range(p, p + n), [[0]] * n, [True] * n)
    batched = ctx.logits_rows(n).copy()
    ctx.seq_rm(0, p, -1)
    single = one_by_one(ctx, batch_toks, p)
    diff = float(np.abs(batched - single).max())
    assert np.array_equal(batched, single), f"batch of {n}: max |logit diff| {diff:.3g}"


def test_tree_batch_spine_exact_other_branches_close(target_ctx):
    """A tree with three branches (one seq id per leaf; shared nodes in several seqs), batched
    spine first as the engine does. The spine's cells are consecutive, as in one-token decoding:
    bit-identical. A side branch's cells have masked holes, which changes the summation order in
    attention: equal up to float rounding, not bit for bit."""
    model, ctx = target_ctx
    toks = model.tokenize(TEXT)
    p = len(toks) - 1
    a, b, c, d, e = toks[1:6]
    # (token, depth, seqs) in batch order: spine root -> a -> c -> e (seq 0), then b, d
    nodes = [(toks[p], 0, [0, 1, 2]), (a, 1, [0, 1]), (c, 2, [0]), (e, 3, [0]), (b, 1, [2]), (d, 2, [1])]
    branches = {0: [0, 1, 2, 3], 1: [0, 1, 5], 2: [0, 4]}
    ctx.clear()
    ctx.decode_seq(toks[:p], 0, last_logits=False)
    for s in (1, 2):
        ctx.seq_cp(0, s)
    ctx.decode([t for t, _, _ in nodes], [p + dep for _, dep, _ in nodes], [s for _, _, s in nodes],
               [True] * len(nodes))
    tree_rows = ctx.logits_rows(len(nodes)).copy()
    for branch, path in branches.items():
        ctx.clear()
        ctx.decode_seq(toks[:p], 0, last_logits=False)
        single = one_by_one(ctx, [nodes[i][0] for i in path], p)
        for row, node in zip(single, path):
            diff = float(np.abs(row - tree_rows[node]).max())
            if branch == 0:
                assert np.array_equal(row, tree_rows[node]), f"spine node {node}: max diff {diff:.3g}"
            else:
                assert diff < 0.05, f"node {node}: max diff {diff:.3g}"
