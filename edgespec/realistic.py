"""A target whose text is the demo target's and whose forward costs what a real model's does.

The demo target (SmolLM2-135M: llama, n_embd 576, 30 layers, 9 heads over 3 KV heads of 64, FFN
1536) is widened in every direction with blocks of zeros:

    residual  576 -> E      the extra dimensions stay 0: every matrix writing the residual
                            (attn_output, ffn_down, the embedding) has zero rows there
    RMS norms w -> w*sqrt(576/E), eps -> eps*576/E
                            mean(x'^2) over E dims is mean(x^2)*576/E, so x'/rms(x') * w'
                            equals x/rms(x) * w exactly (the extra dims' weights are 0)
    heads     9/3 -> H/Hkv  original head h (KV group h//3) sits at (h//3)*g + h%3, g = H/Hkv;
                            the added heads' Q, K, V and attn_output columns are 0, so their
                            output is 0 (softmax over zero scores times zero values)
    FFN       1536 -> F     added gate/up rows and ffn_down columns 0: silu(0)*0 = 0
    layers    30 -> L       added blocks all zero: x + 0 + 0

A zero block quantizes to scale 0 and dequantizes to exact zeros in every ggml type (Q4_K's zero
sub-blocks leave the super-block scale of their non-zero neighbours alone), so the residual stream
carries the demo's values up to the rounding of the chosen type, while each forward streams every
byte through the real quantized kernels. The attention scale (1/sqrt(64)) and RoPE (64 dims,
base 100000) are the demo's.

Where it is biased against a real model of the same bytes: heads stay 64 wide (Llama-3-8B's are
128: the same FLOPs in twice the heads), the vocabulary is the demo's 49,152 (a real 128k vocabulary
adds ~0.4 GB of output layer to an 8B Q4_K_M), and a shape with fewer layers than 30 (1B) is
matched by bytes, with thinner and more layers (more per-layer overhead, which CUDA graphs hide
and CPUs barely notice). Widening the residual to a multiple of 256 keeps every matrix in a K-quant:
at the demo's 576, rows of 576 fall back from Q4_K to Q5_0 (and Q6_K to Q8_0) in llama.cpp's
quantizer, 22 % more bytes per weight and a cheaper kernel per byte at wide batches.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from edgespec.errors import BadRequest, ModelError
from edgespec.synth import TensorSpec, arch_meta, layer_specs, model_specs, quantize_to, tokenizer_fields, write_gguf


@dataclass(frozen=True)
class Widening:
    """The widened target's shape (head_dim stays the source's)."""

    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    tied: bool = True  # False: an output.weight of its own (the embedding's values), as Llama-3-8B has


# --cost NAME -> (widened shape, the real shape of about the same bytes at the demo's vocabulary)
COSTS: dict[str, tuple[Widening, str]] = {
    # Llama-3.2-1B's body (16 x 60.8M) in 30 thinner blocks of 34.1M, plus half its tied embedding
    "1B": (Widening(n_embd=1024, n_layer=30, n_head=16, n_head_kv=4, n_ff=10240), "llama3.2-1b"),
    # Llama-3-8B's own block shape: q 4096 and kv 1024 wide (64 x 64 and 16 x 64), 32 layers
    "8B": (Widening(n_embd=4096, n_layer=32, n_head=64, n_head_kv=16, n_ff=14336, tied=False), "llama3-8b"),
}


@dataclass(frozen=True)
class Source:
    """The demo-shaped source model: hyper-parameters and its tensors as numpy arrays (F32)."""

    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    head_dim: int
    eps: float
    rope_theta: float
    n_ctx: int
    tensors: dict[str, np.ndarray]  # numpy shapes: outputs x inputs


def read_source(path: Path) -> Source:
    """An F32/F16 llama GGUF (the demo target) as arrays."""
    from gguf import GGUFReader

    r = GGUFReader(str(path))

    def kv(key: str):
        f = r.fields.get(f"llama.{key}")
        if f is None:
            raise ModelError(f"{path}: no llama.{key} (not a llama GGUF?)")
        return f.contents()

    tensors = {}
    for t in r.tensors:
        if t.tensor_type.name not in ("F32", "F16"):
            raise ModelError(f"{path}: {t.name} is {t.tensor_type.name}; widen an F32 or F16 file")
        tensors[t.name] = np.asarray(t.data, np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))
    if "output.weight" in tensors:
        raise ModelError(f"{path}: untied output layer; the widening assumes tied embeddings (the demo's)")
    n_embd, n_head = int(kv("embedding_length")), int(kv("attention.head_count"))
    return Source(n_embd=n_embd, n_layer=int(kv("block_count")), n_head=n_head,
                  n_head_kv=int(kv("attention.head_count_kv")), n_ff=int(kv("feed_forward_length")),
                  head_dim=n_embd // n_head, eps=float(kv("attention.layer_norm_rms_epsilon")),
                  rope_theta=float(kv("rope.freq_base")), n_ctx=int(kv("context_length")), tensors=tensors)


def check_widening(src: Source, w: Widening) -> None:
    g0 = src.n_head // src.n_head_kv
    for name, new, old in (("n_embd", w.n_embd, src.n_embd), ("n_layer", w.n_layer, src.n_layer),
                           ("n_head_kv", w.n_head_kv, src.n_head_kv), ("n_ff", w.n_ff, src.n_ff),
                           ("n_head", w.n_head, src.n_head)):
        if new < old:
            raise BadRequest(name, f"must be at least the source's {old}, got {new}")
    if w.n_head % w.n_head_kv or w.n_head // w.n_head_kv < g0:
        raise BadRequest("n_head", f"must be a multiple of n_head_kv ({w.n_head_kv}) with at least {g0} heads "
                                   f"per KV head (the source's grouping), got {w.n_head}")


def head_positions(src: Source, w: Widening) -> list[int]:
    """Where each source head lands: its KV head keeps its index, its rank in the group too."""
    g0, g = src.n_head // src.n_head_kv, w.n_head // w.n_head_kv
    return [(h // g0) * g + h % g0 for h in range(src.n_head)]


def widened_tensor(src: Source, w: Widening, spec: TensorSpec) -> np.ndarray:
    """One tensor of the widened model: the source's values in place, zeros elsewhere."""
    out: np.ndarray = np.zeros(spec.shape, spec.dtype)
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", spec.name)
    if m and int(m.group(1)) >= src.n_layer:
        return out  # an added block: all zero, the identity on the residual stream
    old = src.tensors["token_embd.weight" if spec.name == "output.weight" else spec.name]
    e, d = src.n_embd, src.head_dim
    kind = m.group(2) if m else spec.name
    if kind.endswith("norm") or kind == "output_norm.weight":
        out[:e] = old * math.sqrt(e / w.n_embd)
    elif kind in ("attn_q", "attn_output"):
        for h, p in enumerate(head_positions(src, w)):
            if kind == "attn_q":
                out[p * d:(p + 1) * d, :e] = old[h * d:(h + 1) * d]
            else:
                out[:e, p * d:(p + 1) * d] = old[:, h * d:(h + 1) * d]
    else:  # token_embd, output, attn_k, attn_v, ffn_gate, ffn_up, ffn_down: the source in the top-left corner
        out[:old.shape[0], :old.shape[1]] = old
    return out


