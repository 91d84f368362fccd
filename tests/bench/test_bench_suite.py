import json

import pytest

from edgespec.bench.suite import SHIPPED, VIRTUAL, load_suite, read_suite_file, resolve, suite_names
from edgespec.errors import BadRequest


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_suites_have_ten_prompts_of_their_category(name):
    prompts = load_suite(name)
    assert len(prompts) >= 10
    assert {p.category for p in prompts} == {name}


def test_all_ids_unique_across_shipped_suites():
    prompts = load_suite("all")
    assert len({p.id for p in prompts}) == len(prompts)
    assert [p.category for p in prompts if p.category not in SHIPPED] == []


def test_virtual_suites():
    assert {p.category for p in load_suite("structured")} == {"code", "json", "legal", "rag"}
    assert set(VIRTUAL) <= set(suite_names())
    assert len(load_suite("structured", limit=2)) == 8


def test_long_suite_is_long_structured_work():
    from edgespec.bench.report import classify

    prompts = load_suite("long")
    assert len(prompts) >= 12 and {p.category for p in prompts} == {"long-rag", "long-json", "long-code", "long-legal"}
    assert all(classify(p.category) == "structured" for p in prompts)
    assert min(len(p.prompt) for p in prompts) > 1200  # characters: several hundred tokens each
    assert not {p.id for p in prompts} & {p.id for p in load_suite("all")}


def test_chinese_suite_is_chinese():
    assert all(any("\u4e00" <= ch <= "\u9fff" for ch in p.prompt) for p in load_suite("chinese"))


def test_file_path_suite(tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text('{"id": "a", "category": "c", "prompt": "hi"}\n\n{"id": "b", "category": "c", "prompt": "yo"}\n')
    assert [p.id for p in load_suite(str(f))] == ["a", "b"]


@pytest.mark.parametrize(
    "line, expect",
    [
        ('{"id": "a", "category": "c"}', "line 2: missing field 'prompt'"),
        ('{"id": "a", "prompt": "p"}', "line 2: missing field 'category'"),
        ('{"id": "", "category": "c", "prompt": "p"}', "line 2: field 'id' must be a non-empty string"),
        ("not json", "line 2: not valid JSON"),
        ("[1, 2]", "line 2: expected a JSON object"),
    ],
)
def test_bad_line_names_file_line_and_field(tmp_path, line, expect):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps({"id": "ok", "category": "c", "prompt": "p"}) + "\n" + line + "\n")
    with pytest.raises(BadRequest) as exc:
        read_suite_file(f)
    msg = str(exc.value)
    assert str(f) in msg and expect.replace("line 2", f"{f}:2") in msg


def test_duplicate_ids_rejected(tmp_path):
    f = tmp_path / "dup.jsonl"
    f.write_text('{"id": "a", "category": "c", "prompt": "p"}\n{"id": "a", "category": "c", "prompt": "q"}\n')
    with pytest.raises(BadRequest, match="duplicate id 'a'"):
        load_suite(str(f))


def test_unknown_suite():
    with pytest.raises(BadRequest, match="no shipped suite or file named 'nope'"):
        resolve("nope")


def test_the_json_suite_carries_a_schema_per_prompt():
    prompts = load_suite("json")
    for p in prompts:
        schema = json.loads(p.schema)
        assert schema["type"] in ("object", "array")
    assert all(p.schema is None for p in load_suite("code"))


def test_a_schema_must_be_a_json_schema_object(tmp_path):
    f = tmp_path / "s.jsonl"
    f.write_text('{"id": "a", "category": "c", "prompt": "p", "schema": "object"}\n')
    with pytest.raises(BadRequest, match=r"s.jsonl:1: field 'schema' must be a JSON schema"):
        read_suite_file(f)
