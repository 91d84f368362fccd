"""GGUF files derived from another without llama.cpp: a vocabulary padded as Qwen's large models
pad theirs.

Qwen2.5's 14B-72B files carry 152,064 tokens and their 0.5B-7B drafts 151,936: the same
tokenizer, the larger matrices padded to a multiple of 128 with unused tokens. `pad_vocab` makes
such a twin of any GGUF: `n_extra` unused tokens ("[PAD0]", ...) appended to the token list, their
embedding rows zero (a zero row of any block type is zero bytes: every block's scale is 0), the
text of every other token unchanged. A tied output matrix gives the pad tokens a logit of exactly
0; an untied one gets zero rows too. Used to check padded pairs (edgespec/pairing.py) and to
measure the tick at 150k-260k vocabularies.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# the tensors whose rows are indexed by token id
_VOCAB_TENSORS = ("token_embd.weight", "output.weight")
# per-token metadata arrays and the value a pad token takes in each
_TOKEN_ARRAYS = {"tokenizer.ggml.token_type": 5, "tokenizer.ggml.scores": -1000.0}  # 5: UNUSED


def pad_vocab(src: str | Path, dst: str | Path, n_extra: int) -> Path:
    """Write `dst`: `src` with `n_extra` unused tokens appended to its vocabulary."""
    import gguf

    if n_extra < 1:
        raise ValueError(f"n_extra must be >= 1, got {n_extra}")
    src, dst = Path(src), Path(dst)
    reader = gguf.GGUFReader(str(src))
    arch_field, tokens_field = reader.get_field(gguf.Keys.General.ARCHITECTURE), reader.get_field("tokenizer.ggml.tokens")
    if arch_field is None or tokens_field is None:
        raise ValueError(f"{src}: not a model GGUF (no general.architecture or tokenizer.ggml.tokens)")
    arch = arch_field.contents()
    n_vocab = len(tokens_field.data)
    tmp = dst.with_name(dst.name + ".part")
    writer = gguf.GGUFWriter(str(tmp), arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == "tokenizer.ggml.tokens":
            value = [*value, *(f"[PAD{i}]" for i in range(n_extra))]
        elif field.name in _TOKEN_ARRAYS:
            value = [*value, *([_TOKEN_ARRAYS[field.name]] * n_extra)]
        elif field.name == f"{arch}.vocab_size":
            value = int(value) + n_extra
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    datas = []
    for t in reader.tensors:
        data = np.asarray(t.data)
        if t.name in _VOCAB_TENSORS and data.shape[0] == n_vocab:
            data = np.concatenate([data, np.zeros((n_extra, *data.shape[1:]), dtype=data.dtype)])
        datas.append(data)
        writer.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for data in datas:
        writer.write_tensor_data(data, tensor_endianess=reader.endianess)
    writer.close()
    tmp.replace(dst)
    return dst
