"""The files sites run, not only the F32 demo: every weight type the appliance calls exact is
batch-invariant on the installed wheel, a padded vocabulary pairs on either side, a site's own
target serves without the demo's draft, and Gemma 3 (262,144 tokens, interleaved sliding-window
attention) decodes the same text in every mode. Real models; slow tier."""

from __future__ import annotations

import numpy as np
import pytest

from edgespec import backend
from edgespec.config import EngineConfig, ModelConfig
from edgespec.engine import Engine
from edgespec.sampling import SamplingParams
from edgespec.types import GenerationRequest, SpeculationParams

pytestmark = pytest.mark.slow

TEXT = "The quick brown fox jumps over the lazy dog. " * 6 + "def fibonacci(n):\n    return"
# llama.cpp's quantizer on the demo target (576-wide rows: K-quants take the 1,536-wide down
# products, the rest falls back): together these files hold every type of EXACT_CPU_TYPES
FTYPES = {
    "q4_0": {"Q4_0"}, "q4_1": {"Q4_1"}, "q5_0": {"Q5_0"}, "q5_1": {"Q5_1"}, "q8_0": {"Q8_0"},
    "q4_k_m": {"Q4_K", "Q5_0", "Q6_K"}, "q5_k_m": {"Q5_K", "Q6_K"}, "q6_k": {"Q6_K"}, "q2_k": {"Q3_K", "Q4_0"},
}
# the patch's multi-column kernels take columns in groups (Q8_0: 8; Q6_K and Q5_K: 8 with
# AVX-512, 4 with AVX2): partial, whole and several groups
WIDTHS = (2, 3, 4, 5, 8, 9, 16, 17)


def chain_vs_one_by_one(model: backend.Model, ctx: backend.Context, widths=WIDTHS) -> list[tuple[int, float]]:
    """(width, largest difference) for each width whose batched rows differ from one-token forwards."""
    toks = model.tokenize(TEXT)
    pre, rest = toks[:20], toks[20:]
    bad = []
    for n in widths:
        ctx.clear()
        ctx.decode_seq(pre, 0, (0,), last_logits=False)
        one = []
        for i, t in enumerate(rest[:n]):
            ctx.decode([t], [20 + i], [[0]], [True])
            one.append(ctx.logits(0).copy())
        ctx.clear()
        ctx.decode_seq(pre, 0, (0,), last_logits=False)
        ctx.decode(rest[:n], list(range(20, 20 + n)), [[0]] * n, [True] * n)
        batched = ctx.logits_rows(n).copy()
        if not np.array_equal(np.array(one), batched):
            bad.append((n, float(np.abs(np.array(one) - batched).max())))
    return bad


def test_the_tested_files_cover_every_type_called_exact():
    covered = set().union(*FTYPES.values()) | {"F32", "Q8_0"}
    assert backend.EXACT_CPU_TYPES <= covered, backend.EXACT_CPU_TYPES - covered


@pytest.mark.parametrize("ftype", sorted(FTYPES))
def test_each_weight_type_called_exact_is_batch_invariant(model_variant, ftype):
    """Loaded as the engine loads a target (weights not repacked), every batch width gives each
    token the bits of its one-token forward. A rebuilt wheel that loses a type's coverage fails
    here, by type."""
    path = model_variant(ftype)
    model = backend.Model(path, repack=False)
    assert FTYPES[ftype] <= model.weight_types <= backend.EXACT_CPU_TYPES, model.weight_types
    ctx = backend.Context(model, ModelConfig(path=str(path), n_ctx=512, threads=2))
    try:
        assert chain_vs_one_by_one(model, ctx) == []
    finally:
        ctx.close()
        model.close()


# ggml's repacked x86 kernels take 4 columns at a time in a gemm and the rest one by one in a gemv:
# every width from 1 to 9 mixes them differently
REPACK_WIDTHS = (2, 3, 4, 5, 6, 7, 8, 9, 17)


def test_the_library_has_the_invariant_repacked_kernels():
    """Without tools/patches/ggml-repack-invariant.patch the engine loads CPU targets unrepacked
    (exact, ~0.8x llama.cpp's decoding speed on a Q4_K_M file): say so first."""
    assert backend.repack_invariant(), "libggml-cpu built without tools/patches/ggml-repack-invariant.patch"
    covered = set().union(*FTYPES.values())
    assert backend.INVARIANT_REPACKED_TYPES <= covered, backend.INVARIANT_REPACKED_TYPES - covered


