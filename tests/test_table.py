"""The target's n-gram table: building, predicting, the file, its config, and exactness in the engine."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgespec.config import EngineConfig, ModelConfig
from edgespec.drafters.table import NgramTable
from edgespec.errors import BadRequest, ConfigError, ModelError


def test_decisive_contexts_chain_and_the_longest_context_decides():
    seqs = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [9, 2, 3, 7]]
    t = NgramTable.build(seqs, n_vocab=10)
    # (2, 3) -> 4 twice, -> 7 once: 4 is decisive (2 of 3 >= 0.5, count >= 2)
    assert t.predict([0, 2, 3], 5) == [4, 5]
    # the 3-token context (9, 2, 3) was seen once only: known but not decisive, so the chain ends
    # there instead of falling back to (2, 3)
    assert t.predict([9, 2, 3], 5) == []
    assert t.predict([1, 2, 3], 1) == [4]  # max_len
    assert t.predict([8, 8], 5) == []  # unknown context
    assert t.predict([3], 5) == []  # shorter than the shortest context


def test_min_count_and_min_share():
    seqs = [[1, 2, 3], [1, 2, 4], [1, 2, 5]]  # (1, 2) -> 3, 4, 5: no majority
    assert NgramTable.build(seqs, n_vocab=10).predict([1, 2], 3) == []
    assert NgramTable.build(seqs[:1], n_vocab=10).predict([1, 2], 3) == []  # seen once < min_count
    assert NgramTable.build(seqs[:1], n_vocab=10, min_count=1).predict([1, 2], 3) == [3]


def test_file_roundtrip_and_checks(tmp_path):
    t = NgramTable.build([[1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7]], n_vocab=10, model="demo")
    p = tmp_path / "t.npz"
    t.save(p)
    back = NgramTable.load(p, n_vocab=10)
    assert back.table == t.table and back.model == "demo" and len(back) == len(t)
    with pytest.raises(ModelError, match="10-token vocabulary, the target has 12"):
        NgramTable.load(p, n_vocab=12)
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    with pytest.raises(ModelError, match="not readable"):
        NgramTable.load(bad)
    np.savez(tmp_path / "ids.npz", ctx=np.array([[-1, 1, 99]], np.int32), tok=np.array([3], np.int32),
             n_vocab=np.int64(10), model=np.str_(""), format=np.int64(1))
    with pytest.raises(ModelError, match="corrupt"):
        NgramTable.load(tmp_path / "ids.npz")


def test_config_names_the_missing_table(tmp_path):
    cfg = EngineConfig(target=ModelConfig(path="x.gguf"), draft=None, ngram_table=str(tmp_path / "none.npz"))
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    assert e.value.key == "target.ngram_table"


def test_daemon_config_auto_picks_the_demo_table_only_for_the_demo_target(tmp_path):
    from edgespec.models import BASENAME, table_path
    from edgespec.server.config import InvalidConfig, load

    target = tmp_path / f"{BASENAME}.F32.gguf"
    other = tmp_path / "other.gguf"
    for f in (target, other):
        f.write_bytes(b"")
    NgramTable.build([[1, 2, 3], [1, 2, 3]], n_vocab=10).save(table_path(tmp_path))
    cfg = load(None, env={}, overrides={"target": {"path": str(target)}})
    assert cfg.engine.ngram_table == str(table_path(tmp_path))
    assert load(None, env={}, overrides={"target": {"path": str(other)}}).engine.ngram_table is None
    assert load(None, env={}, overrides={"target": {"path": str(target), "ngram_table": ""}}).engine.ngram_table is None
    with pytest.raises(InvalidConfig) as e:
        load(None, env={}, overrides={"target": {"ngram_table": str(tmp_path / "missing.npz")}})
    assert "target.ngram_table" in dict(e.value.problems)


def test_cli_table_option(tmp_path):
    from edgespec.cli.common import table_for

    assert table_for(tmp_path / "custom.gguf", None) is None
    assert table_for(tmp_path / "custom.gguf", "none") is None
    with pytest.raises(BadRequest, match="--ngram-table"):
        table_for(tmp_path / "custom.gguf", str(tmp_path / "missing.npz"))


# -- with the real target --------------------------------------------------------------------

PROMPTS = ["Write a Python function that reverses a string.", "List three uses of copper.",
           "Explain what a hash map is in two sentences."]


@pytest.fixture(scope="module")
def target_only(demo_pair, tmp_path_factory):
    """The demo target without a draft model: every step is plain decoding plus grafted lookups,
    i.e. a chain, so speculation must reproduce plain output bit for bit (patched ggml)."""
    from edgespec.engine import Engine

    eng = Engine.load(EngineConfig(target=ModelConfig(path=str(demo_pair.target), n_ctx=2048), draft=None))
    yield eng
    eng.close()


def _run(engine, prompt: str, mode: str):
    from edgespec.sampling import SamplingParams
    from edgespec.types import GenerationRequest, SpeculationParams

    toks = engine.encode_chat([("user", prompt)])
    return toks, engine.generate(GenerationRequest(tuple(toks), SamplingParams(max_tokens=64),
                                                   SpeculationParams(mode=mode)))


@pytest.mark.slow
def test_table_drafts_are_exact_and_pay_when_right(target_only, monkeypatch):
    import edgespec.engine as engine_mod
    from edgespec.drafters import NgramDrafter

    # one continuation per prompt lookup: every verified tree is then a chain (bit-exact)
    monkeypatch.setattr(engine_mod, "NgramDrafter", lambda: NgramDrafter(branches=1))
    plain = {p: _run(target_only, p, "plain") for p in PROMPTS}
    # a table that knows these answers (learnt from them), and one with the same contexts that
    # always proposes the wrong next token
    n_vocab = target_only.target.n_vocab
    right = NgramTable.build([list(t) + r.token_ids for t, r in plain.values()] * 2, n_vocab)
    wrong = NgramTable({k: (v + 1) % n_vocab for k, v in right.table.items() if v >= 0}, n_vocab)
    try:
        for name, table in (("right", right), ("wrong", wrong), ("none", None)):
            target_only.table = table
            forwards = emitted = 0
            for p in PROMPTS:
                _, res = _run(target_only, p, "auto")
                assert res.token_ids == plain[p][1].token_ids, (name, p)
                forwards += res.stats.target_forwards
                emitted += len(res.token_ids)
            if name == "right":
                assert forwards < 0.6 * emitted, (forwards, emitted)
            else:
                assert forwards <= emitted
    finally:
        target_only.table = None


@pytest.mark.slow
def test_tablegen_learns_a_loadable_table_from_the_target(demo_pair, tmp_path):
    from edgespec import backend
    from edgespec.tablegen import PromptMaker, build_table, generate_answers

    assert PromptMaker(3)() == PromptMaker(3)()  # deterministic prompts
    model = backend.Model(demo_pair.target)
    try:
        seqs = generate_answers(model, 20, batch=2, max_answer=12, threads=2)
        assert len(seqs) >= 2 and all(0 <= t < model.n_vocab for s in seqs for t in s)
    finally:
        model.close()
    out = tmp_path / "t.npz"
    lines: list[str] = []
    table = build_table(Path(demo_pair.target), out, 16, threads=2, log=lines.append)
    assert NgramTable.load(out, table.n_vocab).table == table.table
    assert any("answer tokens" in s for s in lines)
