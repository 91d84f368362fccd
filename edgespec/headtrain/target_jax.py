"""The target (a llama-architecture GGUF) in jax: batched generation that keeps, for every
position, the inputs of the head's three target layers (the features an EAGLE-3 head reads) and
the target's greedy next token. It builds a head's training data on an accelerator box where
llama.cpp is not built: a GPU makes tens of thousands of answers in minutes, where the 2-core
CPU path (`data.distill_features`, through llama.cpp) makes about 100 a minute.

The maths is llama.cpp's `llm_build_llama` for the GGUF as converted (q/k rows in llama.cpp's
adjacent-pair rope layout, `model_jax.rope`), in float32 with the highest matmul precision.
Features agree with llama.cpp's to float rounding (tests/headtrain/test_target_jax.py); greedy
answers may part where two tokens tie to rounding, which only makes another training sequence.

Batches are left-padded: every sequence writes its next key at the same cache column, and its
rope position is the column less its padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from edgespec.headtrain.model_jax import rms, rope

LAYER_NAMES = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")


@dataclass(frozen=True)
class TargetConfig:
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rope_base: float
    rms_eps: float
    n_vocab: int


def read_gguf(path: Path) -> tuple[TargetConfig, dict[str, np.ndarray]]:
    """The config and float32 weights of a llama-architecture GGUF: `embd` [V, e], `out_norm`
    [e], `output` [V, e] (absent when tied), and per-layer arrays stacked on a leading
    [n_layer] axis, matrices [out, in]."""
    import gguf

    r = gguf.GGUFReader(str(path))
    arch = r.fields["general.architecture"].contents()

    def get(key: str, default=None):
        f = r.fields.get(f"{arch}.{key}")
        return f.contents() if f is not None else default

    t = {x.name: x for x in r.tensors}

    def w(name: str) -> np.ndarray:
        x = t[name]
        data = np.asarray(x.data) if x.tensor_type in (0, 1) else gguf.quants.dequantize(x.data, x.tensor_type)
        return np.asarray(data, np.float32).reshape([int(d) for d in reversed(x.shape)])

    e, nh = int(get("embedding_length")), int(get("attention.head_count"))
    cfg = TargetConfig(
        n_layer=int(get("block_count")), n_embd=e, n_head=nh, n_head_kv=int(get("attention.head_count_kv", nh)),
        head_dim=int(get("rope.dimension_count", e // nh)), rope_base=float(get("rope.freq_base", 10000.0)),
        rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)), n_vocab=int(t["token_embd.weight"].shape[1]),
    )
    out = {"embd": w("token_embd.weight"), "out_norm": w("output_norm.weight")}
    if "output.weight" in t:
        out["output"] = w("output.weight")
    for n in LAYER_NAMES:
        out[n] = np.stack([w(f"blk.{i}.{n}.weight") for i in range(cfg.n_layer)])
    return cfg, out


def save_bf16(cfg: TargetConfig, weights: dict[str, np.ndarray], path: Path) -> None:
    """The weights rounded to bfloat16 (stored as uint16, round to nearest even), half the bytes
    of float32: what travels to an accelerator box that cannot read the model's registry."""
    def bf16(a: np.ndarray) -> np.ndarray:
        u = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)

    np.savez(path, cfg=np.asarray(list(vars(cfg).values()), np.float64), **{k: bf16(v) for k, v in weights.items()})


def load_bf16(path: Path) -> tuple[TargetConfig, dict[str, np.ndarray]]:
    z = np.load(path)
    c = z["cfg"]
    names = list(TargetConfig.__dataclass_fields__)
    cfg = TargetConfig(**{n: (float(v) if n in ("rope_base", "rms_eps") else int(v)) for n, v in zip(names, c)})
    w = {k: (z[k].astype(np.uint32) << 16).view(np.float32) for k in z.files if k != "cfg"}
    return cfg, w