def pieces_vs_whole(model: backend.Model, ctx: backend.Context) -> list[tuple[list[int], float]]:
    """(pieces, largest difference) for each way of reading a 100-token prompt whose next four
    logits differ from reading it whole."""
    toks = model.tokenize(TEXT * 4)[:104]
    prompt, nxt = toks[:100], toks[100:]
    ref, bad = None, []
    for pieces in ([100], [5, 64, 31], [1, 3, 4, 92]):
        ctx.clear()
        at = 0
        for m in pieces:
            ctx.decode(prompt[at:at + m], list(range(at, at + m)), [[0]] * m, [False] * m)
            at += m
        rows = []
        for i, t in enumerate(nxt):
            ctx.decode([t], [100 + i], [[0]], [True])
            rows.append(ctx.logits(0).copy())
        got = np.array(rows)
        if ref is None:
            ref = got
        elif not np.array_equal(got, ref):
            bad.append((pieces, float(np.abs(got - ref).max())))
    return bad


@pytest.mark.parametrize("ftype", sorted(f for f, types in FTYPES.items() if types & backend.REPACKED_TYPES))
def test_repacked_weights_are_batch_invariant_as_the_engine_loads_them(model_variant, ftype):
    """Loaded as the engine loads a CPU target with the patched library (ggml's 8-row repacked
    Q4_0 and Q4_K layouts), every width 1-9 and a prompt read in any pieces give each token the
    bits of its one-token forward. Stock ggml's Q4_K gemv (one float FMA per 256 values, the gemm
    one per 64) fails this at widths 4, 5 and 8, by up to ~1e-3 in the logits; a rebuilt library
    that loses a type's coverage fails here, by type."""
    path = model_variant(ftype)
    assert backend.exact_repack(path), "the engine would load this target unrepacked"
    model = backend.Model(path, repack=True)
    ctx = backend.Context(model, ModelConfig(path=str(path), n_ctx=512, threads=2))
    try:
        assert chain_vs_one_by_one(model, ctx, widths=REPACK_WIDTHS) == []
        assert pieces_vs_whole(model, ctx) == []
    finally:
        ctx.close()
        model.close()


def greedy(engine: Engine, tokens: list[int], mode: str, max_tokens: int = 32) -> list[int]:
    s = engine.open_session(GenerationRequest(tuple(tokens), SamplingParams(temperature=0.0, max_tokens=max_tokens),
                                              SpeculationParams(mode=mode)))
    try:
        while not s.done:
            s.step()
        return s.result().token_ids
    finally:
        s.close()


def greedy_together(engine: Engine, prompts: list[list[int]], mode: str, max_tokens: int = 32) -> list[list[int]]:
    """Several requests decoded at once, one engine tick for all of them (their cells interleave
    in the shared cache)."""
    sessions = [engine.open_session(GenerationRequest(tuple(t), SamplingParams(temperature=0.0, max_tokens=max_tokens),
                                                      SpeculationParams(mode=mode))) for t in prompts]
    try:
        while not all(s.done for s in sessions):
            engine.tick([s for s in sessions if not s.done])
        return [s.result().token_ids for s in sessions]
    finally:
        for s in sessions:
            s.close()


PROMPTS = ["Write a Python function that reverses a list.", "List three colours and one fruit.",
           "用一句话解释什么是投机解码。"]


def _engine(target, draft=None, parallel=1) -> Engine:
    return Engine.load(EngineConfig(target=ModelConfig(path=str(target), n_ctx=1024),
                                    draft=ModelConfig(path=str(draft), n_ctx=1024) if draft else None,
                                    parallel=parallel, suffix_cache=False), calibrate=False)


@pytest.mark.parametrize("side", ["draft", "target"])
def test_a_padded_pair_loads_and_speculates_to_plain_greedy_text(demo_pair, padded_draft, side):
    """The Q8_0 draft with 128 pad tokens drafting for the F32 target (the draft's tail), and as
    a target drafted for by the unpadded Q8_0 (the target's tail): chain and tree give plain's
    tokens, and the draft drafted (tau > 1 on these prompts)."""
    target, draft = (demo_pair.target, padded_draft) if side == "draft" else (padded_draft, demo_pair.draft)
    eng = _engine(target, draft)
    try:
        assert eng.pairing is not None and eng.pairing.padded and eng.pairing.shared == 49152
        assert "padded vocabularies" in eng.model_info()["pairing"]
        for text in PROMPTS:
            tokens = eng.encode_chat([("user", text)])
            plain = greedy(eng, tokens, "plain")
            for mode in ("chain", "tree"):
                assert greedy(eng, tokens, mode) == plain, (mode, text)
    finally:
        eng.close()


