import json

import pytest

from edgespec.bench import report as rep
from edgespec.bench.plot import plot
from edgespec.bench.runner import Row, run
from edgespec.bench.suite import Prompt
from tests.fake_engine import FakeEngine

MODES = ("plain", "chain", "tree", "auto")
PROMPTS = [Prompt(f"{c}-{i}", c, f"{c} prompt {i}") for c in ("code", "json", "drift") for i in range(2)]
ROW_KEYS = {"id", "category", "mode", "tokens", "seconds", "tokens_per_second", "tau", "target_forwards"}
EXTRA_KEYS = {"draft_forwards", "target_seconds", "draft_seconds", "accepted_per_depth",  # where the time went
              "valid",  # MODE+schema rows
              "index", "proposed_by_source", "accepted_by_source"}  # the stream position, drafts by source


def row(id, cat, mode, tokens, seconds, forwards):
    return Row(id, cat, mode, tokens, seconds, tokens / seconds, tokens / forwards, forwards)


def make_report(anchor=None):
    rows = run(FakeEngine(), PROMPTS, MODES, 16, progress=False)
    machine = {"cpu": "Fake CPU", "cores": 2, "gpu": None, "llama_cpp_python": "0.3.36"}
    settings = {"max_tokens": 16, "target": "t.gguf", "draft": "d.gguf"}
    return rep.build_report(rows, command="edgespec bench --suite x", machine=machine, settings=settings, anchor=anchor)


def test_summary_arithmetic():
    rows = [
        row("a", "code", "plain", 10, 1.0, 10),
        row("b", "code", "plain", 30, 1.0, 30),  # 40 tokens / 2 s = 20 tok/s; mean of 10 and 30 = 20
        row("a", "code", "tree", 10, 0.25, 2),
        row("b", "code", "tree", 30, 1.75, 10),  # 40 / 2.0 = 20 tok/s ... speedup 1.0; tau 40/12
        row("c", "chat", "plain", 8, 0.5, 8),
        row("c", "chat", "tree", 8, 0.25, 4),
    ]
    s = rep.summarize(rows)
    assert list(s) == ["code", "chat", "overall"]
    p, t = s["code"]["plain"], s["code"]["tree"]
    assert (p["n"], p["tokens"], p["tokens_per_second"], p["mean_tokens_per_second"], p["speedup"]) == (2, 40, 20.0, 20.0, 1.0)
    assert t["tokens_per_second"] == 20.0 and t["mean_tokens_per_second"] == pytest.approx((40 + 30 / 1.75) / 2, abs=1e-3)
    assert t["tau"] == pytest.approx(40 / 12, abs=1e-4) and t["mean_tau"] == pytest.approx((5 + 3) / 2)
    assert s["chat"]["tree"]["speedup"] == 2.0
    # overall pools every row: plain 48 tokens / 2.5 s, tree 48 / 2.25 s
    assert s["overall"]["tree"]["speedup"] == pytest.approx((48 / 2.25) / (48 / 2.5), abs=1e-3)


def test_no_plain_means_no_speedup():
    s = rep.summarize([row("a", "code", "tree", 10, 1.0, 5)])
    assert s["code"]["tree"]["speedup"] is None


def test_json_schema(tmp_path):
    report = make_report()
    out = tmp_path / "r.json"
    rep.write_json(report, str(out))
    data = json.loads(out.read_text())
    assert {"command", "machine", "settings", "results", "summary", "headline"} <= set(data)
    assert len(data["results"]) == len(PROMPTS) * len(MODES)
    assert all(set(r) == ROW_KEYS | EXTRA_KEYS for r in data["results"])
    assert set(data["summary"]) == {"code", "json", "drift", "overall"}
    assert set(data["summary"]["code"]) == set(MODES)
    # the fake: tree = 4 tokens per forward at 1.6x the forward time -> 2.5x plain
    assert data["summary"]["code"]["tree"]["speedup"] == 2.5
    h = data["headline"]
    assert h["structured_best_mode"] == "tree" and h["structured_best_speedup"] == 2.5
    assert h["structured_tree_tau"] == 4.0
    assert h["drift_auto_speedup"] == pytest.approx(data["summary"]["drift"]["auto"]["speedup"], abs=2e-3)
    assert h["structured_categories"] == ["code", "json"] and h["drift_categories"] == ["drift"]


