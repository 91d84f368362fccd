"""edgespec/constraint.py: llguidance masks on a toy vocabulary, node masks for a tree, and the
masked verification -- statistically exact (chi-square against constrained plain sampling, in the
style of tests/test_verify_stats.py), with deliberately broken twins that the same test rejects.
A real-vocabulary check on the demo target is marked slow."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from edgespec import constraint as C
from edgespec.errors import BadRequest
from edgespec.logprobs import token_logprob
from edgespec.sampling import SamplingParams, logits_to_probs
from edgespec.selftest import ALPHA, chi_square_gof, gumbel_top_k
from edgespec.tree import DraftTree
from edgespec.types import ConstraintSpec

# token ids:     0     1     2     3      4      5      6     7
TOKENS = (b"a", b"b", b"c", b"ab", b"ba", b"cc", b"x", b"\xff<eos>")
EOS = 7
V = len(TOKENS)
# "a" then b/c's, or "b" then a/c's: which tokens are allowed depends on the state
REGEX = ConstraintSpec("regex", "a[bc]*|b[ac]*")


def toy_tokenize(s: str) -> list[int]:
    out, b = [], s.encode()
    while b:  # a byte the toy vocabulary lacks (JSON's braces) reads as "x": only shapes are checked then
        t = max((i for i in range(V - 1) if b.startswith(TOKENS[i])), key=lambda i: len(TOKENS[i]), default=6)
        b = b if t != 6 or b.startswith(b"x") else b"x" + b[1:]
        out.append(t)
        b = b[len(TOKENS[t]):]
    return out


@pytest.fixture(scope="module")
def compiler() -> C.Compiler:
    return C.Compiler(C.Vocabulary(TOKENS, (EOS,), (EOS,), None, toy_tokenize))


def allowed(compiler: C.Compiler, prefix: tuple[int, ...]) -> set[int]:
    m = compiler.matcher(REGEX)
    m.commit(prefix)
    return set(np.flatnonzero(m.mask()).tolist())


def test_masks_follow_the_grammar_and_eos_only_where_it_accepts(compiler):
    assert allowed(compiler, ()) == {0, 1, 3, 4}  # a, b, ab, ba; never x, no EOS on empty text
    assert allowed(compiler, (0,)) == {1, 2, 5, EOS}  # after "a": b, c, cc, or stop
    assert allowed(compiler, (1,)) == {0, 2, 5, EOS}
    m = compiler.matcher(REGEX)
    assert not m.allows([6]) and m.allows([0, 1, 2]) and not m.allows([0, 0])
    m.commit([3])
    assert m.accepting and not m.finished
    with pytest.raises(RuntimeError, match="not allowed"):
        m.commit([4])
    done = compiler.matcher(ConstraintSpec("regex", "ab"))
    done.commit([3])
    assert done.finished and set(np.flatnonzero(done.mask())) == {EOS}
    np.testing.assert_array_equal(C.unpack_bitmask(done.bitmask(), V), done.mask())


@pytest.mark.parametrize("spec, field", [
    (ConstraintSpec("regex", "("), "constraint.value"),
    (ConstraintSpec("json_schema", "{not json"), "constraint.value"),
    (ConstraintSpec("json_schema", "[1]"), "constraint.value"),
    (ConstraintSpec("lark", "start: undefined_rule"), "constraint.value"),
    (ConstraintSpec("grammar", "root ::= undefined-rule"), "constraint.value"),
])
def test_bad_constraints_are_bad_requests(compiler, spec, field):
    with pytest.raises(BadRequest) as e:
        compiler.matcher(spec)
    assert e.value.field == field


def test_every_kind_compiles(compiler):
    for spec in (ConstraintSpec("json_object"), ConstraintSpec("json_schema", '{"type": "string"}'),
                 ConstraintSpec("lark", 'start: "a" "b"*'), ConstraintSpec("grammar", 'root ::= "a" "b"*'),
                 REGEX):
        assert compiler.matcher(spec).mask().shape == (V,)


def two_level(tokens_at_root, children_of):
    t = DraftTree.root(6)
    for x in tokens_at_root:
        c = t.add(0, x, point=True)
        for y in children_of.get(x, ()):
            t.add(c, y, point=True)
    return t


def test_node_masks_are_the_states_after_each_path_and_commit_nothing(compiler):
    m = compiler.matcher(REGEX)
    # a (allowed) -> c (allowed), x (forbidden); x (forbidden) -> a; b -> a
    tree = two_level([0, 6, 1], {0: [2, 6], 6: [0], 1: [0]})
    masks, valid = m.node_masks(tree)
    paths = [tuple(tree.tokens[i] for i in tree.path(n)) for n in range(len(tree))]
    want_valid = [True, True, True, False, False, False, True, True]
    assert valid.tolist() == want_valid, paths
    for i, ok in enumerate(want_valid):
        if ok:
            assert set(np.flatnonzero(masks[i])) == allowed(compiler, paths[i]), paths[i]
        else:
            assert not masks[i].any()
    assert set(np.flatnonzero(m.mask())) == allowed(compiler, ())  # the state did not move


def test_greedy_constrained_is_the_argmax_of_masked_rows(compiler):
    m = compiler.matcher(REGEX)
    rows = np.zeros((3, V))
    rows[0] = [1, 0, 0, 0, 0, 0, 9, 0]  # x is the raw favourite at the root, forbidden: a wins
    rows[1] = [9, 0, 3, 0, 0, 0, 0, 0]  # after "a": a is forbidden, c wins
    rows[2] = [0, 0, 0, 0, 0, 0, 0, 5]
    tree = DraftTree.root(6)
    a = tree.add(0, 0, point=True)
    tree.add(a, 2, point=True)
    masks, _ = m.node_masks(tree)
    res = C.verify_masked(tree, rows, masks, SamplingParams(), np.random.default_rng(0))
    assert res.accepted == [1, 2] and res.token == EOS and res.bonus
    plain = C.verify_masked(tree, rows, np.ones_like(masks), SamplingParams(), np.random.default_rng(0))
    assert plain.accepted == [] and plain.token == 6  # unconstrained: x


def test_mask_helpers():
    q = np.array([0.5, 0.25, 0.25, 0.0])
    mask = np.array([False, True, True, False])
    np.testing.assert_allclose(C.mask_q(q, mask), [0, 0.5, 0.5, 0])
    assert not C.mask_q(q, np.array([False, False, False, True])).any()
    np.testing.assert_array_equal(C.apply_mask(np.ones(4), mask), [-np.inf, 1, 1, -np.inf])


def test_logprobs_of():
    row = np.log(np.array([0.5, 0.3, 0.2]))
    lp = token_logprob(row, SamplingParams(), 1, 2)  # greedy: the raw softmax
    assert lp.token == 1 and lp.logprob == pytest.approx(np.log(0.3))
    assert [t for t, _ in lp.top] == [0, 1] and lp.top[0][1] == pytest.approx(np.log(0.5))
    s = SamplingParams(temperature=1.0, top_k=2)  # sampled: the transformed distribution
    lp = token_logprob(row, s, 0, 3)
    assert lp.logprob == pytest.approx(np.log(0.5 / 0.8)) and len(lp.top) == 2  # the cut token is not offered
    masked = C.apply_mask(row, np.array([False, True, True]))
    lp = token_logprob(masked, SamplingParams(temperature=0.5), 2, 1)
    assert lp.logprob == pytest.approx(np.log(0.2**2 / (0.3**2 + 0.2**2)))


# ---- statistical exactness under a constraint ------------------------------------------------

# Both broken twins are rejected at 5,000 trials with p < 1e-300 (q_left_unmasked) and p = 0
# (parents_mask); the exact verifier gets twice that. Its p is uniform under the null, so its
# false-failure rate is ALPHA (1e-3) at any count (seeds 1, 2, 3 at 10,000: p = 0.015, 0.33, 0.30).
TRIALS = 10_000
BROKEN_TRIALS = 5_000
P = np.array([0.30, 0.05, 0.20, 0.05, 0.10, 0.05, 0.20, 0.05])  # x (forbidden) has real mass
Q = np.array([0.05, 0.30, 0.05, 0.20, 0.05, 0.10, 0.05, 0.20])


def rolled(base, shift_by):
    return lambda prefix: np.roll(base, shift_by(prefix))


TARGET = rolled(np.log(P), lambda pre: sum(t + 1 for t in pre))  # logits after a prefix
DRAFT = rolled(Q, lambda pre: 2 * sum(pre))
SAMPLING = SamplingParams(temperature=1.0)


def constrained_joint(compiler) -> np.ndarray:
    """P(x1, x2) of constrained plain sampling: each token from the masked, transformed target."""
    out = np.zeros(V * V)
    p1 = logits_to_probs(C.apply_mask(TARGET(()), _mask(compiler, ())), SAMPLING)
    for x1 in range(V):
        if p1[x1] == 0:
            continue
        p2 = logits_to_probs(C.apply_mask(TARGET((x1,)), _mask(compiler, (x1,))), SAMPLING)
        out[x1 * V: (x1 + 1) * V] = p1[x1] * p2
    return out


_MASKS: dict[tuple[int, ...], np.ndarray] = {}


def _mask(compiler, prefix) -> np.ndarray:
    """The reference mask after a prefix: a fresh matcher that commits it."""
    if prefix not in _MASKS:
        m = compiler.matcher(REGEX)
        m.commit(prefix)
        _MASKS[prefix] = m.mask()
    return _MASKS[prefix]


def build(compiler, prefix, rng) -> DraftTree:
    """Two draws without replacement from the MASKED draft at the root, each with two more under
    it drawn from the draft masked at that child's state."""
    t = DraftTree.root(prefix[-1] if prefix else 6)
    t.q[0] = DRAFT(prefix)
    for x in gumbel_top_k(C.mask_q(t.q[0], _mask(compiler, prefix)), 2, rng):
        c = t.add(0, x, point=False)
        ctx = prefix + (x,)
        t.q[c] = DRAFT(ctx)
        for y in gumbel_top_k(C.mask_q(t.q[c], _mask(compiler, ctx)), 2, rng):
            t.add(c, y, point=False)
    return t


