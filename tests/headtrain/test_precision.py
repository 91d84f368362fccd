"""Mixed-precision training of a head: bfloat16 weight products with float32 sums, weights and
optimiser. The products and both of their gradients track float32 to bfloat16's rounding, a
train step in bf16 learns what an f32 one learns, and `auto` picks bf16 only where the
hardware multiplies bfloat16 natively. (The training process's heap: tests/test_heap.py.)"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from edgespec.heads.weights import HeadConfig, HeadWeights
from edgespec.headtrain.train import training_precision


@pytest.mark.parametrize(("asked", "backend", "flags", "chosen"), [
    ("auto", "cpu", {"avx2", "avx512f", "amx_bf16"}, "bf16"),
    ("auto", "cpu", {"avx512f", "avx512_bf16"}, "bf16"),
    ("auto", "cpu", {"avx2", "avx512f"}, "f32"),  # bf16 would be emulated
    ("auto", "gpu", set(), "bf16"),
    ("f32", "cpu", {"amx_bf16"}, "f32"),
    ("bf16", "cpu", set(), "bf16"),
])
def test_auto_precision_follows_the_hardware(asked, backend, flags, chosen):
    assert training_precision(asked, backend, frozenset(flags)) == chosen


def test_an_unknown_precision_is_refused_naming_it():
    with pytest.raises(ValueError, match="fp8"):
        training_precision("fp8", "cpu", frozenset())
    mj = pytest.importorskip("edgespec.headtrain.model_jax")
    with pytest.raises(ValueError, match="fp8"):
        mj.make_train_step(_cfg(), 1, precision="fp8")


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_bf16_products_and_their_gradients_track_float32():
    """Forward, d/dx and d/dw (summed over every leading axis) of linear(x, w) in bf16 are
    float32's to within bfloat16's rounding (8 bits of mantissa), and are not float32's bits."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from edgespec.headtrain.model_jax import linear

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((3, 16, 96)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((40, 96)) * 0.1, jnp.float32)
    r = jnp.asarray(rng.standard_normal((3, 16, 40)), jnp.float32)

    def f(prec):
        return lambda x, w: jnp.sum(linear(x, w, prec) * r)

    y32, y16 = linear(x, w, "f32"), linear(x, w, "bf16")
    assert y16.dtype == jnp.float32 and y16.shape == (3, 16, 40)
    g32 = jax.grad(f("f32"), argnums=(0, 1))(x, w)
    g16 = jax.grad(f("bf16"), argnums=(0, 1))(x, w)
    for a, b in [(y16, y32), *zip(g16, g32)]:
        assert a.shape == b.shape and a.dtype == jnp.float32
        assert 0 < _rel(a, b) < 2e-2  # rounded, and only by bfloat16's rounding


