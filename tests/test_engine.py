"""End to end on the demo pair (F32 target, Q8_0 draft): exactness, KV invariants, stopping."""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest

from edgespec.errors import BadRequest, Overloaded
from edgespec.sampling import SamplingParams
from edgespec.types import GenerationRequest, SpeculationParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Write a JavaScript function that reverses a string.",
    "Write a SQL query that returns the ten most recent orders with their customer names.",
    'Extract the person, company and date as JSON from: "On 3 March 2021, Alice Smith joined Initech as CTO."',
    'Return a JSON object with keys "city" and "country" for: Paris is the capital of France.',
    "Continue this contract clause: The Licensee shall not sublicense, assign or transfer",
    "Explain the difference between a list and a tuple in Python.",
    "Context: The Eiffel Tower was completed in 1889 and is 330 metres tall. Question: When was the Eiffel Tower completed?",
    "Write a Python class for a stack with push, pop and peek methods.",
    "List five tips for writing clean code.",
    "Write a bash script that counts the lines of every .py file in a directory.",
    "Write a Python function that merges two sorted lists, with a docstring and an example.",
    "Explain step by step how a hash map works.",
]


def run(engine, prompt_tokens, mode, check_kv=True, **sampling):
    sampling.setdefault("max_tokens", 96)
    req = GenerationRequest(tuple(prompt_tokens), SamplingParams(**sampling), SpeculationParams(mode=mode))
    sess = engine.open_session(req)
    sess.check_kv = check_kv
    try:
        while not sess.done:
            sess.step()  # KV invariants asserted after every step
        return sess.result()
    finally:
        sess.close()


@contextlib.contextmanager
def changed_config(engine, **changes):
    """The engine's EngineConfig with `changes`, for the block's duration."""
    saved = engine.cfg
    engine.cfg = dataclasses.replace(saved, **changes)
    try:
        yield
    finally:
        engine.cfg = saved


@pytest.fixture(scope="module")
def greedy(engine):
    """greedy(prompt, mode) -> the greedy result at 96 tokens, run once per module: the plain run
    every mode is compared with, and the chain and tree runs the tau comparison reads, are shared
    by the tests below instead of being decoded again by each (KV invariants checked every step).
    `prompt`: the user's message, or a tuple of (role, content) messages. Greedy plain decoding
    at max_tokens n is the first n tokens of this run (it ends at n, or at the same EOS)."""
    done: dict[tuple[str | tuple[tuple[str, str], ...], str], object] = {}

    def result(prompt: str | tuple[tuple[str, str], ...], mode: str):
        if (prompt, mode) not in done:
            messages = [("user", prompt)] if isinstance(prompt, str) else list(prompt)
            done[prompt, mode] = run(engine, engine.encode_chat(messages), mode)
        return done[prompt, mode]

    return result


@pytest.mark.parametrize("mode", ["chain", "tree", "auto"])
def test_greedy_equals_plain_token_for_token(greedy, mode):
    taus, full_length = [], 0
    for prompt in PROMPTS:
        plain = greedy(prompt, "plain")
        spec = greedy(prompt, mode)
        assert len(plain.token_ids) >= 16  # the shortest, a two-key JSON object, is 18 tokens
        full_length += len(plain.token_ids) >= 96
        # batch-invariant forwards (tools/patches/): equal token for token, no near-tie allowance
        assert spec.token_ids == plain.token_ids, f"{mode} diverged from plain: {prompt}"
        assert spec.text == plain.text and spec.finish_reason == plain.finish_reason
        assert spec.stats.target_forwards <= plain.stats.target_forwards
        taus.append(spec.stats.tau)
    assert full_length >= 10  # at least 10 prompts compared over >= 96 tokens
    if mode == "tree":
        assert np.mean(taus) > 2.5, taus


