"""An EAGLE-3 head's weights as numpy arrays, and the GGUF llama.cpp's `eagle3` loader reads.

A head is one decoder layer. Its input at position P is the target's token embedding of
token[P+1] (the target's own `token_embd`, shared through llama.cpp's ctx_other, never stored
here) and g[P] = fc([f_low, f_mid, f_high] at P), the inputs of three target layers
concatenated. Attention reads [norm(embedding), norm(g)] (2 * n_embd wide); the residual is g.
The lm_head maps to a reduced draft vocabulary; `d2t[i]` is the target token id of draft
token i (absolute ids, as the GGUF stores them; the HF layout stores offsets d2t[i] - i).

Matrices are [out, in] (torch Linear / GGUF row-major), q and k in llama.cpp's rope layout
(pairs adjacent, LLAMA_ROPE_TYPE_NORM); the HF export permutes them to HF's rotate-half layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np

# the eagle3 GGUF's tensor names -> HeadWeights.w keys, in the order write_gguf writes them
GGUF_TENSORS = {"fc.weight": "fc", "blk.0.attn_norm.weight": "attn_norm", "blk.0.attn_norm_2.weight": "hidden_norm",
                "blk.0.attn_q.weight": "wq", "blk.0.attn_k.weight": "wk", "blk.0.attn_v.weight": "wv",
                "blk.0.attn_output.weight": "wo", "blk.0.ffn_norm.weight": "ffn_norm", "blk.0.ffn_gate.weight": "gate",
                "blk.0.ffn_up.weight": "up", "blk.0.ffn_down.weight": "down", "output_norm.weight": "output_norm",
                "output.weight": "lm_head"}

NAMES = ("fc", "attn_norm", "hidden_norm", "wq", "wk", "wv", "wo", "ffn_norm", "gate", "up", "down",
         "output_norm", "lm_head")


@dataclass
class HeadConfig:
    n_embd: int  # the head's width = the target's (it shares the target's embeddings)
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    layers: tuple[int, int, int]  # target layers whose inputs are the features (low, mid, high)
    n_draft_vocab: int
    rope_base: float
    rms_eps: float
    n_ctx_train: int


@dataclass
class HeadWeights:
    cfg: HeadConfig
    w: dict[str, np.ndarray]  # NAMES -> float32 array
    d2t: np.ndarray  # [n_draft_vocab] int64 target token ids

    @classmethod
    def init(cls, cfg: HeadConfig, d2t: np.ndarray, rng: np.random.Generator,
             embed: np.ndarray | None = None) -> HeadWeights:
        """Small random weights (std 0.02, norms 1); with `embed` ([vocab, n_embd], the target's
        tied embeddings) the lm_head starts as the target's rows of the draft vocabulary."""
        e, f, hq, hk = cfg.n_embd, cfg.n_ff, cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim

        def r(*shape: int) -> np.ndarray:
            return (rng.standard_normal(shape) * 0.02).astype(np.float32)

        w = {
            "fc": r(e, 3 * e), "attn_norm": np.ones(e, np.float32), "hidden_norm": np.ones(e, np.float32),
            "wq": r(hq, 2 * e), "wk": r(hk, 2 * e), "wv": r(hk, 2 * e), "wo": r(e, hq),
            "ffn_norm": np.ones(e, np.float32), "gate": r(f, e), "up": r(f, e), "down": r(e, f),
            "output_norm": np.ones(e, np.float32),
            "lm_head": embed[d2t].astype(np.float32).copy() if embed is not None else r(len(d2t), e),
        }
        return cls(cfg, w, np.asarray(d2t, np.int64))

    @property
    def n_params(self) -> int:
        return int(sum(a.size for a in self.w.values()))


def copy_tokenizer(target_gguf: Path, writer, edit=None) -> None:
    """Copy the target's tokenizer.* metadata (a head speaks the target's vocabulary); `edit(key,
    value) -> value` alters it (tests write incompatible heads with it)."""
    import gguf

    reader = gguf.GGUFReader(str(target_gguf))
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        writer.add_key_value(key, edit(key, value) if edit else value, vtype, sub)


