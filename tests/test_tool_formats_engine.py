"""Every tool-call format on the demo pair, end to end: the tools described to the model in the
format (the demo's template shows none), the grammar forcing a call, generated with speculation
at T = 0 and T = 1, parsed back and validated against the tool's schema."""

from __future__ import annotations

import json

import jsonschema
import pytest

from edgespec import tool_formats, tools
from edgespec.sampling import SamplingParams
from edgespec.types import GenerationRequest, SpeculationParams

pytestmark = pytest.mark.slow

PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                           "unit": {"enum": ["celsius", "fahrenheit"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
          "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather forecast",
                                            "parameters": PARAMS}}


@pytest.mark.parametrize("temperature, choice", [(0.0, "required"), (1.0, "auto")])
def test_a_forced_call_in_every_format_parses_and_validates(engine, temperature, choice):
    """required at T = 0: a call; auto at T = 1: a call, or text that opens none."""
    for fmt in tool_formats.FORMATS:
        spec = tools.parse_tools([WEATHER], choice, False, fmt)  # one call, then the end
        assert spec is not None
        ids = tools.encode_request(engine.encoder, "", (("user", "What is the weather in Oslo, in celsius?"),), (),
                                   spec)
        req = GenerationRequest(tuple(ids), SamplingParams(temperature=temperature, max_tokens=160, seed=11),
                                SpeculationParams(mode="auto"), constraint=spec.constraint())
        r = engine.generate(req)
        content, calls = spec.parse(r.text)
        f = tool_formats.by_name(fmt)
        if content is not None:
            openers = f.openers if f is not None else ("<tool_call>",)
            assert choice == "auto" and not r.text.lstrip().startswith(openers), (fmt, r.text)
            continue
        assert r.finish_reason == "eos" and [c.name for c in calls] == ["get_weather"], (fmt, choice, r.text)
        jsonschema.validate(json.loads(calls[0].arguments), PARAMS)