def anchor_data():
    results = []
    for p in PROMPTS:
        results.append({"id": p.id, "category": p.category, "mode": "plain", "tokens": 16, "seconds": 0.32,
                        "tokens_per_second": 50.0})
        results.append({"id": p.id, "category": p.category, "mode": "speculative", "tokens": 16, "seconds": 0.2,
                        "tokens_per_second": 80.0, "n_drafted": 12, "n_accept": 9})
    results.append({"id": "only-in-anchor", "category": "chat", "mode": "plain", "tokens": 16, "seconds": 1.0,
                    "tokens_per_second": 16.0})
    return {"command": "tools/llama-anchor.sh run ...", "settings": {"draft_max": 4}, "results": results}


def test_anchor_ratios():
    report = make_report(anchor_data())
    ratios = report["anchor"]["edgespec_over_llama_cpp"]
    assert "chat" not in ratios  # only prompts both runs have
    # edgespec plain: 16 tokens / 0.16 s = 100 tok/s vs 50 -> 2.0; tree 250 vs speculative 80
    assert ratios["code"]["plain"]["ratio"] == 2.0
    assert ratios["overall"]["tree"] == {"edgespec_tokens_per_second": 250.0, "llama_cpp_mode": "speculative",
                                         "llama_cpp_tokens_per_second": 80.0, "ratio": 3.125}
    assert report["headline"]["auto_over_llama_cpp_speculative"] == ratios["overall"]["auto"]["ratio"]
    assert report["headline"]["plain_over_llama_cpp_plain"] == 2.0


def test_markdown():
    md = rep.to_markdown(make_report(anchor_data()))
    assert "| category | mode | prompts | tokens | tok/s | speedup vs plain | tau |" in md
    assert "| code | tree | 2 | 32 | 250.0 | 2.50 | 4.00 |" in md
    assert "| overall | plain | 6 | 96 | 100.0 | 1.00 | 1.00 |" in md
    assert "## edgespec over llama.cpp" in md and "| overall | tree | 250.0 | speculative | 80.0 | 3.12 |" in md
    assert "Fake CPU (2 cores)" in md and "`edgespec bench --suite x`" in md