def test_greedy_chain_is_bit_exact(engine, greedy):
    """With the patched ggml (tools/patches/) a chain's verification forward computes what
    one-token forwards compute, bit for bit, and its cells sit where plain decoding puts them:
    greedy chain output equals plain output, with no near-tie allowance: the draft model alone (no
    prompt lookups) through engine.generate, on four prompts of four kinds (the step loop's chain
    with lookups is compared on all of them above)."""
    for prompt in (PROMPTS[0], PROMPTS[3], PROMPTS[5], PROMPTS[7]):
        toks = engine.encode_chat([("user", prompt)])
        plain = greedy(prompt, "plain")
        req = GenerationRequest(tuple(toks), SamplingParams(max_tokens=96),
                                SpeculationParams(mode="chain", ngram=False))
        spec = engine.generate(req)
        assert spec.stats.accepted_tokens > 0
        assert spec.token_ids == plain.token_ids, prompt
        # the time split the bench reports: plain spends nothing in the draft
        for st in (plain.stats, spec.stats):
            assert 0 < st.target_seconds and st.target_seconds + st.draft_seconds <= st.seconds
        assert plain.stats.draft_seconds == 0 < spec.stats.draft_seconds


def test_tree_tau_beats_chain_tau(greedy):
    chain_f = tree_f = 0
    for prompt in PROMPTS[:6]:
        chain_f += greedy(prompt, "chain").stats.target_forwards
        tree_f += greedy(prompt, "tree").stats.target_forwards
    assert chain_f / tree_f >= 1.2, (chain_f, tree_f)  # 1.25-1.35 measured on the demo pair


def test_max_tokens_inside_an_accepted_run(engine, greedy):
    toks = engine.encode_chat([("user", PROMPTS[0])])
    plain = greedy(PROMPTS[0], "plain")  # 96 tokens: n of them are plain's at max_tokens n
    assert plain.finish_reason == "length"
    for n in (1, 2, 7, 13):
        res = run(engine, toks, "tree", max_tokens=n)
        assert res.token_ids == plain.token_ids[:n]
        assert res.finish_reason == "length"
        assert res.text == engine.detokenize(plain.token_ids[:n])


def test_stop_string_spanning_tokens(engine, greedy):
    toks = engine.encode_chat([("user", PROMPTS[0])])
    plain_ids = greedy(PROMPTS[0], "plain").token_ids[:60]  # plain's 60 tokens, without a stop string
    text = engine.detokenize(plain_ids)
    # a stop string covering parts of several tokens, from the middle of the answer
    pieces = [engine.target.piece(t).decode(errors="replace") for t in plain_ids]
    start = len("".join(pieces[:20])) + 1
    stop = text[start:start + 9]
    assert len(stop) == 9 and stop.strip()
    results = {m: run(engine, toks, m, max_tokens=60, stop=(stop,)) for m in ("plain", "chain", "tree")}
    first = text.find(stop)
    for m, r in results.items():
        assert r.finish_reason == "stop", m
        assert r.text == text[:first], m
        assert r.token_ids == results["plain"].token_ids, m


def test_eos_ends_exactly_like_plain(engine):
    toks = engine.encode_chat([("user", "Reply with the single word: yes")])
    plain = run(engine, toks, "plain", max_tokens=200)
    assert plain.finish_reason == "eos"
    for m in ("chain", "tree", "auto"):
        r = run(engine, toks, m, max_tokens=200)
        assert r.finish_reason == "eos" and r.token_ids == plain.token_ids and r.text == plain.text


def test_ignore_eos_runs_to_max_tokens_exactly_like_plain(engine):
    """ignore_eos bans the end-of-generation tokens: the answer that ended after a few tokens runs
    to max_tokens, the same tokens up to where EOS came; speculation equals plain decoding."""
    toks = engine.encode_chat([("user", "What is the capital of France?")])
    ended = run(engine, toks, "plain", max_tokens=24)
    assert ended.finish_reason == "eos" and len(ended.token_ids) < 12  # "The capital of France is Paris."
    plain = run(engine, toks, "plain", max_tokens=24, ignore_eos=True)
    assert plain.finish_reason == "length" and len(plain.token_ids) == 24
    assert plain.token_ids[:len(ended.token_ids)] == ended.token_ids
    assert not any(engine.target.is_eog(t) for t in plain.token_ids)
    for m in ("chain", "auto"):
        r = run(engine, toks, m, max_tokens=24, ignore_eos=True)
        assert r.finish_reason == "length" and r.token_ids == plain.token_ids and r.text == plain.text, m


