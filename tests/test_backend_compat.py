"""Vocabulary compatibility check, on stand-in models (pure logic)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from edgespec.errors import IncompatibleDraft


@dataclass
class Vocab:
    path: Path = Path("m.gguf")
    vocab_type: int = 2
    n_vocab: int = 4
    bos: int = 1
    eos: int = 2
    add_bos: bool = False
    texts: list = field(default_factory=lambda: [b"<unk>", b"<s>", b"</s>", b"a"])

    def token_text(self, t: int) -> bytes:
        return self.texts[t]


def check(t, d):
    from edgespec.backend import check_compatible

    check_compatible(t, d)


def test_same_vocabulary_passes():
    check(Vocab(), Vocab())


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"vocab_type": 1}, "vocab type"),
        ({"n_vocab": 5}, "vocab size"),
        ({"bos": 0}, "BOS"),
        ({"eos": 3}, "EOS"),
        ({"add_bos": True}, "add_bos"),
        ({"texts": [b"<unk>", b"<s>", b"</s>", b"b"]}, "token 3 text"),
    ],
)
def test_each_difference_is_named(change, needle):
    with pytest.raises(IncompatibleDraft) as e:
        check(Vocab(), Vocab(path=Path("d.gguf"), **change))
    assert needle in str(e.value) and "d.gguf" in str(e.value)
