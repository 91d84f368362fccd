"""The EAGLE-3 head in jax, the same maths as llama.cpp's src/models/eagle3.cpp, with
EAGLE-3's training-time test: the head fed its own outputs for `steps` steps.

Why jax: autodiff over a hand-written forward that mirrors llama.cpp's graph line by line, a
CPU wheel of ~100 MB from PyPI (torch from PyPI pulls gigabytes of CUDA libraries on Linux),
and XLA compiles the whole step (forward, backward, Adam) into one fused CPU program.

Training-time test. At head position t the input is (token[t+1], g), the label the target's
greedy next token after token[t+1]. Step 0 uses g = fc(features[t]). Step j >= 1 uses
g = h_{j-1}[t-1], the head's own pre-norm output one position back, exactly what drafting feeds
at depth j+1; its query attends to step-0 keys at positions <= t-j (the committed context) and
to step i's key at position t-(j-i) for i = 1..j (its own drafted ancestors).

Mixed precision (`precision="bf16"`): every weight product and attention's two batched products
(q.k, p.v) round both operands to bfloat16 and sum in float32, in the forward and in both
gradient products (`einsum`: a custom VJP, since autodiff of a bfloat16 product would run the
gradient products in float32); everything else, the weights and Adam included, stays float32.

The step is shaped for a CPU's XLA, where each pass over a [rows, width] tensor costs memory
traffic: grouped-query attention reads its kv heads without repeating them; q and k come out of
their projections with each rope pair split into halves (`_halves`), so rope needs no
interleaving; a query block reads only the key blocks it can see (causal); the softmax over the
context's scores and the drafted ancestors' is formed without concatenating them; and the
training accuracy is read off the max that log-sum-exp takes anyway (no argmax pass).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from edgespec.heads.weights import HeadConfig


def rms(x, w, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, pos, base):
    """llama.cpp's NORM rope: adjacent pairs (x[2i], x[2i+1]) rotated by pos * base^(-2i/d).
    x [B, T, H, d], pos [T] (a numpy array: the angles become constants of the program)."""
    c, s = _rope_angles(x.shape[-1], pos, base)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return jnp.stack([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1).reshape(x.shape)


def _rope_angles(d: int, pos, base):
    """cos and sin of pos * base^(-2i/d), [1, T, 1, d/2]; numpy (program constants) for a numpy pos."""
    xp = np if isinstance(pos, np.ndarray) else jnp
    inv = base ** (-xp.arange(0, d, 2, dtype=xp.float32) / d)
    ang = pos[:, None].astype(xp.float32) * inv[None, :]  # [T, d/2]
    return xp.cos(ang)[None, :, None, :], xp.sin(ang)[None, :, None, :]


def _halves(n_head: int, d: int) -> np.ndarray:
    """The rows of wq / wk reordered per head so that each pair (2i, 2i+1) becomes (i, d/2 + i)."""
    one = np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])
    return (np.arange(n_head)[:, None] * d + one[None, :]).reshape(-1)


def _rope_halves(x, pos, base):
    """`rope` for x whose head dimension holds the pairs' first elements, then their second ones
    (the projection's rows reordered by `_halves`): the same rotation without interleaving.
    q.k is the same in either order, so attention reads these as it would `rope`'s."""
    d = x.shape[-1]
    c, s = _rope_angles(d, pos, base)
    x0, x1 = x[..., :d // 2], x[..., d // 2:]
    return jnp.concatenate([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1)


PRECISIONS = ("f32", "bf16")


def linear(x, w, precision: str = "f32"):
    """x @ w.T. `bf16`: the operands rounded to bfloat16 and the products summed in float32, in
    the forward and in both gradient products (the CPU's AMX / AVX512-BF16 units, a GPU's
    tensor cores); the weights, their gradients and the optimiser stay float32 (mixed
    precision)."""
    if precision == "bf16":
        lead = "abcdefgh"[:x.ndim - 1]
        return _einsum_bf16(f"{lead}i,oi->{lead}o", x, w)
    return x @ w.T


def einsum(spec: str, a, b, precision: str = "f32"):
    """jnp.einsum(spec, a, b); `bf16`: as `linear` (attention's two batched products: q.k and
    p.v). Every index of an operand appears in the other operand or in the result."""
    if precision == "bf16":
        return _einsum_bf16(spec, a, b)
    return jnp.einsum(spec, a, b)


def _bf16_einsum(spec: str, a, b):
    return jnp.einsum(spec, a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _einsum_bf16(spec, a, b):
    return _bf16_einsum(spec, a, b)


def _einsum_bf16_fwd(spec, a, b):
    return _bf16_einsum(spec, a, b), (a, b)


def _einsum_bf16_bwd(spec, res, dy):
    """Both gradient products in bfloat16 too (autodiff of a bfloat16 product would run them in
    float32); d/dw of `linear` sums over every leading axis."""
    a, b = res
    sa, rest = spec.split(",")
    sb, so = rest.split("->")
    return _bf16_einsum(f"{so},{sb}->{sa}", dy, b), _bf16_einsum(f"{sa},{so}->{sb}", a, dy)


_einsum_bf16.defvjp(_einsum_bf16_fwd, _einsum_bf16_bwd)


def _shift(x, k: int):
    """x[:, t - k] at t (zeros where t < k), along axis 1."""
    if k == 0:
        return x
    pad = jnp.zeros_like(x[:, :k])
    return jnp.concatenate([pad, x[:, :-k]], axis=1)


def step(p, cfg: HeadConfig, emb, g, keys: list, j: int, seg=None, precision: str = "f32"):
    """One TTT step. emb, g [B, T, e]; keys: (k, v) of steps 0..j-1; seg [B, T] segment ids of
    packed sequences (attention stays inside one; None: one sequence per row); `precision` of
    the weight products (`linear`) and of attention's two batched products (`einsum`); the
    norms, softmax and rope stay float32.
    Returns (h, logits, (k, v)); k in `_halves` order, as later steps read it."""
    def mm(a, name):
        return linear(a, p[name], precision)

    B, T, _ = emb.shape
    H, KV, d = cfg.n_head, cfg.n_head_kv, cfg.head_dim
    x = jnp.concatenate([rms(emb, p["attn_norm"], cfg.rms_eps), rms(g, p["hidden_norm"], cfg.rms_eps)], axis=-1)
    pos = np.arange(T)
    # q and k in the pairs-split order (`_halves`): the keys kept for later steps are in it too
    q = _rope_halves(linear(x, p["wq"][_halves(H, d)], precision).reshape(B, T, H, d), pos, cfg.rope_base)
    k = _rope_halves(linear(x, p["wk"][_halves(KV, d)], precision).reshape(B, T, KV, d), pos, cfg.rope_base)
    v = mm(x, "wv").reshape(B, T, KV, d)
    rep = H // KV
    kk = [kv[0] for kv in keys] + [k]
    vv = [kv[1] for kv in keys] + [v]
    scale = 1.0 / np.sqrt(d)
    # grouped-query attention without repeating the keys and values: head g*rep + r reads kv head g
    q5 = q.reshape(B, T, KV, rep, d)
    diag = []  # [B, T, KV, rep] scores of the drafted ancestors, one per query row
    for i in range(1, j + 1):
        ki = _shift(kk[i], j - i)  # [B, T, KV, d]
        # a product per (row, head) over d: multiply and sum (as a dot it is thousands of 3x64x1 products)
        di = jnp.sum(q5 * ki[:, :, :, None, :], axis=-1) * scale
        if seg is not None:
            di = jnp.where((_shift(seg, j - i) == seg)[:, :, None, None], di, -1e30)
        diag.append(di)
    # causal: query block b reads the keys of blocks 0..b only
    nb = 2 if T % 2 == 0 and T >= 64 else 1
    tb = T // nb
    outs = []
    for b in range(nb):
        a_, z_ = b * tb, (b + 1) * tb
        sb = einsum("btgrd,bsgd->bgrts", q5[:, a_:z_], kk[0][:, :z_], precision) * scale  # [B, KV, rep, tb, z_]
        t_idx, s_idx = np.arange(a_, z_)[:, None], np.arange(z_)[None, :]
        allowed = jnp.asarray(s_idx <= t_idx - j)[None, None, None]
        if seg is not None:
            allowed = allowed & (seg[:, None, None, a_:z_, None] == seg[:, None, None, None, :z_])
        sb = jnp.where(allowed, sb, -1e30)
        db = [di[:, a_:z_].transpose(0, 2, 3, 1)[..., None] for di in diag]  # [B, KV, rep, tb, 1]
        # softmax over the context's scores and the drafted ancestors' without concatenating them
        top = jax.lax.stop_gradient(functools.reduce(jnp.maximum, db, jnp.max(sb, axis=-1, keepdims=True)))
        e0, ed = jnp.exp(sb - top), [jnp.exp(dd - top) for dd in db]
        den = functools.reduce(jnp.add, ed, jnp.sum(e0, axis=-1, keepdims=True))
        ob = einsum("bgrts,bsgd->btgrd", e0 / den, vv[0][:, :z_], precision)
        for n, i in enumerate(range(1, j + 1)):
            vi = _shift(vv[i], j - i)[:, a_:z_]  # [B, tb, KV, d]
            pi = (ed[n] / den)[..., 0].transpose(0, 3, 1, 2)[..., None]  # [B, tb, KV, rep, 1]
            ob = ob + pi * vi[:, :, :, None, :]
        outs.append(ob)
    out = outs[0] if nb == 1 else jnp.concatenate(outs, axis=1)
    attn = mm(out.reshape(B, T, H * d), "wo")
    ffn_inp = attn + g
    hn = rms(ffn_inp, p["ffn_norm"], cfg.rms_eps)
    h = ffn_inp + mm(jax.nn.silu(mm(hn, "gate")) * mm(hn, "up"), "down")
    logits = mm(rms(h, p["output_norm"], cfg.rms_eps), "lm_head")
    return h, logits, (k, v)


def loss_fn(p, cfg: HeadConfig, embed, feats, tokens, labels_d, steps: int,
            decay: float = 0.8, seg=None, precision: str = "f32"):
    """feats [B, T, 3e] f32; tokens [B, T] (input token[t+1] at t); labels_d [B, T] draft-vocab
    index of the target's next token (-1: outside the draft vocabulary or past the end); seg
    [B, T] segment ids of packed sequences or None; `precision`: `step`'s. Returns (loss,
    per-step top-1 accuracy [steps]). The cross-entropy is logsumexp - the label's logit (no [B, T, V] log-softmax)."""
    emb = embed[tokens]
    g = linear(feats, p["fc"], precision)
    keys: list = []
    total: Any = 0.0
    accs = []
    T = tokens.shape[1]
    for j in range(steps):
        h, logits, kv = step(p, cfg, emb, g, keys, j, seg, precision)
        keys.append(kv)
        valid = (labels_d >= 0) & jnp.asarray(np.arange(T) >= j)[None, :]
        if seg is not None:  # step j's chain starts j positions back: all of it in one sequence
            valid = valid & (_shift(seg, j) == seg)
        lab = jnp.maximum(labels_d, 0)
        top = jax.lax.stop_gradient(jnp.max(logits, axis=-1))
        lse = top + jnp.log(jnp.sum(jnp.exp(logits - top[..., None]), axis=-1))
        ll = jnp.take_along_axis(logits, lab[..., None], axis=-1)[..., 0]
        n = jnp.maximum(valid.sum(), 1)
        total = total + (decay ** j) * jnp.sum(jnp.where(valid, lse - ll, 0.0)) / n
        # top-1 right: the label's logit is the largest (the max logsumexp takes anyway; no argmax pass)
        accs.append(jnp.sum(jnp.where(valid, ll >= top, False)) / n)
        g = _shift(h, 1)
    return total, jnp.stack(accs)


def adam_init(p):
    z = jax.tree_util.tree_map(jnp.zeros_like, p)
    return {"m": z, "v": jax.tree_util.tree_map(jnp.zeros_like, p), "t": jnp.zeros((), jnp.int32)}


def make_train_step(cfg: HeadConfig, steps: int, wd: float = 0.0, packed: bool = False,
                    precision: str = "f32"):
    """A jitted (params, opt, embed, feats, tokens, labels_d, lr[, seg]) -> (params, opt, loss,
    accs): one Adam step (`packed`: with segment ids; `precision`: `step`'s)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")

    def train_step(p, opt, embed, feats, tokens, labels_d, lr, seg=None):
        (loss, accs), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, cfg, embed, feats, tokens, labels_d, steps,
                                                                         seg=seg, precision=precision)
        gn = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree_util.tree_leaves(grads)))
        clip = jnp.minimum(1.0, 1.0 / (gn + 1e-6))
        t = opt["t"] + 1
        b1, b2 = 0.9, 0.95
        m = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g * clip, opt["m"], grads)
        v = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * (g * clip) ** 2, opt["v"], grads)
        c1, c2 = 1 - b1 ** t, 1 - b2 ** t
        p = jax.tree_util.tree_map(lambda w, m, v: w - lr * ((m / c1) / (jnp.sqrt(v / c2) + 1e-8) + wd * w), p, m, v)
        return p, {"m": m, "v": v, "t": t}, loss, accs

    return jax.jit(train_step)
