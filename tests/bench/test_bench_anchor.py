import argparse
from pathlib import Path

import pytest

from edgespec.bench.anchor import AnchorError, completion_cmd, parse_completion, parse_speculative, speculative_cmd

COMPLETION_OUT = """
Hello there
common_perf_print:    sampling time =       3.10 ms /   140 runs   (    0.02 ms per token, 45161.29 tokens per second)
common_perf_print:        load time =     151.92 ms
0.00.816.187 I common_perf_print: prompt eval time =      90.10 ms /    12 tokens (    7.51 ms per token,   133.19 tokens per second)
0.00.816.188 I common_perf_print:        eval time =    4000.00 ms /   127 runs   (   31.50 ms per token,    31.75 tokens per second)
common_perf_print:       total time =    4120.52 ms /   139 tokens
"""

SPECULATIVE_OUT = """
encoded   12 tokens in    0.101 seconds, speed:  118.812 t/s
0.02.259.294 I decoded  129 tokens in    3.512 seconds, speed:   36.731 t/s

n_draft   = 4
n_predict = 129
n_drafted = 112
n_accept  = 85
accept    = 75.893%
"""


def test_parse_completion_takes_decode_not_prompt_eval():
    assert parse_completion(COMPLETION_OUT) == {"tokens": 127, "seconds": 4.0, "tokens_per_second": 31.75}


def test_parse_speculative():
    assert parse_speculative(SPECULATIVE_OUT) == {"tokens": 129, "seconds": 3.512, "tokens_per_second": 36.731,
                                                  "n_drafted": 112, "n_accept": 85}


@pytest.mark.parametrize("fn", [parse_completion, parse_speculative])
def test_unparseable_output(fn):
    with pytest.raises(AnchorError):
        fn("error: unable to load model")


def test_commands_share_settings():
    a = argparse.Namespace(target="t.gguf", draft="d.gguf", max_tokens=64, threads=2, n_ctx=2048, n_gpu_layers=-1,
                           draft_max=4)
    plain = completion_cmd(Path("/b"), a, "PROMPT")
    spec = speculative_cmd(Path("/b"), a, "PROMPT")
    assert plain[0] == "/b/llama-completion" and spec[0] == "/b/llama-speculative-simple"
    for cmd in (plain, spec):
        flags = dict(zip(cmd[1::2], cmd[2::2]))
        assert (flags["-m"], flags["-p"], flags["-n"], flags["--temp"], flags["-t"], flags["-ngl"]) == (
            "t.gguf", "PROMPT", "64", "0", "2", "-1")
    assert spec[spec.index("-md") + 1] == "d.gguf" and spec[spec.index("--spec-draft-n-max") + 1] == "4"
    assert "-no-cnv" in plain
    assert spec[spec.index("--spec-type") + 1] == "draft-simple"