def run(compiler, verify, trials, seed) -> float:
    """p-value of the first two emitted tokens against constrained plain sampling."""
    rng = np.random.default_rng(seed)
    m = compiler.matcher(REGEX)
    counts = np.zeros(V * V, dtype=np.int64)
    for _ in range(trials):
        out: list[int] = []
        m.reset()
        while len(out) < 2:
            prefix = tuple(out)
            tree = build(compiler, prefix, rng)
            rows = np.stack([TARGET(prefix + tuple(tree.tokens[i] for i in tree.path(n))) for n in range(len(tree))])
            masks, _valid = m.node_masks(tree)
            res = verify(tree, rows, masks, rng, m)
            new = [tree.tokens[i] for i in res.accepted] + [res.token]
            if len(out) + len(new) < 2:
                m.commit(new)
            out += new
        counts[out[0] * V + out[1]] += 1
    return chi_square_gof(counts, constrained_joint(compiler))[2]


def exact(tree, rows, masks, rng, m):
    return C.verify_masked(tree, rows, masks, SAMPLING, rng)


def q_left_unmasked(tree, rows, masks, rng, m):
    return C.verify_masked(tree, rows, masks, SAMPLING, rng, q_masked=False)


def parents_mask(tree, rows, masks, rng, m):
    """The target row of node i masked with its parent's state (q masked correctly)."""
    from edgespec.verify import verify_stochastic

    row = lambda i: logits_to_probs(C.apply_mask(rows[i], masks[max(tree.parents[i], 0)]), SAMPLING)
    return verify_stochastic(C.masked_tree(tree, masks), row, rng)


