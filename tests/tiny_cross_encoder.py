"""A tiny BERT cross-encoder GGUF, written as llama.cpp's converter (conversion/bert.py) writes
a reranker: arch `bert`, a WordPiece vocabulary (tokenizer model `bert`, [PAD] 0, [UNK] 100,
[CLS] 101, [SEP] 102, [MASK] 103, words with the phantom space `▁`, `##` pieces without it), a
classifier head, and for the tests of real llama.cpp rank pooling on a file small enough to
load in milliseconds.

Heads, as llama.cpp reads them (llama-graph.cpp, build_pooling, LLAMA_POOLING_TYPE_RANK, over
the [CLS] row):
- "bert": BertForSequenceClassification (ms-marco MiniLM cross-encoders): `cls.output` only
  (the converter drops the pooler) and `bert.classifier.output_labels`;
- "roberta": XLMRobertaForSequenceClassification (bge-reranker): `cls` (dense, then tanh) and
  `cls.output`.
`rank_pooling` writes `bert.pooling_type = 4` (RANK). Today's converter writes no pooling type
for either (llama-server is told `--reranking`), so a file without it is what a site gets.

The weights make the score predictable. Channels 0 and 1 of the hidden state are the "marker"
pair: only the `marker` words' embeddings set them (+4, -4); every other embedding, position and
token-type row is 0 in both. Layer norms are plain (weight 1, bias 0), V and the attention
output are the identity, the feed-forward is 0 and Q, K are random (a seeded, non-uniform
attention across the whole pair). Every operation then treats channels 0 and 1 alike (a layer
norm subtracts one mean from both and scales both by one factor; attention mixes positions, not
channels), so h[0] - h[1] of [CLS] stays exactly 0 in a pair without a marker word, whatever the
rounding (F16 attention included), and is > 0 in a pair with one. The head reads that difference:
    score = sigmoid(16 * (h_cls[0] - h_cls[1]) + b), b = -1:
a pair without a marker word scores exactly sigmoid(-1); a pair with one scores above it."""

from __future__ import annotations

import string
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from edgespec.synth import TensorSpec, write_gguf

PAD, UNK, CLS, SEP, MASK = 0, 100, 101, 102, 103
WORDS = ("what", "is", "the", "capital", "of", "france", "paris", "bananas", "banana", "are", "rich", "in",
         "potassium", "python", "was", "created", "by", "guido", "van", "rossum", "who", "which", "fruit",
         "city", "and", "it", "language", "programming")
MARKERS = ("paris",)  # the word whose presence raises the score
BIAS = -1.0  # the head's bias: the score of a pair without a marker word is sigmoid(BIAS)


