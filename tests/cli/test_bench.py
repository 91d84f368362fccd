"""`edgespec bench` argument errors: one line, exit 2, before any model is loaded."""

import json

import pytest
from typer.testing import CliRunner

from edgespec.cli.main import app


@pytest.fixture()
def invoke():
    runner = CliRunner()

    def _invoke(*args):
        return runner.invoke(app, ["bench", *args])

    return _invoke


def test_bench_is_registered(invoke):
    res = invoke("--help")
    assert res.exit_code == 0 and "--modes" in res.output and "--n-gpu-layers" in res.output


def test_unknown_mode(invoke):
    res = invoke("--modes", "plain,warp")
    assert res.exit_code == 2 and "error: modes: must be among plain, chain, tree, auto (each optionally +schema and/or +suffix), got 'warp'" in res.output


def test_bad_suite_line(invoke, tmp_path):
    f = tmp_path / "s.jsonl"
    f.write_text('{"id": "a", "category": "c", "prompt": "p"}\n{"id": "b", "prompt": "p"}\n')
    res = invoke("--suite", str(f))
    assert res.exit_code == 2 and f"{f}:2: missing field 'category'" in res.output


def test_missing_model(invoke, tmp_path):
    res = invoke("--suite", "code", "--target", str(tmp_path / "nope.gguf"), "--draft", "none")
    assert res.exit_code == 2 and "nope.gguf" in res.output


def test_bad_anchor_file(invoke, tmp_path):
    f = tmp_path / "a.json"
    f.write_text(json.dumps({"results": [{"id": "x", "mode": "plain"}]}))
    res = invoke("--anchor", str(f))
    assert res.exit_code == 2 and "results[0] lacks category, tokens, seconds, tokens_per_second" in res.output


def test_anchor_file_and_anchor_bin_are_exclusive(invoke, tmp_path):
    f = tmp_path / "a.json"
    f.write_text(json.dumps({"results": []}))
    res = invoke("--anchor", str(f), "--anchor-bin", str(tmp_path))
    assert res.exit_code == 2 and "anchor_bin" in res.output and "not both" in res.output


def test_anchor_bin_must_be_a_directory(invoke, tmp_path):
    res = invoke("--anchor-bin", str(tmp_path / "nope"))
    assert res.exit_code == 2 and "anchor_bin" in res.output and "not a directory" in res.output
    res = invoke("--anchor-bin", str(tmp_path), "--anchor-draft-max", "0")
    assert res.exit_code == 2 and "anchor_draft_max" in res.output


def test_anchor_draft_needs_anchor_bin_and_a_file(invoke, tmp_path):
    res = invoke("--anchor-draft", str(tmp_path / "d.gguf"))
    assert res.exit_code == 2 and "anchor_draft: only with --anchor-bin" in res.output


def test_headline_groups_must_name_suite_categories(invoke, tmp_path):
    f = tmp_path / "s.jsonl"
    f.write_text('{"id": "a", "category": "sql", "prompt": "p"}\n{"id": "b", "category": "ood", "prompt": "p"}\n')
    res = invoke("--suite", str(f), "--structured", "sql,codegen")
    assert res.exit_code == 2 and "error: structured: no category 'codegen' in the suite (it has: sql, ood)" in res.output
    res = invoke("--suite", str(f), "--drift", " , ")
    assert res.exit_code == 2 and "error: drift:" in res.output


def test_sampling_options_are_checked(invoke, tmp_path):
    res = invoke("--top-p", "0.9")
    assert res.exit_code == 2 and "error: temperature: top_k / top_p / min_p need a temperature > 0" in res.output
    res = invoke("--temperature", "0.7", "--top-p", "1.5")
    assert res.exit_code == 2 and "error: top_p: must be in (0, 1], got 1.5" in res.output
    res = invoke("--temperature", "-1")
    assert res.exit_code == 2 and "error: temperature: must be in [0, 100]" in res.output
    res = invoke("--temperature", "0.7", "--anchor-bin", str(tmp_path))
    assert res.exit_code == 2 and "error: anchor_bin: llama.cpp's anchor runs are greedy" in res.output