def _layer(cfg: TargetConfig, lw: dict, x, pos, kc, vc, li, col, mask):
    """Decoder layer `li` over x [B, T, e] at rope positions pos [B, T]. Its new keys/values go
    into the caches kc, vc [n_layer, B, S, KV, d] (in place) at columns col..col+T-1; mask
    [B, T, S] says which columns each row sees."""
    B, T, _ = x.shape
    H, KV, d = cfg.n_head, cfg.n_head_kv, cfg.head_dim
    h = rms(x, lw["attn_norm"], cfg.rms_eps)
    q = jax.vmap(lambda a, p: rope(a[None], p, cfg.rope_base)[0])((h @ lw["attn_q"].T).reshape(B, T, H, d), pos)
    k = jax.vmap(lambda a, p: rope(a[None], p, cfg.rope_base)[0])((h @ lw["attn_k"].T).reshape(B, T, KV, d), pos)
    v = (h @ lw["attn_v"].T).reshape(B, T, KV, d)
    kc = jax.lax.dynamic_update_slice(kc, k[None], (li, 0, col, 0, 0))
    vc = jax.lax.dynamic_update_slice(vc, v[None], (li, 0, col, 0, 0))
    kl = jax.lax.dynamic_index_in_dim(kc, li, keepdims=False)
    vl = jax.lax.dynamic_index_in_dim(vc, li, keepdims=False)
    rep = H // KV
    qg = q.reshape(B, T, KV, rep, d)
    s = jnp.einsum("btgrd,bsgd->bgrts", qg, kl) / np.sqrt(d)
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bgrts,bsgd->btgrd", p, vl).reshape(B, T, H * d)
    x = x + o @ lw["attn_output"].T
    h = rms(x, lw["ffn_norm"], cfg.rms_eps)
    x = x + (jax.nn.silu(h @ lw["ffn_gate"].T) * (h @ lw["ffn_up"].T)) @ lw["ffn_down"].T
    return x, kc, vc


def make_forward(cfg: TargetConfig, feature_layers: Sequence[int]):
    """A jitted (weights, tokens [B, T], pos [B, T], kcache, vcache, col, mask [B, T, S]) ->
    (logits of the last column [B, V], features [B, T, 3e] float16, kcache, vcache): the layers
    run as scans between the feature layers, whose inputs are kept; the caches are updated in
    place (donated)."""
    cuts = sorted(set(feature_layers))
    bounds = [0] + cuts + [cfg.n_layer]

    def forward(w, tokens, pos, kcache, vcache, col, mask):
        x = w["embd"][tokens]
        feats = {}
        for a, b in zip(bounds[:-1], bounds[1:]):
            if a in cuts:
                feats[a] = x
            if b == a:
                continue
            lw = {n: w[n][a:b] for n in LAYER_NAMES}

            def body(carry, inp):
                x, kc, vc = carry
                lwi, li = inp
                return _layer(cfg, lwi, x, pos, kc, vc, li, col, mask), None

            (x, kcache, vcache), _ = jax.lax.scan(body, (x, kcache, vcache), (lw, jnp.arange(a, b)))
        last = rms(x[:, -1], w["out_norm"], cfg.rms_eps)
        logits = last @ w.get("output", w["embd"]).T
        f = jnp.concatenate([feats[lid] for lid in feature_layers], axis=-1).astype(jnp.float16)
        return logits, f, kcache, vcache

    return jax.jit(forward, donate_argnums=(3, 4))


@dataclass
class Generated:
    """One batch's sequences: tokens[i] (prompt + answer, the answer ending at its first
    end-of-generation token or at max_new), greedy[i] the target's greedy token after each
    position (what a head is trained on; equal to the next token where the answer was greedy),
    features[i] [len(tokens[i]) - 1, 3e] float16 (the last token is never decoded)."""

    tokens: list[np.ndarray]
    greedy: list[np.ndarray]
    features: list[np.ndarray]


