"""The target in jax (edgespec/headtrain/target_jax.py), which builds a head's training data on a GPU
box without llama.cpp: its answers and features are llama.cpp's, its sampled answers keep the
greedy labels, and `train-head --features jax` then `eval-head` make a head and its card."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edgespec.headtrain.target_jax import sampled_repeats

PROMPTS = ["Write a Python function that reverses a list.", "请简单介绍一下数据安全。",
           "Extract name and city as JSON: Anna Lee lives in Berlin."]


def test_categories_short_of_prompts_get_more_sampled_answers_up_to_a_cap():
    cats = ["json"] * 40 + ["chat"] * 10 + ["chinese"] * 2
    assert sampled_repeats(cats) == {"json": 1, "chat": 2, "chinese": 8}
    assert sampled_repeats(cats, cap=3)["chinese"] == 3
    assert sampled_repeats(["a"] * 5) == {"a": 1}


@pytest.fixture(scope="module")
def jax_target(demo_pair):
    pytest.importorskip("jax")
    import jax.numpy as jnp

    from edgespec.backend import Model
    from edgespec.heads.weights import config_for_target
    from edgespec.headtrain import target_jax as tj

    target = Model(demo_pair.target)
    cfg, w = tj.read_gguf(demo_pair.target)
    toks = [list(target.tokenize(target.chat_prompt([("user", p)]), add_special=True, parse_special=True)) for p in PROMPTS]
    eog = sorted({t for t in range(target.n_vocab) if target.is_eog(t)})
    return {"target": target, "cfg": cfg, "w": {k: jnp.asarray(v) for k, v in w.items()}, "toks": toks, "eog": eog,
            "layers": config_for_target(demo_pair.target, 1).layers}


@pytest.mark.slow
def test_the_demo_source_gguf_dequantizes_to_the_f32_target_bit_for_bit(demo_pair):
    """Why the GPU box may be sent the 94 MiB Q4_1 source instead of the 515 MiB F32 target."""
    from edgespec.headtrain.target_jax import read_gguf
    from edgespec.models import _source_gguf

    src = _source_gguf(demo_pair.target.parent / ".source", lambda s: None)
    c32, w32 = read_gguf(demo_pair.target)
    c41, w41 = read_gguf(src)
    assert c32 == c41 and w32.keys() == w41.keys()
    for k in w32:
        assert np.array_equal(w32[k], w41[k]), k


@pytest.mark.slow
def test_greedy_answers_and_features_are_llama_cpps(jax_target):
    """The same tokens and greedy labels as llama.cpp's own data path (distill_features), the
    features equal to float16 rounding."""
    import jax

    from edgespec.headtrain import target_jax as tj
    from edgespec.headtrain.data import distill_features

    t = jax_target
    ref = distill_features(t["target"], t["layers"], PROMPTS, 24, n_seq=3, threads=2)
    with jax.default_matmul_precision("highest"):
        sq = tj.to_sequences(tj.generate(t["cfg"], t["w"], t["toks"], 24, t["layers"], t["eog"], cache=192))
    assert np.array_equal(sq.tokens, ref.tokens) and np.array_equal(sq.labels, ref.labels)
    assert np.array_equal(sq.starts, ref.starts) and np.array_equal(sq.prompt_len, ref.prompt_len)
    a, b = sq.features.astype(np.float32), ref.features.astype(np.float32)
    scale = np.abs(b).max(axis=1, keepdims=True)  # each row's own scale: features hold a few huge values
    assert np.max(np.abs(a - b) / scale) < 2e-3


@pytest.mark.slow
def test_sampled_answers_keep_the_targets_greedy_token_as_label(jax_target):
    """A sampled answer follows sampled tokens, but every label is the target's argmax at that
    position, checked against llama.cpp's logits over the same sequence; a variant that labels a
    row with the next (sampled) token fails on the rows where the two differ."""
    import jax

    from edgespec.backend import Context
    from edgespec.config import ModelConfig
    from edgespec.headtrain import target_jax as tj

    t = jax_target
    with jax.default_matmul_precision("highest"):
        g = tj.generate(t["cfg"], t["w"], t["toks"], 24, t["layers"], t["eog"], temperature=1.0, seed=3)
    target = t["target"]
    ctx = Context(target, ModelConfig(path=str(target.path), n_ctx=256, threads=2))
    differ = 0
    try:
        for seq, greedy in zip(g.tokens, g.greedy):
            ctx.clear()
            lg = ctx.decode_rows(list(seq), list(range(len(seq))), [(0,)] * len(seq), [True] * len(seq))
            rows = np.flatnonzero(greedy >= 0)
            assert np.array_equal(greedy[rows], np.argmax(lg[rows], axis=1))
            inside = rows[rows + 1 < len(seq)]
            differ += int(np.sum(seq[inside + 1] != greedy[inside]))
    finally:
        ctx.close()
    assert differ > 0  # at T = 1 some sampled tokens are not the greedy ones, so the check above has teeth


@pytest.mark.slow
def test_train_head_with_jax_features_then_eval_head_writes_the_card(demo_pair, tmp_path, monkeypatch):
    pytest.importorskip("jax")
    from typer.testing import CliRunner

    # the command runs inside this test process: leave its heap settings alone (edgespec/heap.py)
    monkeypatch.setenv("EDGESPEC_KEEP_HEAP", "0")

    from edgespec.cli.main import app

    out, wd = tmp_path / "head.gguf", tmp_path / "work"
    r = CliRunner().invoke(app, ["models", "train-head", str(out), "--work-dir", str(wd), "--features", "jax",
                                 "--distill-prompts", "3", "--wide-prompts", "1", "--heldout-prompts", "1", "--max-new", "12", "--streams", "4",
                                 "--sampled", "1", "--max-sampled", "2", "--epochs", "2", "--window", "32",
                                 "--draft-vocab", "1024", "--n-ff", "256", "--threads", "2", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads((wd / "report.json").read_text())
    assert rep["train_sequences"] == 3 + 1 + 2 and rep["spec"]["features"] == "jax"  # category, wide, sampled
    assert len(rep["acceptance_by_depth"]) == 3 and rep["command"].startswith("edgespec models train-head")
    held = json.loads((wd / "heldout.json").read_text())
    assert len(held["sequences"]) == 2  # the first prompt of each source
    assert all(n < len(sq) for n, sq in zip(held["prompt_len"], held["sequences"]))
    r2 = CliRunner().invoke(app, ["models", "eval-head", str(out), "--work-dir", str(wd), "--threads", "2"])
    assert r2.exit_code == 0, r2.output
    card = json.loads(out.with_suffix(".json").read_text())
    assert card["command"] == rep["command"] and card["heldout"]["depth1"] == round(rep["acceptance_by_depth"][0], 4)
    assert card["data"]["wide_prompts"] == 1 and "init" not in card
    r3 = CliRunner().invoke(app, ["models", "train-head", str(out), "--sampled", "1"])
    assert r3.exit_code != 0 and "--sampled needs --features jax" in r3.output
