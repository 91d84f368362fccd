"""Random-weight GGUFs of real models' shapes: what a forward of Llama-3-8B or Qwen2.5-14B costs on
this box, without fetching the model.

A shape is written with the `gguf` package as F16 matrices (F32 norms and biases), then quantized
by llama.cpp's own quantizer, so the file holds the tensor types a real Q4_K_M (or Q8_0, ...)
download holds. The tokenizer is the demo model's (49,152 tokens, copied from its GGUF): llama.cpp
needs one to load the file, and the output layer's cost follows the vocabulary size. `vocab` asks
for a real size instead: the demo's tokens padded with unused control tokens.

The values are random normals (scale 0.02) tiled from a fixed pool: a dense kernel's cost does not
depend on them, and the pool keeps generation at memory speed for an 8B shape. `layers` writes the
first N blocks only (a forward costs about N/n_layer of the whole body, plus the output layer).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgespec.errors import BadRequest, ModelError

DEMO_VOCAB = 49_152


@dataclass(frozen=True)
class Shape:
    """The hyper-parameters that set a dense decoder's forward cost (Hugging Face config names in
    the comments)."""

    arch: str  # GGUF architecture: llama | qwen2 (qwen2: biases on Q, K and V)
    n_embd: int  # hidden_size
    n_layer: int  # num_hidden_layers
    n_head: int  # num_attention_heads
    n_head_kv: int  # num_key_value_heads
    n_ff: int  # intermediate_size
    n_vocab: int  # vocab_size (the real model's; the file takes the demo's unless asked)
    head_dim: int
    tied: bool  # tie_word_embeddings: no output.weight
    rope_theta: float
    eps: float = 1e-5


SHAPES: dict[str, Shape] = {
    "llama3-8b": Shape("llama", 4096, 32, 32, 8, 14336, 128_256, 128, False, 500_000.0),
    "llama3.2-3b": Shape("llama", 3072, 28, 24, 8, 8192, 128_256, 128, True, 500_000.0),
    "llama3.2-1b": Shape("llama", 2048, 16, 32, 8, 8192, 128_256, 64, True, 500_000.0),
    "qwen2.5-14b": Shape("qwen2", 5120, 48, 40, 8, 13824, 152_064, 128, False, 1_000_000.0, 1e-6),
    "qwen2.5-7b": Shape("qwen2", 3584, 28, 28, 4, 18944, 152_064, 128, False, 1_000_000.0, 1e-6),
    "qwen2.5-1.5b": Shape("qwen2", 1536, 28, 12, 2, 8960, 151_936, 128, True, 1_000_000.0, 1e-6),
    "qwen2.5-0.5b": Shape("qwen2", 896, 24, 14, 2, 4864, 151_936, 64, True, 1_000_000.0, 1e-6),
}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # numpy order: (rows = outputs, columns = inputs)
    dtype: type  # np.float16 | np.float32


def demo_donor() -> Path:
    """The GGUF whose tokenizer the generated files carry."""
    from edgespec.models import default_pair

    return default_pair().target


# --- writing ---------------------------------------------------------------------------------------


def tokenizer_fields(donor: Path, n_vocab: int | None = None) -> list[tuple[str, Any, Any, Any]]:
    """The donor's `tokenizer.*` key-values as (key, value, GGUF type, array element type), its
    token list padded to `n_vocab` with unused control tokens when that is larger."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(str(donor))
    out: list[tuple[str, Any, Any, Any]] = []
    for key, f in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = f.types[0]
        sub = f.types[1] if vtype == GGUFValueType.ARRAY else None
        out.append((key, f.contents(), vtype, sub))
    have = next(len(v) for k, v, _, _ in out if k == "tokenizer.ggml.tokens")
    if n_vocab is not None and n_vocab < have:
        raise BadRequest("vocab", f"must be at least the demo tokenizer's {have} tokens, got {n_vocab}")
    if n_vocab is not None and n_vocab > have:
        pad = n_vocab - have
        extra: dict[str, list[Any]] = {"tokenizer.ggml.tokens": [f"<|synth_unused_{i}|>" for i in range(pad)],
                 "tokenizer.ggml.token_type": [3] * pad,  # CONTROL: never produced by the BPE merges
                 "tokenizer.ggml.scores": [0.0] * pad}
        out = [(k, list(v) + extra[k] if k in extra else v, t, s) for k, v, t, s in out]
    return out