def generate(cfg: TargetConfig, w: dict, prompts: Sequence[Sequence[int]], max_new: int, feature_layers: Sequence[int],
             eog: Sequence[int], temperature: float = 0.0, seed: int = 0, forward=None,
             cache: int = 0) -> Generated:
    """Answers to a batch of tokenized prompts: greedy at temperature 0, else sampled at that
    temperature (the greedy token is still recorded at every position). `cache`: the KV cache's
    columns (0: just enough; one width for every batch compiles the decode step once)."""
    fwd = forward or make_forward(cfg, feature_layers)
    B = len(prompts)
    P = -(-max(len(p) for p in prompts) // 64) * 64  # a few prompt widths: a few compilations
    S = max(cache, P + max_new)
    pad = np.asarray([P - len(p) for p in prompts], np.int32)
    toks = np.zeros((B, P), np.int32)
    for i, p in enumerate(prompts):
        toks[i, pad[i]:] = p
    L, KV, d = cfg.n_layer, cfg.n_head_kv, cfg.head_dim
    kc = jnp.zeros((L, B, S, KV, d), jnp.float32)
    vc = jnp.zeros((L, B, S, KV, d), jnp.float32)
    cols = np.arange(S)
    pos = np.maximum(np.arange(P)[None, :] - pad[:, None], 0).astype(np.int32)
    mask = (cols[None, None, :] <= np.arange(P)[None, :, None]) & (cols[None, None, :] >= pad[:, None, None])
    mask |= cols[None, None, :] == np.arange(P)[None, :, None]  # a pad row sees itself (no NaN)
    logits, f, kc, vc = fwd(w, jnp.asarray(toks), jnp.asarray(pos), kc, vc, 0, jnp.asarray(mask))
    feats = [np.asarray(f)]
    greedy_cols: list[np.ndarray] = []
    chosen_cols: list[np.ndarray] = []
    key = jax.random.PRNGKey(seed)
    eog_a = np.asarray(sorted(eog), np.int64)
    done = np.zeros(B, bool)
    for i in range(max_new):
        g = np.asarray(jnp.argmax(logits, axis=-1))
        if temperature > 0:
            key, sub = jax.random.split(key)
            c = np.asarray(jax.random.categorical(sub, logits / temperature, axis=-1))
        else:
            c = g
        greedy_cols.append(g)
        chosen_cols.append(c)
        done |= np.isin(c, eog_a)
        if done.all() or i == max_new - 1:
            break
        col = P + i
        p1 = (col - pad)[:, None].astype(np.int32)
        m1 = ((cols[None, :] <= col) & (cols[None, :] >= pad[:, None]))[:, None, :]
        logits, f, kc, vc = fwd(w, jnp.asarray(c[:, None].astype(np.int32)), jnp.asarray(p1), kc, vc, col,
                                jnp.asarray(m1))
        feats.append(np.asarray(f))
    G = np.stack(greedy_cols, axis=1)  # [B, n]: greedy after prompt + i answer tokens
    C = np.stack(chosen_cols, axis=1)
    F = np.concatenate(feats, axis=1)  # [B, P + n - 1, 3e]: rows of every decoded column
    out = Generated([], [], [])
    for b in range(B):
        ans = C[b]
        stop = np.flatnonzero(np.isin(ans, eog_a))
        n = int(stop[0]) + 1 if len(stop) else len(ans)
        ans = ans[:n]
        plen = P - pad[b]
        seq = np.concatenate([toks[b, pad[b]:], ans]).astype(np.int32)
        gr = np.full(len(seq), -1, np.int32)
        gr[plen - 1:plen - 1 + n] = G[b, :n]
        out.tokens.append(seq)
        out.greedy.append(gr)
        out.features.append(F[b, pad[b]:pad[b] + len(seq) - 1])  # the last token is never decoded
    return out


def to_sequences(gen: Generated):
    """`data.Sequences` (rows tokens[:-1]; labels the greedy token after each row, -1 inside the
    prompt but for its last row)."""
    from edgespec.headtrain.data import Sequences

    toks, labs, feats, st, plen = [], [], [], [0], []
    for t, g, f in zip(gen.tokens, gen.greedy, gen.features):
        n = len(t) - 1
        toks.append(t[:-1])
        labs.append(g[:-1])
        feats.append(f)
        st.append(st[-1] + n)
        plen.append(int(np.argmax(g >= 0)) + 1)
    return Sequences(np.concatenate(toks), np.concatenate(labs), np.concatenate(feats), np.asarray(st, np.int64),
                     np.asarray(plen, np.int32))


def _highest_precision():
    import contextlib

    if hasattr(jax, "default_matmul_precision"):
        return jax.default_matmul_precision("highest")
    jax.config.update("jax_default_matmul_precision", "highest")
    return contextlib.nullcontext()


def prompt_tokens(spec, log) -> dict:
    """The held-out and training prompts (`wide.prompt_sources`, chat template applied)
    as token ids, with the target's end-of-generation ids: tokenized through llama.cpp once and
    kept in the work directory, so that a box without llama.cpp can build the data from it."""
    import json

    from edgespec.headtrain.wide import prompt_sources

    wide = f"-w{spec.wide_prompts}" if spec.wide_prompts else ""
    path = spec.work_dir / "data" / f"prompt-tokens-s{spec.seed}-h{spec.heldout_prompts}-n{spec.distill_prompts}{wide}.json"
    if path.is_file():
        return json.loads(path.read_text())
    try:
        from edgespec.backend import Model
    except ImportError as e:
        raise RuntimeError(f"{path} is missing and llama.cpp is not importable here to tokenize the prompts: "
                           "run the same command where llama.cpp is installed first (it stops after writing it "
                           "with --epochs 0 --minutes 0 ... or copy the work directory)") from e
    target = Model(spec.target)
    h = spec.heldout_prompts
    sources = [pairs for _, pairs in prompt_sources(h, spec.distill_prompts, spec.wide_prompts, spec.seed)]

    def tok(p: str) -> list[int]:
        return list(target.tokenize(target.chat_prompt([("user", p)]), add_special=True, parse_special=True))

    eog = sorted({t for t in range(target.n_vocab) if target.is_eog(t)})
    out = {"held": [tok(p) for src in sources for _, p in src[:h]],
           "train": [tok(p) for src in sources for _, p in src[h:]], "eog": eog,
           "train_categories": [c for src in sources for c, _ in src[h:]]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out))
    log(f"tokenized {len(out['held']) + len(out['train'])} prompts into {path}")
    return out