def vocabulary() -> tuple[list[str], list[int]]:
    """(tokens, token types): BERT's special ids at their usual places, the words, then each
    letter, digit and punctuation mark as a word start (`▁x`) and as a piece (`x`)."""
    toks = ["[PAD]", *[f"[unused{i}]" for i in range(1, 100)], "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    types = [3] + [1] * 99 + [3] * 4  # CONTROL for the specials, as the converter marks added tokens
    chars = string.ascii_lowercase + string.digits + string.punctuation
    pieces = list(dict.fromkeys([f"\u2581{w}" for w in WORDS] + [f"\u2581{c}" for c in chars] + list(chars)))
    return toks + pieces, types + [1] * len(pieces)


def _dyadic(rng: np.random.Generator, rows: int, n: int) -> np.ndarray:
    """[rows, n] with channels 0 and 1 = 0 and channels 2.. = +v, -v pairs (v in 1/4 .. 2,
    dyadic), shuffled: each row sums to exactly 0 in float arithmetic."""
    half = (n - 2) // 2
    out = np.zeros((rows, n), dtype=np.float32)
    for r in range(rows):
        v = rng.choice([0.25, 0.5, 1.0, 1.5, 2.0], size=half) * rng.choice([-1.0, 1.0], size=half)
        out[r, 2:2 + 2 * half] = rng.permutation(np.concatenate([v, -v]))
    return out


def write_cross_encoder(path: Path, *, head: str = "bert", rank_pooling: bool = True, n_embd: int = 32,
                        n_head: int = 2, n_layer: int = 2, n_ctx: int = 512, seed: int = 0,
                        markers: Sequence[str] = MARKERS) -> Path:
    """An F32 `bert` cross-encoder GGUF at `path` (tens of kilobytes); see the module's docstring."""
    from gguf import GGUFValueType as T

    if head not in ("bert", "roberta"):
        raise ValueError(f"head must be bert or roberta, got {head!r}")
    toks, types = vocabulary()
    rng = np.random.default_rng(seed)
    n_ff = 2 * n_embd
    u32 = T.UINT32
    meta: list[tuple[str, object, object, object]] = [
        ("general.name", f"tiny-{head}-cross-encoder", T.STRING, None),
        ("general.file_type", 0, u32, None),  # ALL_F32
        ("bert.context_length", n_ctx, u32, None), ("bert.embedding_length", n_embd, u32, None),
        ("bert.feed_forward_length", n_ff, u32, None), ("bert.block_count", n_layer, u32, None),
        ("bert.attention.head_count", n_head, u32, None),
        ("bert.attention.layer_norm_epsilon", 1e-12, T.FLOAT32, None),
        ("bert.attention.causal", False, T.BOOL, None),
        ("tokenizer.ggml.model", "bert", T.STRING, None), ("tokenizer.ggml.pre", "default", T.STRING, None),
        ("tokenizer.ggml.tokens", toks, T.ARRAY, T.STRING), ("tokenizer.ggml.token_type", types, T.ARRAY, T.INT32),
        ("tokenizer.ggml.token_type_count", 2, u32, None),
        ("tokenizer.ggml.unknown_token_id", UNK, u32, None), ("tokenizer.ggml.seperator_token_id", SEP, u32, None),
        ("tokenizer.ggml.padding_token_id", PAD, u32, None), ("tokenizer.ggml.cls_token_id", CLS, u32, None),
        ("tokenizer.ggml.mask_token_id", MASK, u32, None),
    ]
    if rank_pooling:
        meta.append(("bert.pooling_type", 4, u32, None))  # LLAMA_POOLING_TYPE_RANK
    if head == "bert":
        meta.append(("bert.classifier.output_labels", ["LABEL_0"], T.ARRAY, T.STRING))
    tok = _dyadic(rng, len(toks), n_embd)
    for w in markers:
        tok[toks.index(f"\u2581{w}"), :2] = (4.0, -4.0)
    eye, zero = np.eye(n_embd, dtype=np.float32), np.zeros(n_embd, dtype=np.float32)
    ones = np.ones(n_embd, dtype=np.float32)
    tensors: dict[str, np.ndarray] = {
        "token_embd.weight": tok, "token_types.weight": _dyadic(rng, 2, n_embd),
        "position_embd.weight": _dyadic(rng, n_ctx, n_embd),
        "token_embd_norm.weight": ones, "token_embd_norm.bias": zero,
    }
    for i in range(n_layer):
        p = f"blk.{i}."
        for name in ("attn_q", "attn_k"):  # a seeded attention pattern: non-uniform, across the pair
            tensors[p + name + ".weight"] = (rng.standard_normal((n_embd, n_embd)) * 0.5).astype(np.float32)
            tensors[p + name + ".bias"] = (rng.standard_normal(n_embd) * 0.1).astype(np.float32)
        tensors.update({p + "attn_v.weight": eye, p + "attn_v.bias": zero, p + "attn_output.weight": eye,
                        p + "attn_output.bias": zero, p + "attn_output_norm.weight": ones,
                        p + "attn_output_norm.bias": zero,
                        p + "ffn_up.weight": np.zeros((n_ff, n_embd), np.float32), p + "ffn_up.bias": np.zeros(n_ff, np.float32),
                        p + "ffn_down.weight": np.zeros((n_embd, n_ff), np.float32), p + "ffn_down.bias": zero,
                        p + "layer_output_norm.weight": ones, p + "layer_output_norm.bias": zero})
    read = np.zeros((1, n_embd), dtype=np.float32)
    read[0, :2] = (16.0, -16.0)
    if head == "roberta":  # the dense layer keeps channel 0 where it is (tanh is increasing)
        tensors["cls.weight"], tensors["cls.bias"] = eye, zero
    tensors["cls.output.weight"], tensors["cls.output.bias"] = read, np.array([BIAS], dtype=np.float32)
    specs = [TensorSpec(name, a.shape, np.float32) for name, a in tensors.items()]
    write_gguf(path, "bert", meta, specs, lambda s: tensors[s.name])
    return path
