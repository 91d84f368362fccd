"""The serving benchmark's loop with fake clients (pure logic: rotation, concurrency, ratios, the
scenario's window), and the server commands it builds."""

import threading
import time
import tomllib
from pathlib import Path

import pytest

from edgespec.bench.serve_report import to_markdown
from edgespec.bench.serve_run import Level, drafts_since, long_prompt, run_batch, run_levels, run_scenario, warmup_curve
from edgespec.bench.serve_stats import Trace
from edgespec.bench.serve_systems import daemon_sections, llama_server_cmd, toml_config
from edgespec.bench.suite import Prompt
from edgespec.errors import BadRequest

PROMPTS = [Prompt(f"p{i}", "c", f"prompt {i}") for i in range(3)]


class FakeClient:
    """Emits `tokens` chunks of `per_chunk` tokens, `step` seconds apart; logs calls."""

    def __init__(self, system, calls, *, step=0.001, tokens=4, per_chunk=1):
        self.system, self.calls, self.step, self.tokens, self.per_chunk = system, calls, step, tokens, per_chunk
        self.active = 0
        self.peak = 0
        self.lock = threading.Lock()

    def stream(self, prompt_id, prompt, max_tokens, tokens=(), on_chunk=None):
        with self.lock:
            self.calls.append((self.system, prompt_id))
            self.active += 1
            self.peak = max(self.peak, self.active)
        tr = Trace(self.system, prompt_id, time.perf_counter())
        for _ in range(min(self.tokens, max_tokens) // self.per_chunk):
            time.sleep(self.step)
            tr.arrivals.append((time.perf_counter(), self.per_chunk))
            if on_chunk:
                on_chunk(tr)
        with self.lock:
            self.active -= 1
        return tr

    def close(self):
        pass


def test_run_batch_keeps_n_in_flight_and_takes_prompts_in_turn():
    calls = []
    c = FakeClient("a", calls, step=0.01)
    traces, wall = run_batch(c, PROMPTS, start=1, count=5, concurrency=2, max_tokens=4, tokens={})
    assert len(traces) == 5 and wall > 0
    assert c.peak == 2
    assert sorted(p for _, p in calls) == sorted(["p1", "p2", "p0", "p1", "p2"])


def test_run_levels_rotates_systems_and_reports_ratios():
    calls, started = [], []

    def start(n):
        started.append(n)
        clients = {"edgespec-auto": FakeClient("edgespec-auto", calls, per_chunk=2),
                   "edgespec-plain": FakeClient("edgespec-plain", calls, step=0.004)}
        return Level(clients=clients, stop=lambda: started.append(-n))

    levels = run_levels(start, ["edgespec-auto", "edgespec-plain"], PROMPTS, [1, 2], requests=4, rounds=2,
                        max_tokens=4, progress=False)
    assert started == [1, -1, 2, -2]  # each level's servers stopped before the next start
    # warm-up (one each), then round 0: auto, plain; round 1: plain, auto
    order = [s for s, _ in calls[:2 + 8]]
    assert order[:2] == ["edgespec-auto", "edgespec-plain"]
    assert order[2:4] == ["edgespec-auto"] * 2 and order[4:6] == ["edgespec-plain"] * 2
    assert order[6:8] == ["edgespec-plain"] * 2 and order[8:10] == ["edgespec-auto"] * 2
    lv = levels[0]
    assert lv["concurrency"] == 1 and set(lv["systems"]) == {"edgespec-auto", "edgespec-plain"}
    auto = lv["systems"]["edgespec-auto"]
    assert len(auto["rounds_tokens_per_second"]) == 2 and len(auto["requests"]) == 4
    assert auto["pooled"]["completion_tokens"] == 16
    r = lv["ratios"]["edgespec-auto / edgespec-plain"]
    assert len(r["rounds"]) == 2 and r["median"] > 1.5  # auto's fake is much faster
    md = to_markdown({"command": "x", "settings": {"max_tokens": 4, "requests": 4, "rounds": 2, "threads": 1,
                                                    "suite": "s", "prompts": 3, "n_ctx": 512},
                      "machine": {}, "levels": levels})
    assert "| 2 | edgespec-plain |" in md and "edgespec-auto / edgespec-plain" in md
    assert set(lv["warmup_curve"]["edgespec-auto / edgespec-plain"]) == {"0"}  # 2 rounds of 2 requests
    assert "Warm-up curve" in md and "after 0" in md


def trace(system, tokens, t0=0.0, t1=1.0):
    tr = Trace(system, "p", t0)
    tr.arrivals = [(t0 + 0.01, 1), (t1, tokens - 1)]
    return tr


def test_the_warm_up_curve_pools_the_rounds_after_n_requests():
    # four rounds of 10 requests; plain makes 100 tokens a second throughout, auto 100, 150,
    # 200, 300 (a cache warming up): after 0 requests all rounds, after 10 the last three, after
    # 30 the last one
    def rounds(rates):
        return [([trace("x", 10) for _ in range(10)], 10 * 10 / r) for r in rates]

    cells = {"edgespec-auto": rounds([100, 150, 200, 300]), "edgespec-plain": rounds([100] * 4)}
    curve = warmup_curve(cells, [10, 10, 10, 10])
    pts = curve["edgespec-auto / edgespec-plain"]
    assert set(pts) == {"0", "10", "30"}  # no round starts after 100 requests
    assert pts["30"] == pytest.approx(3.0)
    assert pts["10"] == pytest.approx(300 / (1 / 1.5 + 1 / 2 + 1 / 3) / 100)  # tokens over wall, not a mean of ratios
    assert pts["0"] == pytest.approx(400 / (1 + 1 / 1.5 + 1 / 2 + 1 / 3) / 100)
    assert list(curve) == ["edgespec-auto / edgespec-plain"]  # only the pairs that ran


def test_the_drafts_by_source_are_the_levels_own_and_reach_the_report():
    before = {"proposed_by_source": {"suffix": 10, "draft": 5}, "accepted_by_source": {"suffix": 4, "draft": 5},
              "prompt_store": {"entries": 3, "bytes": 1 << 20, "hits": 2, "restored_tokens": 100, "stored": 3}}
    now = {"proposed_by_source": {"suffix": 110, "draft": 5, "prompt_lookup": 50},
           "accepted_by_source": {"suffix": 64, "draft": 5, "prompt_lookup": 10},
           "suffix_cache": {"enabled": 1.0, "documents": 40.0, "bytes": 4096.0, "hits": 30.0, "lookups": 90.0},
           "prompt_store": {"entries": 5, "bytes": 5 << 20, "hits": 12, "restored_tokens": 700, "stored": 9}}
    d = drafts_since(now, before)
    # the store's entries and bytes now, its hits and tokens written back over the level
    assert d["prompt_store"] == {"entries": 5, "bytes": 5 << 20, "hits": 10, "restored_tokens": 600, "stored": 6}
    assert d["by_source"] == {"suffix": {"proposed": 100, "accepted": 60, "acceptance": 0.6},
                              "prompt_lookup": {"proposed": 50, "accepted": 10, "acceptance": 0.2}}  # draft: none since
    calls = []
    level = Level(clients={"edgespec-auto": FakeClient("edgespec-auto", calls)}, stop=lambda: None,
                  draft_stats=lambda: d)
    levels = run_levels(lambda n: level, ["edgespec-auto"], PROMPTS, [1], requests=2, rounds=1, max_tokens=4,
                        progress=False)
    assert levels[0]["drafts"] == d
    md = to_markdown({"command": "x", "settings": {"max_tokens": 4, "requests": 2, "rounds": 1, "threads": 1,
                                                    "suite": "s", "prompts": 3, "n_ctx": 512},
                      "machine": {}, "levels": levels})
    assert "| 1 | suffix | 100 | 60 | 60 % |" in md and "40 replies, 4 KiB" in md
    assert "| 1 | prompt store | 5 prefills, 5 MiB | 10 hits | 600 tokens written back |" in md


def test_the_requests_each_drafter_drafted_for_are_the_levels_own_and_reach_the_report():
    before = {"requests_by_drafter": {"draft": 2, "head": 1}}
    now = {"proposed_by_source": {"head": 40}, "accepted_by_source": {"head": 20},
           "requests_by_drafter": {"draft": 5, "head": 9}}
    d = drafts_since(now, before)
    assert d["requests_by_drafter"] == {"draft": 3, "head": 8}
    assert "requests_by_drafter" not in drafts_since({"requests_by_drafter": {"draft": 2}}, before)  # none since
    level = Level(clients={"edgespec-auto": FakeClient("edgespec-auto", [])}, stop=lambda: None,
                  draft_stats=lambda: d, info={"daemon": {"draft": "q8.gguf", "head": "h.gguf"}})
    levels = run_levels(lambda n: level, ["edgespec-auto"], PROMPTS, [1], requests=2, rounds=1, max_tokens=4,
                        progress=False)
    md = to_markdown({"command": "x", "settings": {"max_tokens": 4, "requests": 2, "rounds": 1, "threads": 1,
                                                    "suite": "s", "prompts": 3, "n_ctx": 512},
                      "machine": {}, "levels": levels})
    assert "| 1 | requests by drafter | draft 3, head 8 | | |" in md
    assert "N=1: q8.gguf and h.gguf beside it" in md


def test_rounds_must_fit_the_requests():
    with pytest.raises(BadRequest):
        run_levels(lambda n: None, ["a"], PROMPTS, [1], requests=1, rounds=2, max_tokens=4, progress=False)


def test_scenario_submits_the_long_prompt_once_the_streams_decode():
    calls = []
    c = FakeClient("s", calls, step=0.01, tokens=20)
    long = Prompt("long", "long", "x")
    res = run_scenario(c, PROMPTS, long, {}, stream_tokens=20, long_tokens=2, warm_tokens=3)
    assert calls[-1] == ("s", "long") and len(calls) == 4
    assert res["streams"] == 3 and res["streams_decoding_throughout"] == 3
    assert res["long_ttft_s"] > 0 and res["window_gaps"] >= 3
    assert len(res["requests"]) == 4


def test_long_prompt_comes_close_below_the_target():
    def tokenize(text):  # ~ one token per 4 characters, + a template of 10
        return [0] * (10 + len(text) // 4)

    p = long_prompt(tokenize, [Prompt("a", "c", "word " * 50)], 2000)
    n = len(tokenize(p.prompt))
    assert 1990 <= n <= 2000 and p.prompt.endswith("one sentence.")


def test_daemon_config_is_valid_toml_the_daemon_accepts(tmp_path: Path):
    from edgespec.server.config import load

    for name in ("t.gguf", "d.gguf"):
        (tmp_path / name).write_bytes(b"")  # the config checks the files exist, not what they hold
    sections = daemon_sections(target=str(tmp_path / "t.gguf"), draft=str(tmp_path / "d.gguf"), parallel=3,
                               n_ctx=1024, threads=1, max_tokens=64)
    text = toml_config(sections)
    assert tomllib.loads(text)["server"]["parallel"] == 3
    (tmp_path / "c.toml").write_text(text)
    cfg = load(tmp_path / "c.toml", env={})
    assert cfg.server.parallel == 3 and cfg.server.host == "127.0.0.1" and not cfg.server.prompt_cache
    assert cfg.engine.target.n_ctx == 1024 and cfg.engine.draft is not None
    cached = daemon_sections(target=str(tmp_path / "t.gguf"), draft=None, parallel=2, n_ctx=1024, threads=1,
                             max_tokens=64, prompt_cache=True)
    (tmp_path / "p.toml").write_text(toml_config(cached))
    assert load(tmp_path / "p.toml", env={}).server.prompt_cache
    assert cfg.engine.target.flash_attn and cfg.engine.draft.flash_attn
    no_fa = daemon_sections(target=str(tmp_path / "t.gguf"), draft=str(tmp_path / "d.gguf"), parallel=1, n_ctx=1024,
                            threads=1, max_tokens=64, flash_attn=False)
    (tmp_path / "f.toml").write_text(toml_config(no_fa))
    off = load(tmp_path / "f.toml", env={}).engine
    assert not off.target.flash_attn and off.draft is not None and not off.draft.flash_attn


def test_the_report_says_what_the_servers_reuse():
    from edgespec.bench.serve_report import _caches

    assert _caches({}).startswith("No prompt cache")
    on = _caches({"prompt_cache": True, "suffix_cache": True})
    assert "Prompt cache on" in on and "cache_prompt: true" in on and "suffix cache on" in on
    assert _caches({"prompt_cache": "as the attached daemon"}).startswith("Prompt cache as the attached daemon")


def test_the_report_says_whether_requests_ran_to_max_tokens():
    from edgespec.bench.serve_report import _length

    assert "EOS ends earlier" in _length({"max_tokens": 64})
    both = _length({"max_tokens": 64, "ignore_eos": True})
    assert "every request runs to 64 tokens" in both and "ignore_eos" in both and "EOS ends earlier" not in both


def test_llama_server_command():
    plain = llama_server_cmd(Path("/b"), target="t.gguf", draft=None, parallel=4, n_ctx=1024, threads=2, port=9)
    def val(flag):
        return plain[plain.index(flag) + 1]

    assert plain[0] == "/b/llama-server"
    assert (val("--host"), val("-np"), val("-c"), val("-t")) == ("127.0.0.1", "4", "4096", "2")
    assert "-md" not in plain and "--no-kv-unified" in plain
    assert val("-fa") == "on"
    off = llama_server_cmd(Path("/b"), target="t.gguf", draft=None, parallel=1, n_ctx=1024, threads=2, port=9,
                           flash_attn=False)
    assert off[off.index("-fa") + 1] == "off"
    spec = llama_server_cmd(Path("/b"), target="t.gguf", draft="d.gguf", parallel=1, n_ctx=1024, threads=2, port=9)
    assert spec[spec.index("-md") + 1] == "d.gguf"
    assert spec[spec.index("--spec-draft-n-max") + 1] == "4" and spec[spec.index("--spec-draft-n-min") + 1] == "0"


def test_a_chat_template_file_reaches_both_servers(tmp_path: Path):
    """--chat-template: a GGUF without a template (the registry's Gemma 3 270M) is served by both
    systems with the same file."""
    from edgespec.server.config import load

    tpl = Path(__file__).parents[1] / "templates" / "gemma-3.jinja"
    (tmp_path / "t.gguf").write_bytes(b"")
    sections = daemon_sections(target=str(tmp_path / "t.gguf"), draft=None, parallel=1, n_ctx=1024, threads=1,
                               max_tokens=64, chat_template=str(tpl))
    (tmp_path / "c.toml").write_text(toml_config(sections))
    assert load(tmp_path / "c.toml", env={}).chat_template == tpl.read_text()
    assert "chat_template" not in daemon_sections(target="t.gguf", draft=None, parallel=1, n_ctx=1024, threads=1,
                                                  max_tokens=64)["target"]
    cmd = llama_server_cmd(Path("/b"), target="t.gguf", draft=None, parallel=1, n_ctx=1024, threads=2, port=9,
                           chat_template=str(tpl))
    assert "--jinja" in cmd and cmd[cmd.index("--chat-template-file") + 1] == str(tpl)


def test_draft_none_serves_model_free_and_refuses_llama_servers_draft(tmp_path: Path):
    from typer.testing import CliRunner

    from edgespec.cli.bench_serve import _models
    from edgespec.cli.main import app

    t = tmp_path / "t.gguf"
    t.write_bytes(b"")
    assert _models(str(t), "none") == (str(t), None)
    with pytest.raises(FileNotFoundError):
        _models(str(t), str(tmp_path / "missing.gguf"))
    out = CliRunner().invoke(app, ["bench-serve", "--target", str(t), "--draft", "none", "--llama-server-bin",
                                   str(tmp_path), "--llama-server-modes", "draft"])
    assert out.exit_code != 0 and "llama_server" in out.output
