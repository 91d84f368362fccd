"""`edgespec plan --measure`'s arithmetic (edgespec/economics.py) on made-up timing tables, and
one real measurement of the demo pair (slow)."""

from __future__ import annotations

import json

import pytest

from edgespec.economics import break_even, drafter_verdict, economics, render, speedup, tokens_per_step

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


def test_plan_measure_refuses_an_acceptance_outside_0_1(tmp_path) -> None:
    from typer.testing import CliRunner

    from edgespec.cli.main import app

    r = CliRunner().invoke(app, ["plan", "--measure", "--target", str(tmp_path / "t.gguf"), "--acceptance", "0.7,1.2"])
    assert r.exit_code == 2 and "acceptance" in r.output
