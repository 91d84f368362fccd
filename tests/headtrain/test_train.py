"""The trainer against llama.cpp: its jax forward and training-time test are llama.cpp's eagle3
graph (a head in the wrong rope layout is told apart), the tiny head it trains loads and drafts
as training measured, fine-tuning starts from a head, scored text is kept in shards, and a run
resumes from its checkpoint."""

from __future__ import annotations

import numpy as np
import pytest

from edgespec import backend
from edgespec.config import ModelConfig
from edgespec.heads.hf import unpermute
from edgespec.heads.weights import HeadWeights, config_for_target, read_gguf, write_gguf
from tests.heads.test_heads import TEXT, head_logits, random_head

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def target(demo_pair):
    m = backend.Model(demo_pair.target)
    yield m
    m.close()


@pytest.fixture(scope="module")
def embed(demo_pair):
    from edgespec.headtrain.train import target_embeddings

    return target_embeddings(demo_pair.target)


def jax_logits(h: HeadWeights, embed, f, tokens):
    import jax.numpy as jnp

    from edgespec.headtrain import model_jax as mj

    p = {k: jnp.asarray(v) for k, v in h.w.items()}
    n = len(tokens) - 1
    g = jnp.asarray(f[:n])[None] @ p["fc"].T
    hid, lg, _ = mj.step(p, h.cfg, jnp.asarray(embed[tokens[1:]])[None], g, [], 0)
    # depth 2: the drafted position reads the last output as g
    g2 = jnp.concatenate([g, hid[:, -1:]], axis=1)
    _, lg2, _ = mj.step(p, h.cfg, jnp.asarray(embed[tokens[1:] + [tokens[1]]])[None], g2, [], 0)
    return np.asarray(lg[0]), np.asarray(hid[0]), np.asarray(lg2[0, -1])


def test_jax_forward_is_llama_cpps_eagle3_graph(target, demo_pair, embed, tmp_path):
    pytest.importorskip("jax")
    h = random_head(demo_pair, embed)
    path = write_gguf(h, tmp_path / "h.gguf", demo_pair.target, dtype="f32")
    toks = target.tokenize(TEXT)
    f, lg, hid, nxt = head_logits(target, demo_pair, path, toks)
    jl, jh, jn = jax_logits(h, embed, f, toks)
    assert np.abs(lg[:, h.d2t] - jl).max() < 2e-3 * max(1.0, np.abs(jl).max())
    assert np.abs(hid - jh).max() < 2e-3 * max(1.0, np.abs(jh).max())
    assert np.abs(nxt[h.d2t] - jn).max() < 2e-3 * max(1.0, np.abs(jn).max())
    # a broken twin: q and k in HF's rotate-half layout instead of llama.cpp's -> the check fails
    bad = HeadWeights(h.cfg, dict(h.w), h.d2t)
    bad.w["wq"], bad.w["wk"] = unpermute(h.w["wq"], h.cfg.n_head), unpermute(h.w["wk"], h.cfg.n_head_kv)
    bl, _, _ = jax_logits(bad, embed, f, toks)
    assert np.abs(lg[:, h.d2t] - bl).max() > 1e-2 * max(1.0, np.abs(jl).max())


def test_fine_tuning_starts_from_the_head_and_adds_wide_prompts(tiny_head, demo_pair, embed, tmp_path):
    """`--init` trains from a head's weights and keeps its draft vocabulary; `--wide-prompts`
    answers prompts built around package text beside the category prompts, the first of each
    source held out."""
    from dataclasses import replace

    from edgespec.headtrain.train import train

    base = read_gguf(tiny_head["path"])
    spec = replace(tiny_head["spec"], out=tmp_path / "ft.gguf", work_dir=tmp_path / "w", hf_dir=None, init=tiny_head["path"],
                   distill_prompts=1, wide_prompts=2, text_windows=0, max_new=16, epochs=2, lr=1e-9)
    rep = train(spec, log=lambda s: None)
    data = sorted(p.name for p in (spec.work_dir / "data").glob("*.npz"))
    assert data == ["heldout-s0-n16-1.npz", "heldout-wide-s0-n16-1.npz", "train-s0-n16-0000.npz",
                    "train-wide-s0-n16-0000.npz"], data
    assert rep["heldout_curve"][0][0] == 0  # the starting head's own figure comes first
    ft = read_gguf(spec.out)
    assert np.array_equal(ft.d2t, base.d2t) and ft.cfg == base.cfg
    for k in base.w:  # a learning rate of 1e-9: what was written is the starting head
        assert np.allclose(ft.w[k], base.w[k], atol=2e-3), k
    # a head shaped for another target is refused before training (the data is on disk now)
    wrong = HeadWeights(replace(base.cfg, n_embd=64), base.w, base.d2t)
    write_gguf(wrong, tmp_path / "wrong.gguf", demo_pair.target)
    with pytest.raises(ValueError, match="not shaped for this target"):
        train(replace(spec, init=tmp_path / "wrong.gguf", work_dir=spec.work_dir), log=lambda s: None)


