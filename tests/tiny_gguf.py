"""A tiny llama GGUF with a 258-token byte tokenizer: loads in llama.cpp in milliseconds, for tests
of files edgespec writes (edgespec/synth.py, edgespec/realistic.py)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from edgespec.synth import TensorSpec, arch_meta, layer_specs, model_specs, write_gguf


def byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode table: one token per byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, extra = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return [chr(c) for c in cs]


def tokenizer(controls: Sequence[str] = ()) -> list[tuple[str, object, object, object]]:
    """`controls`: control tokens after <s> and </s> (ids 258, 259, ...)."""
    from gguf import GGUFValueType as T

    toks = [*byte_tokens(), "<s>", "</s>", *controls]
    return [("tokenizer.ggml.model", "gpt2", T.STRING, None), ("tokenizer.ggml.pre", "default", T.STRING, None),
            ("tokenizer.ggml.tokens", toks, T.ARRAY, T.STRING),
            ("tokenizer.ggml.token_type", [1] * 256 + [3] * (2 + len(controls)), T.ARRAY, T.INT32),
            ("tokenizer.ggml.merges", ["Ġ t"], T.ARRAY, T.STRING),
            ("tokenizer.ggml.bos_token_id", 256, T.UINT32, None), ("tokenizer.ggml.eos_token_id", 257, T.UINT32, None)]


def write_tiny(path: Path, n_embd: int = 64, n_layer: int = 2, n_head: int = 4, n_head_kv: int = 2, n_ff: int = 128,
               seed: int = 0, controls: Sequence[str] = ()) -> Path:
    """An F32 llama with tied embeddings whose values are F16-representable (an F16 copy is
    lossless); `controls`: control tokens its vocabulary holds besides <s> and </s>."""
    from gguf import GGUFValueType as T

    tok = tokenizer(controls)
    n_vocab = len(tok[2][1])  # type: ignore[arg-type]
    dims = dict(n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, n_ff=n_ff, head_dim=n_embd // n_head)
    meta = [("general.file_type", 0, T.UINT32, None) if k == "general.file_type" else (k, v, t, s)
            for k, v, t, s in arch_meta("llama", n_layer=n_layer, n_vocab=n_vocab, rope_theta=10000.0, eps=1e-5,
                                        **dims)] + tok
    specs = [TensorSpec(s.name, s.shape, np.float32)
             for s in model_specs(n_vocab, n_embd, True, (layer_specs(i, **dims) for i in range(n_layer)))]
    rng = np.random.default_rng(seed)

    def make(s: TensorSpec) -> np.ndarray:
        x = rng.standard_normal(s.shape) * 0.1 + (1.0 if len(s.shape) == 1 else 0.0)
        return x.astype(np.float16).astype(np.float32)

    write_gguf(path, "llama", meta, specs, make)
    return path
