"""The widened target (edgespec/realistic.py) and the random-shape generator (edgespec/synth.py) on
tiny shapes: zero blocks stay exact zeros through llama.cpp's quantizer, and a widened model's
logits are the source's."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from edgespec.errors import BadRequest
from edgespec.realistic import Widening, check_widening, read_source, widen, widened_tensor
from edgespec.synth import TensorSpec
from tests.tiny_gguf import write_tiny

# the source: n_embd 64, 2 layers, 4 heads over 2 KV heads of 16, FFN 128
WIDE = Widening(n_embd=256, n_layer=3, n_head=12, n_head_kv=4, n_ff=512)  # K-quant rows; 3 heads per KV head
SAME_GROUPS = Widening(n_embd=256, n_layer=3, n_head=8, n_head_kv=4, n_ff=512)  # the source's 2 per KV head


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


def _logits(path: Path, text: str = "the quick brown fox, 12 times over") -> np.ndarray:
    from edgespec import backend
    from edgespec.config import ModelConfig

    m = backend.Model(path)
    ctx = backend.Context(m, ModelConfig(str(path), n_ctx=64, n_batch=64, threads=1))
    try:
        toks = m.tokenize(text)
        n = len(toks)
        ctx.decode_rows(toks, list(range(n)), [[0]] * n, [True] * n)
        return np.array(ctx.logits_rows(n))
    finally:
        ctx.close()
        m.close()


def test_zero_blocks_dequantize_to_exact_zeros(tiny: Path, tmp_path: Path) -> None:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    out = widen(tiny, WIDE, tmp_path / "w.gguf", "q4_k_m")
    src = read_source(tiny)
    types = set()
    for t in GGUFReader(str(out)).tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        got = dequantize(t.data, t.tensor_type).reshape(shape)
        want = widened_tensor(src, WIDE, TensorSpec(t.name, shape, np.float32))
        assert np.all(got[want == 0] == 0), t.name  # every added block is exactly zero
        assert np.count_nonzero(got) > 0 or not np.any(want), t.name
        types.add(t.tensor_type.name)
    assert {"Q4_K", "Q6_K"} <= types  # 256-wide rows: the K-quants a real Q4_K_M file holds


def test_widened_logits_are_the_source_s(tiny: Path, tmp_path: Path) -> None:
    ref = _logits(tiny)
    for i, w in enumerate((WIDE, SAME_GROUPS, replace(WIDE, tied=False))):  # F32: up to the order of the sums
        got = _logits(widen(tiny, w, tmp_path / f"{i}.f32.gguf", "f32"))
        np.testing.assert_allclose(got, ref, atol=1e-4 * np.abs(ref).max())


def test_widened_q8_0_is_bit_for_bit_the_source_q8_0(tiny: Path, tmp_path: Path) -> None:
    """With the source's head grouping every quantized block of the source reappears as it was
    (added blocks are zero and add exact zeros), and the norms' rescaling is a power of two here."""
    from edgespec import backend

    backend.quantize(tiny, tmp_path / "src.q8_0.gguf", "q8_0")
    ref = _logits(tmp_path / "src.q8_0.gguf")
    got = _logits(widen(tiny, SAME_GROUPS, tmp_path / "w.q8_0.gguf", "q8_0"))
    assert np.array_equal(got, ref)


def test_widening_never_narrows(tiny: Path) -> None:
    src = read_source(tiny)
    with pytest.raises(BadRequest, match="n_embd"):
        check_widening(src, Widening(32, 2, 4, 2, 128))
    with pytest.raises(BadRequest, match="n_head"):
        check_widening(src, Widening(64, 2, 4, 4, 128))  # 1 head per KV head: the source has 2


def test_synth_writes_a_loadable_real_shape(tiny: Path, tmp_path: Path) -> None:
    from edgespec import backend
    from edgespec.synth import synth

    out = synth("qwen2.5-0.5b", "q8_0", tmp_path / "q.gguf", layers=1, vocab=300, donor=tiny)
    m = backend.Model(out)
    try:
        assert (m.n_layer, m.n_embd, m.n_vocab) == (1, 896, 300)
        assert backend.model_arch(m) == "qwen2"
    finally:
        m.close()
    with pytest.raises(BadRequest, match="layers"):
        synth("llama3-8b", "q8_0", tmp_path / "x.gguf", layers=33, donor=tiny)
    with pytest.raises(BadRequest, match="shape"):
        synth("llama9-1t", "q8_0", tmp_path / "x.gguf", donor=tiny)


def test_greedy_text_is_shared(tiny: Path, tmp_path: Path) -> None:
    from edgespec.realistic import agreement, greedy_tokens

    prompts = ["hello", "a b c d"]
    ref = greedy_tokens(tiny, prompts, 12, threads=1)
    got = greedy_tokens(widen(tiny, WIDE, tmp_path / "w.f32.gguf", "f32"), prompts, 12, threads=1)
    assert agreement(got, ref) == (sum(map(len, ref)), sum(map(len, ref)))
    assert agreement([[1, 2, 3]], [[1, 5, 3]]) == (1, 3)


@pytest.mark.slow
def test_models_synth_command(demo_pair, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from edgespec.cli.main import app

    out = tmp_path / "s.gguf"
    r = CliRunner().invoke(app, ["models", "synth", "--shape", "qwen2.5-0.5b", "--type", "q8_0", "--layers", "1",
                                 "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert out.is_file() and not list(tmp_path.glob("*.part"))
