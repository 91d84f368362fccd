"""How a draft model speaks the target's vocabulary (pure: no llama.cpp).

`check_compatible` takes anything with a vocabulary's facts (`backend.Model` at load, `GgufVocab`
read from a file's header by `edgespec plan` and `models add`) and returns the `Pairing` the
engine applies to the draft's context, or raises IncompatibleDraft naming the first difference.
`pair` goes one step further: a draft with another tokenizer drafts through text (`TextPairing`,
edgespec/drafters/text.py); only a draft with no tokenizer at all is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgespec.errors import IncompatibleDraft, ModelError

# llama.cpp's common/speculative.cpp: a draft may have up to this many tokens more or fewer than the
# target (a padded vocabulary: Qwen2.5's 152,064-token large models and 151,936-token small ones),
# and the first ids (special tokens that base and instruct builds name differently) are not compared
VOCAB_MAX_SIZE_DIFFERENCE = 128
VOCAB_CHECK_START_TOKEN_ID = 5


@dataclass(frozen=True)
class Pairing:
    """How a draft model speaks the target's vocabulary: the ids below `shared` are the same tokens
    in both; beyond it, on either side, lies a padded tail. A draft never proposes a token of its
    own tail (its logits there read as -inf: probability 0, which keeps the verifier exact at
    T > 0), and a target token of the target's tail reaches the draft as `substitute`."""

    n_target: int  # tokens in the target's vocabulary
    n_draft: int  # and in the draft's
    shared: int
    substitute: int = 0

    @property
    def padded(self) -> bool:
        return self.n_target != self.n_draft or self.shared != self.n_target

    def rows_in_target_vocab(self, rows: np.ndarray) -> np.ndarray:
        """[n, draft vocab] draft logits -> [n, target vocab]: the shared range as it is, -inf
        elsewhere (a new float32 array)."""
        out = np.full((rows.shape[0], self.n_target), -np.inf, dtype=np.float32)
        out[:, :self.shared] = rows[:, :self.shared]
        return out

    def to_draft_ids(self, tokens: np.ndarray) -> None:
        """Target ids -> the draft's, in place: ids beyond the shared range become `substitute`."""
        tokens[tokens >= self.shared] = self.substitute

    def describe(self) -> str:
        if not self.padded:
            return f"same vocabulary ({self.n_target} tokens)"
        return (f"padded vocabularies: target {self.n_target}, draft {self.n_draft} tokens, the first "
                f"{self.shared} the same (tail tokens never drafted)")


@dataclass(frozen=True)
class TextPairing:
    """A draft with another tokenizer: it reads the target's context as text and its continuation
    is re-tokenized with the target's tokenizer (drafters/text.py). `why`: what differs."""

    why: str
    padded = False

    def describe(self) -> str:
        return (f"different tokenizers ({self.why}): drafts through text, its continuation re-tokenized "
                "with the target's tokenizer and verified as point drafts (output unchanged)")


def pair(target: Any, draft: Any) -> Pairing | TextPairing:
    """How `draft` drafts for `target`: token for token (`check_compatible`'s Pairing), or through
    text when the vocabularies differ (TextPairing). Raises IncompatibleDraft naming the field
    only where text cannot bridge them either: a draft (or target) with no tokenizer."""
    try:
        return check_compatible(target, draft)
    except IncompatibleDraft as exc:
        for role, m in (("draft", draft), ("target", target)):
            if m.vocab_type == 0 or m.n_vocab <= 0:
                raise IncompatibleDraft(
                    f"{role}.path: {m.path.name} has no tokenizer (tokenizer.ggml.model), so it cannot "
                    "draft or be drafted for through text either") from None
        return TextPairing(str(exc).split(": ", 1)[-1])


