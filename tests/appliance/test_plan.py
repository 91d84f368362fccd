"""Memory plan: GGUF facts, arithmetic, verdicts, the CLI, and (slow) agreement with llama.cpp."""

from __future__ import annotations

import ctypes
import json
import math

import gguf
import numpy as np
import pytest
from typer.testing import CliRunner

from edgespec.config import EngineConfig, ModelConfig, models_dir
from edgespec.errors import ConfigError, ModelError
from edgespec.plan import (
    GIB,
    MIB,
    check_fits,
    compare_with_reported,
    draft_ratio_warning,
    explain,
    parse_llama_log,
    plan_for_config,
    plan_memory,
    read_model_facts,
)


def write_gguf(path, *, n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_vocab=100, n_ff=128, params_scale=1,
               tokens=None, tokenizer="gpt2"):
    """A tiny llama-shaped GGUF: header facts plus f32 tensors of known sizes (not a runnable model)."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(tokenizer)
    w.add_block_count(n_layer)
    w.add_embedding_length(n_embd)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_feed_forward_length(n_ff)
    w.add_context_length(2048)
    w.add_token_list(tokens or [f"t{i}" for i in range(n_vocab)])  # no llama.vocab_size: count the tokens
    w.add_tensor("token_embd.weight", np.zeros((n_vocab, n_embd * params_scale), dtype=np.float32))
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((n_ff, n_embd), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def tiny(tmp_path):
    return write_gguf(tmp_path / "tiny.gguf")


def test_read_model_facts(tiny):
    f = read_model_facts(tiny)
    assert (f.arch, f.n_layer, f.n_embd, f.n_head, f.n_head_kv, f.n_vocab, f.n_ff) == ("llama", 2, 64, 4, 2, 100, 128)
    assert f.key_length == f.value_length == 16  # n_embd / n_head when key_length is absent
    assert f.n_params == 100 * 64 + 128 * 64
    assert f.weights_bytes == 100 * 64 * 4 + 128 * 64 * 2
    assert f.n_ctx_train == 2048
    # per cell: layers * kv heads * (k + v) dims * bytes
    assert f.kv_bytes_per_cell("f16") == 2 * 2 * 32 * 2
    assert f.kv_bytes_per_cell("q8_0") == 2 * 2 * 32 * 34 / 32


def test_read_model_facts_errors(tmp_path):
    with pytest.raises(ModelError, match="not found"):
        read_model_facts(tmp_path / "missing.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(ModelError, match="not a readable GGUF"):
        read_model_facts(bad)


def test_plan_arithmetic(tiny):
    f = read_model_facts(tiny)
    p = plan_memory(f, f, n_ctx=1000, parallel=3, kv_type="f16", n_ubatch=32, n_outputs=8, gpu=False)
    cells = 3328  # one context for the 3 slots: 3 * (1000 + 65) = 3195, padded to 256
    t = p.target
    assert t.kv_bytes == cells * 256
    # no flash attention: KQ (n_head * cells) outgrows the logits row (100)
    assert t.compute_bytes == 4 * 32 * (4 * cells + 128 + 64)
    assert t.output_bytes == 4 * 100 * 8
    assert t.total() == f.weights_bytes + t.kv_bytes + t.compute_bytes + t.output_bytes
    assert p.total_bytes == 2 * t.total()
    fa = plan_memory(f, None, n_ctx=1000, flash_attn=True, n_ubatch=32, kv_type="q8_0", gpu=True)
    cells = 1280  # 1 * (1000 + 65), padded
    assert fa.target.compute_bytes == 4 * 32 * (100 + 128 + 64)
    assert fa.target.kv_bytes == math.ceil(cells * 2 * 2 * 32 * 34 / 32)
    assert fa.overhead_bytes > 0 and fa.draft is None and fa.draft_ratio is None


def test_the_embedding_context_is_the_third_model(tiny, tmp_path):
    from edgespec.server.config import EmbeddingConfig

    f = read_model_facts(tiny)
    cfg = EngineConfig(target=ModelConfig(path=str(tiny), n_ctx=1000), draft=None)
    base = plan_for_config(cfg, gpu=False)
    shared = plan_for_config(cfg, gpu=False, embedding=EmbeddingConfig(n_ctx=500, n_batch=64))
    e = shared.embedding
    assert e is not None and e.role == "embedding" and e.weights_bytes == 0  # the target's weights, shared
    assert e.kv_bytes == 512 * f.kv_bytes_per_cell("f16")  # its own f16 cache, padded to 256
    assert shared.total_bytes == base.total_bytes + e.total() and [m.role for m in shared.models][-1] == "embedding"
    other = write_gguf(tmp_path / "emb.gguf", n_embd=32)
    own = plan_for_config(cfg, gpu=False, embedding=EmbeddingConfig(path=str(other), n_ctx=500, n_batch=64))
    assert own.embedding.weights_bytes == read_model_facts(other).weights_bytes
    assert plan_for_config(cfg, gpu=False, embedding=EmbeddingConfig(enabled=False)).embedding is None

    # a query-likelihood reranker reads up to 256 rows of logits a forward, a yes/no one 64 (a row a document)
    from edgespec.server.config import RerankConfig

    yes_no = plan_for_config(cfg, gpu=False, rerank=RerankConfig(n_ctx=500, n_batch=64)).rerank
    ql = plan_for_config(cfg, gpu=False, rerank=RerankConfig(n_ctx=500, n_batch=64, kind="causal-query-likelihood")).rerank
    assert ql.output_bytes - yes_no.output_bytes == 4 * f.n_vocab * (256 - 64)


def test_plan_rejects_bad_values(tiny):
    f = read_model_facts(tiny)
    with pytest.raises(ConfigError, match="kv_type"):
        plan_memory(f, None, n_ctx=512, kv_type="q5_1")
    with pytest.raises(ConfigError, match="parallel"):
        plan_memory(f, None, n_ctx=512, parallel=0)


@pytest.mark.parametrize(
    "ratio, expect",
    [(0.04, None), (0.03, None), (0.05, None), (0.02, "below"), (0.2, "above"), (1.0, "demo pair")],
)
def test_draft_ratio_band(ratio, expect):
    message = draft_ratio_warning(ratio)
    assert (message is None) if expect is None else (expect in message)


def test_ratio_and_quantised_kv_warnings(tmp_path):
    target = read_model_facts(write_gguf(tmp_path / "t.gguf", params_scale=25))
    draft = read_model_facts(write_gguf(tmp_path / "d.gguf"))
    p = plan_memory(target, draft, n_ctx=256, kv_type="q4_0")
    assert 0.05 < p.draft_ratio < 0.2
    assert any("above the useful" in w for w in p.warnings)
    assert any("flash attention" in w for w in p.warnings)


def test_check_fits_and_explanation(tiny):
    f = read_model_facts(tiny)
    p = plan_memory(f, f, n_ctx=4096, parallel=2, gpu=False)
    check_fits(p, 1 * GIB)  # fits: no exception
    with pytest.raises(ConfigError) as exc:
        check_fits(p, p.total_bytes, device="CUDA0")  # no room for the 5 % headroom
    text = str(exc.value)
    assert exc.value.key == "engine"
    assert "does NOT fit" in text and "CUDA0" in text and "target" in text and "draft" in text and "KV" in text
    d = p.as_dict(1 * GIB)
    assert d["fits"] is True and d["models"]["draft"]["kv_bytes"] == p.draft.kv_bytes


def test_plan_for_config(tiny):
    cfg = EngineConfig(
        target=ModelConfig(path=str(tiny), n_ctx=512, n_batch=64, n_gpu_layers=-1),
        draft=ModelConfig(path=str(tiny), n_ctx=512, n_batch=64),
        parallel=2,
    )
    p = plan_for_config(cfg)
    assert (p.n_ctx, p.parallel, p.n_ubatch, p.kv_type) == (512, 2, 64, "f16") and p.overhead_bytes > 0


def test_a_head_beside_the_draft_is_the_plans_third_model(tiny, tmp_path):
    """[draft] head: the head's context as a head drafting alone is planned (its KV over the
    target's cells, every row an output), and the target's forwards output three layers' inputs."""
    from dataclasses import replace

    head = write_gguf(tmp_path / "head.gguf", n_layer=1)
    cfg = EngineConfig(target=ModelConfig(path=str(tiny), n_ctx=512, n_batch=64),
                       draft=ModelConfig(path=str(tiny), n_ctx=512, n_batch=64), parallel=2)
    base = plan_for_config(cfg, gpu=False)
    both = plan_for_config(replace(cfg, head=ModelConfig(path=str(head), n_ctx=512, n_batch=64)), gpu=False)
    assert [m.role for m in both.models] == ["target", "draft", "head"]
    h, f = both.head, read_model_facts(head)
    cells = base.target.kv_bytes / read_model_facts(tiny).kv_bytes_per_cell("f16")
    assert h.kv_bytes == f.kv_bytes_per_cell("f16") * cells  # over the target's cells
    assert both.target.output_bytes == base.target.output_bytes + 4 * 3 * read_model_facts(tiny).n_embd * 64
    assert both.total_bytes == base.total_bytes + h.total() + 4 * 3 * read_model_facts(tiny).n_embd * 64
    assert h.weights_bytes == f.weights_bytes


