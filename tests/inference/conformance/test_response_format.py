"""``response_format`` (and vLLM's ``guided_*`` / ``structured_outputs`` extensions) on ``/v1/completions`` and
``/v1/chat/completions``: the request checks, and end to end through the official ``openai`` client against the
conformance suite's tiny random model, whose output the engine's grammar must hold to the constraint.

A random model writes long strings: the schemas here bound every value (enums, bounded integers, booleans, short
strings) so that a constrained output completes within ``max_tokens``."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from lightning_llmopt.inference.serving.protocol import APIError, parse_chat, parse_completion

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["ann", "bob"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "tag": {"type": "string", "maxLength": 3},
    },
    "required": ["name", "age", "ok", "tag"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
MSGS = [{"role": "user", "content": "A person as JSON"}]


def _chat(**body: Any) -> Any:
    return parse_chat({"model": "m", "messages": MSGS, **body}, 16)


def _completion(**body: Any) -> Any:
    return parse_completion({"model": "m", "prompt": "x", **body})


# ---------------------------------------------------------------------------------------------- the request checks


@pytest.mark.parametrize("parse", [_chat, _completion], ids=["chat", "completions"])
def test_constraints_reach_the_sampling_params(parse):
    assert parse(response_format={"type": "text"}).params.structured_output is None
    assert parse().constraint_param is None
    obj = parse(response_format={"type": "json_object"})
    assert obj.params.structured_output.json_object is True and obj.constraint_param == "response_format"
    assert parse(response_format=JSON_SCHEMA).params.structured_output.json_schema == SCHEMA
    for body, kind, value in [
        ({"guided_json": SCHEMA}, "json_schema", SCHEMA),
        ({"guided_json": json.dumps(SCHEMA)}, "json_schema", SCHEMA),
        ({"guided_regex": "[0-9]+"}, "regex", "[0-9]+"),
        ({"guided_choice": ["yes", "no"]}, "choice", ("yes", "no")),
        ({"guided_grammar": 'start: "a"'}, "grammar", 'start: "a"'),
        ({"structured_outputs": {"json": SCHEMA}}, "json_schema", SCHEMA),
        ({"structured_outputs": {"json_object": True}}, "json_object", True),
        ({"structured_outputs": {"choice": ["a"], "regex": None}}, "choice", ("a",)),
    ]:
        req = parse(**body)
        out = req.params.structured_output
        assert out.kind == kind and getattr(out, kind) == value, body
        assert req.constraint_param == next(iter(body))


@pytest.mark.parametrize(
    "body, param",
    [
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_object", "schema": {}}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": []}}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "extra": 1}}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "name": 3}}}, "response_format"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs"),
        ({"structured_outputs": {"xml": "a"}}, "structured_outputs"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ],
)
@pytest.mark.parametrize("parse", [_chat, _completion], ids=["chat", "completions"])
def test_bad_constraints_name_their_field(parse, body, param):
    with pytest.raises(APIError) as e:
        parse(**body)
    assert e.value.status == 400 and e.value.param == param


# ---------------------------------------------------------------------------------------------------- end to end


def test_json_schema(client):
    kw = dict(model="tiny", messages=MSGS, response_format=JSON_SCHEMA, max_tokens=120, temperature=0)
    out = client.chat.completions.create(**kw)
    text = out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)
    streamed = list(client.chat.completions.create(stream=True, **kw))
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed) == text
    assert streamed[-1].choices[0].finish_reason == "stop"

    done = client.completions.create(
        model="tiny", prompt="{", max_tokens=120, temperature=0, extra_body={"response_format": JSON_SCHEMA}
    )
    assert done.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(done.choices[0].text), SCHEMA)


def test_json_object(client):
    """Any JSON object: a random model rarely closes a string, so only some of the seeded samples finish (``{}``);
    each that does must parse as an object, and every one starts as an object."""
    kw, fmt = dict(max_tokens=40, temperature=1.0, seed=0, n=8), {"type": "json_object"}
    chat = client.chat.completions.create(model="tiny", messages=MSGS, response_format=fmt, **kw)
    legacy = client.completions.create(model="tiny", prompt="Hi", extra_body={"response_format": fmt}, **kw)
    texts = [(ch.message.content, ch.finish_reason) for ch in chat.choices]
    texts += [(ch.text, ch.finish_reason) for ch in legacy.choices]
    assert all(text.startswith("{") for text, _ in texts), texts
    finished = [json.loads(text) for text, reason in texts if reason == "stop"]
    assert finished and all(isinstance(obj, dict) for obj in finished), texts


def test_regex_choice_and_grammar(client):
    kw: dict[str, Any] = dict(model="tiny", prompt="x", max_tokens=20, temperature=1.0, seed=3, n=4)
    out = client.completions.create(extra_body={"guided_regex": r"[0-9]{3}-(ab|cd)"}, **kw)
    assert all(re.fullmatch(r"[0-9]{3}-(ab|cd)", ch.text) and ch.finish_reason == "stop" for ch in out.choices)
    out = client.completions.create(extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}}, **kw)
    assert all(ch.text in ("yes", "no", "maybe") for ch in out.choices)
    grammar = 'start: "(" item ("," item)* ")"\nitem: "a" | "b"'
    out = client.completions.create(extra_body={"guided_grammar": grammar}, **{**kw, "max_tokens": 8})
    for ch in out.choices:
        assert re.fullmatch(r"\([ab](,[ab])*\)?", ch.text), ch.text  # complete, or cut short by max_tokens
        assert (ch.finish_reason == "stop") == ch.text.endswith(")")


def test_bad_response_format_over_http(client):
    for kw, param in [
        (dict(response_format={"type": "xml"}), "response_format"),
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}),
         "response_format"),  # refused by the grammar library
        (dict(extra_body={"guided_regex": "(unclosed"}), "guided_regex"),
        (dict(extra_body={"guided_grammar": "start: undefined_rule"}), "guided_grammar"),
    ]:  # fmt: skip
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, **kw)
        assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body={"response_format": {"type": 1}})
    assert e.value.body["param"] == "response_format"
