import pytest

from edgespec.bench.runner import BenchEngine, mode_order, parse_modes, prompt_tokens, run
from edgespec.bench.suite import Prompt
from edgespec.errors import BadRequest
from edgespec.sampling import SamplingParams
from tests.fake_engine import FakeEngine

PROMPTS = [Prompt(f"p{i}", "code" if i < 2 else "drift", f"prompt {i}") for i in range(4)]


def calls(engine: FakeEngine) -> list[tuple[tuple[int, ...], str, int]]:
    """(prompt tokens, mode, max_tokens) of every generate call, in order."""
    return [(r.prompt_tokens, r.speculation.mode, r.sampling.max_tokens) for r in engine.requests]


def test_the_fake_is_a_bench_engine() -> None:
    engine: BenchEngine = FakeEngine()  # mypy checks the fake against the Protocol (a typed test)
    assert run(engine, PROMPTS[:1], ("plain",), 4, warmup=False, progress=False)[0].tokens == 4


def test_mode_order_rotates():
    modes = ["plain", "chain", "tree"]
    assert [mode_order(modes, i) for i in range(4)] == [
        ["plain", "chain", "tree"],
        ["chain", "tree", "plain"],
        ["tree", "plain", "chain"],
        ["plain", "chain", "tree"],
    ]


def test_parse_modes():
    assert parse_modes("plain, tree,auto") == ("plain", "tree", "auto")
    with pytest.raises(BadRequest, match="modes"):
        parse_modes("plain,fast")
    with pytest.raises(BadRequest, match="duplicate"):
        parse_modes("plain,plain")
    with pytest.raises(BadRequest, match="at least one"):
        parse_modes(" , ")


def test_run_interleaves_modes_prompt_by_prompt_after_warmup():
    engine = FakeEngine()
    modes = ("plain", "chain", "tree", "auto")
    rows = run(engine, PROMPTS, modes, 16, progress=False)
    warm, recorded = calls(engine)[: len(modes)], calls(engine)[len(modes):]
    assert [c[1] for c in warm] == list(modes) and all(c[2] == 8 for c in warm)
    assert [c[1] for c in recorded] == [m for i in range(4) for m in mode_order(modes, i)]
    assert [(r.id, r.mode) for r in rows] == [(p.id, m) for i, p in enumerate(PROMPTS) for m in mode_order(modes, i)]
    # every mode of one prompt gets the same prompt tokens: the chat template applied once
    for i, p in enumerate(PROMPTS):
        toks = {c[0] for c in recorded[4 * i: 4 * i + 4]}
        assert toks == {prompt_tokens(engine, p)}
    # the chat prompt tokenised whole, special tokens parsed (as llama.cpp's tools do)
    assert recorded[0][0] == tuple(engine.tokenize("<user>prompt 0\n<assistant>", parse_special=True))
    assert set(engine.tokenized) == {(True, True)}


def test_greedy_unless_sampling_is_given_then_one_seed_per_prompt():
    engine = FakeEngine()
    modes = ("plain", "chain", "auto")
    run(engine, PROMPTS, modes, 16, progress=False)
    assert all(s.temperature == 0.0 and s.max_tokens in (8, 16) for s in [r.sampling for r in engine.requests])
    engine = FakeEngine()
    base = SamplingParams(temperature=0.8, top_p=0.9, seed=100, max_tokens=3)
    run(engine, PROMPTS, modes, 16, progress=False, sampling=base)
    recorded = [r.sampling for r in engine.requests][len(modes):]
    assert all((s.temperature, s.top_p, s.max_tokens) == (0.8, 0.9, 16) for s in recorded)
    seeds = [[s.seed for s in recorded[i * len(modes):(i + 1) * len(modes)]] for i in range(len(PROMPTS))]
    assert seeds == [[100 + i] * len(modes) for i in range(len(PROMPTS))]  # same in every mode, one per prompt


def test_rows_come_from_stats():
    engine = FakeEngine()
    rows = run(engine, PROMPTS[:1], ("plain", "tree"), 16, warmup=False, progress=False)
    plain, tree = rows
    assert plain.as_dict() == {"id": "p0", "category": "code", "mode": "plain", "tokens": 16, "seconds": 0.16,
                               "tokens_per_second": 100.0, "tau": 1.0, "target_forwards": 16,
                               "draft_forwards": 0, "target_seconds": 0.16, "draft_seconds": 0.0,
                               "accepted_per_depth": [], "valid": None, "index": 0,
                               "proposed_by_source": {}, "accepted_by_source": {}}
    assert (tree.tokens, tree.target_forwards, tree.tau, tree.seconds) == (16, 4, 4.0, 0.064)
    assert (tree.draft_forwards, tree.draft_seconds, tree.accepted_per_depth) == (12, 0.024, (4, 4, 4))
    assert len(engine.requests) == 2