def test_parse_llama_log_sums_backends():
    log = (
        "load_tensors:   CPU_Mapped model buffer size =    92.10 MiB\n"
        "load_tensors:        CUDA0 model buffer size =  1000.00 MiB\n"
        "llama_kv_cache:        CPU KV buffer size =    90.00 MiB\n"
        "sched_reserve:        CPU compute buffer size =    99.38 MiB\n"
        "sched_reserve:      CUDA0 compute buffer size =    10.00 MiB\n"
    )
    got = parse_llama_log(log)
    assert got["weights_bytes"] == round(1092.10 * MIB)
    assert got["kv_bytes"] == 90 * MIB
    assert got["compute_bytes"] == round(109.38 * MIB)


def test_cli_plan(tiny):
    from edgespec.cli.main import app

    runner = CliRunner()
    ok = runner.invoke(app, ["plan", "--target", str(tiny), "--draft", str(tiny), "--n-ctx", "512", "--vram", "1"])
    assert ok.exit_code == 0, ok.output
    assert "fits:" in ok.output and "demo pair" in ok.output
    no = runner.invoke(app, ["plan", "--target", str(tiny), "--n-ctx", "4096", "--parallel", "64", "--vram", "0.01"])
    assert no.exit_code == 1 and "does NOT fit" in no.output
    js = runner.invoke(app, ["plan", "--target", str(tiny), "--n-ctx", "512", "--vram", "1", "--cpu", "--json"])
    data = json.loads(js.output)
    assert data["fits"] is True and data["overhead_bytes"] == 0 and "target" in data["models"]
    bad = runner.invoke(app, ["plan", "--target", str(tiny), "--kv-type", "q5"])
    assert bad.exit_code == 2
    both = runner.invoke(app, ["plan", "--target", str(tiny), "--draft", str(tiny), "--head", str(tiny), "--n-ctx",
                               "512", "--vram", "1", "--cpu", "--json"])
    assert set(json.loads(both.output)["models"]) >= {"target", "draft", "head"}


