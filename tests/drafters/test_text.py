"""Cross-tokenizer drafting (edgespec/drafters/text.py), fast: the boundary logic on small
tokenizers of our own, the drafter's KV on the fake backend, the engine with a text draft giving
plain's greedy tokens, and the exactness of its point drafts at T > 0 (with a broken twin)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from edgespec import session_parts
from edgespec.drafters.base import run_alone
from edgespec.drafters.text import (
    DraftView,
    TextDrafter,
    complete_utf8,
    target_continuation,
)
from edgespec.engine import Engine
from edgespec.kv import SeqRange
from edgespec.sampling import SamplingParams
from edgespec.selftest import ALPHA, check_tree_exact
from edgespec.shape import Shape
from edgespec.slots import Slot, seqs_per_slot
from edgespec.tree import DraftTree
from edgespec.types import GenerationRequest, SpeculationParams
from tests.fake_backend import VOCAB, FakeContext, FakeModel, bigram_table


class Tok:
    """A greedy longest-match tokenizer over `pieces` (id -> bytes; empty pieces are specials)."""

    def __init__(self, pieces: dict[int, bytes], add_bos: bool = False, bos: int = 0, eos: int = 1):
        self.pieces, self.add_bos, self.bos, self.eos = pieces, add_bos, bos, eos
        self.by_len = sorted(((p, t) for t, p in pieces.items() if p), key=lambda x: -len(x[0]))
        self.calls: list[str] = []

    def piece(self, t: int) -> bytes:
        return self.pieces.get(t, b"")

    def is_eog(self, t: int) -> bool:
        return t == self.eos

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        self.calls.append(text)
        data, out, i = text.encode(), [], 0
        while i < len(data):
            p, t = next((p, t) for p, t in self.by_len if data.startswith(p, i))
            out.append(t)
            i += len(p)
        return ([self.bos] if add_special and self.add_bos else []) + out


BYTES = {300 + b: bytes([b]) for b in range(256)}  # byte fallback
# the target: characters, a space, "\n", the merges "\n\n", " the", "the", "ab"; é as two bytes
TARGET = Tok({0: b"", 1: b"", 2: b" ", 3: b"\n", 4: b"\n\n", 5: b" the", 6: b"the", 7: b"ab",
              **{10 + i: bytes([97 + i]) for i in range(26)}, **BYTES})
# the draft: other ids, other merges ("th", "e "), é whole; adds a BOS
DRAFT = Tok({0: b"", 1: b"", 2: b"\n", 3: b" ", 4: b"th", 5: b"e ", 6: "é".encode(),
             **{40 + i: bytes([97 + i]) for i in range(26)}}, add_bos=True)


def ids(tok: Tok, text: str) -> list[int]:
    return tok.tokenize(text, add_special=False)


def test_complete_utf8_holds_back_a_trailing_partial_character():
    e, smile = "é".encode(), "😀".encode()
    assert complete_utf8(b"ab") == 2 and complete_utf8(b"") == 0
    assert complete_utf8(b"a" + e) == 3 and complete_utf8(b"a" + e[:1]) == 1
    assert complete_utf8(smile[:3]) == 0 and complete_utf8(smile) == 4


def test_the_continuation_starts_at_the_context_end():
    ctx = ids(TARGET, "so ab")
    assert target_continuation(TARGET, ctx, b" the cat") == ids(TARGET, " the cat")


def test_a_token_straddling_the_context_end_is_replaced_by_its_part_past_it():
    # the context ends in "\n"; behind it the draft's "\nthe" tokenizes as "\n\n" + "the": the
    # "\n\n" straddles the end, so its second "\n" is tokenized alone in its place
    ctx = ids(TARGET, "x") + [3]
    out = target_continuation(TARGET, ctx, b"\nthe end")
    assert out == [3, 6, *ids(TARGET, " end")]
    assert b"".join(TARGET.piece(t) for t in out) == b"\nthe end"
    # "a" + draft "b": the merge "ab" straddles; "b" alone follows the context's "a"
    assert target_continuation(TARGET, ids(TARGET, "xa"), b"b c") == ids(TARGET, "b c")


def test_a_partial_character_is_never_proposed_and_a_split_context_proposes_nothing():
    e = "é".encode()
    out = target_continuation(TARGET, ids(TARGET, "a b"), b" c" + e[:1])
    assert out == ids(TARGET, " c")
    assert target_continuation(TARGET, ids(TARGET, "a") + [300 + e[0]], e[1:] + b"x") == []


def test_special_tokens_of_the_context_render_empty():
    assert target_continuation(TARGET, [1, 1, 1, 1], b"ab c") == ids(TARGET, "ab c")


def test_the_view_retokenizes_only_its_tail():
    target_text = "the thing " * 20
    v = DraftView(TARGET, DRAFT, tail=4)
    toks = ids(TARGET, target_text)
    changed = v.update(toks[:30])
    assert changed == 1 and v.ids[0] == DRAFT.bos  # behind the BOS
    assert b"".join(DRAFT.piece(t) for t in v.ids) == b"".join(TARGET.piece(t) for t in toks[:30])
    DRAFT.calls.clear()
    before = list(v.ids)
    changed = v.update(toks[:33])
    assert v.ids[:changed] == before[:changed] and changed >= len(before) - 4
    assert len(DRAFT.calls) == 1 and len(DRAFT.calls[0]) < 20  # the tail and the new text only
    assert b"".join(DRAFT.piece(t) for t in v.ids) == b"".join(TARGET.piece(t) for t in toks[:33])
    assert v.ids == [DRAFT.bos] + ids(DRAFT, "".join(TARGET.piece(t).decode() for t in toks[:33]))


def test_the_view_waits_for_a_character_split_across_target_tokens():
    e = "é".encode()
    v = DraftView(TARGET, DRAFT)
    v.update(ids(TARGET, "ab") + [300 + e[0]])
    assert not v.complete and b"".join(DRAFT.piece(t) for t in v.ids) == b"ab"
    v.update(ids(TARGET, "ab") + [300 + e[0], 300 + e[1]])
    assert v.complete and v.ids[-1] == 6


# --- the drafter on the fake backend ------------------------------------------------------------

FAKE_TARGET = Tok({0: b"", 1: b"", **{4 + i: bytes([97 + i]) for i in range(26)}})
FAKE_DRAFT = Tok({0: b"", 1: b"", 2: b"qu", **{30 + i: bytes([97 + i]) for i in range(26)}}, add_bos=True)


def _tables() -> tuple[np.ndarray, np.ndarray]:
    """The target's bigram table over its letters (4..29) only, and the draft's: the same
    transitions over its own ids (30..55), so it predicts the target's greedy text."""
    t = bigram_table(7)
    letters = np.arange(4, 30)
    mask = np.full(VOCAB, -30.0)
    mask[letters] = 0.0
    mask[1] = 0.0
    t = t + mask
    d = np.full((VOCAB, VOCAB), -30.0)
    for a in range(26):
        d[30 + a, 30:56] = t[4 + a, 4:30]
        d[30 + a, 1] = t[4 + a, 1]
    d[0] = d[30]  # after the BOS
    d[2] = d[30 + ord("u") - 97]  # after "qu": as after "u"
    return t, d