STOCHASTIC_PROMPT = "The three most popular programming languages are"
STOCHASTIC_TOP_K = 4
# One-sample chi-square against the exact distribution (alpha 1e-3: the correct engine fails 1 run
# in 1,000 whatever the count). The count is sized by the broken twin below (each node's children
# verified on its first sibling's row), which draws a pair the target cannot (top_k 4) in ~1.75% of
# samples (7 in its first 400): with 500 samples it escapes about e^-8.75 ~ 2e-4 of the time by
# that route alone. (A twin reading the parent's row instead drew 181 impossible pairs in 200.)
STOCHASTIC_SAMPLES = 500


def exact_first_two(engine, toks) -> dict:
    """The target's own joint distribution of the first two tokens (top_k 4, temperature 1)."""
    from edgespec.sampling import logits_to_probs

    s = SamplingParams(temperature=1.0, top_k=STOCHASTIC_TOP_K)
    p1 = logits_to_probs(engine.next_logits(toks)[0], s)
    out = {}
    for a in np.flatnonzero(p1):
        p2 = logits_to_probs(engine.next_logits(list(toks) + [int(a)])[0], s)
        out.update({(int(a), int(b)): p1[a] * p2[b] for b in np.flatnonzero(p2)})
    return out


def tree_samples_p_value(engine, n: int, stop_at_impossible: bool = False) -> float:
    """n tree-decoded samples of the first two tokens, their chi-square p-value against the exact
    distribution (edgespec.selftest's test: rare cells pooled, an impossible pair gives 0).
    `stop_at_impossible`: return that 0 at the first impossible pair, the p-value all n samples
    would give (the seeds fix every sample), without decoding the rest."""
    from edgespec.selftest import chi_square_gof

    toks = engine.tokenize(STOCHASTIC_PROMPT)
    exact = exact_first_two(engine, toks)
    counts: dict[tuple, int] = {}
    for seed in range(n):
        req = GenerationRequest(tuple(toks), SamplingParams(temperature=1.0, top_k=STOCHASTIC_TOP_K, seed=seed,
                                                            max_tokens=2),
                                SpeculationParams(mode="tree", tree_depth=2, tree_nodes=8))
        key = tuple(engine.generate(req).token_ids)
        counts[key] = counts.get(key, 0) + 1
        if stop_at_impossible and key not in exact:
            return 0.0
    keys = sorted(set(exact) | set(counts))
    return chi_square_gof(np.array([counts.get(k, 0) for k in keys]), np.array([exact.get(k, 0.0) for k in keys]))[2]


def test_stochastic_tree_matches_plain_distribution(engine):
    """Temperature 1, top_k 4: the first two generated tokens' joint distribution under tree
    decoding equals the target's own (plain decoding's), computed exactly from its logits;
    p < 1e-3 fails."""
    from edgespec.selftest import ALPHA

    p_value = tree_samples_p_value(engine, STOCHASTIC_SAMPLES)
    assert p_value > ALPHA, p_value


def test_a_tree_verified_on_another_branchs_rows_is_rejected(engine, monkeypatch):
    """The broken twin: each drafted node's children verified against the target row of its
    parent's first child (one branch's rows read for its siblings' branches: an indexing slip in
    the real forward's layout that the fake-backend tests cannot see). Rejected by the same test
    at the same sample count."""
    import edgespec.tick.verdict as verdict
    from edgespec.selftest import ALPHA

    real = verdict.verify_stochastic

    def first_siblings_rows(tree, probs, rng):
        kids = tree.children()
        return real(tree, lambda i: probs(kids[tree.parents[i]][0] if i else 0), rng)

    monkeypatch.setattr(verdict, "verify_stochastic", first_siblings_rows)
    p_value = tree_samples_p_value(engine, STOCHASTIC_SAMPLES, stop_at_impossible=True)
    assert p_value < ALPHA, p_value


def test_seeded_sampling_is_reproducible(engine):
    """A seed fixes the sample for the same drafts: a fixed mode from the same (empty) caches. (A
    draft cache left by another request changes the draft's numerics a little, and so which
    tokens a seed draws, not their distribution; plain mode is reproducible from any state.)"""
    toks = engine.tokenize("Once upon a time")
    out = []
    for mode in ("tree", "tree", "plain"):
        for slot in engine.slots:
            slot.reset()
        out.append(run(engine, toks, mode, temperature=0.8, seed=7, max_tokens=24).token_ids)
    assert out[0] == out[1]
    assert run(engine, toks, "plain", temperature=0.8, seed=7, max_tokens=24).token_ids == out[2]  # warm caches


