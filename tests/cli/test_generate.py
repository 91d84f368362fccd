"""The local CLI: bad input is one line naming the value, exit code 2, never a traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

EDGESPEC = [sys.executable, "-m", "edgespec.cli.main"]


def run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*EDGESPEC, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--mode", "fast"], "mode"),
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["--top-p", "1.5"], "top_p"),
        (["--min-p", "1"], "min_p"),
        (["--max-tokens", "0"], "max_tokens"),
        (["--tree-depth", "0"], "tree_depth"),
        (["--target", "/nonexistent/model.gguf"], "/nonexistent/model.gguf"),
    ],
)
def test_generate_bad_input_is_one_line_exit_2(args, needle):
    r = run("generate", "hello", *args)
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip()
    assert err.startswith("error: ") and needle in err, err
    assert "Traceback" not in r.stderr and len(err.splitlines()) == 1, err


@pytest.mark.slow
def test_generate_json_auto_reports_its_stats_and_the_controller(demo_pair):
    """One local run in the default mode (auto): the JSON object, its speculation stats, and the
    controller's summary (a CLI run loads and calibrates both models: one run checks all three)."""
    r = run("generate", "Write a Python function that adds two numbers.", "--max-tokens", "24", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) == {"text", "tokens", "finish_reason", "stats"}
    assert out["finish_reason"] in ("length", "eos") and 1 <= len(out["tokens"]) <= 24
    st = out["stats"]
    for k in ("target_forwards", "drafted_tokens", "accepted_tokens", "tau", "tokens_per_second", "seconds"):
        assert k in st
    assert st["tau"] == pytest.approx(len(out["tokens"]) / st["target_forwards"], rel=0.15)
    assert {"steps_per_mode", "breaker_transitions", "final_shape", "state"} <= set(st["controller"])


@pytest.mark.slow
def test_a_draft_of_another_tokenization_drafts_through_text(engine, tmp_path):
    """A draft whose tokenization differs (BOS added by one and not the other) is no longer
    refused: it drafts through text (edgespec/drafters/text.py), and the greedy text is plain's
    (the plain reference decoded by the suite's in-process engine, as tests/server/test_exact_replay.py
    does for the daemon, instead of a second CLI run that loads and calibrates both models again)."""
    from gguf import GGUFReader

    from edgespec.sampling import SamplingParams
    from edgespec.types import GenerationRequest, SpeculationParams

    bad = tmp_path / "other-vocab.gguf"
    shutil.copy(engine.cfg.draft.path, bad)
    reader = GGUFReader(bad, "r+")
    field = reader.fields["tokenizer.ggml.add_bos_token"]
    part = field.parts[field.data[0]]
    part[0] = not part[0]  # BOS added by one and not the other: not the target's tokenization
    del reader
    prompt = "List the days of the week."
    r = run("generate", prompt, "--draft", str(bad), "--max-tokens", "16", "--mode", "chain", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    plain = engine.generate(GenerationRequest(tuple(engine.encode_chat([("user", prompt)])),
                                              SamplingParams(max_tokens=16), SpeculationParams(mode="plain")))
    assert out["tokens"] == plain.token_ids
    assert out["stats"]["drafted_tokens"] > 0  # it drafted, not fell back to plain


@pytest.mark.slow
def test_selftest_json_passes_on_the_demo_pair(demo_pair):
    r = run("selftest", "--json", "--trials", "20000")
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["passed"] is True
    names = {c["name"] for c in out["checks"]}
    assert "greedy_tree_equals_plain" in names and any(n.endswith(":tree") for n in names)
    assert all(set(c) == {"name", "p_value", "passed"} for c in out["checks"])
