"""Mixed-precision training of a head: bfloat16 weight products with float32 sums, weights and
optimiser. The products and both of their gradients track float32 to bfloat16's rounding, a
train step in bf16 learns what an f32 one learns, and `auto` picks bf16 only where the
hardware multiplies bfloat16 natively. (The training process's heap: tests/test_heap.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from edgespec.heads.train import training_precision
from edgespec.heads.weights import HeadConfig, HeadWeights


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
    mj = pytest.importorskip("edgespec.heads.model_jax")
    with pytest.raises(ValueError, match="fp8"):
        mj.make_train_step(_cfg(), 1, precision="fp8")


def _rel(a, b) -> float:  # noqa: ANN001
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_bf16_products_and_their_gradients_track_float32():
    """Forward, d/dx and d/dw (summed over every leading axis) of linear(x, w) in bf16 are
    float32's to within bfloat16's rounding (8 bits of mantissa), and are not float32's bits."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from edgespec.heads.model_jax import linear

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((3, 16, 96)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((40, 96)) * 0.1, jnp.float32)
    r = jnp.asarray(rng.standard_normal((3, 16, 40)), jnp.float32)

    def f(prec):  # noqa: ANN001, ANN202
        return lambda x, w: jnp.sum(linear(x, w, prec) * r)

    y32, y16 = linear(x, w, "f32"), linear(x, w, "bf16")
    assert y16.dtype == jnp.float32 and y16.shape == (3, 16, 40)
    g32 = jax.grad(f("f32"), argnums=(0, 1))(x, w)
    g16 = jax.grad(f("bf16"), argnums=(0, 1))(x, w)
    for a, b in [(y16, y32), *zip(g16, g32)]:
        assert a.shape == b.shape and a.dtype == jnp.float32
        assert 0 < _rel(a, b) < 2e-2  # rounded, and only by bfloat16's rounding


def _cfg(n_vocab: int = 64) -> HeadConfig:
    return HeadConfig(n_embd=64, n_ff=128, n_head=4, n_head_kv=2, head_dim=16, layers=(0, 1, 2),
                      n_draft_vocab=n_vocab, rope_base=10000.0, rms_eps=1e-5, n_ctx_train=128)


def test_a_bf16_train_step_learns_what_an_f32_one_learns():
    """From the same start on the same batches, 60 Adam steps in each precision: both fit a
    learnable mapping (label = a fixed function of the input token), to nearly the same loss and
    the same training accuracy. A broken mixed-precision step (say, a d/dw that does not sum
    over the batch) would leave the bf16 run far behind."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from edgespec.heads import model_jax as mj

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