def test_slots_and_validation(engine):
    toks = tuple(engine.tokenize("hi"))
    s1 = engine.open_session(GenerationRequest(toks))
    s2 = engine.open_session(GenerationRequest(toks))
    with pytest.raises(Overloaded):
        engine.open_session(GenerationRequest(toks))
    s1.close("cancelled")
    assert s1.result().finish_reason == "cancelled"
    s3 = engine.open_session(GenerationRequest(toks))
    s2.close()
    s3.close()
    assert engine.free_slots == 2
    with pytest.raises(BadRequest) as e:
        engine.open_session(GenerationRequest(toks * 2000))
    assert e.value.field == "prompt" and "2048" in str(e.value)


def test_useless_draft_still_exact(demo_pair, tmp_path):
    from edgespec.config import EngineConfig, ModelConfig
    from edgespec.engine import Engine
    from edgespec.models import write_random_draft

    bad = write_random_draft(demo_pair.draft, tmp_path / "random.gguf")
    eng = Engine.load(EngineConfig(ModelConfig(str(demo_pair.target), n_ctx=1024), ModelConfig(str(bad), n_ctx=1024)))
    try:
        toks = eng.encode_chat([("user", PROMPTS[0])])
        plain = run(eng, toks, "plain", max_tokens=32)
        tree = run(eng, toks, "tree", max_tokens=32)
        auto = run(eng, toks, "auto", max_tokens=32)
        assert tree.token_ids == plain.token_ids == auto.token_ids
        # random weights almost never agree (prompt lookups, grafted into the tree too, may)
        assert tree.stats.accepted_by_source.get("draft", 0) <= 3
    finally:
        eng.close()


def test_auto_stops_drafting_early_by_default():
    from edgespec.controller import ControllerConfig

    assert ControllerConfig().stop_prob == 0.6


LONG_PROMPT = ("Context: " + " ".join(
    f"Record {i}: the sensor in room {i % 17} read {20 + i % 9}.{i % 10} degrees at {i % 24:02d}:00." for i in range(30))
    + "\nQuestion: list the records of room 3 with their readings.")


def test_auto_emits_its_first_token_before_the_draft_runs(engine, monkeypatch):
    """auto's first step is plain: the first chunk comes after one target forward (the draft has not
    absorbed the prompt yet), then the request speculates, and the output is plain decoding's."""
    from edgespec.controller import Controller

    toks = engine.encode_chat([("user", PROMPTS[0])])
    plain = run(engine, toks, "plain", check_kv=False)
    req = GenerationRequest(tuple(toks), SamplingParams(max_tokens=96), SpeculationParams(mode="auto", ngram=False))
    # whether speculation pays on this host at this minute is the controller's call (its own tests);
    # here it is told that it does (a breaker that never opens, a catch-up that always pays), and the
    # first step must still be plain
    monkeypatch.setattr(Controller, "_catchup_pays", lambda self, *a: True)
    # nor does the goodput guard hold it plain (what earlier tests on this shared engine measured)
    monkeypatch.setattr(engine.goodput, "enabled", False)
    saved = engine.controller_cfg
    engine.controller_cfg = dataclasses.replace(saved, open_margin=1.0)
    try:
        sess = engine.open_session(req)
        sess.check_kv = True
        try:
            chunk = sess.step()
            assert len(chunk.token_ids) == 1 and sess.stats.target_forwards == 1
            # the draft has not run: it holds at most what an earlier request left it (the draft cache)
            assert sess.stats.draft_forwards == 0 and sess.slot.draft.pos_max(0) == sess.stats.draft_cached_tokens - 1
            while not sess.done:
                sess.step()
            spec = sess.result()
        finally:
            sess.close()
    finally:
        engine.controller_cfg = saved
    assert spec.stats.draft_forwards > 0 and spec.stats.tau > 1.5
    assert spec.token_ids == plain.token_ids