@pytest.mark.parametrize("with_anchor", [False, True])
def test_plot_is_png(tmp_path, with_anchor):
    out = tmp_path / "p.png"
    plot(make_report(anchor_data() if with_anchor else None), str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_machine_info_keys():
    m = rep.machine_info("cpu")
    assert {"cpu", "cores", "llama_cpp_python", "gpu", "backend"} <= set(m)
    assert m["llama_cpp_python"] == "0.3.36"


def test_markdown_anchor_without_common_prompts():
    anchor = anchor_data()
    for r in anchor["results"]:
        r["id"] = "other-" + r["id"]
    report = make_report(anchor)
    assert report["anchor"]["edgespec_over_llama_cpp"] == {}
    assert "No prompt ids in common with the anchor run" in rep.to_markdown(report)
    assert "auto_over_llama_cpp_speculative" not in report["headline"]


def test_time_split_and_costs():
    rows = run(FakeEngine(), PROMPTS, MODES, 16, progress=False)
    costs = {"target_seconds": {"1": 0.010, "4": 0.0125}, "draft_seconds": {"1": 0.004}}
    report = rep.build_report(rows, command="c", machine={}, settings={}, costs=costs)
    split = report["time_split"]
    assert set(split) == {"structured", "overall"}
    tree = split["overall"]["tree"]  # 4 tokens per forward, 10 ms target + 6 ms draft per forward
    assert tree["tau"] == 4.0
    assert (tree["target_ms_per_token"], tree["draft_ms_per_token"], tree["other_ms_per_token"]) == (2.5, 1.5, 0.0)
    assert tree["draft_forwards_per_token"] == 0.75 and tree["accepted_at_least"] == [1.0, 1.0, 1.0]
    assert split["overall"]["plain"]["accepted_at_least"] == [] and split["overall"]["plain"]["draft_ms_per_token"] == 0
    md = rep.to_markdown(report)
    assert "## Where the time goes" in md and "| overall | tree | 4.00 | 2.50 | 1.50 | 0.00 | 10.00 | 0.75 | 1.00 1.00 1.00 |" in md
    assert "| target | 10.0 | 12.5 |" in md and "| draft | 4.0 | – |" in md


def test_ceiling_from_costs():
    """The bound a chain of k drafts could reach if every draft were accepted: k + 1 tokens for a
    2-token draft catch-up, k - 1 one-token draft forwards and one verification of k + 1 tokens,
    against k + 1 plain forwards. Hand-computed from piecewise-linear tables."""
    costs = {"target_seconds": {"1": 0.010, "2": 0.010, "4": 0.012, "8": 0.016},
             "draft_seconds": {"1": 0.004, "2": 0.005}}
    bound = rep.ceiling(costs, depths=(1, 3, 4))
    assert bound["draft_over_target"] == 0.4 and (bound["target_ms"], bound["draft_ms"]) == (10.0, 4.0)
    assert bound["chain"]["1"] == {"perfect_draft": round(20 / 15, 3), "free_draft": 2.0}   # 2 x 10 / (5 + 10)
    assert bound["chain"]["3"] == {"perfect_draft": 1.6, "free_draft": round(40 / 12, 3)}   # 4 x 10 / (5 + 8 + 12)
    assert bound["chain"]["4"]["perfect_draft"] == round(50 / 30, 3)  # T(5) = 13 ms, between 4 and 8
    assert (bound["best_depth"], bound["best_perfect_draft"]) == (4, round(50 / 30, 3))
    assert rep.ceiling({"target_seconds": {"1": 0.01}}) is None  # no draft costs: no bound
    rows = run(FakeEngine(), PROMPTS, MODES, 16, progress=False)
    report = rep.build_report(rows, command="c", machine={}, settings={}, costs=costs)
    assert report["headline"]["perfect_draft_ceiling"] == report["ceiling"]["best_perfect_draft"]
    md = rep.to_markdown(report)
    assert "## The ceiling these costs allow" in md and "0.40 of a target forward" in md
    perfect = next(line for line in md.splitlines() if line.startswith("| draft always right |"))
    assert perfect.split(" | ")[1:3] == ["1.33", "1.50"]  # k = 1: 20 / 15; k = 2: 30 / (5 + 4 + 11)
    assert "perfect_draft_ceiling" not in rep.build_report(rows, command="c", machine={}, settings={})["headline"]


def test_ceiling_takes_plain_from_the_run():
    """The bound is over this run's plain speed: T(1) is what the plain rows measured, not the
    cost table's (refined at the run's end, possibly in another host state), and no T(n) is taken
    under it. Here the table says 10 ms and the plain rows 13 ms (a run slowed by the host)."""
    costs = {"target_seconds": {"1": 0.010, "2": 0.010, "4": 0.012, "8": 0.016},
             "draft_seconds": {"1": 0.004, "2": 0.005}}
    bound = rep.ceiling(costs, depths=(1, 4), plain_seconds=0.013)
    assert (bound["target_ms"], bound["table_target_ms"], bound["target_ms_from"]) == (13.0, 10.0, "plain rows")
    assert bound["chain"]["1"] == {"perfect_draft": round(26 / 18, 3), "free_draft": 2.0}  # T(2) = max(10, 13)
    assert bound["chain"]["4"] == {"perfect_draft": round(65 / 30, 3), "free_draft": 5.0}  # 5 x 13 / (5 + 12 + 13)
    assert rep.ceiling(costs, depths=(1,))["target_ms_from"] == "cost table"

    def plain_row(i, forwards, seconds):
        return Row(f"p{i}", "code", "plain", forwards, seconds * 1.1, forwards / (seconds * 1.1), 1.0, forwards,
                   target_seconds=seconds)

    rows = [plain_row(0, 50, 0.6), plain_row(1, 50, 0.7)]  # 1.3 s over 100 forwards
    assert rep.plain_forward_seconds(rows) == pytest.approx(0.013)
    assert rep.plain_forward_seconds([r for r in rows if r.mode != "plain"]) is None
    report = rep.build_report(rows, command="c", machine={}, settings={}, costs=costs)
    assert report["ceiling"]["target_ms"] == 13.0
    md = rep.to_markdown(report)
    assert "13.0 ms: this run's plain forwards; the cost table at the run's end says 10.0" in md


@pytest.mark.parametrize("category, group", [
    ("code", "structured"), ("JSON_extraction", "structured"), ("legal-clauses", "structured"),
    ("rag answers", "structured"), ("sql", "structured"), ("contract_review", "structured"),
    ("drift", "drift"), ("OOD", "drift"), ("out-of-domain", "drift"), ("random_symbols", "drift"),
    ("wordplay", "drift"), ("random-json", "drift"),  # drift wins
    ("chat", None), ("chinese", None), ("food", None), ("encoding", None), ("fragments", None),
])
def test_classify_category_names(category, group):
    assert rep.classify(category) == group


def test_headline_on_a_suite_with_other_category_names():
    """A suite the bench has never seen: its categories are grouped by name, each headline figure
    pools its group's tokens and seconds, and the report says which categories it pooled."""
    rows = []
    for cat, plain_s, auto_s, forwards in (("json_extraction", 1.0, 0.5, 4), ("codegen", 1.0, 0.8, 8),
                                           ("out_of_domain", 1.0, 1.25, 16), ("chat", 1.0, 0.1, 1)):
        rows += [row(f"{cat}-1", cat, "plain", 16, plain_s, 16), row(f"{cat}-1", cat, "auto", 16, auto_s, forwards)]
    report = rep.build_report(rows, command="x", machine={}, settings={})
    h = report["headline"]
    assert h["structured_categories"] == ["json_extraction", "codegen"] and h["drift_categories"] == ["out_of_domain"]
    assert h["structured_best_mode"] == "auto"
    assert h["structured_best_speedup"] == pytest.approx((32 / 1.3) / (32 / 2.0), abs=1e-3)  # chat's 10x left out
    assert h["drift_auto_speedup"] == pytest.approx(0.8, abs=1e-3)
    assert set(report["time_split"]) == {"structured", "overall"}
    # named outright, the groups are taken as given
    h2 = rep.build_report(rows, command="x", machine={}, settings={}, structured=["codegen"], drift=["chat"])["headline"]
    assert h2["structured_best_speedup"] == pytest.approx(1.25, abs=1e-3) and h2["drift_auto_speedup"] == pytest.approx(10.0)
    md = rep.to_markdown({**report, "machine": {}, "settings": {}})
    assert "- structured_categories: json_extraction, codegen" in md


def test_headline_without_structured_categories_says_how_to_name_them():
    rows = [row("c-1", "chat", "plain", 16, 1.0, 16), row("c-1", "chat", "auto", 16, 0.5, 4)]
    report = rep.build_report(rows, command="x", machine={}, settings={})
    assert "structured_best_speedup" not in report["headline"]
    assert "- structured_categories: (none: name them with --structured / --drift)" in rep.to_markdown(report)


def test_structured_output_section_counts_valid_answers_and_compares_with_the_free_mode():
    schema = '{"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}'
    prompts = [Prompt(f"j{i}", "json", "extract", schema) for i in range(3)]
    engine = FakeEngine()
    rows = run(engine, prompts, ("plain", "auto", "auto+schema"), 16, progress=False)
    rows = [r if r.mode != "auto+schema" or r.id != "j1" else Row(**{**r.as_dict(), "valid": False,
                                                                      "accepted_per_depth": ()}) for r in rows]
    machine = {"cpu": "Fake CPU", "cores": 2, "gpu": None, "llama_cpp_python": "0.3.36"}
    report = rep.build_report(rows, command="c", machine=machine, settings={"max_tokens": 16})
    so = report["structured_output"]["auto+schema"]
    assert (so["valid"], so["checked"]) == (2, 3)
    assert so["over_free"] == pytest.approx(so["tokens_per_second"] / so["free_tokens_per_second"], abs=1e-3)
    assert report["headline"]["schema_valid"] == {"auto+schema": "2/3"}
    md = rep.to_markdown(report)
    assert "## Structured output" in md and "| auto+schema | 2/3 |" in md
    assert "structured_output" not in make_report()