def widen(src_path: Path, w: Widening, out: Path, ftype: str = "q4_k_m",
          log: Callable[[str], None] = lambda s: None, layers: int | None = None) -> Path:
    """Write the widened model of `src_path` (the demo target, F32) quantized to `ftype`.
    `layers`: keep the first N blocks only, for cost checks of a big shape on a small box (the
    text is then not the source's)."""
    src = read_source(src_path)
    check_widening(src, w)
    if layers is not None:
        w = replace(w, n_layer=layers)
    tok = tokenizer_fields(src_path)
    n_vocab = src.tensors["token_embd.weight"].shape[0]
    dims: dict[str, Any] = dict(n_embd=w.n_embd, n_head=w.n_head, n_head_kv=w.n_head_kv, n_ff=w.n_ff,
                                head_dim=src.head_dim)
    meta = arch_meta("llama", n_layer=w.n_layer, n_vocab=n_vocab, rope_theta=src.rope_theta,
                     eps=src.eps * src.n_embd / w.n_embd, n_ctx=src.n_ctx,
                     name=f"demo target widened to {w}", **dims) + tok
    specs = model_specs(n_vocab, w.n_embd, w.tied, (layer_specs(i, **dims) for i in range(w.n_layer)))
    out.parent.mkdir(parents=True, exist_ok=True)
    f16 = out.with_name(out.name + ".f16.part")
    log(f"writing the demo target widened to {w} as F16 ({f16})")
    try:
        write_gguf(f16, "llama", meta, specs, lambda s: widened_tensor(src, w, s))
    except BaseException:
        f16.unlink(missing_ok=True)
        raise
    return quantize_to(f16, out, ftype, log)