def test_draft_window_starts_the_draft_over_on_the_prompts_tail(engine):
    """A prompt longer than the draft window: the draft absorbs only the prompt's last `window`
    tokens (draft positions from 0). The target still verifies every token, so the output is
    plain decoding's, bit for bit; the KV invariants hold after every step; the draft still
    drafts usefully."""
    toks = engine.encode_chat([("user", LONG_PROMPT)])
    window = 48
    assert len(toks) > 4 * window
    plain = run(engine, toks, "plain", check_kv=False)
    with changed_config(engine, draft_window=window):
        req = GenerationRequest(tuple(toks), SamplingParams(max_tokens=96), SpeculationParams(mode="chain", ngram=False))
        sess = engine.open_session(req)
        sess.check_kv = True
        try:
            assert sess.drafter.backlog(sess.tokens) == window
            sess.step()
            assert sess.drafter.offset == len(toks) - window
            assert sess.slot.draft.pos_max(0) < window + 8  # draft positions count from the window's start
            while not sess.done:
                sess.step()
            spec = sess.result()
        finally:
            sess.close()
    assert spec.token_ids == plain.token_ids
    assert spec.stats.accepted_tokens > 0.5 * len(spec.token_ids)


def test_draft_window_after_a_long_plain_phase(engine):
    """sync (the catch-up before a half-open probe) starts over too when the plain phase left
    more than the window behind; the draft's cache then ends exactly where the context does."""
    from edgespec.drafters import ModelDrafter

    slot = next(s for s in engine.slots if not s.busy)
    toks = engine.encode_chat([("user", LONG_PROMPT)])
    d = ModelDrafter(slot.draft, window=32)
    try:
        d.begin(toks[:20])
        d.sync(toks[:20])
        assert (d.offset, d.n_past, slot.draft.pos_max(0)) == (0, 19, 18)
        d.sync(toks[:30])  # a short backlog: caught up in place
        assert (d.offset, d.n_past, slot.draft.pos_max(0)) == (0, 29, 28)
        d.sync(toks)  # a long one: over again on the last 32 tokens before the root
        assert d.offset == len(toks) - 1 - 32 and d.n_past == len(toks) - 1
        assert slot.draft.pos_max(0) == 31
        assert d.backlog(toks + [5] * 100) == 32
    finally:
        d.end()


def test_prompt_cache_keeps_the_shared_prefix_bit_for_bit(engine):
    """A request whose prompt shares a long prefix with the slot's last prompt prefills only from
    the last whole n_batch chunk they share, and decodes exactly what it decodes from an empty
    cache: the same logits after the prefill, bit for bit, and the same greedy tokens, plain and
    auto, with the KV invariants checked every step."""
    context = "Context: " + " ".join(
        f"Record {i}: the sensor in room {i % 17} read {20 + i % 9}.{i % 10} degrees at {i % 24:02d}:00." for i in range(40))
    a = engine.encode_chat([("user", context + "\nQuestion: list the records of room 3.")])
    b = engine.encode_chat([("user", context + "\nQuestion: which room read the highest value?")])
    chunk = engine.reuse_chunk  # 1 on a CPU with the patched ggml: any length is reusable
    assert engine.batch_invariant and chunk == 1
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert shared > engine.cfg.target.n_batch + 8
    kept = shared // chunk * chunk

    def fresh(toks, mode, max_tokens=48):
        for slot in engine.slots:
            slot.reset()
        return run(engine, toks, mode, max_tokens=max_tokens)

    def first_logits(toks):
        sess = engine.open_session(GenerationRequest(tuple(toks), SamplingParams(max_tokens=4),
                                                     SpeculationParams(mode="plain", ngram=False)))
        try:
            sess.step()  # the last piece's forward, the root last in it
            return sess.stats.cached_prompt_tokens, sess.slot.target.logits(-1).copy()
        finally:
            sess.close()

    # the root's logits after the prefill: from a kept prefix equal to those from an empty cache
    # (batch-invariant forwards: the rest read as a small batch gives the same bits)
    for slot in engine.slots:
        slot.reset()
    n0, l0 = first_logits(b)
    fresh(a, "plain", 2)  # leaves a's prefill in a slot
    n1, l1 = first_logits(b)
    assert (n0, n1) == (0, kept) and np.array_equal(l0, l1)

    want = {mode: fresh(b, mode) for mode in ("plain", "auto")}
    assert want["plain"].stats.cached_prompt_tokens == 0
    assert want["auto"].token_ids == want["plain"].token_ids
    for mode in ("plain", "auto"):
        fresh(a, "plain", 2)
        got = run(engine, b, mode, max_tokens=48)  # the slot holding a's prefill is chosen; KV invariants every step
        assert got.stats.cached_prompt_tokens == kept
        assert got.token_ids == want[mode].token_ids, mode

    # the same prompt again reuses its own prefill (all of it but the last token)
    again = run(engine, b, "plain", max_tokens=48)
    assert again.stats.cached_prompt_tokens == (len(b) - 1) // chunk * chunk
    assert again.token_ids == want["plain"].token_ids
    # off: every request prefills everything
    with changed_config(engine, prompt_cache=False):
        assert run(engine, b, "plain", max_tokens=8).stats.cached_prompt_tokens == 0