@pytest.mark.parametrize("spec", ["btgrd,bsgd->bgrts", "bgrts,bsgd->btgrd"])
def test_bf16_attention_products_and_their_gradients_track_float32(spec):
    """Attention's two batched products (q.k, grouped heads; p.v) in bf16: the product and both
    gradients are float32's to within bfloat16's rounding, and not float32's bits."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from edgespec.headtrain.model_jax import einsum

    B, T, G, R, d = 2, 12, 2, 3, 16
    rng = np.random.default_rng(2)
    shapes = {"btgrd": (B, T, G, R, d), "bsgd": (B, T, G, d), "bgrts": (B, G, R, T, T)}
    sa, rest = spec.split(",")
    sb, so = rest.split("->")
    a = jnp.asarray(rng.standard_normal(shapes[sa]), jnp.float32)
    b = jnp.asarray(rng.standard_normal(shapes[sb]), jnp.float32)
    r = jnp.asarray(rng.standard_normal(jnp.einsum(spec, a, b).shape), jnp.float32)
    y32, y16 = einsum(spec, a, b, "f32"), einsum(spec, a, b, "bf16")
    g32 = jax.grad(lambda a, b: jnp.sum(einsum(spec, a, b, "f32") * r), argnums=(0, 1))(a, b)
    g16 = jax.grad(lambda a, b: jnp.sum(einsum(spec, a, b, "bf16") * r), argnums=(0, 1))(a, b)
    for x, y in [(y16, y32), *zip(g16, g32)]:
        assert x.shape == y.shape and x.dtype == jnp.float32
        assert 0 < _rel(x, y) < 2e-2


def test_rope_on_split_pairs_gives_the_attention_scores_of_llama_cpp_rope():
    """q and k projected with `_halves`-reordered rows and rotated by `_rope_halves` give the
    same q.k as llama.cpp's pairwise rope on the original rows (and the rotated rows are the
    same numbers, reordered); a reordering of one side only does not."""
    pytest.importorskip("jax")
    import jax.numpy as jnp

    from edgespec.headtrain.model_jax import _halves, _rope_halves, rope

    H, d, T, e = 3, 16, 10, 24
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, T, e)).astype(np.float32)
    wq, wk = (rng.standard_normal((H * d, e)).astype(np.float32) for _ in range(2))
    pos = np.arange(T)

    def proj(w):
        return jnp.asarray(x @ w.T).reshape(1, T, H, d)

    perm = _halves(H, d)
    q, k = rope(proj(wq), pos, 10000.0), rope(proj(wk), pos, 10000.0)
    qh, kh = _rope_halves(proj(wq[perm]), pos, 10000.0), _rope_halves(proj(wk[perm]), pos, 10000.0)
    np.testing.assert_allclose(np.asarray(qh).reshape(1, T, -1), np.asarray(q).reshape(1, T, -1)[..., perm],
                               rtol=1e-5, atol=1e-5)
    s, sh = (np.einsum("bthd,bshd->bhts", np.asarray(a), np.asarray(b)) for a, b in [(q, k), (qh, kh)])
    np.testing.assert_allclose(sh, s, rtol=1e-4, atol=1e-4)
    mixed = np.einsum("bthd,bshd->bhts", np.asarray(qh), np.asarray(k))
    assert np.abs(mixed - s).max() > 0.1


def test_the_training_accuracy_is_the_argmax_accuracy():
    """loss_fn's per-step accuracy (the label's logit is the largest) equals argmax == label over
    the scored rows, and its loss is the mean cross-entropy (log-sum-exp less the label's logit)."""
    pytest.importorskip("jax")
    import jax.numpy as jnp

    from edgespec.headtrain import model_jax as mj

    V, n_tok, B, T = 64, 50, 2, 16
    cfg = _cfg(V)
    rng = np.random.default_rng(4)
    p = {k: jnp.asarray(v) for k, v in HeadWeights.init(cfg, np.arange(V), rng).w.items()}
    embed = jnp.asarray(rng.standard_normal((n_tok, cfg.n_embd)), jnp.float32)
    feats = jnp.asarray(rng.standard_normal((B, T, 3 * cfg.n_embd)), jnp.float32)
    tok = jnp.asarray(rng.integers(0, n_tok, (B, T)), jnp.int32)
    g = mj.linear(feats, p["fc"])
    _, logits, _ = mj.step(p, cfg, embed[tok], g, [], 0)
    lab = np.asarray(jnp.argmax(logits, -1)).copy()
    lab[:, ::3] = (lab[:, ::3] + 1) % V  # a third wrong
    lab[0, 5] = -1  # not scored
    loss, accs = mj.loss_fn(p, cfg, embed, feats, tok, jnp.asarray(lab), 1)
    scored = lab >= 0
    want = (np.asarray(jnp.argmax(logits, -1)) == lab)[scored].mean()
    assert abs(float(accs[0]) - want) < 1e-6 and 0.5 < want < 0.8
    lg = np.asarray(logits, np.float64)
    lse = np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1)) + lg.max(-1)
    nll = (lse - np.take_along_axis(lg, np.maximum(lab, 0)[..., None], -1)[..., 0])[scored].mean()
    assert abs(float(loss) - nll) < 1e-4 * max(1.0, nll)


