"""Forwards of the F32 demo target, and of a Q8_0 model, are batch-invariant: every token's
logits are bit-identical to one-token forwards at every batch width up to n_batch, whatever
else shares the forward, and wherever the shared cache put its cells.

This is what tools/patches/ggml-batch-invariant.patch buys (stock ggml differs by up to ~0.01
in the logits between batch widths and between cell layouts, and flips the argmax at near-ties):
greedy speculation then reproduces plain greedy decoding exactly, prompts are read in whole
n_batch pieces, and a daemon's history cannot change an output. The Q8_0 half also checks the
patch's multi-column Q8_0 kernel against the F32 model's logits (a kernel that is only
self-consistent would pass the exactness half). A stock llama-cpp-python build fails this file."""

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


def test_the_wheel_carries_the_patch():
    """An installed wheel built without tools/patches/ would pass nothing below: say so first."""
    import llama_cpp

    assert hasattr(llama_cpp.llama_cpp._lib, "edgespec_abort_flag"), "llama-cpp-python built without the ggml patch"


# widths on both sides of the streaming kernels' limits (F32: 16 rows a pass up to 8 columns, then
# 8-row x 2-column tiles, an odd column in 8 x 1, up to 1.5 MiB of columns, 256 tokens of the demo
# target's 1,536-wide product; Q8_0: 32 columns) and of the flash attention's 64-row tiles
@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, 256, 257])
def test_chain_batch_equals_one_token_forwards(target_ctx, n):
    _check_chain(*target_ctx, n)


@pytest.mark.parametrize("n", [2, 3, 8, 9, 17, 32, 33, 65])
def test_q8_0_chain_batch_equals_one_token_forwards(q8_ctx, n):
    _check_chain(*q8_ctx, n)


def test_a_prompt_read_in_any_pieces_gives_the_same_cells(target_ctx):
    """A 300-token prompt read whole, in 64-token pieces, or in odd pieces: every later logit is
    the same bits (prompts are read in whole n_batch pieces, a kept prefill is reusable at any
    length)."""
    model, ctx = target_ctx
    toks = (model.tokenize(TEXT * 8))[:300]
    assert len(toks) == 300
    nxt = toks[1:9]
    ref = None
    for pieces in ([300], [64] * 4 + [44], [7, 100, 193], [1, 2, 297]):
        ctx.clear()
        at = 0
        for m in pieces:
            ctx.decode(toks[at:at + m], range(at, at + m), [[0]] * m, [False] * m)
            at += m
        got = one_by_one(ctx, nxt, 300)
        if ref is None:
            ref = got
        assert np.array_equal(got, ref), f"pieces {pieces}: max diff {np.abs(got - ref).max():.3g}"


def test_cells_scattered_through_the_shared_cache_change_nothing(target_ctx):
    """Another sequence fills the cache first and leaves holes below this one's cells, so that
    find_slot puts later tokens BELOW earlier ones (the daemon's reused slots): the flash
    attention visits cells in position order (the patch's self_kv_order), so the logits are the
    ones of a fresh context."""
    model, ctx = target_ctx
    toks = (model.tokenize(TEXT * 4))[:160]
    ctx.clear()
    ctx.decode(toks[:100], range(100), [[0]] * 100, [False] * 100)
    ref = one_by_one(ctx, toks[100:], 100)
    ctx.clear()
    ctx.decode(toks[:120], range(120), [[1]] * 120, [False] * 120)  # cells 0..119: another sequence
    ctx.decode(toks[:100], range(100), [[0]] * 100, [False] * 100)  # cells 120..219
    ctx.seq_rm(1, -1, -1)  # cells 0..119 free: the next tokens of seq 0 land there, below its own
    got = one_by_one(ctx, toks[100:], 100)
    assert np.array_equal(got, ref), f"max diff {np.abs(got - ref).max():.3g}"


def test_a_batch_shared_with_other_sequences_changes_nothing(target_ctx):
    """A chain verified beside another sequence's prompt piece in one forward: its rows are the
    one-token rows."""
    model, ctx = target_ctx
    toks = model.tokenize(TEXT)
    p = len(toks) - 1
    chain = [toks[p]] + toks[1:6]
    ctx.clear()
    ctx.decode_seq(toks[:p], 0, last_logits=False)
    single = one_by_one(ctx, chain, p)
    ctx.clear()
    ctx.decode_seq(toks[:p], 0, last_logits=False)
    other = toks[:50]
    ctx.decode(chain + other, list(range(p, p + len(chain))) + list(range(50)),
               [[0]] * len(chain) + [[3]] * 50, [True] * len(chain) + [False] * 50)
    batched = ctx.logits_rows(len(chain)).copy()
    assert np.array_equal(batched, single), f"max diff {np.abs(batched - single).max():.3g}"


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
    toks = model.tokenize(TEXT * 2)
    p = len(toks) - 1
    ctx.clear()
    ctx.decode_seq(toks[:p], 0, last_logits=False)
    batch_toks = [toks[p]] + (toks[1:] * 4)[:n - 1]
    ctx.decode(batch_toks, range(p, p + n), [[0]] * n, [True] * n)
    batched = ctx.logits_rows(n).copy()
    ctx.seq_rm(0, p, -1)
    single = one_by_one(ctx, batch_toks, p)
    diff = float(np.abs(batched - single).max())
    assert np.array_equal(batched, single), f"batch of {n}: max |logit diff| {diff:.3g}"