def _demo_gguf():
    for name in ("SmolLM2-135M-Instruct.Q8_0.gguf", "SmolLM2-135M-Instruct.F32.gguf"):
        path = models_dir() / name
        if path.is_file():
            return path
    pytest.skip(f"demo models not prepared in {models_dir()} (run `edgespec models prepare-demo`)")


@pytest.mark.slow
def test_estimates_match_llama_cpp_at_load():
    """Load the demo GGUF with llama.cpp and compare its reported buffer sizes with the plan (a
    context of the cells the engine gives one slot)."""
    import llama_cpp  # only this test may import llama_cpp directly

    from edgespec.config import shared_cells

    path = _demo_gguf()
    n_ctx, n_batch = 1024, 256
    facts = read_model_facts(path)
    plan = plan_memory(facts, None, n_ctx=n_ctx, n_ubatch=n_batch, gpu=False)
    n_ctx = shared_cells(1, n_ctx)
    lines: list[str] = []

    @llama_cpp.llama_log_callback
    def capture(level, text, user_data):
        lines.append(text.decode(errors="replace"))

    llama_cpp.llama_log_set(capture, ctypes.c_void_p(0))
    try:
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, verbose=False)
        model_size = llama_cpp.llama_model_size(llm.model)
        llm.close()
    finally:
        from llama_cpp._logger import llama_log_callback  # llama-cpp-python's own, set at import

        llama_cpp.llama_log_set(llama_log_callback, ctypes.c_void_p(0))
    reported = parse_llama_log("".join(lines))
    checks = compare_with_reported(plan.target, **{**reported, "weights_bytes": model_size})
    by_item = {c.item: c for c in checks}
    assert {"kv_bytes", "compute_bytes"} <= set(by_item), reported  # the log was captured
    assert abs(by_item["weights_bytes"].rel_error) < 0.03, by_item
    assert abs(by_item["kv_bytes"].rel_error) < 0.01, by_item  # exact arithmetic
    assert -0.05 < by_item["compute_bytes"].rel_error < 0.10, by_item  # an estimate