def _cfg(n_vocab: int = 64) -> HeadConfig:
    return HeadConfig(n_embd=64, n_ff=128, n_head=4, n_head_kv=2, head_dim=16, layers=(0, 1, 2),
                      n_draft_vocab=n_vocab, rope_base=10000.0, rms_eps=1e-5, n_ctx_train=128)


def test_a_bf16_train_step_learns_what_an_f32_one_learns():
    """From the same start on the same batches, 60 Adam steps in each precision: both fit a
    learnable mapping (label = a fixed function of the input token), to nearly the same loss and
    the same training accuracy. A broken mixed-precision step (say, a d/dw that does not sum
    over the batch) would leave the bf16 run far behind."""
    pytest.importorskip("jax")
    import jax.numpy as jnp

    from edgespec.headtrain import model_jax as mj

    V, n_tok, B, T = 64, 200, 4, 32
    cfg = _cfg(V)
    rng = np.random.default_rng(1)
    head = HeadWeights.init(cfg, np.arange(V), rng)
    embed = jnp.asarray(rng.standard_normal((n_tok, cfg.n_embd)) * 0.5, jnp.float32)
    table = rng.integers(0, V, n_tok).astype(np.int32)  # the mapping to learn
    batches = []
    for _ in range(4):
        tok = rng.integers(0, n_tok, (B, T)).astype(np.int32)
        feats = rng.standard_normal((B, T, 3 * cfg.n_embd)).astype(np.float32)
        seg = np.repeat(np.arange(2), T // 2)[None].repeat(B, 0).astype(np.int32)
        batches.append(tuple(jnp.asarray(a) for a in (feats, tok, table[tok], seg)))
    out = {}
    for prec in ("f32", "bf16"):
        p = {k: jnp.asarray(v) for k, v in head.w.items()}
        opt = mj.adam_init(p)
        step = mj.make_train_step(cfg, 2, packed=True, precision=prec)
        for i in range(60):
            f, tok, lab, seg = batches[i % len(batches)]
            p, opt, loss, accs = step(p, opt, embed, f, tok, lab, jnp.float32(3e-3), seg)
        out[prec] = (float(loss), float(accs[0]))
    (l32, a32), (l16, a16) = out["f32"], out["bf16"]
    assert a32 > 0.9 and l32 < 0.5 * np.log(V), out  # the mapping is learnt
    assert a16 > a32 - 0.05 and l16 < 1.5 * l32 + 0.05, out



def test_causal_query_blocks_give_every_row_its_causal_prefix_only():
    """A window long enough for causal query blocks (T >= 64) computes what a short one without
    blocks computes: each row of the training-time test, at every step and with packed segments,
    depends on its own prefix only. So a 128-row window's first 48 rows (first block) equal a
    48-row window's (no blocks), and its first 100 rows equal a 100-row window's (other blocks)."""
    pytest.importorskip("jax")
    import jax.numpy as jnp

    from edgespec.headtrain import model_jax as mj

    cfg = _cfg(64)
    rng = np.random.default_rng(5)
    p = {k: jnp.asarray(v) for k, v in HeadWeights.init(cfg, np.arange(64), rng).w.items()}
    T = 128
    emb = rng.standard_normal((1, T, cfg.n_embd)).astype(np.float32)
    g0 = rng.standard_normal((1, T, cfg.n_embd)).astype(np.float32)
    seg = np.repeat(np.arange(4), [30, 41, 40, 17])[None].astype(np.int32)

    def chain(n: int) -> list:
        keys, g, hs = list[Any](), jnp.asarray(g0[:, :n]), []
        for j in range(3):
            h, _, kv = mj.step(p, cfg, jnp.asarray(emb[:, :n]), g, keys, j, jnp.asarray(seg[:, :n]))
            keys.append(kv)
            hs.append(np.asarray(h))
            g = mj._shift(h, 1)
        return hs

    full = chain(T)
    for n in (48, 100):
        for j, (a, b) in enumerate(zip(full, chain(n))):
            np.testing.assert_allclose(a[:, :n], b, rtol=2e-5, atol=2e-5, err_msg=f"step {j}, {n} rows")
