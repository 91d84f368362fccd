"""Batched forwards of the F32 demo target, and of a Q8_0 model, are bit-identical to one-token
forwards.

This is what tools/patches/ggml-cpu-small-batch.patch buys (stock ggml differs by up to ~0.01
in the logits and flips the argmax at near-ties): greedy speculation then reproduces plain
greedy decoding exactly. The Q8_0 half also checks the patch's multi-column Q8_0 kernel against
the F32 model's logits (a kernel that is only self-consistent would pass the exactness half). A
stock llama-cpp-python build fails the F32 half (tinyBLAS's Q8_0 tiles happen to keep each column's
order)."""

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


@pytest.fixture(scope="module")
def q8_ctx(demo_pair):
    """The Q8_0 demo draft: on x86 its mat-muls run the patch's Q8_0 kernel at every batch size."""
    assert demo_pair.draft.name.endswith(".Q8_0.gguf")
    model = backend.Model(demo_pair.draft)
    ctx = backend.Context(model, ModelConfig(path=str(demo_pair.draft), n_ctx=1024, threads=2), n_seq_max=1)
    yield model, ctx
    ctx.close()
    model.close()


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 9, 17, 32])
def test_chain_batch_equals_one_token_forwards(target_ctx, n):
    _check_chain(*target_ctx, n)


@pytest.mark.parametrize("n", [2, 3, 8, 9, 17, 32])
def test_q8_0_chain_batch_equals_one_token_forwards(q8_ctx, n):
    _check_chain(*q8_ctx, n)


def test_q8_0_logits_agree_with_the_f32_model(target_ctx, q8_ctx):
    """The kernel computes the right thing, not just the same thing twice: the Q8_0 model's
    logits track the F32 model's (8-bit weights: close, not equal) and pick the same argmax."""
    (model, f32), (_, q8) = target_ctx, q8_ctx
    toks = model.tokenize(TEXT)
    rows = []
    for ctx in (f32, q8):
        ctx.clear()
        ctx.decode_seq(toks[:-8], 0, last_logits=False)
        ctx.decode(toks[-8:], range(len(toks) - 8, len(toks)), [[0]] * 8, [True] * 8)  # 8 columns: the patch's kernel
        rows.append(ctx.logits_rows(8).copy())
    a, b = rows
    assert np.corrcoef(a.ravel(), b.ravel())[0, 1] > 0.99
    assert (a.argmax(1) == b.argmax(1)).mean() >= 0.75


def _check_chain(model, ctx, n):
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
