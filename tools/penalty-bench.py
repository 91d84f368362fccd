#!/usr/bin/env python3
"""What penalties and logit_bias cost beside structured output: `tools/penalty-bench.py`.

auto decoding of the json suite (8 prompts, 64 tokens, 2 rounds, the order reversed in the second),
interleaved per prompt: free text, json_schema constraint,
presence+frequency penalties, logit_bias + repetition penalty. tok/s ratios over free text."""
import json, statistics, time
from edgespec.config import EngineConfig, ModelConfig, models_dir
from edgespec.engine import Engine
from edgespec.sampling import SamplingParams
from edgespec.types import ConstraintSpec, GenerationRequest, SpeculationParams
M = models_dir()
eng = Engine.load(EngineConfig(ModelConfig(str(M / "SmolLM2-135M-Instruct.F32.gguf"), n_ctx=2048, threads=2),
                               ModelConfig(str(M / "SmolLM2-135M-Instruct.Q8_0.gguf"), n_ctx=2048, threads=2)))
rows = [json.loads(l) for l in open("edgespec/bench/suites/json.jsonl")][:8]
V = {"free": lambda r: (SamplingParams(max_tokens=64), None),
     "schema": lambda r: (SamplingParams(max_tokens=64), ConstraintSpec("json_schema", json.dumps(r["schema"]))),
     "penalties": lambda r: (SamplingParams(max_tokens=64, presence_penalty=0.3, frequency_penalty=0.3), None),
     "bias+rep": lambda r: (SamplingParams(max_tokens=64, repetition_penalty=1.1, logit_bias={13: -2.0, 28: 1.0}), None)}
tok = {k: 0 for k in V}; sec = {k: 0.0 for k in V}; tau = {k: [] for k in V}
for rnd in range(2):
    for r in rows:
        toks = eng.encode_chat([("user", r["prompt"])])
        for k in (list(V) if rnd == 0 else list(V)[::-1]):
            s, c = V[k](r)
            t0 = time.perf_counter()
            res = eng.generate(GenerationRequest(tuple(toks), s, SpeculationParams(mode="auto"), constraint=c))
            sec[k] += time.perf_counter() - t0; tok[k] += len(res.token_ids); tau[k].append(res.stats.tau)
for k in V:
    print(f"{k:10s} tokens {tok[k]:5d}  tok/s {tok[k]/sec[k]:6.1f}  ratio {(tok[k]/sec[k])/(tok['free']/sec['free']):.3f}  tau {statistics.mean(tau[k]):.2f}")