def test_trained_tiny_head(tiny_head, target):
    """What jax learnt is what llama.cpp drafts: on its own training answers the GGUF, run by
    llama.cpp through Eagle3Drafter, predicts the target's greedy tokens as training measured."""
    from edgespec.headtrain.evaluate import acceptance

    rep = tiny_head["report"]
    head = backend.Model(tiny_head["path"])  # llama.cpp's eagle3 loader accepts it
    try:
        assert backend.model_arch(head) == "eagle3" and head.size_bytes == rep["head_bytes"]
        assert rep["draft_vocab"] == 2048 and rep["steps"] > 0
        assert rep["train_acc_by_step"][0] > 0.5  # it learnt its training answers
        from edgespec.headtrain.data import Sequences

        tr = Sequences.load(next((tiny_head["work"] / "data").glob("train-*.npz")))
        seqs = [tr.sequence(i) for i in range(2)]
        seen = acceptance(target, head, seqs, [int(x) for x in tr.prompt_len[:2]], depth=3, threads=1)
        assert seen.rates[0] > 0.5 and seen.rates[0] >= seen.rates[1] >= seen.rates[2] > 0.1, seen.rates
    finally:
        head.close()
    # an answer it never saw: reported; a head trained on four answers barely generalises
    assert rep["heldout_positions"] > 20 and 0 <= rep["acceptance_by_depth"][0] <= 1
    assert (tiny_head["hf"] / "config.json").is_file() and (tiny_head["hf"] / "model.safetensors").is_file()
    assert (tiny_head["work"] / "checkpoint.npz").is_file()


def test_scored_text_is_built_in_shards_that_a_larger_count_extends(tiny_head, target, tmp_path):
    """`--text-windows`: the first N windows of package text (at most two a file), the target's
    greedy next token at every position, in shards kept on disk; a larger N keeps the full shards
    and adds the rest."""
    from dataclasses import replace

    from edgespec.headtrain import train as tr
    from edgespec.headtrain.data import package_texts

    assert sorted(p.name for p in (tiny_head["work"] / "data").glob("text-*.npz")) == ["text-s0-64-0000-2.npz"]
    five = tr.text_windows(target, 5, 32, 0)
    assert len(five) == 5 and all(len(w) == 32 for w in five)
    assert tr.text_windows(target, 3, 32, 0) == five[:3]
    first = target.tokenize(next(package_texts(max_files=1 << 30, seed=0))[:20_000], add_special=False)
    assert five[0] == first[:32]

    layers = config_for_target(tiny_head["spec"].target, 1).layers
    spec = replace(tiny_head["spec"], work_dir=tmp_path, window=32)
    old = tr.TEXT_WINDOWS_PER_SHARD
    tr.TEXT_WINDOWS_PER_SHARD = 2
    try:
        three = tr.scored_text(replace(spec, text_windows=3), target, layers, log=lambda s: None)
        names = sorted(p.name for p in (tmp_path / "data").glob("*.npz"))
        assert names == ["text-s0-32-0000-2.npz", "text-s0-32-0001-1.npz"], names
        kept = (tmp_path / "data" / names[0]).stat().st_mtime_ns
        five_sq = tr.scored_text(replace(spec, text_windows=5), target, layers, log=lambda s: None)
    finally:
        tr.TEXT_WINDOWS_PER_SHARD = old
    assert (tmp_path / "data" / names[0]).stat().st_mtime_ns == kept  # the full shard was kept
    assert len(five_sq.starts) == 6 and np.array_equal(five_sq.tokens[:96], three.tokens)
    assert np.array_equal(five_sq.tokens, np.concatenate(five))
    # every position is labelled with the target's greedy next token, as one forward gives it
    ctx = backend.Context(target, ModelConfig(path=str(target.path), n_ctx=64, n_batch=64, threads=1))
    try:
        ctx.decode(five[4], list(range(32)), [(0,)] * 32, [True] * 32)
        greedy = np.argmax(ctx.logits_rows(32), axis=1)
    finally:
        ctx.close()
    assert np.array_equal(five_sq.labels[128:], greedy)
    assert five_sq.features.shape == (160, 3 * 576) and five_sq.features.dtype == np.float16