class TextModel(FakeModel):
    def __init__(self, table, tok: Tok, path: str):
        super().__init__(table, path)
        self.tok = tok
        self.add_bos, self.bos = tok.add_bos, tok.bos

    def piece(self, t: int) -> bytes:
        return self.tok.piece(t)

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return self.tok.tokenize(text, add_special, parse_special)


def text_engine(parallel: int = 2, n_ctx: int = 256, window: int = 256) -> Engine:
    from edgespec.config import EngineConfig, ModelConfig, shared_cells

    t, d = _tables()
    target, draft = TextModel(t, FAKE_TARGET, "/fake/target.gguf"), TextModel(d, FAKE_DRAFT, "/fake/draft.gguf")
    cfg = EngineConfig(ModelConfig("/fake/target.gguf", n_ctx=n_ctx, n_batch=64),
                       ModelConfig("/fake/draft.gguf", n_ctx=n_ctx, n_batch=64), parallel=parallel,
                       draft_window=window)
    n_seq = seqs_per_slot(parallel, cfg.max_tree_leaves)
    tctx = FakeContext(target, shared_cells(parallel, n_ctx), parallel * n_seq)
    dctx = FakeContext(draft, shared_cells(parallel, n_ctx), parallel * n_seq)
    slots = [Slot(i, SeqRange(tctx, i * n_seq, n_seq, n_ctx), SeqRange(dctx, i * n_seq, n_seq, n_ctx))
             for i in range(parallel)]
    eng = Engine(cfg, target, draft, slots, (tctx, dctx), draft_kind="text")  # type: ignore[arg-type]
    eng.goodput.enabled = False
    eng.cost.alpha = 0.0
    return eng


def run(eng: Engine, prompt: list[int], mode: Any, temperature: float = 0.0, max_tokens: int = 40):
    s = eng.open_session(GenerationRequest(tuple(prompt), SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                                                         seed=3),
                                           SpeculationParams(mode=mode, ngram=False, suffix=False)))
    s.check_kv = True
    try:
        while not s.done:
            s.step()
        return s.result().token_ids, s.stats
    finally:
        s.close()


@pytest.mark.parametrize("window", [256, 6])
def test_a_text_draft_gives_plain_greedy_tokens_and_is_accepted(window):
    eng = text_engine(window=window)
    assert eng.draft_kind == "text"
    for text in ("quick brown", "aaa", "zebra quu"):
        prompt = ids(FAKE_TARGET, text.replace(" ", ""))
        plain, _ = run(eng, prompt, "plain")
        for mode in ("chain", "tree", "auto"):
            assert run(eng, prompt, mode)[0] == plain, (mode, text)
        _, stats = run(eng, prompt, "chain")
        assert stats.accepted_by_source.get("draft", 0) > 0, stats


