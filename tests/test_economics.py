"""`edgespec plan --measure`'s arithmetic (edgespec/economics.py) on made-up timing tables, and
one real measurement of the demo pair (slow)."""

from __future__ import annotations

import json

import pytest

from edgespec.economics import break_even, drafter_verdict, economics, render, speedup, stream_sizes, tokens_per_step

FLAT = {n: 0.010 for n in range(1, 65)}  # verification free: a GPU's small batches
LINEAR = {n: 0.010 * n + 0.001 * (n > 1) for n in range(1, 65)}  # dearer than n forwards: never pays


def test_tokens_per_step_is_the_geometric_sum() -> None:
    assert tokens_per_step(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert tokens_per_step(1.0, 4) == 5
    assert tokens_per_step(0.0, 7) == 1


def test_speedup_by_hand() -> None:
    t = {1: 0.010, 5: 0.020}
    # k = 4 at a = 0.8: 3.3616 tokens for 20 ms + 4 x 1 ms, against 10 ms a token
    assert speedup(0.8, 4, t, 0.001) == pytest.approx((1 - 0.8 ** 5) / 0.2 / 0.024 * 0.010)


def test_break_even() -> None:
    # free verification and free drafts pay at any acceptance above zero
    assert break_even(3, FLAT, 0.0) == 0.0
    # verification as dear as n forwards never pays, even at acceptance 1 with free drafts
    assert break_even(3, LINEAR, 0.0) is None
    # T(2) = 1.5 T(1), free draft: 1 + a = 1.5 at a = 0.5
    assert break_even(1, {1: 1.0, 2: 1.5}, 0.0) == pytest.approx(0.5, abs=1e-3)
    a = break_even(4, {1: 1.0, 5: 2.0}, 0.05)
    assert a is not None
    assert speedup(a, 4, {1: 1.0, 5: 2.0}, 0.05) == pytest.approx(1.0, abs=1e-3)


def test_economics_on_a_gpu_like_table() -> None:
    e = economics(FLAT, 0.0005)
    assert e.pays
    best = e.best(0.8)
    assert best.speedups[0.8] == max(d.speedups[0.8] for d in e.depths)
    assert 1 < best.k < 63  # deep chains stop paying: each draft token costs 5 % of a forward
    d = e.as_dict()
    assert json.loads(json.dumps(d))["best"]["0.8"]["k"] == best.k
    assert "no chain depth pays" not in render(e)


def test_economics_says_plainly_when_nothing_pays() -> None:
    e = economics(LINEAR, 0.003)
    assert not e.pays
    assert all(d.break_even is None for d in e.depths)
    assert "no chain depth pays on this box" in render(e)


def test_drafter_verdict_is_plan_measures_verdict() -> None:
    cheap = drafter_verdict(FLAT, 0.001)
    assert cheap is not None and cheap["pays"] and cheap["ceiling"] > 2.0 and cheap["draft_share"] == 0.1
    dear = drafter_verdict(LINEAR, 0.003)
    assert dear is not None and not dear["pays"] and dear["ceiling"] < 1.0
    # the demo's F32 curve (plan --measure's table): its Q8_0 draft at 0.59 of a forward pays 1.08x
    # at 0.8 (depth 1); at 0.85 of a forward nothing does
    demo = {1: 0.0706, 2: 0.0763, 3: 0.0855, 4: 0.0897, 5: 0.094, 6: 0.1022, 8: 0.116}
    cheap, costly = drafter_verdict(demo, 0.0414), drafter_verdict(demo, 0.060)
    assert cheap is not None and cheap["pays"] and costly is not None and not costly["pays"]
    assert drafter_verdict({1: 0.01}, 0.001) is None  # one size: nothing to judge


# the 1B-cost target on one core of this CPU (edgespec.bench.cost_curve, ms): 4, 8 and 16 tokens a kernel
CPU_1B = {1: 0.078, 4: 0.1155, 8: 0.2187, 12: 0.2844, 16: 0.2928, 20: 0.3805, 24: 0.4666, 28: 0.5542, 32: 0.5436}


def test_several_streams_price_their_chains_together() -> None:
    # 4 streams of depth 1 verify 8 tokens against plain's 4: at a = 0.8, 1.8 tokens a stream for
    # T(8) + T_draft(4) against T(4) for one
    assert speedup(0.8, 1, CPU_1B, 0.01, streams=4) == pytest.approx(1.8 / (0.2187 + 0.01) * 0.1155)
    # one stream is the single-stream arithmetic
    assert speedup(0.7, 3, CPU_1B, 0.005, streams=1) == speedup(0.7, 3, CPU_1B, 0.005)
    e = economics(CPU_1B, 0.01, streams=4)
    assert [d.k for d in e.depths] == [1, 2, 3, 4, 5, 6, 7]
    assert e.as_dict()["streams"] == 4 and e.as_dict()["draft_share"] == pytest.approx(0.01 / 0.1155)


def test_a_chain_that_pays_alone_stops_paying_beside_other_streams() -> None:
    """On a CPU whose forward grows with its tokens, one stream's chain pays and four streams'
    do not; on a flat (GPU-like) curve four streams pay as one does. An implementation that
    priced the streams' verification at one stream's width would call four streams a win."""
    alone = economics(CPU_1B, 0.006)
    assert alone.pays and alone.best(0.8).speedups[0.8] > 1.6
    # four streams: only depth 3 (16 tokens, where the kernel's 16-token step makes 12-16 nearly
    # one price) stays above plain, at 1.06x
    four = economics(CPU_1B, 0.01, streams=4)
    assert four.best(0.8).k == 3 and 1.0 < four.best(0.8).speedups[0.8] < 1.1
    assert "ceiling at acceptance 0.8: 1.06x plain at 4 streams (chain depth 3)" in render(four)
    dear = economics(CPU_1B, 0.03, streams=4)
    assert not dear.pays
    assert "no chain depth pays on this box with this draft at 4 streams" in render(dear)
    flat = economics(FLAT, 0.0005, streams=4)
    assert flat.pays
    assert flat.best(0.8).speedups[0.8] == pytest.approx(economics(FLAT, 0.0005).best(0.8).speedups[0.8], rel=0.05)


def test_stream_sizes() -> None:
    assert stream_sizes(1, (1, 2, 3)) == (1, 2, 3)
    assert stream_sizes(4) == (1, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60, 64)
    assert stream_sizes(8, widest=32) == (1, 8, 16, 24, 32)
    with pytest.raises(ValueError):
        economics(CPU_1B, 0.0, streams=0)
    with pytest.raises(ValueError):  # no width of 5 measured
        economics(CPU_1B, 0.0, streams=5)


def test_economics_needs_one_token_and_a_wider_forward() -> None:
    with pytest.raises(ValueError):
        economics({1: 0.01}, 0.0)


@pytest.mark.slow
def test_plan_measure_on_the_demo_pair(demo_pair) -> None:
    from typer.testing import CliRunner

    from edgespec.cli.main import app

    r = CliRunner().invoke(app, ["plan", "--measure", "--cpu", "--target", str(demo_pair.target), "--draft",
                                 str(demo_pair.draft), "--rounds", "1", "--context", "64", "--threads", "1",
                                 "--alternate", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["alternate"] and d["n_gpu_layers"] == 0
    assert set(d["t_target_seconds"]) >= {"1", "2", "64"}
    assert 0 < d["draft_share"] < 2
    assert {x["k"] for x in d["depths"]} >= {1, 4, 63}


@pytest.mark.slow
def test_plan_measure_at_four_streams_on_the_demo_pair(demo_pair) -> None:
    from typer.testing import CliRunner

    from edgespec.cli.main import app

    r = CliRunner().invoke(app, ["plan", "--measure", "--cpu", "--target", str(demo_pair.target), "--draft",
                                 str(demo_pair.draft), "--rounds", "1", "--context", "64", "--threads", "1",
                                 "--parallel", "4", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["streams"] == 4
    assert set(d["t_target_seconds"]) == {str(n) for n in stream_sizes(4)}
    assert [x["k"] for x in d["depths"]] == list(range(1, 16))


def test_plan_measure_refuses_streams_out_of_range(tmp_path) -> None:
    from typer.testing import CliRunner

    from edgespec.cli.main import app

    r = CliRunner().invoke(app, ["plan", "--measure", "--target", str(tmp_path / "t.gguf"), "--parallel", "0"])
    assert r.exit_code == 2 and "--parallel" in r.output


def test_plan_measure_refuses_an_acceptance_outside_0_1(tmp_path) -> None:
    from typer.testing import CliRunner

    from edgespec.cli.main import app

    r = CliRunner().invoke(app, ["plan", "--measure", "--target", str(tmp_path / "t.gguf"), "--acceptance", "0.7,1.2"])
    assert r.exit_code == 2 and "acceptance" in r.output