def check_compatible(target: Any, draft: Any) -> Pairing:
    """The draft must speak the target's vocabulary token for token over the range both hold, as
    llama.cpp's common/speculative.cpp accepts it: the same vocabulary type, the same BOS where
    one is added (and EOS where one is added), sizes within VOCAB_MAX_SIZE_DIFFERENCE, the same
    text for every shared id from VOCAB_CHECK_START_TOKEN_ID on. Raises IncompatibleDraft saying
    what differs (the first differing token by id and text); returns the Pairing."""
    diffs = []
    if target.vocab_type != draft.vocab_type:
        diffs.append(f"vocab type {target.vocab_type} vs {draft.vocab_type}")
    if abs(target.n_vocab - draft.n_vocab) > VOCAB_MAX_SIZE_DIFFERENCE:
        diffs.append(f"vocab size {target.n_vocab} vs {draft.n_vocab} (at most {VOCAB_MAX_SIZE_DIFFERENCE} "
                     "tokens of padding apart)")
    if target.add_bos != draft.add_bos:
        diffs.append(f"add_bos {target.add_bos} vs {draft.add_bos}")
    elif target.add_bos and target.bos != draft.bos:
        diffs.append(f"BOS {target.bos} vs {draft.bos}")
    t_eos, d_eos = getattr(target, "add_eos", False), getattr(draft, "add_eos", False)
    if t_eos != d_eos:
        diffs.append(f"add_eos {t_eos} vs {d_eos}")
    elif t_eos and target.eos != draft.eos:
        diffs.append(f"EOS {target.eos} vs {draft.eos}")
    shared = min(target.n_vocab, draft.n_vocab)
    if not diffs:
        t = first_differing_token(target, draft, VOCAB_CHECK_START_TOKEN_ID, shared)
        if t is not None:
            diffs.append(f"token {t} text {target.token_text(t)!r} vs {draft.token_text(t)!r}")
    if diffs:
        raise IncompatibleDraft(
            f"draft {draft.path.name} cannot draft for target {target.path.name}: " + "; ".join(diffs)
        )
    return Pairing(target.n_vocab, draft.n_vocab, shared, substitute=max(0, draft.eos) if draft.eos < shared else 0)


def first_differing_token(a: Any, b: Any, start: int, end: int) -> int | None:
    """The first id in [start, end) whose text differs between the two vocabularies, or None."""
    for t in range(start, end):
        if a.token_text(t) != b.token_text(t):
            return t
    return None


# tokenizer.ggml.model -> llama.cpp's enum llama_vocab_type
_VOCAB_TYPES = {"no_vocab": 0, "llama": 1, "gpt2": 2, "bert": 3, "t5": 4, "rwkv": 5, "plamo2": 6}


class GgufVocab:
    """A GGUF file's vocabulary facts from its header (no weights loaded), as check_compatible
    reads them. Where the header leaves add_bos unset it takes llama.cpp's default per type."""

    def __init__(self, path: str | Path):
        from gguf import GGUFReader  # numpy memmap; lazily imported to keep CLI start-up fast

        self.path = Path(path)
        try:
            fields = GGUFReader(str(self.path)).fields
        except Exception as exc:  # gguf raises ValueError/struct errors on non-GGUF files
            raise ModelError(f"{self.path}: not a readable GGUF file ({exc})") from exc

        def get(key: str, default: Any = None) -> Any:
            f = fields.get(key)
            return default if f is None else f.contents()

        self._texts = [t.encode() if isinstance(t, str) else bytes(t) for t in (get("tokenizer.ggml.tokens") or [])]
        self.n_vocab = len(self._texts)
        model = get("tokenizer.ggml.model", "no_vocab")
        self.vocab_type = _VOCAB_TYPES.get(str(model), -1)
        self.bos = int(get("tokenizer.ggml.bos_token_id", -1))
        self.eos = int(get("tokenizer.ggml.eos_token_id", -1))
        self.add_bos = bool(get("tokenizer.ggml.add_bos_token", self.vocab_type in (1, 3)))
        self.add_eos = bool(get("tokenizer.ggml.add_eos_token", False))

    def token_text(self, t: int) -> bytes:
        return self._texts[t]


def describe_pair(target: str | Path, draft: str | Path) -> str:
    """One line on a pair's vocabularies, read from the files: what the daemon will do with it."""
    try:
        return pair(GgufVocab(target), GgufVocab(draft)).describe()
    except IncompatibleDraft as exc:
        return f"incompatible: {exc}"