def test_tree_verification_under_a_constraint_is_constrained_sampling(compiler):
    p = run(compiler, exact, TRIALS, seed=1)
    assert p >= ALPHA, p


@pytest.mark.parametrize("broken", [q_left_unmasked, parents_mask])
def test_broken_masking_is_rejected(compiler, broken):
    p = run(compiler, broken, BROKEN_TRIALS, seed=1)
    assert p < ALPHA, f"{broken.__name__} not detected: p = {p}"


# ---- the real vocabulary -----------------------------------------------------------------------


@pytest.mark.slow
def test_json_schema_on_the_demo_vocabulary():
    from edgespec import backend
    from edgespec.config import models_dir
    from edgespec.server.config import DEMO_TARGET

    path = models_dir() / DEMO_TARGET
    if not path.is_file():
        pytest.skip("demo models missing: run `edgespec models prepare-demo`")
    model = backend.Model(path)
    try:
        comp = C.Compiler(C.Vocabulary.from_model(model))
        schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                  "required": ["name", "age"], "additionalProperties": False}
        m = comp.matcher(ConstraintSpec("json_schema", json.dumps(schema)))
        text = '{"name":"Bob","age":42}'
        ids = model.tokenize(text, False, False)
        start = m.mask()
        assert not start[model.tokenize("[", False, False)[0]] and not start[model.eos]  # an object, not empty
        for t in ids:
            assert m.mask()[t], model.piece(t)
            m.commit([t])
        assert m.accepting and set(np.flatnonzero(m.mask())) == {t for t in range(model.n_vocab) if model.is_eog(t)}
    finally:
        model.close()