def sampled_repeats(categories: Sequence[str], cap: int = 8) -> dict[str, int]:
    """Answers sampled per prompt and sampled round, by category: categories with fewer distinct
    prompts than the mean get more (the generator runs out of chat and Chinese prompts long
    before JSON and RAG), at most `cap`."""
    from collections import Counter

    n = Counter(categories)
    mean = sum(n.values()) / len(n)
    return {c: int(min(cap, max(1, round(mean / k)))) for c, k in n.items()}


def build_sequences_jax(spec, layers, log):
    """`train.build_sequences` with the target run in jax (an accelerator when jax has one):
    greedy answers to every prompt, then `spec.sampled` rounds of answers sampled at
    `spec.sample_temperature` (`sampled_repeats` per prompt), `spec.streams` sequences per
    forward. Batches are kept in work_dir/data (a rerun resumes). Returns (train Sequences,
    held-out Sequences, n_vocab)."""
    import time

    from tqdm import tqdm

    from edgespec.headtrain.data import Sequences

    d = spec.work_dir / "data"
    d.mkdir(parents=True, exist_ok=True)
    toks = prompt_tokens(spec, log)
    cfg, w_np = read_gguf(spec.target)
    w = {k: jnp.asarray(v) for k, v in w_np.items()}
    del w_np
    fwd = make_forward(cfg, layers)
    eog = toks["eog"]
    tag = f"jax-s{spec.seed}-n{spec.max_new}-b{spec.streams}"

    width = -(-max(len(t) for t in toks["held"] + toks["train"]) // 64) * 64 + spec.max_new  # one cache width

    def run(prompts: list, temperature: float, seed: int, path: Path, bar) -> Sequences:
        if path.is_file():
            bar.update(len(prompts))
            return Sequences.load(path)
        B = spec.streams
        padded = prompts + [prompts[0]] * (-len(prompts) % B)  # one batch width: one compilation
        parts = []
        for s in range(0, len(padded), B):
            with _highest_precision():  # llama.cpp's float32, not TF32
                g = generate(cfg, w, padded[s:s + B], spec.max_new, layers, eog, temperature, seed + s, fwd,
                             cache=width)
            keep = min(B, len(prompts) - s)
            parts.append(to_sequences(Generated(g.tokens[:keep], g.greedy[:keep], g.features[:keep])))
            bar.update(keep)
        sq = Sequences.concat(parts)
        sq.save(path)
        return sq

    t0 = time.time()
    held_tok = toks["held"]
    train_tok = toks["train"]
    cats = toks.get("train_categories") or ["all"] * len(train_tok)
    reps = sampled_repeats(cats)
    per = spec.streams * 2  # a shard; the data budget is checked between shards
    rounds = []
    left = spec.max_sampled or None
    for r in range(1 + spec.sampled):
        idx = range(len(train_tok)) if r == 0 else [i for i in range(len(train_tok)) for _ in range(reps[cats[i]])]
        order = sorted(idx, key=lambda i: len(train_tok[i]))  # similar widths per batch
        if r and left is not None:
            order, left = order[:left], left - min(left, len(order))
        rounds.append(order)
    if spec.sampled:
        log("sampled answers per prompt and round: " + ", ".join(f"{c} {k}" for c, k in sorted(reps.items())))
    parts = []
    with tqdm(total=len(held_tok) + sum(len(o) for o in rounds), desc="target answers + features (jax)",
              unit="answer") as bar:
        held = run(held_tok, 0.0, spec.seed, d / f"heldout-{tag}-{len(held_tok)}.npz", bar)
        for r, order in enumerate(rounds):
            temp = 0.0 if r == 0 else spec.sample_temperature
            for c in range(0, len(order), per):
                if spec.data_minutes and time.time() - t0 > spec.data_minutes * 60:
                    log(f"data budget of {spec.data_minutes} min spent: round {r} stops at {c} of {len(order)} answers")
                    break
                chunk = [train_tok[i] for i in order[c:c + per]]
                path = d / f"train-{tag}-r{r}-{c // per:04d}.npz"
                parts.append(run(chunk, temp, spec.seed * 1000 + r * 100_003 + c, path, bar))
    data = Sequences.concat(parts)
    log(f"{len(data.starts) - 1} sequences, {len(data.tokens)} rows, {int((data.labels >= 0).sum())} labelled, "
        f"in {time.time() - t0:.0f} s ({jax.default_backend()})")
    return data, held, cfg.n_vocab