def test_progress_bar_on_stderr(capsys):
    run(FakeEngine(), PROMPTS[:2], ("plain", "chain"), 4, warmup=False, progress=True)
    err = capsys.readouterr().err
    assert "bench" in err and "4/4" in err


def test_bad_max_tokens():
    with pytest.raises(BadRequest, match="max_tokens"):
        run(FakeEngine(), PROMPTS, ("plain",), 0, progress=False)


def test_external_modes_join_the_rotation():
    """llama.cpp's binaries (`--anchor-bin`) run inside the same rotation as the engine's modes,
    with the prompt's chat text; their rows go to external_rows, not to the engine's rows."""
    engine = FakeEngine()
    seen = []

    def ext(name):
        def run_ext(prompt, text):
            seen.append((prompt.id, name, text))
            return {"tokens": 16, "seconds": 0.2, "tokens_per_second": 80.0}
        return run_ext

    external = {"llama.cpp:plain": ext("llama.cpp:plain"), "llama.cpp:speculative": ext("llama.cpp:speculative")}
    ext_rows = []
    modes = ("plain", "auto")
    rows = run(engine, PROMPTS[:3], modes, 16, warmup=False, progress=False, external=external, external_rows=ext_rows)
    everything = list(modes) + list(external)
    order = [m for i in range(3) for m in mode_order(everything, i)]
    engine_order = [c[1] for c in calls(engine)]
    assert engine_order == [m for m in order if m in modes]
    assert [(r.id, r.mode) for r in rows] == [(p.id, m) for i, p in enumerate(PROMPTS[:3])
                                              for m in mode_order(everything, i) if m in modes]
    assert [(s[0], s[1]) for s in seen] == [(p.id, m) for i, p in enumerate(PROMPTS[:3])
                                            for m in mode_order(everything, i) if m in external]
    assert seen[0][2] == "<user>prompt 0\n<assistant>"  # the engine's chat template
    assert ext_rows[0] == {"id": "p0", "category": "code", "mode": "llama.cpp:plain", "tokens": 16,
                           "seconds": 0.2, "tokens_per_second": 80.0}
    assert len(ext_rows) == 6


SCHEMA = '{"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, ' \
         '"required": ["name", "age"], "additionalProperties": false}'


def test_schema_modes_constrain_each_prompt_by_its_schema_and_check_the_answer():
    prompts = [Prompt("j0", "json", "extract", SCHEMA), Prompt("j1", "json", "extract", SCHEMA)]
    engine = FakeEngine()
    rows = run(engine, prompts, ("auto", "auto+schema"), 16, warmup=False, progress=False)
    assert [c.kind if c else None for c in (r.constraint for r in engine.requests)] == [None, "json_schema", "json_schema", None]
    assert all(c is None or c.value == SCHEMA for c in (r.constraint for r in engine.requests))
    assert [m for _, m, _ in calls(engine)] == ["auto"] * 4  # the engine's mode is the base mode
    by_mode = {(r.id, r.mode): r.valid for r in rows}
    assert by_mode == {("j0", "auto"): None, ("j0", "auto+schema"): True,
                       ("j1", "auto+schema"): True, ("j1", "auto"): None}
    engine = FakeEngine()
    engine.answer = '{"name": "Ann", "age": "three"}'  # parses, but the schema wants an integer
    rows = run(engine, prompts[:1], ("auto+schema",), 16, warmup=False, progress=False)
    assert rows[0].valid is False
    engine.answer = '{"name": "Ann", '  # does not parse
    assert run(engine, prompts[:1], ("auto+schema",), 16, warmup=False, progress=False)[0].valid is False


def test_schema_mode_needs_a_schema_on_every_prompt():
    assert parse_modes("plain+schema,auto") == ("plain+schema", "auto")
    with pytest.raises(BadRequest, match="modes"):
        parse_modes("fast+schema")
    with pytest.raises(BadRequest, match="p0 has none"):
        run(FakeEngine(), PROMPTS[:1], ("auto+schema",), 16, warmup=False, progress=False)


def test_modes_of_another_engine_run_in_the_same_rotation():
    main, head = FakeEngine(), FakeEngine()
    modes = ("plain", "tree", "head:tree")
    rows = run(main, PROMPTS, modes, 16, progress=False, others={"head": head})
    assert [(r.id, r.mode) for r in rows] == [(p.id, m) for i, p in enumerate(PROMPTS) for m in mode_order(modes, i)]
    assert [c[1] for c in calls(head)] == ["tree"] * (1 + len(PROMPTS))  # its warm-up, then one per prompt
    assert [c[1] for c in calls(main)].count("tree") == 1 + len(PROMPTS)
    with pytest.raises(BadRequest, match="names no engine"):
        run(main, PROMPTS, ("plain", "draft2:tree"), 16, progress=False, warmup=False)
