"""The embeddings request and response bodies (pure), and the routes on the fake daemon."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from edgespec.errors import BadRequest
from edgespec.server import embeddings as emb
from tests.server.test_http import HTTP, MODEL, raw


def parse(body):
    return emb.parse_request(body, models=("m",), max_inputs=4, max_bytes=100)


def test_inputs_of_every_shape():
    assert parse({"input": "hi"}).inputs == ("hi",)
    assert parse({"input": ["a", "b"], "model": "m"}).inputs == ("a", "b")
    assert parse({"input": [1, 2, 3]}).inputs == ((1, 2, 3),)
    assert parse({"input": [[1, 2], [3]], "encoding_format": "base64"}) == \
        emb.EmbeddingRequest(((1, 2), (3,)), "base64", "")


@pytest.mark.parametrize("body, field", [
    ({"input": ""}, "input[0]"), ({"input": []}, "input"), ({"input": 3}, "input"),
    ({"input": ["a", 3]}, "input[1]"), ({"input": [[1], []]}, "input[1]"), ({"input": ["a"] * 5}, "input"),
    ({"input": ["x" * 60, "y" * 60]}, "input[1]"), ({"input": "a", "model": "other"}, "model"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format"), ({"input": "a", "dimensions": 64}, "dimensions"),
    ({"input": "a", "bogus": 1}, "bogus"), ({"input": [True]}, "input[0]"),
])
def test_bad_fields_are_named(body, field):
    with pytest.raises(BadRequest) as e:
        parse(body)
    assert e.value.field == field


def test_base64_is_little_endian_float32_as_openai_sends_it():
    v = np.array([[0.6, 0.8], [1.0, 0.0]], dtype=np.float32)
    b = emb.response_body(v, model="m", prompt_tokens=7, encoding_format="base64")
    assert np.array_equal(np.frombuffer(base64.b64decode(b["data"][1]["embedding"]), dtype="<f4"), v[1])
    f = emb.response_body(v, model="m", prompt_tokens=7, encoding_format="float")
    assert f["data"][0] == {"object": "embedding", "index": 0, "embedding": [pytest.approx(0.6), pytest.approx(0.8)]}
    assert f["usage"] == {"prompt_tokens": 7, "total_tokens": 7} and f["object"] == "list"


def test_routes_refuse_bad_bodies_by_name_and_off_means_404(make_daemon):
    r = make_daemon(http=HTTP)
    status, _, out = raw(r, "POST", "/v1/embeddings", {"model": MODEL, "input": [[1], "x", 2]})
    assert status == 400 and json.loads(out)["error"]["param"] == "input[2]"
    off = make_daemon(http=HTTP, embedding={"enabled": False})
    status, _, out = raw(off, "POST", "/v1/embeddings", {"input": "x"})
    assert status == 404