def cost_target_path(cost: str, ftype: str = "q4_k_m", directory: Path | None = None) -> Path:
    from edgespec.config import models_dir
    from edgespec.models import BASENAME

    return (directory or models_dir()) / f"{BASENAME}.widened-{cost}.{ftype.upper()}.gguf"


def prepare_cost_target(cost: str, src_path: Path, ftype: str = "q4_k_m", directory: Path | None = None,
                        log: Callable[[str], None] = lambda s: None) -> Path:
    """The `--cost` target beside the demo pair (built once; an existing file is kept)."""
    if cost not in COSTS:
        raise BadRequest("cost", f"unknown cost {cost!r}; one of {', '.join(COSTS)}")
    out = cost_target_path(cost, ftype, directory)
    if out.is_file():
        log(f"{out} exists")
        return out
    return widen(src_path, COSTS[cost][0], out, ftype, log)


def greedy_tokens(path: Path, prompts: list[str], n_tokens: int = 64, threads: int | None = None) -> list[list[int]]:
    """Each prompt's greedy continuation (`n_tokens`, one-token forwards, chat template not
    applied): the text a widened target must share with its source."""
    from edgespec import backend
    from edgespec.config import ModelConfig

    m = backend.Model(path)
    out = []
    try:
        for text in prompts:
            toks = m.tokenize(text)
            ctx = backend.Context(m, ModelConfig(str(path), n_ctx=len(toks) + n_tokens + 8, n_batch=512,
                                                 threads=threads or 0))
            try:
                n = len(toks)
                ctx.decode_rows(toks, list(range(n)), [(0,)] * n, [False] * (n - 1) + [True])
                gen: list[int] = []
                for i in range(n_tokens):
                    t = int(np.argmax(ctx.logits(-1)))
                    gen.append(t)
                    if m.is_eog(t):
                        break
                    ctx.decode_rows([t], [n + i], [(0,)], [True])
                out.append(gen)
            finally:
                ctx.close()
    finally:
        m.close()
    return out


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, int]:
    """(tokens before the first difference, summed over prompts; tokens compared)."""
    same = total = 0
    for x, y in zip(a, b):
        n = min(len(x), len(y))
        k = next((i for i in range(n) if x[i] != y[i]), n)
        same, total = same + k, total + max(len(x), len(y))
    return same, total


def next_token_argmax(path: Path, sequences: list[list[int]], threads: int | None = None) -> list[np.ndarray]:
    """For each token sequence, the model's greedy next token after every prefix (one forward of
    the whole sequence): two models' rows agree where a greedy draft of one would be accepted by
    the other, teacher-forced on the same text."""
    from edgespec import backend
    from edgespec.config import ModelConfig

    m = backend.Model(path)
    out = []
    try:
        for toks in sequences:
            n = len(toks)
            ctx = backend.Context(m, ModelConfig(str(path), n_ctx=n + 8, n_batch=max(512, n), threads=threads or 0))
            try:
                ctx.decode_rows(toks, list(range(n)), [(0,)] * n, [True] * n)
                out.append(np.argmax(ctx.logits_rows(n), axis=1))
            finally:
                ctx.close()
    finally:
        m.close()
    return out