def test_training_resumes_from_its_checkpoint(tiny_head):
    from dataclasses import replace

    from edgespec.headtrain.train import train

    spec = tiny_head["spec"]
    rep = train(replace(spec, epochs=spec.epochs + 2, hf_dir=None, heldout_prompts=spec.heldout_prompts), log=lambda s: None)
    assert rep["steps"] > tiny_head["report"]["steps"]
    assert rep["steps"] - tiny_head["report"]["steps"] <= 2 * max(1, rep["train_windows"] // spec.batch)


def test_training_time_test_is_what_drafting_computes(target, demo_pair, embed, tmp_path):
    """TTT step j at position t (g = the step before's output at t-1; attention to the committed
    context up to t-j and to its own drafted ancestors) is llama.cpp drafting depth j+1."""
    pytest.importorskip("jax")
    import jax.numpy as jnp

    from edgespec.headtrain import model_jax as mj

    h = random_head(demo_pair, embed, seed=3)
    path = write_gguf(h, tmp_path / "h.gguf", demo_pair.target, dtype="f32")
    toks = target.tokenize(TEXT)
    n = len(toks) - 3  # committed head positions 0..n-1; drafted n, n+1
    x = toks[1:n + 3]  # the input token at each head position
    head = backend.Model(path)
    cfg = ModelConfig(path=str(demo_pair.target), n_ctx=256, n_batch=64, threads=1)
    tctx = backend.FeatureContext(target, cfg, backend.target_layer_ids(head))
    hctx = backend.HeadContext(head, tctx, cfg)
    try:
        tctx.decode_seq(toks, 0)
        f = tctx.features()[:n + 2]
        hctx.decode(x[:n], range(n), [(0,)] * n, hctx.encode(f[:n]), [False] * (n - 1) + [True])
        g = hctx.hidden(-1).copy()
        g_committed = g.copy()
        drafted = []
        for d in range(2):
            hctx.decode([x[n + d]], [n + d], [(0,)], g[None], [True])
            drafted.append(hctx.logits(0)[h.d2t].copy())
            g = hctx.hidden(0).copy()
    finally:
        hctx.close()
        tctx.close()
        head.close()
    p = {k: jnp.asarray(v) for k, v in h.w.items()}
    emb = jnp.asarray(embed[x])[None]
    gj = jnp.asarray(f)[None] @ p["fc"].T
    keys: list = []
    out = []
    for j in range(3):
        hj, lg, kv = mj.step(p, h.cfg, emb, gj, keys, j)
        keys.append(kv)
        out.append(np.asarray(lg[0]))
        gj = mj._shift(hj, 1)
    h0 = np.asarray(mj.step(p, h.cfg, emb, jnp.asarray(f)[None] @ p["fc"].T, [], 0)[0][0])
    assert np.abs(h0[n - 1] - g_committed).max() < 2e-3 * max(1.0, np.abs(h0).max())
    for d in range(2):
        ref = out[d + 1][n + d]
        assert np.abs(ref - drafted[d]).max() < 2e-3 * max(1.0, np.abs(ref).max()), d
    # the step-0 logits at those positions (no TTT: features the head never has while drafting) differ
    assert np.abs(out[0][n + 1] - drafted[1]).max() > 1e-2 * max(1.0, np.abs(drafted[1]).max())
