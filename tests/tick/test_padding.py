"""Padded forwards (`[speculation] pad_forwards`, backend.Context): every target and draft-model
forward handed to llama.cpp holds one of the fixed widths (controller/widths.py), the extra tokens
inert in the context's scratch sequence and removed after the forward.

On the demo pair (CPU, the batch-invariant patch) padding must change no bit: greedy output at one
and at several streams, and seeded sampling, equal an engine that does not pad; the forwards'
widths are all in the fixed set; the scratch cells never outlive their forward (every session's
cells are checked after every tick) and each slot keeps the same cells as without padding. The fast tier checks the setting and the pricing."""

from __future__ import annotations

import pytest

from edgespec.config import EngineConfig, ModelConfig
from edgespec.controller import CostModel
from edgespec.controller.widths import WIDTHS
from edgespec.sampling import SamplingParams
from edgespec.settings import setting
from edgespec.types import GenerationRequest, SpeculationParams

PROMPTS = [
    ("Write a Python function that checks whether a number is prime.", "auto"),
    ("List five tips for writing clean code.", "tree"),
    ("Continue this contract clause: The Licensee shall not sublicense, assign or transfer", "chain"),
]
MAX_TOKENS = 8


def test_auto_pads_on_a_gpu_only_and_the_setting_names_itself() -> None:
    cfg = EngineConfig(ModelConfig(path="t.gguf"), None)
    assert cfg.pad_forwards == "auto"
    assert cfg.pads_forwards(gpu=True) and not cfg.pads_forwards(gpu=False)
    assert EngineConfig(ModelConfig(path="t.gguf"), None, pad_forwards=True).pads_forwards(gpu=False)
    assert not EngineConfig(ModelConfig(path="t.gguf"), None, pad_forwards=False).pads_forwards(gpu=True)
    s = setting("speculation", "pad_forwards")
    assert s.problem("auto") is None and s.problem(True) is None and s.problem(False) is None
    assert "auto, true, false" in (s.problem("yes") or "")
    with pytest.raises(Exception, match=r"speculation\.pad_forwards"):
        EngineConfig(ModelConfig(path="t.gguf"), None, pad_forwards="yes").validate()


def test_a_padding_cost_model_prices_every_forward_at_a_fixed_width() -> None:
    cost = CostModel()
    unpadded = [cost.pad_to(n) for n in range(1, 65)]
    cost.widths = WIDTHS
    padded = [cost.pad_to(n) for n in range(1, 65)]
    assert all(w in WIDTHS and w >= n for n, w in zip(range(1, 65), padded))
    assert any(w not in WIDTHS for w in unpadded)  # without padding a forward keeps its own width
    assert cost.pad_to(65) == 65  # beyond the widest: unpadded
    assert cost.drafting("draft").at(100).pad_to(5) in WIDTHS  # the controller's views price alike


def test_off_a_forward_is_padded_only_where_a_wider_measured_width_costs_less() -> None:
    """pad_forwards off (a CPU's auto): no fixed widths, but a context still pads 2-3 tokens up to
    the 4 a repacked 4-column kernel runs cheaper, and the cost model files those forwards there;
    on a curve that grows with n nothing is padded. An EAGLE-3 head's context is never padded."""
    from types import SimpleNamespace

    from edgespec.engine import pad_forwards

    repacked = CostModel.from_tables({1: 0.10, 2: 0.16, 3: 0.19, 4: 0.13, 8: 0.26}, {1: 0.015, 2: 0.03, 4: 0.02})
    target, draft = SimpleNamespace(pad_width=None), SimpleNamespace(pad_width=None)
    cfg = EngineConfig(ModelConfig(path="t.gguf"), None, pad_forwards=False)
    cost = pad_forwards(repacked, (target, draft), cfg)  # type: ignore[arg-type]  # pad_width is all it reads
    assert cost.widths is None and cost.padded == {"target", "draft"}
    assert [target.pad_width(n) for n in (1, 2, 3, 4, 5, 8)] == [1, 4, 4, 4, 5, 8]
    assert draft.pad_width(2) == 4 and draft.pad_width(1) == 1
    rising = pad_forwards(CostModel(), (target,), cfg)  # type: ignore[arg-type]
    assert all(target.pad_width(n) == n for n in range(1, 17)) and rising.padded == {"target"}


