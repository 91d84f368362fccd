#!/usr/bin/env python3
"""What penalties, logit_bias and tool calls cost beside structured output: `tools/penalty-bench.py`.

auto decoding of the json suite (8 prompts, 64 tokens, 2 rounds, the order reversed in the second),
interleaved per prompt: free text, json_schema constraint, presence+frequency penalties,
logit_bias + repetition penalty, and tool calling as the HTTP API serves it (the prompt's schema
as a tool's parameters, tool_choice required: the tools in the prompt, the call grammar as the
constraint; one call with parallel_tool_calls false, as one schema object, and calls with the
default true), beside the same tools prompt without a grammar. tok/s ratios over free text: over
the totals, and the median of the ratios paired per prompt and round (a burst of load on a shared
host moves one pair, not the total)."""
import json, statistics, time
from edgespec import tools
from edgespec.config import EngineConfig, ModelConfig, models_dir
from edgespec.engine import Engine
from edgespec.sampling import SamplingParams
from edgespec.types import ConstraintSpec, GenerationRequest, SpeculationParams
M = models_dir()
eng = Engine.load(EngineConfig(ModelConfig(str(M / "SmolLM2-135M-Instruct.F32.gguf"), n_ctx=2048, threads=2),
                               ModelConfig(str(M / "SmolLM2-135M-Instruct.Q8_0.gguf"), n_ctx=2048, threads=2)))
rows = [json.loads(l) for l in open("edgespec/bench/suites/json.jsonl")][:8]


def tool_spec(r, parallel=None):  # what an OpenAI client sends: one function taking the prompt's fields, required
    return tools.parse_tools([{"type": "function", "function": {"name": "record", "description": "Record the fields",
                                                                "parameters": r["schema"]}}], "required", parallel)


def chat(r):
    return eng.encode_chat([("user", r["prompt"])])


def with_tools(r):  # the prompt as the HTTP API renders it for a request with tools
    return tools.encode_request(eng.encoder, "", [("user", r["prompt"])], (), tool_spec(r))


S = SamplingParams(max_tokens=64)
V = {"free": lambda r: (S, None, chat(r)),
     "schema": lambda r: (S, ConstraintSpec("json_schema", json.dumps(r["schema"])), chat(r)),
     "penalties": lambda r: (SamplingParams(max_tokens=64, presence_penalty=0.3, frequency_penalty=0.3), None, chat(r)),
     "bias+rep": lambda r: (SamplingParams(max_tokens=64, repetition_penalty=1.1, logit_bias={13: -2.0, 28: 1.0}), None,
                            chat(r)),
     "tools-free": lambda r: (S, None, with_tools(r)),
     "tool-call": lambda r: (S, tool_spec(r, False).constraint(), with_tools(r)),
     "tool-calls": lambda r: (S, tool_spec(r).constraint(), with_tools(r))}
tok = {k: 0 for k in V}; sec = {k: 0.0 for k in V}; tau = {k: [] for k in V}; calls = {k: 0 for k in V}
pair = {k: [] for k in V}  # per prompt and round: this variant's tok/s over free text's
for rnd in range(2):
    for r in rows:
        rate = {}
        for k in (list(V) if rnd == 0 else list(V)[::-1]):
            s, c, toks = V[k](r)
            t0 = time.perf_counter()
            res = eng.generate(GenerationRequest(tuple(toks), s, SpeculationParams(mode="auto"), constraint=c))
            dt = time.perf_counter() - t0
            sec[k] += dt; tok[k] += len(res.token_ids); tau[k].append(res.stats.tau); rate[k] = len(res.token_ids) / dt
            if k.startswith("tool-call"):
                calls[k] += len(tools.parse_answer(res.text, truncated=res.finish_reason == "length")[1])
        for k in V:
            pair[k].append(rate[k] / rate["free"])
for k in V:
    print(f"{k:10s} tokens {tok[k]:5d}  tok/s {tok[k]/sec[k]:6.1f}  ratio {(tok[k]/sec[k])/(tok['free']/sec['free']):.3f}  "
          f"paired median {statistics.median(pair[k]):.3f}  tau {statistics.mean(tau[k]):.2f}")
print(f"calls parsed from {2 * len(rows)} answers: tool-call {calls['tool-call']}, tool-calls {calls['tool-calls']}")