@pytest.mark.slow
def test_constrained_greedy_decoding_of_the_demo_target_matches_the_schema():
    """Plain greedy decoding with each step's logits masked (the engine's job once wired): the demo
    target then writes schema-valid JSON and stops with an end-of-generation token."""
    import jsonschema

    from edgespec import backend
    from edgespec.config import ModelConfig, models_dir
    from edgespec.server.config import DEMO_TARGET

    path = models_dir() / DEMO_TARGET
    if not path.is_file():
        pytest.skip("demo models missing: run `edgespec models prepare-demo`")
    model = backend.Model(path)
    ctx = backend.Context(model, ModelConfig(path=str(path), n_ctx=512, n_batch=128))
    try:
        schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                   "country": {"type": "string", "maxLength": 30}},
                  "required": ["city", "country"], "additionalProperties": False}
        m = C.Compiler(C.Vocabulary.from_model(model)).matcher(ConstraintSpec("json_schema", json.dumps(schema)))
        prompt = model.tokenize(model.chat_prompt([("user", "Name the capital of France as JSON.")]), True, True)
        ctx.decode_seq(prompt, 0)
        out: list[int] = []
        for _ in range(64):
            masks, _ = m.node_masks(DraftTree.root(prompt[-1]))
            t = int(np.argmax(C.apply_mask(ctx.logits(-1), masks[0])))
            if model.is_eog(t):
                break
            m.commit([t])
            out.append(t)
            ctx.decode_seq([t], len(prompt) + len(out) - 1)
        else:
            pytest.fail(f"no end of generation after 64 tokens: {model.detokenize(out)!r}")
        assert m.accepting
        jsonschema.validate(json.loads(model.detokenize(out)), schema)
    finally:
        ctx.close()
        model.close()


class _FailsAfterCommit:
    """A real matcher that passes llguidance's limits once a token is committed (as a grammar
    like `(a{1000}){1000}` does after some text on a real vocabulary)."""

    def __init__(self, m):
        self._m, self.failed = m, False

    def __getattr__(self, name):
        return getattr(self._m, name)

    def try_consume_tokens(self, toks):
        if self.failed:
            return 0
        n = self._m.try_consume_tokens(toks)
        self.failed = True
        return n

    def is_error(self) -> bool:
        return self.failed

    def get_error(self) -> str:
        return "lexer error: too many expressions constructed\n<state>the grammar's text</state>"


