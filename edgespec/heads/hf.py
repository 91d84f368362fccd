"""The public EAGLE-3 HF layout (config.json + model.safetensors), as published EAGLE-3
checkpoints are laid out and as llama.cpp's convert_hf_to_gguf.py reads them (with
`--target-model-dir` naming the target's HF directory).

Differences from the GGUF: names (`midlayer.*`, `norm`, `lm_head`), q/k in HF's rotate-half
layout (the converter permutes them back to llama.cpp's), and d2t as offsets
(target id = i + d2t[i]); `t2d` marks which target tokens are in the draft vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from edgespec.heads.weights import HeadConfig, HeadWeights


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half rows -> llama.cpp adjacent pairs (convert_hf_to_gguf's LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of `permute`: llama.cpp layout -> HF layout."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_config(c: HeadConfig, target_vocab: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": c.n_embd,
        "intermediate_size": c.n_ff,
        "num_attention_heads": c.n_head,
        "num_key_value_heads": c.n_head_kv,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_eps,
        "rope_theta": c.rope_base,
        "max_position_embeddings": c.n_ctx_train,
        "vocab_size": target_vocab,
        "draft_vocab_size": c.n_draft_vocab,
        "target_hidden_size": c.n_embd,
        "eagle_aux_hidden_state_layer_ids": list(c.layers),
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def write_hf(head: HeadWeights, out_dir: Path, target_vocab: int) -> Path:
    from safetensors.numpy import save_file

    c, w = head.cfg, head.w
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t2d = np.zeros(target_vocab, bool)
    t2d[head.d2t] = True
    tensors = {
        "fc.weight": w["fc"],
        "midlayer.input_layernorm.weight": w["attn_norm"],
        "midlayer.hidden_norm.weight": w["hidden_norm"],
        "midlayer.self_attn.q_proj.weight": unpermute(w["wq"], c.n_head),
        "midlayer.self_attn.k_proj.weight": unpermute(w["wk"], c.n_head_kv),
        "midlayer.self_attn.v_proj.weight": w["wv"],
        "midlayer.self_attn.o_proj.weight": w["wo"],
        "midlayer.post_attention_layernorm.weight": w["ffn_norm"],
        "midlayer.mlp.gate_proj.weight": w["gate"],
        "midlayer.mlp.up_proj.weight": w["up"],
        "midlayer.mlp.down_proj.weight": w["down"],
        "norm.weight": w["output_norm"],
        "lm_head.weight": w["lm_head"],
        "d2t": (head.d2t - np.arange(len(head.d2t))).astype(np.int64),
        "t2d": t2d,
    }
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(hf_config(c, target_vocab), indent=2) + "\n")
    return out_dir


def read_hf(hf_dir: Path) -> HeadWeights:
    """Read the HF layout back (what a converter sees), into llama.cpp's layout."""
    from safetensors.numpy import load_file

    hf_dir = Path(hf_dir)
    cfg = json.loads((hf_dir / "config.json").read_text())
    t = load_file(str(hf_dir / "model.safetensors"))
    c = HeadConfig(n_embd=cfg["hidden_size"], n_ff=cfg["intermediate_size"], n_head=cfg["num_attention_heads"],
                   n_head_kv=cfg["num_key_value_heads"], head_dim=cfg["head_dim"],
                   layers=tuple(cfg["eagle_aux_hidden_state_layer_ids"]), n_draft_vocab=cfg["draft_vocab_size"],
                   rope_base=cfg["rope_theta"], rms_eps=cfg["rms_norm_eps"], n_ctx_train=cfg["max_position_embeddings"])
    w = {
        "fc": t["fc.weight"], "attn_norm": t["midlayer.input_layernorm.weight"],
        "hidden_norm": t["midlayer.hidden_norm.weight"],
        "wq": permute(t["midlayer.self_attn.q_proj.weight"], c.n_head),
        "wk": permute(t["midlayer.self_attn.k_proj.weight"], c.n_head_kv),
        "wv": t["midlayer.self_attn.v_proj.weight"], "wo": t["midlayer.self_attn.o_proj.weight"],
        "ffn_norm": t["midlayer.post_attention_layernorm.weight"], "gate": t["midlayer.mlp.gate_proj.weight"],
        "up": t["midlayer.mlp.up_proj.weight"], "down": t["midlayer.mlp.down_proj.weight"],
        "output_norm": t["norm.weight"], "lm_head": t["lm_head.weight"],
    }
    d2t = t["d2t"] + np.arange(len(t["d2t"]))
    return HeadWeights(c, w, d2t.astype(np.int64))
