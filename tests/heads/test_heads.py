"""EAGLE-3 heads through llama.cpp: bad heads are refused naming what differs, the reduced
vocabulary maps to target ids, and the GGUF and HF layouts round-trip. The trainer's own checks
are in tests/headtrain/test_train.py."""

from __future__ import annotations

import numpy as np
import pytest

from edgespec import backend
from edgespec.config import ModelConfig
from edgespec.errors import IncompatibleDraft
from edgespec.heads.hf import permute, read_hf, unpermute, write_hf
from edgespec.heads.weights import HeadWeights, config_for_target, read_gguf, write_gguf

pytestmark = pytest.mark.slow

TEXT = "The quick brown fox jumps over the lazy dog, and then it runs away into the forest."


@pytest.fixture(scope="module")
def target(demo_pair):
    m = backend.Model(demo_pair.target)
    yield m
    m.close()


@pytest.fixture(scope="module")
def embed(demo_pair):
    from edgespec.headtrain.train import target_embeddings

    return target_embeddings(demo_pair.target)


def random_head(demo_pair, embed, n_draft=512, seed=0) -> HeadWeights:
    cfg = config_for_target(demo_pair.target, n_draft, n_ff=256)
    rng = np.random.default_rng(seed)
    d2t = np.sort(rng.choice(len(embed), n_draft, replace=False)).astype(np.int64)
    h = HeadWeights.init(cfg, d2t, rng, embed=embed)
    for k in ("wo", "down", "gate", "up"):
        h.w[k] = (rng.standard_normal(h.w[k].shape) * 0.05).astype(np.float32)
    # the target's features are large: a small fc lets attention (where rope acts) weigh in
    h.w["fc"] *= 0.01
    h.w["wq"] *= 10
    h.w["wk"] *= 10
    h.w["wv"] *= 10
    return h


def head_logits(target, demo_pair, path, tokens):
    """Head logits and pre-norm outputs at every position of `tokens` (committed, real features)
    plus one drafted position fed the last output: what the drafter does at depth 2."""
    head = backend.Model(path)
    cfg = ModelConfig(path=str(demo_pair.target), n_ctx=256, n_batch=64, threads=1)
    tctx = backend.FeatureContext(target, cfg, backend.target_layer_ids(head))
    hctx = backend.HeadContext(head, tctx, cfg)
    try:
        tctx.decode_seq(tokens, 0)
        f = tctx.features()
        n = len(tokens) - 1
        hctx.decode(tokens[1:], range(n), [(0,)] * n, hctx.encode(f[:n]), [True] * n)
        lg = np.stack([hctx.logits(i).copy() for i in range(n)])
        hid = np.stack([hctx.hidden(i).copy() for i in range(n)])
        hctx.decode([tokens[1]], [n], [(0,)], hid[-1:], [True])
        nxt = hctx.logits(0).copy()
        return f, lg, hid, nxt
    finally:
        hctx.close()
        tctx.close()
        head.close()


def test_reduced_vocabulary_maps_to_target_ids(target, demo_pair, embed, tmp_path):
    h = random_head(demo_pair, embed, n_draft=300)
    path = write_gguf(h, tmp_path / "h.gguf", demo_pair.target)
    _, lg, _, _ = head_logits(target, demo_pair, path, target.tokenize(TEXT))
    assert lg.shape[1] == target.n_vocab
    finite = np.isfinite(lg)
    assert finite[:, h.d2t].all() and finite.sum(axis=1).tolist() == [300] * len(lg)
    assert np.isin(lg.argmax(axis=1), h.d2t).all()


def bad_head(demo_pair, embed, tmp_path, **kw):
    h = random_head(demo_pair, embed)
    if "layers" in kw:
        h.cfg.layers = kw.pop("layers")
    if "target_hidden" in kw:  # a head made for a narrower target (llama.cpp itself loads it)
        h.w["fc"] = np.ascontiguousarray(h.w["fc"][:, :3 * kw["target_hidden"]])
    return write_gguf(h, tmp_path / "bad.gguf", demo_pair.target, **kw)


@pytest.mark.parametrize("kind,expected", [
    ("layers", r"target layer ids \[2, 15, 30\] out of range 0\.\.29"),
    ("hidden", r"target hidden size 512 vs the target's n_embd 576"),
    ("vocab", r"token 1000 text"),
])
def test_bad_heads_are_refused_naming_what_differs(target, demo_pair, embed, tmp_path, kind, expected):
    if kind == "layers":
        path = bad_head(demo_pair, embed, tmp_path, layers=(2, 15, 30))
    elif kind == "hidden":
        path = bad_head(demo_pair, embed, tmp_path, target_hidden=512)
    else:
        def edit(key, value):
            if key == "tokenizer.ggml.tokens":
                value = list(value)
                value[1000] = "<not-the-target's>"
            return value
        path = bad_head(demo_pair, embed, tmp_path, vocab_edit=edit)
    head = backend.Model(path)
    cfg = ModelConfig(path=str(demo_pair.target), n_ctx=128, threads=1)
    tctx = backend.Context(target, cfg)
    try:
        with pytest.raises(IncompatibleDraft, match=expected):
            backend.HeadContext(head, tctx, cfg)
    finally:
        tctx.close()
        head.close()


def test_a_plain_model_is_not_a_head(target, demo_pair):
    draft = backend.Model(demo_pair.draft)
    cfg = ModelConfig(path=str(demo_pair.target), n_ctx=128, threads=1)
    tctx = backend.Context(target, cfg)
    try:
        with pytest.raises(IncompatibleDraft, match="not an EAGLE-3 head .architecture 'llama'"):
            backend.HeadContext(draft, tctx, cfg)
    finally:
        tctx.close()
        draft.close()


def test_hf_layout_round_trips(target, demo_pair, embed, tmp_path):
    pytest.importorskip("safetensors")
    h = random_head(demo_pair, embed)
    w = h.w["wq"]
    assert np.array_equal(permute(unpermute(w, 9), 9), w) and not np.array_equal(unpermute(w, 9), w)
    write_hf(h, tmp_path / "hf", target.n_vocab)
    back = read_hf(tmp_path / "hf")
    assert np.array_equal(back.d2t, h.d2t) and back.cfg == h.cfg
    for k in h.w:
        assert np.array_equal(back.w[k], h.w[k]), k
    a = head_logits(target, demo_pair, write_gguf(h, tmp_path / "a.gguf", demo_pair.target), target.tokenize(TEXT))[1]
    b = head_logits(target, demo_pair, write_gguf(back, tmp_path / "b.gguf", demo_pair.target), target.tokenize(TEXT))[1]
    assert np.array_equal(a, b)


def test_gguf_reads_back_what_was_written(target, demo_pair, embed, tmp_path):
    h = random_head(demo_pair, embed)
    back = read_gguf(write_gguf(h, tmp_path / "h32.gguf", demo_pair.target, dtype="f32"))
    assert back.cfg == h.cfg and np.array_equal(back.d2t, h.d2t)
    for k in h.w:
        assert np.array_equal(back.w[k], h.w[k]), k
    half = read_gguf(write_gguf(h, tmp_path / "h16.gguf", demo_pair.target))
    for k in h.w:
        assert np.array_equal(half.w[k], h.w[k].astype(np.float16).astype(np.float32)), k
    with pytest.raises(ValueError, match="not an EAGLE-3 head.*llama"):
        read_gguf(demo_pair.target)