def test_the_host_caches_count_on_a_cpu_engine(tiny):
    """On a CPU the device is the host's memory: the prompt store's and the suffix cache's bounds
    count in the plan (and its verdict names them); on a GPU they do not."""
    import dataclasses

    cfg = EngineConfig(target=ModelConfig(path=str(tiny), n_ctx=1000), draft=None,
                       prompt_cache_bytes=300 << 20, suffix_cache_bytes=20 << 20)
    cpu, gpu = plan_for_config(cfg, gpu=False), plan_for_config(cfg, gpu=True)
    assert cpu.cache_bytes == 320 << 20 and gpu.cache_bytes == 0
    none = plan_for_config(dataclasses.replace(cfg, prompt_cache=False, suffix_cache=False), gpu=False)
    assert none.cache_bytes == 0 and cpu.total_bytes == none.total_bytes + (320 << 20)
    assert cpu.as_dict()["cache_bytes"] == 320 << 20
    assert "caches 320.0 MiB" in explain(cpu, 1 << 40)
    with pytest.raises(ConfigError, match="prompt_cache_bytes"):
        check_fits(cpu, none.total_bytes + (100 << 20))


def test_cli_plan_says_which_pairing_applies(tiny, tmp_path):
    """`plan --draft` reads both vocabularies from the headers: the same, a padded tail (Qwen's
    large and small files), another tokenizer (a text draft, naming the first differing token), or
    a refusal where text cannot bridge them (a draft with no tokenizer), naming the field."""
    from edgespec.cli.main import app

    runner = CliRunner()

    def pairing(draft) -> str:
        out = runner.invoke(app, ["plan", "--target", str(tiny), "--draft", str(draft), "--n-ctx", "512", "--vram", "1",
                                  "--cpu", "--json"])
        assert out.exit_code == 0, out.output
        return json.loads(out.output)["pairing"]

    assert pairing(tiny).startswith("same vocabulary (100 tokens)")
    padded = write_gguf(tmp_path / "padded.gguf", n_vocab=228)
    assert pairing(padded).startswith("padded vocabularies: target 100, draft 228 tokens, the first 100 the same")
    other = write_gguf(tmp_path / "other.gguf", tokens=[f"t{i}" for i in range(7)] + [f"u{i}" for i in range(7, 100)])
    assert pairing(other).startswith("different tokenizers (token 7 text b't7' vs b'u7'): drafts through text")
    none = write_gguf(tmp_path / "none.gguf", tokenizer="no_vocab")
    assert pairing(none).startswith("incompatible: draft.path: none.gguf has no tokenizer")
    text = runner.invoke(app, ["plan", "--target", str(tiny), "--draft", str(padded), "--n-ctx", "512", "--vram", "1"])
    assert "pairing: padded vocabularies" in text.output


def test_plan_systemd_writes_memory_limits_sized_from_the_plan(tiny):
    """`plan --systemd`: the unit's MemoryHigh is the plan's total plus the host's allowance, and
    MemoryMax sits above it; more slots (a larger plan) raise both."""
    import configparser

    from edgespec.cli.main import app
    from edgespec.plan import HOST_ALLOWANCE_BYTES, MEMORY_MAX_FACTOR

    def limits(parallel: int) -> tuple[int, int, int]:
        out = CliRunner().invoke(app, ["plan", "--target", str(tiny), "--n-ctx", "4096", "--cpu", "--parallel",
                                       str(parallel), "--systemd"])
        assert out.exit_code == 0, out.output
        unit = configparser.ConfigParser()
        unit.read_string(out.output)
        js = CliRunner().invoke(app, ["plan", "--target", str(tiny), "--n-ctx", "4096", "--cpu", "--parallel",
                                      str(parallel), "--json"])
        total = json.loads(js.output)["total_bytes"]
        mib = lambda v: int(v.removesuffix("M")) << 20
        return mib(unit["Service"]["MemoryHigh"]), mib(unit["Service"]["MemoryMax"]), total

    high, top, total = limits(1)
    assert total + HOST_ALLOWANCE_BYTES <= high < total + HOST_ALLOWANCE_BYTES + (1 << 20)
    assert abs(top - high * MEMORY_MAX_FACTOR) < 2 << 20 and top > high
    assert limits(8)[0] > high