def test_a_failed_step_leaves_nothing_to_reuse(engine, monkeypatch):
    """A session closed in the middle of a step (an error) empties its slot's cache."""
    toks = engine.encode_chat([("user", LONG_PROMPT)])
    for slot in engine.slots:
        slot.reset()
    req = GenerationRequest(tuple(toks), SamplingParams(max_tokens=16), SpeculationParams(mode="plain"))
    sess = engine.open_session(req)
    slot = sess.slot

    def boom(*args, **kwargs):
        raise RuntimeError("decode failed")

    monkeypatch.setattr(engine.target_ctx, "decode_rows", boom)
    with pytest.raises(RuntimeError):
        sess.step()
    monkeypatch.undo()
    sess.close()
    assert slot.prefill == () and slot.target.pos_max(0) == -1 and not slot.busy
    assert slot.draft_cache is None and slot.draft.pos_max(0) == -1


SYSTEM = ("You are the support assistant of a utility company. Answer politely and precisely. Quote tariffs in "
          "EUR per kWh with two decimals. Tariffs: Basic 0.31 EUR/kWh, monthly fee 9.90 EUR; Green 0.34 EUR/kWh, "
          "renewable, monthly fee 7.50 EUR; Night 0.24 EUR/kWh from 22:00 to 06:00, else 0.36 EUR/kWh. For an "
          "outage, ask for the meter number and the postal code. Billing disputes: form D-7 within 30 days.")
# the second turn of the draft-cache tests: its plain run is the module's (the `greedy` fixture)
POWER_OUT = (("system", SYSTEM), ("user", "My power is out, what should I do?"))