def test_a_grammar_past_its_limits_ends_its_request_never_the_tick(compiler):
    """Once llguidance fails (its limits) the request may only end: its masks allow end-of-
    generation alone, no drafted node is valid, nothing is forced, commits are ignored. Raising
    there failed the engine's tick for every request batched with it."""
    m = compiler.matcher(REGEX)
    m._m = _FailsAfterCommit(m._m)
    m.commit((0,))
    tree = two_level([2, 6, 1], {2: [2], 6: [0], 1: [0]})
    masks, valid = m.node_masks(tree)
    assert valid.tolist() == [True] + [False] * (len(tree) - 1)
    assert set(np.flatnonzero(masks[0])) == {EOS} and not masks[1:].any()
    assert set(np.flatnonzero(m.mask())) == {EOS} and m.forced(4) == [] and m.finished and m.accepting
    m.commit((2,))  # the tokens the tick emitted before it saw: ignored, no error
    assert m.error == "lexer error: too many expressions constructed <state>the grammar's text</state>"


def test_a_grammar_past_its_limits_at_its_first_mask_is_refused_by_field(compiler, monkeypatch):
    import llguidance as llg

    monkeypatch.setattr(C, "LIMITS", llg.LLParserLimits(max_lexer_states=2, verbose_errors=False))
    with pytest.raises(BadRequest) as e:
        compiler.matcher(ConstraintSpec("regex", "(a|b|c){3,40}[bc]{5,30}"))
    assert e.value.field == "constraint.value" and "too complex" in str(e.value)


def test_a_grammar_that_recurses_deep_compiles_without_taking_the_process_down():
    """A Lark chain of 4,400 one-line rules (64 KB, within limits.max_constraint_bytes) makes
    llguidance's grammar check recurse past a thread's default 8 MiB stack: the process died
    (SIGSEGV) when a handler thread compiled it. Compiles run on a large-stack thread of their own."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import threading
        from tests.test_constraint import EOS, TOKENS, toy_tokenize
        from edgespec import constraint as C
        from edgespec.errors import BadRequest
        from edgespec.types import ConstraintSpec
        n = 4400
        lark = "start:a0\\n" + "".join(f'a{i}:"a"a{i + 1}\\n' for i in range(n)) + f'a{n}:"b"\\n'
        assert len(lark) < 64 << 10
        compiler = C.Compiler(C.Vocabulary(TOKENS, (EOS,), (EOS,), None, toy_tokenize))
        def compile():  # in a thread of the default stack size, as a request's handler
            try:
                compiler.matcher(ConstraintSpec("lark", lark))
                print("compiled")
            except BadRequest as exc:
                print("refused", exc)
        t = threading.Thread(target=compile)
        t.start()
        t.join()
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.startswith(("compiled", "refused")), done.stdout


def _fork() -> DraftTree:
    t = DraftTree.root(6)  # the root, then "a" and "b" beside each other
    t.add(0, 0, False)
    t.add(0, 1, False)
    return t


def test_masks_past_the_step_budget_fail_the_grammar_not_the_tick(compiler):
    """A request's masks in one step (drafted paths and the tree) past `step_seconds`: the matcher
    fails with the reason, allows only end-of-generation, and drafts nothing more."""
    m = compiler.matcher(REGEX)
    assert m.failure is None and m.spent == 0.0  # the compile's first mask is not a step's
    m.step_seconds = 0.0
    assert m.mask_after([0]).any()  # the step's first mask is computed (it spends time)...
    assert not m.mask_after([1]).any()  # ...then the step's budget is spent: nothing more is drafted
    nm = m.node_bits(_fork())
    assert "token masks took over 0 s" in (m.failure or "")
    assert set(np.flatnonzero(nm.dense()[0])) == {EOS} and not nm.valid[1:].any()
    assert m.finished and m.forced(4) == []
    roomy = compiler.matcher(REGEX)  # the default budget: a toy grammar's tree is far within it
    roomy.node_bits(_fork())
    assert roomy.failure is None and roomy.spent == 0.0


class _Slow:
    """A real matcher whose every mask costs `seconds` of the calling thread's CPU time."""

    def __init__(self, m, seconds: float):
        self._m, self.seconds = m, seconds

    def __getattr__(self, name):
        return getattr(self._m, name)

    def spend(self) -> None:
        """Take `seconds` of the calling thread's CPU time."""
        end = time.thread_time() + self.seconds
        while time.thread_time() < end:
            pass

    def unsafe_compute_mask_ptr(self, ptr, nbytes):
        self.spend()
        return self._m.unsafe_compute_mask_ptr(ptr, nbytes)