def test_plan_systemd_from_a_config_adds_the_address_rules_systemd_can_express(tmp_path):
    """From the daemon's config: listeners all on loopback -> IPAddressDeny=any with localhost
    and the rpc_servers' addresses allowed; a listener elsewhere serves clients the config does
    not list -> no address rules (a host name in rpc_servers, which systemd cannot express, too)."""
    from edgespec.cli.main import app

    target = write_gguf(tmp_path / "t.gguf")

    def dropin(extra: str, in_target: str = "") -> list[tuple[str, str]]:
        (tmp_path / "e.toml").write_text(f'[draft]\npath = ""\n{extra}[target]\npath = "{target}"\n{in_target}')
        out = CliRunner().invoke(app, ["plan", "--config", str(tmp_path / "e.toml"), "--systemd"])
        assert out.exit_code == 0, out.output
        lines = [ln for ln in out.output.splitlines() if ln and not ln.startswith("#")]
        assert lines[0] == "[Service]"
        return [tuple(ln.split("=", 1)) for ln in lines[1:]]  # type: ignore[misc]

    rules = dropin("")
    assert [k for k, _ in rules[:2]] == ["MemoryHigh", "MemoryMax"]
    assert rules[2:] == [("IPAddressDeny", "any"), ("IPAddressAllow", "localhost")]
    rules = dropin("", 'n_gpu_layers = -1\nrpc_servers = ["10.0.0.7:50052"]\n')
    assert rules[2:] == [("IPAddressDeny", "any"), ("IPAddressAllow", "localhost"), ("IPAddressAllow", "10.0.0.7")]
    assert len(dropin("", 'n_gpu_layers = -1\nrpc_servers = ["gpu-box:50052"]\n')) == 2
    assert [k for k, _ in dropin('[server]\nhost = "0.0.0.0"\ninsecure = true\n')] == ["MemoryHigh", "MemoryMax"]


def test_one_device_probe_serves_the_cli_the_start_check_and_the_models_budget(tiny, monkeypatch):
    """`edgespec plan`, the daemon's start check and the chat models' budget all ask
    backend.device_memory: the first GPU ggml lists when layers go to a GPU, else (or with --cpu,
    or without one) the RAM."""
    from edgespec import backend
    from edgespec.cli.main import app
    from edgespec.plan import system_memory_bytes
    from edgespec.server.chat_plan import budget_bytes
    from edgespec.server.config import check_memory

    listed = [backend.Device("CPU", "cpu", 0, 0), backend.Device("FakeGPU0", "gpu", GIB, 2 * GIB)]
    monkeypatch.setattr(backend, "devices", lambda: listed)
    on_gpu = EngineConfig(ModelConfig(str(tiny), n_ctx=512, n_gpu_layers=-1), None)
    huge = EngineConfig(ModelConfig(str(tiny), n_ctx=1 << 20, n_gpu_layers=-1), None, parallel=1024)
    runner = CliRunner()

    def cli(*extra: str) -> dict:
        out = runner.invoke(app, ["plan", "--target", str(tiny), "--n-ctx", "512", "--json", *extra])
        return json.loads(out.output)

    assert backend.device_memory() == (2 * GIB, "FakeGPU0", True)
    got = cli()
    assert (got["device"], got["device_bytes"], got["overhead_bytes"] > 0) == ("FakeGPU0", 2 * GIB, True)
    assert budget_bytes(0, on_gpu) == (int(2 * GIB * 0.95), "FakeGPU0")
    with pytest.raises(ConfigError, match="FakeGPU0"):
        check_memory(huge)
    ram = system_memory_bytes()
    got = cli("--cpu")
    assert (got["device"], got["device_bytes"], got["overhead_bytes"]) == ("RAM", ram, 0)
    assert budget_bytes(0, EngineConfig(ModelConfig(str(tiny), n_ctx=512), None)) == (int(ram * 0.95), "RAM")
    listed[1:] = []  # no GPU: the RAM for every one of them, and no CUDA runtime in the plan
    got = cli()
    assert (got["device"], got["device_bytes"], got["overhead_bytes"]) == ("RAM", ram, 0)
    assert budget_bytes(0, on_gpu) == (int(ram * 0.95), "RAM")
    with pytest.raises(ConfigError, match="RAM"):
        check_memory(huge)
