"""The pieces tools/gpu-bench.sh runs: T(n) with steady and alternating shapes
(edgespec.bench.cost_curve over edgespec.economics.measure) and the greedy mismatch count by
verification width (edgespec.bench.mismatch), on a tiny real GGUF where a model is needed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgespec.bench.cost_curve import parse_sizes
from edgespec.bench.mismatch import WidthCount, first_difference, to_markdown, tree_for_width
from edgespec.session import TREE_EXPAND, TREE_WIDTH
from tests.tiny_gguf import write_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2  # one stopped early
    assert first_difference([], []) is None


def test_width_count_adds_up() -> None:
    c = WidthCount(8)
    c.add([1, 2, 3, 4], [1, 2, 3, 4], forwards=2, drafted=14)
    c.add([1, 2, 3, 4], [1, 2, 9, 9], forwards=1, drafted=7)
    d = c.as_dict()
    assert (d["prompts"], d["diverged"], d["tokens"], d["same_prefix"]) == (2, 1, 8, 6)
    assert d["first_differences"] == [None, 2]
    assert d["mean_verify_tokens"] == 8.0
    md = to_markdown({"settings": {"prompts": 2, "max_tokens": 4, "n_gpu_layers": -1, "flash_attn": False},
                      "backend": "cuda", "widths": [d]})
    assert "| 8 | 8.0 | 1 / 2 | 6 / 8 |" in md


@pytest.mark.parametrize("width", [2, 4, 5, 8, 16, 32, 64, 65])
def test_the_tree_for_a_width_grows_its_nodes(width: int) -> None:
    """width - 1 nodes, and levels enough: the explicit tree's level 1 holds TREE_WIDTH nodes,
    each further level TREE_EXPAND x TREE_WIDTH."""
    nodes, depth = tree_for_width(width)
    assert nodes == width - 1
    assert TREE_WIDTH + (depth - 1) * TREE_EXPAND * TREE_WIDTH >= nodes
    assert depth == 1 or TREE_WIDTH + (depth - 2) * TREE_EXPAND * TREE_WIDTH < nodes


def test_a_width_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="width"):
        tree_for_width(1)
    with pytest.raises(ValueError, match="width"):
        tree_for_width(66)


def test_parse_sizes() -> None:
    assert parse_sizes("1-4,8,16") == [1, 2, 3, 4, 8, 16]
    assert parse_sizes("2,1,2") == [1, 2]
    for bad in ("", "0-3", "4-2", "x"):
        with pytest.raises(ValueError):
            parse_sizes(bad)


def test_steady_and_alternating_curves_on_a_real_gguf(tiny: Path, tmp_path: Path) -> None:
    """Both shapes measured for two models, every size, through the module's command line."""
    from edgespec.bench.cost_curve import main

    out = tmp_path / "t.json"
    md = tmp_path / "t.md"
    assert main(["--model", f"a={tiny}", "--model", f"b={tiny}", "--sizes", "1-3,8", "--rounds", "1",
                 "--context", "16", "--threads", "1", "--no-flash-attn", "--json", str(out),
                 "--markdown", str(md)]) == 0
    r = json.loads(out.read_text())
    assert set(r["curves"]) == {"steady", "alternate"}
    for shape in r["curves"].values():
        assert set(shape) == {"a", "b"}
        for table in shape.values():
            assert set(table) == {"1", "2", "3", "8"} and all(t > 0 for t in table.values())
    assert r["settings"]["flash_attn"] is False
    assert "| 8 |" in md.read_text()


def test_measure_alternates_and_repeats_shapes(tiny: Path, monkeypatch) -> None:
    """`alternate` puts an untimed one-token forward before every timed one, `repeat` that many
    untimed forwards of the timed size."""
    from edgespec import economics

    calls: list[int] = []
    real = economics._Timer._forward

    def spy(self, n: int) -> float:
        calls.append(n)
        return real(self, n)

    monkeypatch.setattr(economics._Timer, "_forward", spy)
    economics.measure([(tiny, (4,))], context=8, rounds=1, threads=1, alternate=True, repeat=2)
    assert calls[-4:] == [4, 4, 1, 4]  # the timed round: two warm, one token, the timed forward
    calls.clear()
    economics.measure([(tiny, (4,))], context=8, rounds=1, threads=1)
    assert calls[-1:] == [4] and 1 not in calls[2:]
