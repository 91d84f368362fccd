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

Mixed precision (`precision="bf16"`): every weight product rounds both operands to bfloat16 and
sums in float32, in the forward and in both gradient products (`linear`: a custom VJP, since
autodiff of a bfloat16 product would run the gradient products in float32); everything else,
the weights and Adam included, stays float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from edgespec.heads.weights import HeadConfig


def rms(x, w, eps):  # noqa: ANN001, ANN201
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, pos, base):  # noqa: ANN001, ANN201
    """llama.cpp's NORM rope: adjacent pairs (x[2i], x[2i+1]) rotated by pos * base^(-2i/d).
    x [B, T, H, d], pos [T] (a numpy array: the angles become constants of the program)."""
    d = x.shape[-1]
    xp = np if isinstance(pos, np.ndarray) else jnp
    inv = base ** (-xp.arange(0, d, 2, dtype=xp.float32) / d)
    ang = pos[:, None].astype(xp.float32) * inv[None, :]  # [T, d/2]
    c, s = xp.cos(ang)[None, :, None, :], xp.sin(ang)[None, :, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return jnp.stack([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1).reshape(x.shape)


PRECISIONS = ("f32", "bf16")


def linear(x, w, precision: str = "f32"):  # noqa: ANN001, ANN201
    """x @ w.T. `bf16`: the operands rounded to bfloat16 and the products summed in float32, in
    the forward and in both gradient products (the CPU's AMX / AVX512-BF16 units, a GPU's
    tensor cores); the weights, their gradients and the optimiser stay float32 (mixed
    precision)."""
    if precision == "bf16":
        return _linear_bf16(x, w)
    return x @ w.T


def _bf16_dot(a, b, dims):  # noqa: ANN001, ANN202
    return jax.lax.dot_general(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), (dims, ((), ())),
                               preferred_element_type=jnp.float32)


@jax.custom_vjp
def _linear_bf16(x, w):  # noqa: ANN001, ANN202
    return _bf16_dot(x, w, ((x.ndim - 1,), (1,)))  # [..., out]


def _linear_bf16_fwd(x, w):  # noqa: ANN001, ANN202
    return _linear_bf16(x, w), (x, w)


def _linear_bf16_bwd(res, dy):  # noqa: ANN001, ANN202
    x, w = res  # x [..., in], w [out, in], dy [..., out]
    dx = _bf16_dot(dy, w, ((dy.ndim - 1,), (0,)))  # [..., in]
    lead = tuple(range(x.ndim - 1))
    dw = _bf16_dot(dy, x, (lead, lead))  # [out, in]: summed over every row
    return dx, dw


_linear_bf16.defvjp(_linear_bf16_fwd, _linear_bf16_bwd)


def _shift(x, k: int):  # noqa: ANN001, ANN202
    """x[:, t - k] at t (zeros where t < k), along axis 1."""
    if k == 0:
        return x
    pad = jnp.zeros_like(x[:, :k])
    return jnp.concatenate([pad, x[:, :-k]], axis=1)


def step(p, cfg: HeadConfig, emb, g, keys: list, j: int, seg=None, precision: str = "f32"):  # noqa: ANN001, ANN201
    """One TTT step. emb, g [B, T, e]; keys: (k, v) of steps 0..j-1; seg [B, T] segment ids of
    packed sequences (attention stays inside one; None: one sequence per row); `precision` of
    the weight products (`linear`; attention, the norms, softmax and rope stay float32).
    Returns (h, logits, (k, v))."""
    def mm(a, name):  # noqa: ANN001, ANN202
        return linear(a, p[name], precision)

    B, T, _ = emb.shape
    H, KV, d = cfg.n_head, cfg.n_head_kv, cfg.head_dim
    x = jnp.concatenate([rms(emb, p["attn_norm"], cfg.rms_eps), rms(g, p["hidden_norm"], cfg.rms_eps)], axis=-1)
    pos = np.arange(T)
    q = rope(mm(x, "wq").reshape(B, T, H, d), pos, cfg.rope_base)
    k = rope(mm(x, "wk").reshape(B, T, KV, d), pos, cfg.rope_base)
    v = mm(x, "wv").reshape(B, T, KV, d)
    rep = H // KV
    kk = [kv[0] for kv in keys] + [k]
    vv = [kv[1] for kv in keys] + [v]
    scale = 1.0 / np.sqrt(d)
    k0 = jnp.repeat(kk[0], rep, axis=2)
    v0 = jnp.repeat(vv[0], rep, axis=2)
    s0 = jnp.einsum("bthd,bshd->bhts", q, k0) * scale
    t_idx, s_idx = np.arange(T)[:, None], np.arange(T)[None, :]
    allowed = jnp.asarray(s_idx <= t_idx - j)[None, None]
    if seg is not None:
        allowed = allowed & (seg[:, None, :, None] == seg[:, None, None, :])
    s0 = jnp.where(allowed, s0, -1e30)
    diag = []
    for i in range(1, j + 1):
        ki = _shift(jnp.repeat(kk[i], rep, axis=2), j - i)
        di = jnp.einsum("bthd,bthd->bht", q, ki)[..., None] * scale  # [B, H, T, 1]
        if seg is not None:
            di = jnp.where((_shift(seg, j - i) == seg)[:, None, :, None], di, -1e30)
        diag.append(di)
    alls = jnp.concatenate([s0] + diag, axis=-1)
    pr = jax.nn.softmax(alls, axis=-1)
    out = jnp.einsum("bhts,bshd->bthd", pr[..., :T], v0)
    for n, i in enumerate(range(1, j + 1)):
        vi = _shift(jnp.repeat(vv[i], rep, axis=2), j - i)
        out = out + pr[..., T + n].transpose(0, 2, 1)[..., None] * vi
    attn = mm(out.reshape(B, T, H * d), "wo")
    ffn_inp = attn + g
    hn = rms(ffn_inp, p["ffn_norm"], cfg.rms_eps)
    h = ffn_inp + mm(jax.nn.silu(mm(hn, "gate")) * mm(hn, "up"), "down")
    logits = mm(rms(h, p["output_norm"], cfg.rms_eps), "lm_head")
    return h, logits, (k, v)


def loss_fn(p, cfg: HeadConfig, embed, feats, tokens, labels_d, steps: int,  # noqa: ANN001, ANN201
            decay: float = 0.8, seg=None, precision: str = "f32"):
    """feats [B, T, 3e] f32; tokens [B, T] (input token[t+1] at t); labels_d [B, T] draft-vocab
    index of the target's next token (-1: outside the draft vocabulary or past the end); seg
    [B, T] segment ids of packed sequences or None; `precision`: `step`'s. Returns (loss,
    per-step top-1 accuracy [steps]). The cross-entropy is logsumexp - the label's logit (no [B, T, V] log-softmax)."""
    emb = embed[tokens]
    g = linear(feats, p["fc"], precision)
    keys: list = []
    total, accs = 0.0, []
    T = tokens.shape[1]
    for j in range(steps):
        h, logits, kv = step(p, cfg, emb, g, keys, j, seg, precision)
        keys.append(kv)
        valid = (labels_d >= 0) & jnp.asarray(np.arange(T) >= j)[None, :]
        if seg is not None:  # step j's chain starts j positions back: all of it in one sequence
            valid = valid & (_shift(seg, j) == seg)
        lab = jnp.maximum(labels_d, 0)
        nll = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, lab[..., None], axis=-1)[..., 0]
        n = jnp.maximum(valid.sum(), 1)
        total = total + (decay ** j) * jnp.sum(jnp.where(valid, nll, 0.0)) / n
        accs.append(jnp.sum(jnp.where(valid, jnp.argmax(logits, -1) == lab, False)) / n)
        g = _shift(h, 1)
    return total, jnp.stack(accs)


def adam_init(p):  # noqa: ANN001, ANN201
    z = jax.tree_util.tree_map(jnp.zeros_like, p)
    return {"m": z, "v": jax.tree_util.tree_map(jnp.zeros_like, p), "t": jnp.zeros((), jnp.int32)}


def make_train_step(cfg: HeadConfig, steps: int, wd: float = 0.0, packed: bool = False,  # noqa: ANN201
                    precision: str = "f32"):
    """A jitted (params, opt, embed, feats, tokens, labels_d, lr[, seg]) -> (params, opt, loss,
    accs): one Adam step (`packed`: with segment ids; `precision`: the weight products')."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")

    def train_step(p, opt, embed, feats, tokens, labels_d, lr, seg=None):  # noqa: ANN001, ANN202
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