def write_gguf(path: Path, arch: str, meta: Sequence[tuple[str, object, object, object]],
               specs: Sequence[TensorSpec], make: Callable[[TensorSpec], np.ndarray]) -> None:
    """Stream a GGUF to `path`: the key-values, then each tensor as `make(spec)` builds it (one in
    memory at a time)."""
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    for key, value, vtype, sub in meta:
        w.add_key_value(key, value, vtype, sub)  # type: ignore[arg-type]
    for s in specs:
        nbytes = int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize
        w.add_tensor_info(s.name, s.shape, np.dtype(s.dtype), nbytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for s in specs:
        a = make(s)
        if a.shape != s.shape or a.dtype != np.dtype(s.dtype):
            raise ModelError(f"{s.name}: built {a.shape} {a.dtype}, declared {s.shape} {np.dtype(s.dtype)}")
        w.write_tensor_data(a)
    w.close()


def arch_meta(arch: str, *, n_embd: int, n_layer: int, n_head: int, n_head_kv: int, n_ff: int, n_vocab: int,
              head_dim: int, rope_theta: float, eps: float, n_ctx: int = 8192, name: str = "synth"
              ) -> list[tuple[str, object, object, object]]:
    """The architecture's key-values for a llama-style decoder (F16 file type)."""
    from gguf import GGUFValueType as T

    u32, f32 = T.UINT32, T.FLOAT32
    return [
        ("general.name", name, T.STRING, None),
        ("general.file_type", 1, u32, None),  # LLAMA_FTYPE_MOSTLY_F16
        (f"{arch}.block_count", n_layer, u32, None),
        (f"{arch}.context_length", n_ctx, u32, None),
        (f"{arch}.embedding_length", n_embd, u32, None),
        (f"{arch}.feed_forward_length", n_ff, u32, None),
        (f"{arch}.attention.head_count", n_head, u32, None),
        (f"{arch}.attention.head_count_kv", n_head_kv, u32, None),
        (f"{arch}.attention.key_length", head_dim, u32, None),
        (f"{arch}.attention.value_length", head_dim, u32, None),
        (f"{arch}.rope.dimension_count", head_dim, u32, None),
        (f"{arch}.rope.freq_base", rope_theta, f32, None),
        (f"{arch}.attention.layer_norm_rms_epsilon", eps, f32, None),
        (f"{arch}.vocab_size", n_vocab, u32, None),
    ]


def layer_specs(i: int, *, n_embd: int, n_head: int, n_head_kv: int, n_ff: int, head_dim: int,
                biases: bool = False) -> list[TensorSpec]:
    """One decoder block's tensors (numpy shapes: outputs x inputs)."""
    f16, f32 = np.float16, np.float32
    q, kv = n_head * head_dim, n_head_kv * head_dim
    b = f"blk.{i}."
    out = [
        TensorSpec(b + "attn_norm.weight", (n_embd,), f32),
        TensorSpec(b + "attn_q.weight", (q, n_embd), f16),
        TensorSpec(b + "attn_k.weight", (kv, n_embd), f16),
        TensorSpec(b + "attn_v.weight", (kv, n_embd), f16),
        TensorSpec(b + "attn_output.weight", (n_embd, q), f16),
        TensorSpec(b + "ffn_norm.weight", (n_embd,), f32),
        TensorSpec(b + "ffn_gate.weight", (n_ff, n_embd), f16),
        TensorSpec(b + "ffn_up.weight", (n_ff, n_embd), f16),
        TensorSpec(b + "ffn_down.weight", (n_embd, n_ff), f16),
    ]
    if biases:
        out += [TensorSpec(b + "attn_q.bias", (q,), f32), TensorSpec(b + "attn_k.bias", (kv,), f32),
                TensorSpec(b + "attn_v.bias", (kv,), f32)]
    return out


def model_specs(n_vocab: int, n_embd: int, tied: bool, layers: Iterator[list[TensorSpec]]) -> list[TensorSpec]:
    out = [TensorSpec("token_embd.weight", (n_vocab, n_embd), np.float16),
           TensorSpec("output_norm.weight", (n_embd,), np.float32)]
    if not tied:
        out.append(TensorSpec("output.weight", (n_vocab, n_embd), np.float16))
    for specs in layers:
        out += specs
    return out


class _Pool:
    """Random values tiled from one pool (a prime count, so rows do not repeat in step)."""

    def __init__(self, seed: int, n: int = 1_048_573, scale: float = 0.02):
        self.values = (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float16)

    def __call__(self, s: TensorSpec) -> np.ndarray:
        if len(s.shape) == 1:  # norms 1, biases small
            return np.ones(s.shape, s.dtype) if s.name.endswith("norm.weight") else np.zeros(s.shape, s.dtype)
        return np.resize(self.values, s.shape).astype(s.dtype, copy=False)


# --- the command -----------------------------------------------------------------------------------


def quantize_to(src: Path, out: Path, ftype: str, log: Callable[[str], None]) -> Path:
    """`src` (an F16 GGUF) as `ftype` at `out`; src is removed."""
    from edgespec import backend

    if ftype == "f16":
        os.replace(src, out)
        return out
    log(f"quantizing to {ftype} with llama.cpp's quantizer")
    part = out.with_name(out.name + ".part")
    try:
        backend.quantize(src, part, ftype)
        os.replace(part, out)
    finally:
        part.unlink(missing_ok=True)
        src.unlink(missing_ok=True)
    return out


def synth(shape: str, ftype: str, out: Path, *, layers: int | None = None, vocab: int | None = None,
          donor: Path | None = None, seed: int = 0, log: Callable[[str], None] = lambda s: None) -> Path:
    """Write a random-weight GGUF of `shape` (a SHAPES key) quantized to `ftype`."""
    from edgespec import backend

    if shape not in SHAPES:
        raise BadRequest("shape", f"unknown shape {shape!r}; one of {', '.join(SHAPES)}")
    if ftype not in backend.FTYPES:
        raise BadRequest("type", f"unknown type {ftype!r}; one of {', '.join(backend.FTYPES)}")
    sh = SHAPES[shape]
    n_layer = sh.n_layer if layers is None else layers
    if not 1 <= n_layer <= sh.n_layer:
        raise BadRequest("layers", f"must be in [1, {sh.n_layer}] for {shape}, got {layers}")
    donor = donor or demo_donor()
    if not donor.is_file():
        raise ModelError(f"tokenizer donor not found: {donor} (run `edgespec models prepare-demo`)")
    tok = tokenizer_fields(donor, vocab)
    n_vocab = next(len(v) for k, v, _, _ in tok if k == "tokenizer.ggml.tokens")
    dims = dict(n_embd=sh.n_embd, n_head=sh.n_head, n_head_kv=sh.n_head_kv, n_ff=sh.n_ff, head_dim=sh.head_dim)
    meta = arch_meta(sh.arch, n_layer=n_layer, n_vocab=n_vocab, rope_theta=sh.rope_theta, eps=sh.eps,
                     name=f"synth {shape} ({n_layer} layers)", **dims) + tok
    specs = model_specs(n_vocab, sh.n_embd, sh.tied,
                        (layer_specs(i, biases=sh.arch == "qwen2", **dims) for i in range(n_layer)))
    out.parent.mkdir(parents=True, exist_ok=True)
    f16 = out.with_name(out.name + ".f16.part")
    log(f"writing {shape}, {n_layer}/{sh.n_layer} layers, vocab {n_vocab}, as F16 ({f16})")
    try:
        write_gguf(f16, sh.arch, meta, specs, _Pool(seed))
    except BaseException:
        f16.unlink(missing_ok=True)
        raise
    return quantize_to(f16, out, ftype, log)