def test_the_drafter_proposes_point_drafts_and_keeps_only_the_context_in_its_cells():
    eng = text_engine(parallel=1)
    slot = eng.slots[0]
    d = session_parts.new_drafter(eng, slot)
    assert isinstance(d, TextDrafter)
    toks = ids(FAKE_TARGET, "quickbrown")
    d.begin(toks)
    tree = DraftTree.root(toks[-1])
    rep = run_alone(d.propose_steps(tree, toks, Shape("chain", depth=5, nodes=5), SamplingParams(temperature=1.0),
                                    np.random.default_rng(0)), slot.draft)
    tree.check()
    assert rep.levels == len(tree) - 1 > 0
    assert all(tree.point[1:]) and all(q is None for q in tree.q)  # one-hot proposals: q never read
    d.check_kv(toks)
    assert slot.draft.ctx.tokens_of(slot.draft.base) == [FAKE_DRAFT.bos] + ids(FAKE_DRAFT, "quickbrown")
    assert d.backlog(toks) == 0
    more = toks + tree.tokens[1:3]  # two accepted: the next step absorbs their text only
    d.accept(tree, [1, 2], more)
    before = len(slot.draft.ctx.decodes)
    run_alone(d.propose_steps(DraftTree.root(more[-1]), more, Shape("chain", depth=2, nodes=2), SamplingParams(),
                              np.random.default_rng(0)), slot.draft)
    assert slot.draft.ctx.decodes[before] <= 3


def test_a_sampled_request_through_a_text_draft_runs_with_its_kv_checked():
    eng = text_engine(parallel=1)
    out, _ = run(eng, ids(FAKE_TARGET, "quick"), "chain", temperature=0.8)
    assert len(out) == 40 or eng.target.is_eog(out[-1])


# --- exactness at T > 0 ---------------------------------------------------------------------------

# the target: 3 letters and an end, after each prefix a distribution of its own
LETTERS = Tok({0: b"", 1: b"x", 2: b"y", 3: b"z", 4: b"xy"})
V = 5


def target_row(prefix: tuple[int, ...]) -> np.ndarray:
    rng = np.random.default_rng(hash(prefix) % (1 << 32))
    p = rng.dirichlet(np.ones(V) * 0.7)
    p[0] = 0.0
    return p / p.sum()


def text_chain(claim_sampled: bool):
    """A step's chain as a text drafter builds it: a deterministic draft text (here a function of
    the prefix's last token) re-tokenized behind the context. `claim_sampled`: the broken twin,
    which tells the verifier the chain was drawn from a draft distribution that puts 0.4 on it."""
    texts = {0: b"xyz", 1: b"yz", 2: b"zx", 3: b"xy", 4: b"zz"}

    def build(prefix, rng):
        last = prefix[-1] if prefix else 0
        ctx = list(prefix) or [0]
        tree = DraftTree.root(last)
        node = 0
        for t in target_continuation(LETTERS, ctx, texts[last])[:2]:
            if claim_sampled:
                q = np.full(V, 0.6 / (V - 1))
                q[t] = 0.4
                tree.q[node] = q
            node = tree.add(node, t, point=not claim_sampled)
        return tree

    return build


def test_text_drafts_verified_as_point_drafts_are_exactly_the_target():
    r = check_tree_exact("text", target_row, text_chain(False), n_tokens=2, trials=60_000,
                         rng=np.random.default_rng(5))
    assert r.passed, r


def test_text_drafts_claimed_as_sampled_are_rejected():
    """The broken twin: the same deterministic chain, verified as if drawn from a q that gives
    it 0.4 (min(1, p/q) then over-accepts it): the output is no longer the target's."""
    r = check_tree_exact("text-broken", target_row, text_chain(True), n_tokens=2, trials=20_000,
                         rng=np.random.default_rng(5))
    assert not r.passed and r.p_value < ALPHA


def test_a_full_draft_range_starts_over_on_its_last_half_and_stays_exact():
    """A draft range shorter than the request (the draft's tokens may outnumber the target's):
    the drafter starts over on the last half of it instead of overflowing, and on every step
    after that only when it fills again."""
    eng = text_engine(parallel=1, n_ctx=256)
    eng.slots[0].draft.n_ctx = 24
    prompt = ids(FAKE_TARGET, "quickbrown")
    plain, _ = run(eng, prompt, "plain", max_tokens=60)
    dctx = eng.slots[0].draft.ctx
    before = len(dctx.decodes)
    out, stats = run(eng, prompt, "chain", max_tokens=60)
    assert out == plain and stats.accepted_by_source.get("draft", 0) > 0
    assert max(dctx.decodes[before + 1:]) <= 12  # a start-over reads half the range, not all of it