def _slow(limits: C.MaskLimits, seconds: float) -> C.Matcher:
    """A matcher after "a" (then b, c and cc are allowed, again and again), each mask `seconds`."""
    m = C.Compiler(C.Vocabulary(TOKENS, (EOS,), (EOS,), None, toy_tokenize), limits).matcher(REGEX)
    m.commit((0,))
    m._m = _Slow(m._m, seconds)
    return m


def _burn(seconds: float) -> None:
    """The engine thread's other work: `seconds` of this thread's CPU time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_grammar_just_under_the_step_bound_every_step_waits_for_its_share():
    """Masks of 0.04 s a step pass a step's bound of 0.05 s every time: unpaced, such a request
    took the engine 0.04 s a step for as long as it ran. Its bucket (a burst of 0.05 s, refilled
    at a quarter of the engine thread's time) runs dry within two steps: it then waits (the
    schedule holds it out of ticks) until the others' work has refilled it, and never fails; its
    masks stay within the burst, its share, and one step."""
    limits = C.MaskLimits(step_seconds=0.05, tick_seconds=1.0, burst_seconds=0.05, share=0.25)
    m = _slow(limits, 0.01)
    tree = two_level([1, 2, 5], {})  # the root and three children: 4 masks, 0.04 s a step
    t0, waits = time.thread_time(), []
    for _ in range(8):
        assert not m.waiting()
        m.allow(1)
        m.node_bits(tree)
        m.commit((1,))
        waits.append(0)
        while m.waiting():  # sitting the tick out: another request's 5 ms tick runs
            m.defer()
            _burn(0.005)
            waits[-1] += 1
    assert m.failure is None and m.deferred == sum(waits)
    assert waits[0] == 0 and all(w >= 4 for w in waits[2:]), waits  # 0.04 s refills in 0.16 s of engine time
    assert m.total <= 0.05 + 0.25 * (time.thread_time() - t0) + 0.04 + 0.01, m.total


def test_a_matcher_that_fails_is_never_held():
    """A failed grammar's request must step to end: `waiting` is False once it failed."""
    limits = C.MaskLimits(step_seconds=0.05, tick_seconds=1.0, burst_seconds=0.0, share=0.01)
    m = _slow(limits, 0.01)
    m.allow(1)
    m.node_bits(two_level([1], {}))
    m.allow(1)
    assert m.waiting()
    m.error = "failed"
    assert not m.waiting()


def test_grammars_in_one_tick_share_its_mask_time():
    """Two requests whose masks take 0.04 s a step each (under the step's 0.05 s) in one tick
    whose masks may take 0.05 s together, beside a third request: each may take a third, so both fail, and the tick's masks
    took at most its bound and one mask each (today: 0.08 s). A cheap grammar beside them in the
    same tick is served."""
    from types import SimpleNamespace

    from edgespec.tick.schedule import share_masks

    limits = C.MaskLimits(step_seconds=0.05, tick_seconds=0.05, burst_seconds=10.0, share=0.5)
    costly = [_slow(limits, 0.005) for _ in range(2)]
    cheap = _slow(limits, 0.0)
    tree = two_level([1, 2, 5], {1: [1, 2], 2: [1, 2]})  # 8 masks: 0.04 s a step for a costly one
    share_masks([SimpleNamespace(matcher=m) for m in (*costly, cheap)] + [SimpleNamespace(matcher=None)])
    t0 = time.thread_time()
    for m in costly:
        m.node_bits(tree)
    took = time.thread_time() - t0
    assert all("share of the tick" in (m.failure or "") for m in costly), [m.failure for m in costly]
    assert took <= 0.05 + 2 * 0.005 + 0.005, took
    nm = cheap.node_bits(tree)
    assert cheap.failure is None and nm.valid.all()