def test_tree_batch_every_branch_exact(target_ctx):
    """A tree with three branches (one seq id per leaf; shared nodes in several seqs), batched
    spine first as the engine does: every node's logits, on the spine or on a side branch (whose
    ancestors have other branches' masked cells between them), are the one-token logits of its
    own path."""
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
            assert np.array_equal(row, tree_rows[node]), f"branch {branch} node {node}: max diff {diff:.3g}"


def test_abort_stops_a_forward_and_the_context_stays_usable(target_ctx):
    """`Context.abort()` from another thread stops a long prompt forward at its next graph node
    (the patch's edgespec_abort_flag): the decode raises ForwardAborted, llama.cpp drops the
    aborted piece's cells, and the context decodes on as if the piece had never been sent."""
    import threading

    from edgespec.errors import ForwardAborted

    model, ctx = target_ctx
    toks = (model.tokenize(TEXT * 12))[:900]
    ctx.clear()
    ctx.decode(toks[:100], range(100), [[0]] * 100, [False] * 100)
    ctx.abort()  # set before the call: the first node stops it, as a deadline passing mid-forward would
    with pytest.raises(ForwardAborted):
        ctx.decode(toks[100:900], range(100, 900), [[0]] * 800, [False] * 800)
    ctx.clear_abort()
    assert ctx.pos_max(0) < 900 and ctx.pos_max(0) >= 99  # the first 100 are kept at least
    ctx.seq_rm(0, 100, -1)
    ctx.decode(toks[100:101], [100], [[0]], [True])
    after = ctx.logits(0).copy()
    ctx.clear()
    ctx.decode(toks[:101], range(101), [[0]] * 101, [False] * 100 + [True])
    assert np.array_equal(after, ctx.logits(-1))
    # and from another thread, while the forward runs
    ctx.clear()
    timer = threading.Timer(0.05, ctx.abort)
    timer.start()
    try:
        with pytest.raises(ForwardAborted):
            for _ in range(50):  # a forward long enough that the timer fires inside one
                ctx.decode(toks[:512], range(512), [[0]] * 512, [False] * 512)
                ctx.clear()
    finally:
        timer.join()
        ctx.clear_abort()
        ctx.clear()


def test_a_lone_token_deep_in_a_long_context_is_its_batched_row(target_ctx):
    """Plain decoding's forward (one token, one sequence) shares its attention out over the
    threads by cells and by V's columns (the patch's edgespec_fa_lone), where a batch takes work
    units of GQA groups: 700 positions deep, a lone token's logits are the bits of its row in a
    batched forward, on two threads and on one."""
    model, ctx = target_ctx
    toks = (model.tokenize(TEXT * 16))[:705]
    assert len(toks) == 705
    p = 700
    ctx.clear()
    ctx.decode_seq(toks[:p], 0, last_logits=False)
    ctx.decode(toks[p:], range(p, 705), [[0]] * 5, [True] * 5)
    batched = ctx.logits_rows(5).copy()
    for threads in (2, 1):
        ctx.set_threads(threads)
        try:
            ctx.seq_rm(0, p, -1)
            single = one_by_one(ctx, toks[p:], p)
        finally:
            ctx.set_threads(2)
        diff = float(np.abs(batched - single).max())
        assert np.array_equal(batched, single), f"{threads} thread(s): max |logit diff| {diff:.3g}"


def test_the_thread_count_changes_no_bit(target_ctx):
    """The thread governor (controller/threads.py) may run a forward on one thread or two: every
    element's reduction order is the same either way."""
    model, ctx = target_ctx
    toks = model.tokenize(TEXT * 2)[:120]
    rows = []
    for n in (2, 1, 2):
        ctx.set_threads(n)
        ctx.clear()
        ctx.decode(toks, range(len(toks)), [[0]] * len(toks), [False] * (len(toks) - 20) + [True] * 20)
        rows.append(ctx.logits_rows(20).copy())
    ctx.set_threads(2)
    assert np.array_equal(rows[0], rows[1]) and np.array_equal(rows[0], rows[2])