def write_gguf(head: HeadWeights, path: Path, target_gguf: Path, dtype: str = "f16",
               name: str = "edgespec EAGLE-3 head", target_hidden: int | None = None, vocab_edit=None) -> Path:
    """Write `head` as an `eagle3` GGUF (matrices in `dtype`: f16 or f32; norms F32; d2t I64)."""
    import gguf

    c = head.cfg
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    wr = gguf.GGUFWriter(str(tmp), arch="eagle3")
    wr.add_name(name)
    wr.add_uint32("eagle3.context_length", c.n_ctx_train)
    wr.add_uint32("eagle3.embedding_length", c.n_embd)
    wr.add_uint32("eagle3.block_count", 1)
    wr.add_uint32("eagle3.feed_forward_length", c.n_ff)
    wr.add_uint32("eagle3.attention.head_count", c.n_head)
    wr.add_uint32("eagle3.attention.head_count_kv", c.n_head_kv)
    wr.add_uint32("eagle3.attention.key_length", c.head_dim)
    wr.add_uint32("eagle3.attention.value_length", c.head_dim)
    wr.add_uint32("eagle3.rope.dimension_count", c.head_dim)
    wr.add_float32("eagle3.rope.freq_base", c.rope_base)
    wr.add_float32("eagle3.attention.layer_norm_rms_epsilon", c.rms_eps)
    wr.add_array("eagle3.target_layers", [int(x) for x in c.layers])
    wr.add_uint32("eagle3.target_hidden_size", target_hidden or c.n_embd)
    wr.add_bool("eagle3.norm_before_residual", False)
    wr.add_bool("eagle3.norm_before_fc", False)
    copy_tokenizer(Path(target_gguf), wr, vocab_edit)
    mat = np.float16 if dtype == "f16" else np.float32
    for tname, key in GGUF_TENSORS.items():
        arr = head.w[key]  # matrices in `dtype`, the norms (vectors) in float32
        wr.add_tensor(tname, np.ascontiguousarray(arr, dtype=mat if arr.ndim == 2 else np.float32))
    wr.add_tensor("d2t", np.ascontiguousarray(head.d2t, dtype=np.int64))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    tmp.replace(path)
    return path


def config_for_target(target_gguf: Path, n_draft_vocab: int, n_ff: int | None = None,
                      layers: tuple[int, int, int] | None = None) -> HeadConfig:
    """A head shaped after the target's hyperparameters (read from its GGUF). The default layers
    are EAGLE-3's: 2, n_layer // 2, n_layer - 3."""
    import gguf

    r = gguf.GGUFReader(str(target_gguf))
    arch = r.fields["general.architecture"].contents()

    def get(key: str, default=None):
        f = r.fields.get(f"{arch}.{key}")
        return f.contents() if f is not None else default

    n_layer = int(get("block_count"))
    e, nh = int(get("embedding_length")), int(get("attention.head_count"))
    return HeadConfig(
        n_embd=e, n_ff=int(n_ff or get("feed_forward_length")), n_head=nh,
        n_head_kv=int(get("attention.head_count_kv", nh)), head_dim=int(get("rope.dimension_count", e // nh)),
        layers=layers or (2, n_layer // 2, n_layer - 3), n_draft_vocab=int(n_draft_vocab),
        rope_base=float(get("rope.freq_base", 10000.0)), rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        n_ctx_train=int(get("context_length", 4096)),
    )


def read_gguf(path: Path) -> HeadWeights:
    """The head `write_gguf` wrote (matrices back to float32): what `train-head --init` starts
    from. Raises ValueError for a GGUF that is not an `eagle3` head or lacks a tensor."""
    import gguf

    r = gguf.GGUFReader(str(path))
    arch = r.fields.get("general.architecture")
    if arch is None or arch.contents() != "eagle3":
        raise ValueError(f"{path}: not an EAGLE-3 head (general.architecture is "
                         f"{arch.contents() if arch is not None else 'missing'}, expected eagle3)")

    def get(key: str):
        return r.fields[f"eagle3.{key}"].contents()

    tensors = {t.name: np.asarray(t.data) for t in r.tensors}
    missing = [n for n in (*GGUF_TENSORS, "d2t") if n not in tensors]
    if missing:
        raise ValueError(f"{path}: the head lacks tensors {', '.join(missing)}")
    w = {key: tensors[name].astype(np.float32) for name, key in GGUF_TENSORS.items()}
    d2t = tensors["d2t"].astype(np.int64)
    cfg = HeadConfig(
        n_embd=int(get("embedding_length")), n_ff=int(get("feed_forward_length")), n_head=int(get("attention.head_count")),
        n_head_kv=int(get("attention.head_count_kv")), head_dim=int(get("attention.key_length")),
        layers=cast(tuple[int, int, int], tuple(int(x) for x in get("target_layers"))), n_draft_vocab=len(d2t),
        rope_base=float(get("rope.freq_base")), rms_eps=float(get("attention.layer_norm_rms_epsilon")),
        n_ctx_train=int(get("context_length")))
    return HeadWeights(cfg, w, d2t)