def test_compiles_run_below_the_engines_cpu_priority(compiler):
    """A compile (seconds of CPU for a hostile grammar) takes what the engine's forwards leave of
    the cores: its thread's nice value is COMPILE_NICE above the caller's (Linux)."""
    import os
    import threading

    if not hasattr(os, "getpriority"):
        pytest.skip("no per-thread nice values here")
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    theirs = compiler._on_large_stack(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
    assert theirs == min(19, mine + C.COMPILE_NICE)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # the caller's own is kept


# 40 juxtaposed, highly ambiguous expressions: compiles at once and stays under llguidance's fuel,
# but its Earley sets grow with the text, so its masks get costly (the demo target's greedy text
# under it: ~3 ms a step by 10 tokens, ~25 ms by 40, ~0.1 s by 100, against ~24 ms for the
# target's own step). Also in tests/server/test_probes_e2e.py's hostile corpus.
COSTLY_LARK = ConstraintSpec("lark", "start: " + " ".join(["e"] * 40) + "\n"
                             'e: e e e e | e e e | e e | e "+" e | /[a-z]/ | "(" e ")"\n')


@pytest.mark.slow
def test_a_real_costly_grammar_is_paced_to_its_share_while_a_plain_request_is_served(engine):
    """The real demo target and the real llguidance matcher of COSTLY_LARK beside a plain request:
    once its masks cost more than its share of the engine thread (a burst of 20 ms, a quarter of
    the engine's time), it sits out ticks while the plain request gets a token every tick; it
    never fails, and while both run its masks stay within the burst, the share and one step.
    (Before: it failed past its share with a 400.)"""
    from edgespec.sampling import SamplingParams
    from edgespec.types import GenerationRequest, SpeculationParams

    limits = C.MaskLimits(burst_seconds=0.02, share=0.25)
    m = C.Compiler(C.Vocabulary.from_model(engine.target), limits).matcher(COSTLY_LARK)
    prompt = tuple(engine.tokenize("Write a long expression:", add_special=True))
    costly = engine.open_session(GenerationRequest(prompt, SamplingParams(max_tokens=60),
                                                   SpeculationParams(mode="plain"), matcher=m))
    plain = engine.open_session(GenerationRequest(prompt, SamplingParams(max_tokens=60),
                                                  SpeculationParams(mode="plain")))
    shared_cpu, shared_masks, step_max, held, idle = 0.0, 0.0, 0.0, 0, 0
    try:
        while not plain.done:  # the pacing is beside it (alone, the costly request is not held back)
            beside = not plain.prefilling
            t0, m0, n0, p0 = time.thread_time(), m.total, len(costly.out), len(plain.out)
            engine.tick([plain, costly])
            step_max = max(step_max, m.total - m0)
            if beside:
                shared_cpu += time.thread_time() - t0
                shared_masks += m.total - m0
                held += len(costly.out) == n0 and not costly.prefilling
                idle += len(plain.out) == p0
    finally:
        costly.close()
        plain.close()
    assert m.failure is None and costly.finish_reason == "cancelled" and len(costly.out) >= 20, (m.failure, costly.out)
    assert m.deferred > 0 and held > 0, (m.deferred, held)
    assert idle == 0  # the plain request got a token every tick
    assert shared_masks <= 0.02 + 0.25 * shared_cpu + step_max + 0.005, (shared_masks, shared_cpu, step_max)
    print(f"costly grammar: {len(costly.out)} tokens, masks {shared_masks:.3f} s of {shared_cpu:.3f} s engine time "
          f"beside the plain request; held {m.deferred} ticks; its largest step {step_max * 1000:.1f} ms")