# ---- the demo pair ---------------------------------------------------------------------------


def _load(demo_pair, pad: bool):
    from edgespec.engine import Engine

    cfg = EngineConfig(ModelConfig(str(demo_pair.target), n_ctx=512, n_batch=256),
                       ModelConfig(str(demo_pair.draft), n_ctx=512, n_batch=256), parallel=3,
                       suffix_cache=False, prompt_cache_bytes=0, pad_forwards=pad)
    return Engine.load(cfg, calibrate=False)


@pytest.fixture(scope="module")
def pair(demo_pair):
    padded, plain = _load(demo_pair, True), _load(demo_pair, False)
    yield padded, plain
    padded.close()
    plain.close()


def _req(toks, mode, **sampling) -> GenerationRequest:
    return GenerationRequest(tuple(toks), SamplingParams(max_tokens=MAX_TOKENS, **sampling),
                             SpeculationParams(mode=mode, draft_tokens=3))


def _together(engine, jobs) -> list[list[int]]:
    """Every job [(prompt tokens, mode)] decoded at once, one session per slot, through shared ticks."""
    sess = [engine.open_session(_req(t, m)) for t, m in jobs]
    for s in sess:
        s.check_kv = True  # the KV invariants after every tick
    live = list(sess)
    while live:
        engine.tick(live)
        live = [s for s in live if not s.done]
    out = [list(s.out) for s in sess]
    for s in sess:
        s.close()
    return out


def _kept(engine) -> list[tuple[int, bytes]]:
    """Each slot's kept cells (its prefill, reused by the next prompt that shares it), as bytes."""
    return [(slot.target.cells(), slot.target.seq_state()) for slot in engine.slots]


def _scratch_empty(ctx) -> bool:
    return ctx.pos_max(ctx.scratch_seq) == -1 and ctx.pos_min(ctx.scratch_seq) == -1


@pytest.mark.slow
def test_padded_forwards_change_no_token_at_one_and_several_streams(pair):
    padded, plain = pair
    assert padded.model_info()["pad_forwards"] and not plain.model_info()["pad_forwards"]
    jobs = [(padded.encode_chat([("user", p)]), m) for p, m in PROMPTS]
    tctx, dctx = padded.target_ctx, padded.draft_ctx
    for ctx in (tctx, dctx):
        ctx.forward_widths.clear()
        ctx.padded_tokens = 0
    alone = padded.generate(_req(*jobs[0])).token_ids
    assert alone == plain.generate(_req(*jobs[0])).token_ids
    together, kept = _together(padded, jobs), _kept(padded)
    assert together == _together(plain, jobs)
    assert together[0] == list(alone)
    # the scratch cells never outlive their forward: each slot keeps what it keeps unpadded, bit for bit
    assert kept == _kept(plain) and all(n > 0 for n, _ in kept)
    for ctx in (tctx, dctx):
        # every forward the fixed set can hold ran at one of its widths (a prompt of < 64 tokens
        # too); wider ones (three prompts read in one forward) at their own
        assert ctx.forward_widths and all(w in WIDTHS for w in ctx.forward_widths if w <= max(WIDTHS)), \
            ctx.forward_widths
        assert ctx.padded_tokens > 0 and _scratch_empty(ctx)
    assert not plain.target_ctx.padded_tokens and any(w not in WIDTHS for w in plain.target_ctx.forward_widths)


@pytest.mark.slow
def test_seeded_sampling_is_unchanged_by_padding(pair):
    """At temperature 0.8 with one seed and a fixed chain, the padded engine samples what the
    unpadded one does: the same logits, bit for bit, and the same random draws."""
    toks = pair[0].encode_chat([("user", PROMPTS[1][0])])
    got = [eng.generate(_req(toks, "chain", temperature=0.8, seed=7)).token_ids for eng in pair]
    assert got[0] == got[1] and len(got[0]) == MAX_TOKENS
