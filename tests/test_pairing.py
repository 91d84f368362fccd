"""Draft/target vocabulary pairing (edgespec/pairing.py), pure: the rules llama.cpp's
common/speculative applies, the padded tail's handling, and that speculation through a padded
draft stays exactly the target's distribution (with a broken twin that must be rejected)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from edgespec.errors import IncompatibleDraft
from edgespec.pairing import (
    VOCAB_CHECK_START_TOKEN_ID,
    VOCAB_MAX_SIZE_DIFFERENCE,
    Pairing,
    TextPairing,
    check_compatible,
    pair,
)
from edgespec.sampling import SamplingParams, logits_to_probs
from edgespec.selftest import ALPHA, check_tree_exact, draw
from edgespec.tree import DraftTree

TEXTS = [b"<unk>", b"<s>", b"</s>", b"<pad>", b"<sep>", b"a", b"b", b"c"]


@dataclass
class Vocab:
    path: Path = Path("m.gguf")
    vocab_type: int = 2
    bos: int = 1
    eos: int = 2
    add_bos: bool = False
    add_eos: bool = False
    texts: list = field(default_factory=lambda: list(TEXTS))

    @property
    def n_vocab(self) -> int:
        return len(self.texts)

    def token_text(self, t: int) -> bytes:
        return self.texts[t]


def padded(n: int) -> list[bytes]:
    return TEXTS + [f"[PAD{i}]".encode() for i in range(n)]


def test_same_vocabulary_is_not_padded():
    p = check_compatible(Vocab(), Vocab())
    assert p == Pairing(8, 8, 8, substitute=2) and not p.padded
    assert "same vocabulary" in p.describe()


@pytest.mark.parametrize(("t_pad", "d_pad"), [(128, 0), (0, 128), (3, 1)])
def test_a_padded_tail_on_either_side_pairs_on_the_shared_range(t_pad, d_pad):
    p = check_compatible(Vocab(texts=padded(t_pad)), Vocab(texts=padded(d_pad)))
    assert (p.n_target, p.n_draft, p.shared) == (8 + t_pad, 8 + d_pad, 8 + min(t_pad, d_pad))
    assert p.padded and "padded vocabularies" in p.describe()


def test_special_tokens_below_the_check_start_may_differ_as_in_llama_cpp():
    # a base draft for an instruct target: other special tokens, other EOS, no BOS added
    base = Vocab(eos=0, texts=[b"<|endoftext|>", b"<|im_start|>", b"<|im_end|>", b"x", b"y", *TEXTS[5:]])
    assert VOCAB_CHECK_START_TOKEN_ID == 5
    assert not check_compatible(Vocab(), base).padded


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"vocab_type": 1}, "vocab type 2 vs 1"),
        ({"texts": padded(VOCAB_MAX_SIZE_DIFFERENCE + 1)}, "vocab size 8 vs 137"),
        ({"add_bos": True}, "add_bos"),
        ({"add_eos": True}, "add_eos"),
        ({"texts": TEXTS[:6] + [b"B", b"c"]}, "token 6 text b'b' vs b'B'"),
    ],
)
def test_each_difference_is_named(change, needle):
    with pytest.raises(IncompatibleDraft) as e:
        check_compatible(Vocab(), Vocab(path=Path("d.gguf"), **change))
    assert needle in str(e.value) and "d.gguf" in str(e.value)


def test_bos_and_eos_are_compared_only_where_they_are_added():
    with pytest.raises(IncompatibleDraft, match="BOS 1 vs 0"):
        check_compatible(Vocab(add_bos=True), Vocab(add_bos=True, bos=0))
    with pytest.raises(IncompatibleDraft, match="EOS 2 vs 3"):
        check_compatible(Vocab(add_eos=True), Vocab(add_eos=True, eos=3))
    check_compatible(Vocab(), Vocab(bos=0, eos=3))


def test_the_first_differing_token_of_the_shared_range_is_named_past_the_tail():
    d = Vocab(texts=padded(2))
    d.texts[7] = b"C"
    with pytest.raises(IncompatibleDraft, match="token 7 text b'c' vs b'C'"):
        check_compatible(Vocab(texts=padded(5)), d)


def test_draft_rows_read_in_the_target_vocabulary():
    smaller = Pairing(n_target=6, n_draft=4, shared=4)
    rows = np.arange(8, dtype=np.float32).reshape(2, 4)
    out = smaller.rows_in_target_vocab(rows)
    assert out.shape == (2, 6) and out.dtype == np.float32
    assert (out[:, :4] == rows).all() and np.isneginf(out[:, 4:]).all()
    larger = Pairing(n_target=4, n_draft=6, shared=4)  # the draft's own tail is never proposed
    out = larger.rows_in_target_vocab(np.zeros((1, 6), np.float32))
    assert out.shape == (1, 4) and (out == 0).all()


def test_target_tail_tokens_reach_the_draft_as_the_substitute():
    p = Pairing(n_target=10, n_draft=8, shared=8, substitute=2)
    tok = np.array([0, 7, 8, 9, 3], dtype=np.int32)
    p.to_draft_ids(tok)
    assert tok.tolist() == [0, 7, 2, 2, 3]


# --- exactness at T > 0 through a padded draft ---------------------------------------------------

# the target's 8 tokens: 2 of them (35 % of its mass) in its padded tail, which the draft lacks
P = np.array([0.30, 0.15, 0.10, 0.06, 0.04, 0.25, 0.06, 0.04])
DRAFT_LOGITS = np.log(np.array([[0.05, 0.05, 0.2, 0.3, 0.4, 0.0]]) + 1e-30).astype(np.float32)  # its own tail: id 5
PAIRING = Pairing(n_target=8, n_draft=6, shared=5)
SAMPLING = SamplingParams(temperature=1.0)


def padded_chain(claimed_q) -> callable:
    """A chain of 2 drawn from the padded draft's q; the verifier is told `claimed_q`."""
    q = logits_to_probs(PAIRING.rows_in_target_vocab(DRAFT_LOGITS)[0], SAMPLING).astype(np.float64)

    def build(prefix, rng):
        tokens = [prefix[-1] if prefix else 0, draw(q, rng), draw(q, rng)]
        return DraftTree(tokens, [-1, 0, 1], [0, 1, 2], [True, False, False], [claimed_q, claimed_q, None])

    return build, q