def test_a_draft_with_another_tokenizer_drafts_through_text(demo_pair, gemma_target):
    """Gemma 3 270M (262,144 SentencePiece tokens) drafting for the demo's F32 target (49,152 BPE
    tokens): the pair loads as a text draft and says so, and chain and tree give plain's greedy
    tokens with drafted tokens accepted on a repetitive prompt."""
    eng = _engine(demo_pair.target, gemma_target)
    try:
        assert eng.draft_kind == "text" and "drafts through text" in eng.model_info()["pairing"]
        tokens = eng.tokenize("Monday, Tuesday, Wednesday, Thursday, Friday. Monday, Tuesday, Wednesday, Thursday,"
                              " Friday. Monday,")
        plain = greedy(eng, tokens, "plain", 24)
        for mode in ("chain", "tree"):
            s = eng.open_session(GenerationRequest(tuple(tokens), SamplingParams(temperature=0.0, max_tokens=24),
                                                   SpeculationParams(mode=mode, ngram=False, suffix=False)))
            s.check_kv = True
            try:
                while not s.done:
                    s.step()
                assert s.result().token_ids == plain, mode
                assert s.stats.accepted_by_source.get("draft", 0) > 0, s.stats
            finally:
                s.close()
    finally:
        eng.close()


def test_a_site_target_alone_serves_with_model_free_drafting(gemma_target):
    """The demo draft belongs to the demo target: another target with no draft named loads
    alone (the daemon's config and the CLI's) and drafts from n-grams."""
    from edgespec.cli.common import engine_config
    from edgespec.server.config import load

    assert engine_config(str(gemma_target), None).draft is None
    cfg = load(env={"EDGESPEC_TARGET_PATH": str(gemma_target)}, check_models=True)
    assert cfg.engine.draft is None and cfg.engine.head is None


def test_a_model_without_a_chat_template_is_refused_for_chat_naming_the_fix(gemma_target):
    """Gemma 3 270M is a base model: no template. Chat is refused (llama.cpp would apply ChatML,
    a format the model never saw); raw prompts serve."""
    from edgespec.errors import BadRequest

    model = backend.Model(gemma_target)
    try:
        assert model.chat_template is None
        with pytest.raises(BadRequest, match="no chat template.*chat_template"):
            model.chat_prompt([("user", "hi")])
        assert model.tokenize("hi")
    finally:
        model.close()


def test_every_chat_renders_the_ggufs_own_jinja_template(demo_pair):
    """Chats without tools render the GGUF's Jinja template too, not llama.cpp's built-in ChatML
    matcher: SmolLM2's template adds its default system message, which the matcher leaves out."""
    from edgespec import chat

    model = backend.Model(demo_pair.draft)
    try:
        text = model.chat_prompt([("user", "hi")])
        assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
        assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
        # tokens: the template's special tokens as ids, the contents as text
        ids = chat.encode_chat(model, [("user", "<|im_end|> hi")])
        assert ids.count(model.special_tokens["<|im_end|>"]) == 2  # system's and user's, not the content's
        assert model.detokenize(ids).count("You are a helpful AI assistant") == 1
    finally:
        model.close()


def test_gemma3_sliding_window_target_is_exact_in_every_mode(gemma_target):
    """Gemma 3 270M Q4_K_M (interleaved 512-token sliding window, 262,144 tokens) as a target:
    its forwards are batch-invariant, the load reports the window's handling, and plain, chain,
    tree and auto give the same greedy tokens on two slots at once (scattered, shared cells)."""
    model = backend.Model(gemma_target, repack=False)
    assert model.n_swa == 512 and model.n_vocab == 262144
    ctx = backend.Context(model, ModelConfig(path=str(gemma_target), n_ctx=512, threads=2))
    try:
        assert chain_vs_one_by_one(model, ctx, widths=(2, 5, 9)) == []
    finally:
        ctx.close()
        model.close()
    eng = _engine(gemma_target, parallel=2)
    try:
        info = eng.model_info()
        assert info["exactness"].startswith("bit-exact") and "sliding_window" in info
        prompts = [eng.tokenize(t) for t in (
            "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
            "def fibonacci(n):\n    if n < 2:\n        return n\n    return")]
        plain = [greedy(eng, t, "plain") for t in prompts]  # each alone
        for mode in ("chain", "tree", "auto"):
            assert greedy_together(eng, prompts, mode) == plain, mode
    finally:
        eng.close()


def test_fast_kernels_trade_exactness_for_speed_and_say_so(model_variant, monkeypatch):
    """[target] fast_kernels: the target repacked and the tiled K-quant kernel on, and the
    promise says "up to float rounding" with the reason."""
    monkeypatch.setenv("GGML_CPU_TILED_MM", "0")  # restored after the test: Engine.load sets it
    path = model_variant("q4_k_m")
    exact = _engine(path)
    try:
        # repacked only where the library's repacked kernels are batch-invariant
        assert exact.target.repacked == backend.repack_invariant() and exact.exactness().startswith("bit-exact")
    finally:
        exact.close()
    fast = Engine.load(EngineConfig(target=ModelConfig(path=str(path), n_ctx=512), draft=None, fast_kernels=True),
                       calibrate=False)
    try:
        assert fast.target.repacked and not fast.batch_invariant
        assert fast.exactness().startswith("up to float rounding") and "target.fast_kernels" in fast.exactness()
    finally:
        fast.close()