def _shared(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_draft_cache_keeps_any_shared_prefix(engine, greedy):
    """The draft keeps what a request left in its sequence 0: the next request on the slot absorbs
    only what follows the prefix they share (a system prompt here: any length, not whole chunks),
    decodes plain decoding's tokens (KV invariants every step), and its draft sees the same
    context as a cold one would: the root's draft logits agree with a cold draft's."""
    from edgespec.drafters import ModelDrafter
    from edgespec.drafters.model import DraftCache

    a = engine.encode_chat([("system", SYSTEM), ("user", "What does the Green tariff cost?")])
    b = engine.encode_chat(list(POWER_OUT))
    shared = _shared(a, b)
    assert 80 < shared < len(b) - 4
    want = greedy(POWER_OUT, "plain")
    for slot in engine.slots:
        slot.reset()
    first = run(engine, a, "chain")
    assert first.stats.draft_cached_tokens == 0
    got = run(engine, b, "chain")  # the slot holding a's draft cells is chosen
    assert got.stats.draft_cached_tokens == shared
    assert got.token_ids == want.token_ids

    # the kept cells are the right ones: the root's draft logits from a's kept cells equal, bit for
    # bit, those of a draft that absorbed b itself in the same two batches (up to the shared prefix,
    # then the rest); cells of another text under the same claim (a broken cache) are far off
    slot = next(s for s in engine.slots if not s.busy)
    d = ModelDrafter(slot.draft)

    def root_logits(tokens, kept=None, absorb=None):
        if absorb is not None:  # what the cache's cells really hold
            d.begin(absorb)
            d.sync(absorb)
        n = d.begin(tokens, kept)
        if kept is None:
            d._catch_up(tokens, shared, last_logits=False)
        d._catch_up(tokens, len(tokens), last_logits=True)
        assert slot.draft.pos_max(0) == len(tokens) - 1
        return n, slot.draft.logits(-1).copy()

    def tv(x, y):  # total variation distance of the two softmaxes
        px, py = np.exp(x - x.max()), np.exp(y - y.max())
        return 0.5 * np.abs(px / px.sum() - py / py.sum()).sum()

    try:
        _, cold = root_logits(b)
        n, warm = root_logits(b, DraftCache(0, tuple(a[:-1])), absorb=a)
        other = engine.encode_chat([("system", SYSTEM.upper()), ("user", "What does the Green tariff cost?")])
        _, wrong = root_logits(b, DraftCache(0, tuple(a[:-1])), absorb=other)
    finally:
        d.end()
    assert n == shared
    assert np.array_equal(warm, cold)
    assert tv(wrong, cold) > 0.2

    # off: every request's draft starts empty
    with changed_config(engine, prompt_cache=False):
        assert run(engine, b, "chain").stats.draft_cached_tokens == 0


def test_draft_cache_keeps_the_reply_for_the_next_turn(engine):
    """A chat's next turn starts with the previous prompt and the reply: the draft keeps both (its
    cells for the reply were written while drafting), where the target keeps the prompt's whole
    chunks only."""
    for slot in engine.slots:
        slot.reset()
    turn1 = [("system", SYSTEM), ("user", "Which tariff is cheapest at night?")]
    p1 = engine.encode_chat(turn1)
    sess = engine.open_session(GenerationRequest(tuple(p1), SamplingParams(max_tokens=48), SpeculationParams(mode="chain")))
    while not sess.done:
        sess.step()
    r1, context1 = sess.result(), list(sess.tokens)  # the context: the reply, and what its last step verified past it
    sess.close()
    p2 = engine.encode_chat(turn1 + [("assistant", r1.text), ("user", "And its monthly fee?")])
    r2 = run(engine, p2, "chain", max_tokens=16)
    assert r2.stats.draft_cached_tokens > len(p1) + 8  # into the reply
    assert r2.stats.draft_cached_tokens <= _shared(context1, p2)
    assert r2.token_ids == run(engine, p2, "plain", max_tokens=16, check_kv=False).token_ids


def test_draft_cache_behind_the_draft_window(engine):
    """A long prompt leaves the draft's cells starting at its window's offset; a request sharing
    more than that offset keeps them (at the same offset) and absorbs only the rest."""
    window = 48
    a = engine.encode_chat([("user", LONG_PROMPT)])
    b = engine.encode_chat([("user", LONG_PROMPT.replace("room 3 with", "room 5 with"))])
    shared = _shared(a, b)
    for slot in engine.slots:
        slot.reset()
    with changed_config(engine, draft_window=window):
        want = run(engine, b, "plain", check_kv=False)
        for slot in engine.slots:
            slot.reset()
        run(engine, a, "chain", max_tokens=8)
        kept = next(s.draft_cache for s in engine.slots if s.draft_cache is not None)
        assert kept.offset == len(a) - window and shared > kept.offset
        got = run(engine, b, "chain")
    assert got.stats.draft_cached_tokens == shared - kept.offset
    assert got.token_ids == want.token_ids


def test_idle_work_brings_the_draft_up_to_the_last_context(engine, greedy):
    """A request whose draft never ran (plain here; auto declining the draft's prefill of a long
    prompt is the same) leaves its context to idle time: idle_work absorbs it into the draft one
    `budget` piece per call (a piece stopped by abort_idle_work leaves the draft as it was), and the next request sharing a prefix with it finds the draft there
    (draft_cached_tokens) and decodes plain decoding's tokens. No idle work on a busy slot, none
    once caught up, none with the cache off."""
    import math

    a = engine.encode_chat([("system", SYSTEM), ("user", "What does the Green tariff cost?")])
    b = engine.encode_chat(list(POWER_OUT))
    shared = _shared(a, b)
    want = greedy(POWER_OUT, "plain")
    for slot in engine.slots:
        slot.reset()
    ra = run(engine, a, "plain", max_tokens=8)
    slot = next(s for s in engine.slots if s.last_context)
    assert slot.last_context == tuple(a) + tuple(ra.token_ids) and slot.draft_cache is None

    slot.busy = True
    assert not engine.idle_work()  # a busy slot's draft belongs to its request
    slot.busy = False
    with changed_config(engine, prompt_cache=False):
        assert not engine.idle_work()
    assert engine.idle_work(budget=32)
    held = slot.draft_cache
    engine.abort_idle_work()  # a job arrived: the piece stops, the draft keeps what it held
    assert not engine.idle_work(budget=32)
    assert slot.draft_cache == held and slot.draft.pos_max(0) == len(held.tokens) - 1
    engine.abort_idle_work(False)
    pieces = 1
    while engine.idle_work(budget=32):
        pieces += 1
        assert slot.draft.pos_max(0) == len(slot.draft_cache.tokens) - 1
    n = len(slot.last_context)
    assert pieces == math.ceil(n / 32) and slot.draft_cache.tokens == slot.last_context
    assert slot.draft_cache.offset == 0 and slot.draft.pos_max(0) == n - 1
    assert not engine.idle_work()  # caught up

    got = run(engine, b, "chain")
    # the target's kept prefill too, at any length (batch-invariant forwards)
    assert got.stats.draft_cached_tokens == shared and got.stats.cached_prompt_tokens == shared
    assert got.token_ids == want.token_ids


def test_draft_cache_limits(engine):
    """The draft keeps no more than the window's worth of a long context ahead of time (idle work
    starts over on its tail, as a request does), and a kept context spanning more than
    REUSE_WINDOWS windows is dropped rather than reused (its every forward would attend over it)."""
    from edgespec.drafters import ModelDrafter
    from edgespec.drafters.model import REUSE_WINDOWS, DraftCache

    toks = engine.encode_chat([("user", LONG_PROMPT)])
    window = 48
    assert len(toks) > 2 * window
    for slot in engine.slots:
        slot.reset()
    with changed_config(engine, draft_window=window):
        run(engine, toks, "plain", max_tokens=4)
        while engine.idle_work():
            pass
    slot = next(s for s in engine.slots if s.last_context)
    n = len(slot.last_context)
    assert slot.draft_cache.offset == n - window and slot.draft.pos_max(0) == window - 1

    slot = next(s for s in engine.slots if not s.busy)
    d = ModelDrafter(slot.draft)
    held = 100
    try:
        d.begin(toks)
        d.absorb(toks, held)
        kept = DraftCache(0, tuple(toks[:held]))
        small = ModelDrafter(slot.draft, window=held // REUSE_WINDOWS - 1)
        assert small.begin(toks, kept) == 0 and slot.draft.pos_max(0) == -1  # too long to keep
        d.begin(toks)
        d.absorb(toks, held)
        fits = ModelDrafter(slot.draft, window=-(-held // REUSE_WINDOWS))
        assert fits.begin(toks, kept) == held and slot.draft.pos_max(0) == held - 1
    finally:
        d.end()


def test_a_draft_that_cannot_pay_on_this_box_leaves_auto_to_model_free_drafts(engine, greedy):
    """Calibration judges each drafter by plan --measure's arithmetic; where no chain pays, auto
    requests never run the draft model (n-grams and the suffix cache only), and the text holds."""
    prompt = engine.encode_chat([("user", PROMPTS[0])])
    plain_ids = greedy(PROMPTS[0], "plain").token_ids[:24]  # plain's at max_tokens 24
    saved = dict(engine.draft_verdicts)
    engine.draft_verdicts["draft"] = {"pays": False, "acceptance": 0.8, "ceiling": 0.7, "depth": 1,
                                      "draft_share": 0.6, "break_even": None}
    try:
        assert not engine.drafter_pays("model")
        got = run(engine, prompt, "auto", max_tokens=24)
    finally:
        engine.draft_verdicts.clear()
        engine.draft_verdicts.update(saved)
    assert got.stats.draft_forwards == 0 and got.token_ids == plain_ids
    # the calibrated engine reports its own verdict (whatever this host makes of it)
    assert set(engine.model_info()["draft_economics"]["draft"]) >= {"pays", "ceiling", "draft_share"}