def test_speculation_through_a_padded_draft_is_exactly_the_target():
    build, q = padded_chain(None)
    assert q.shape == (8,) and q[5:].sum() == 0  # neither tail is ever proposed
    build, _ = padded_chain(q)
    r = check_tree_exact("padded", lambda prefix: P, build, n_tokens=2, trials=60_000, rng=np.random.default_rng(3))
    assert r.passed, r


def test_a_draft_q_read_over_its_own_vocabulary_is_rejected():
    """The broken twin: the proposals come from the padded draft, but the verifier is told the
    draft's q renormalised over its own 6 tokens (its tail's row read as a real token's), so
    every shared token's q is understated: the output is no longer the target's."""
    own = logits_to_probs(DRAFT_LOGITS[0].copy(), SAMPLING).astype(np.float64)
    own[5] = np.exp(0.0)  # the draft's tail token given a logit of 0 instead of -inf
    wrong_q = np.concatenate([own / own.sum(), [0.0, 0.0]])[:8]
    build, _ = padded_chain(wrong_q)
    r = check_tree_exact("padded-broken", lambda prefix: P, build, n_tokens=2, trials=20_000,
                         rng=np.random.default_rng(3))
    assert not r.passed and r.p_value < ALPHA


def test_another_tokenizer_pairs_through_text_naming_what_differs():
    p = pair(Vocab(), Vocab(path=Path("d.gguf"), vocab_type=1, texts=TEXTS[:6] + [b"B", b"c"]))
    assert isinstance(p, TextPairing) and not p.padded
    assert p.describe().startswith("different tokenizers (vocab type 2 vs 1): drafts through text")
    assert isinstance(pair(Vocab(), Vocab()), Pairing)


@pytest.mark.parametrize("role", ["draft", "target"])
def test_a_model_without_a_tokenizer_is_refused_naming_the_field(role):
    none = Vocab(path=Path("none.gguf"), vocab_type=0)
    t, d = (Vocab(), none) if role == "draft" else (none, Vocab())
    with pytest.raises(IncompatibleDraft, match=f"^{role}.path: none.gguf has no tokenizer"):
        pair(t, d)
