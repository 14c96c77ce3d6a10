"""``tools`` and ``tool_choice`` on ``/v1/chat/completions``: the tool-call parsers and their streaming on texts, the
request checks, and end to end through the official ``openai`` client against a tiny random model (ByteTokenizer,
a custom chat template that writes the tools and the tool turns into the prompt).

A random model cannot be steered into writing a tool call by itself: ``"required"`` and named choices are
constrained by the engine's grammar, and ``"auto"`` end to end is driven by a regular expression
(``structured_outputs``) that writes a Hermes call, which the parser must then read."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from lightning_llmopt.inference.serving.protocol import APIError, parse_chat
from lightning_llmopt.inference.serving.tool_calls import (
    TOOL_PARSERS,
    Hermes,
    Llama3Json,
    ToolPlan,
    ToolStream,
    get_tool_parser,
    required_schema,
)

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]},
        "unit": {"type": "string", "enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"type": "boolean"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather of a city", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MSGS = [{"role": "user", "content": "Weather in Paris?"}]


def _chat(**body: Any) -> Any:
    return parse_chat({"model": "m", "messages": MSGS, **body}, 16)


def _param_of(**body: Any) -> str | None:
    with pytest.raises(APIError) as e:
        _chat(**body)
    assert e.value.status == 400
    return e.value.param


# ---------------------------------------------------------------------------------------------------- the parsers


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>', None, [("f", {"x": 1})]),
        ('Let me see.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', "Let me see.", [("f", {})]),
        (
            '<tool_call>{"name": "f", "arguments": {"x": "<a>"}}</tool_call>\n<tool_call>{"name": "g", "arguments": '
            '"{\\"y\\": [1, 2]}"}</tool_call>',
            None,
            [("f", {"x": "<a>"}), ("g", {"y": [1, 2]})],
        ),
        ('<tool_call>{"name": "f", "arguments": {"x": 1}}', None, [("f", {"x": 1})]),  # ended at EOS, unclosed
        ('<tool_call>{"name": "f"}</tool_call>', None, [("f", {})]),  # no arguments: an empty object
        ('<tool_call>{"name": "f", "parameters": {"q": "ü"}}</tool_call>', None, [("f", {"q": "ü"})]),
        ("no call here <tool", "no call here <tool", []),
        ('<tool_call>{"name": "f", "arguments": {"x": </tool_call>', None, []),  # broken JSON: all content
        ('<tool_call>{"arguments": {}}</tool_call>', None, []),  # no name
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', None, []),  # arguments not an object
    ],
)
def test_hermes_parser(text, content, calls):
    parsed = Hermes().parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls
    assert parsed.content == (content if calls else text)
    assert all(c.id.startswith("call_") for c in parsed.calls) and len({c.id for c in parsed.calls}) == len(calls)


@pytest.mark.parametrize(
    "text, calls",
    [
        ('{"name": "f", "parameters": {"x": 1}}', [("f", {"x": 1})]),
        (' \n{"name": "f", "arguments": {"x": "a;b"}}\n', [("f", {"x": "a;b"})]),
        ('<|python_tag|>{"name": "f", "parameters": {}}', [("f", {})]),
        (
            '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {"b": 2}}',
            [("f", {"a": 1}), ("g", {"b": 2})],
        ),
        ('{"name": "f", "parameters": {"a": 1}} and more', []),
        ('{"parameters": {}}', []),
        ('{"name": "f", "parameters": {"a": ', []),  # cut off
        ("The answer is 4.", []),
        ('[{"name": "f", "parameters": {}}]', []),
    ],
)
def test_llama3_json_parser(text, calls):
    parsed = Llama3Json().parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls
    assert parsed.content == (None if calls else text)


def test_registry_names_and_unknown_parser():
    from lightning_llmopt.cli.serve import TOOL_CALL_PARSERS

    assert sorted(TOOL_CALL_PARSERS) == sorted(TOOL_PARSERS)
    assert isinstance(get_tool_parser("hermes"), Hermes) and isinstance(get_tool_parser("llama3_json"), Llama3Json)
    with pytest.raises(ValueError, match="'nope' is unknown; known: hermes, llama3_json"):
        get_tool_parser("nope")


def _replay(plan: ToolPlan, text: str, step: int, engine_reason: str = "stop") -> tuple[str | None, list, str | None]:
    """What a client rebuilds from the deltas of ``text`` fed ``step`` characters at a time: the content, the calls
    as ``(id, name, arguments)``, and the finish reason."""
    stream, deltas = ToolStream(plan), []
    for i in range(0, len(text), step):
        deltas += stream.feed(text[i : i + step])
    held, reason = stream.finish(engine_reason)
    content, calls = None, {}
    for d in deltas + held:
        if "content" in d:
            content = (content or "") + d["content"]
        for tc in d.get("tool_calls", []):
            call = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            call["id"] = tc.get("id", call["id"])
            call["name"] = tc.get("function", {}).get("name", call["name"])
            call["arguments"] += tc.get("function", {}).get("arguments", "")
    return content, [(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls.items())], reason


TEXTS = [
    'Sure. \n<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call><tool_call>{"name": "g"}</tool_call>',
    "<tool_ca is not a call, and neither is <tool_call> this",
    "plain text with a < sign   ",
    '  {"name": "f", "parameters": {"x": [1, 2]}}',
    '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}',
    "{not json",
    " Hello",
    "",
]


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
@pytest.mark.parametrize("text", TEXTS)
def test_streamed_auto_rebuilds_the_parsed_message(parser, text):
    plan = ToolPlan("auto", parser=get_tool_parser(parser))
    whole = plan.parse(text)
    for step in (1, 3, 1000):
        content, calls, reason = _replay(plan, text, step)
        assert content == (whole.content or None)
        assert [(name, args) for _, name, args in calls] == [(c.name, c.arguments) for c in whole.calls]
        assert all(i and i.startswith("call_") for i, _, _ in calls)
        assert reason == ("tool_calls" if whole.calls else "stop")
    if parser == "hermes" and "<tool_call>{" in text:  # the content before a call streams before the end
        assert ToolStream(plan).feed(text[: text.index("<tool_call>{") + 3]) == [{"content": "Sure."}]


def test_required_and_named_plans():
    schema = required_schema(TOOLS, parallel=False)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    branches = schema["items"]["anyOf"]
    assert [b["properties"]["name"]["enum"] for b in branches] == [["get_weather"], ["add"]]
    assert [b["properties"]["parameters"] for b in branches] == [WEATHER, ADD]
    assert "maxItems" not in required_schema(TOOLS)

    required = ToolPlan("required")
    text = '[{"name": "add", "parameters": {"a": 3, "b": true}}, {"name": "get_weather", "parameters": {}}]'
    parsed = required.parse(text)
    assert parsed.content is None and [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("add", {"a": 3, "b": True}), ("get_weather", {}),
    ]  # fmt: skip
    assert (
        required.finish_reason(parsed, "stop") == "tool_calls" and required.finish_reason(parsed, "length") == "length"
    )
    assert required.parse('[{"name": "add", "para').calls == []  # cut off by max_tokens: the text stays content
    content, calls, reason = _replay(required, text, 5)
    assert content is None and reason == "tool_calls"
    assert [(n, a) for _, n, a in calls] == [(c.name, c.arguments) for c in parsed.calls]

    named = ToolPlan("named", name="add")
    assert [(c.name, c.arguments) for c in named.parse('{"a": 1, "b": false}').calls] == [
        ("add", '{"a": 1, "b": false}')
    ]
    content, calls, reason = _replay(named, '{"a": 1, "b": false}', 4)
    assert content is None and [(n, a) for _, n, a in calls] == [("add", '{"a": 1, "b": false}')] and reason == "stop"
    with pytest.raises(ValueError, match="mode 'named' takes"):
        ToolPlan("named")


# ---------------------------------------------------------------------------------------------- the request checks


def test_tool_choice_modes_and_constraints():
    none = _chat(tools=TOOLS, tool_choice="none")
    assert none.tools is None and none.tool_plan is None and none.params.structured_output is None
    assert _chat().tool_plan is None  # no tools: no tool calls read
    auto = _chat(tools=TOOLS)  # tools without tool_choice: auto
    assert auto.tools == TOOLS and auto.tool_plan.mode == "auto" and auto.params.structured_output is None
    req = _chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert req.params.structured_output.json_schema == required_schema(TOOLS, parallel=False)
    assert req.constraint_param == "tool_choice" and req.tool_plan.mode == "required"
    named = _chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}})
    assert named.params.structured_output.json_schema == ADD and named.tool_plan.name == "add"
    bare = _chat(tools=[{"type": "function", "function": {"name": "ping"}}], tool_choice="required")
    assert (
        bare.params.structured_output.json_schema["items"]["anyOf"][0]["properties"]["parameters"]["type"] == "object"
    )


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": []}, "tools"),
        ({"tools": {"type": "function"}}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [{"type": "function", "function": {"name": "f", "extra": 1}}]}, "tools[0].function"),
        ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "add"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ],
)
def test_bad_tools_name_their_field(body, param):
    assert _param_of(**body) == param


def test_tool_turns_in_messages():
    history = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "f", "arguments": "not json"}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    req = parse_chat({"model": "m", "messages": history}, 16)
    assert req.messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
        {"id": "call_2", "type": "function", "function": {"name": "f", "arguments": "not json"}},
    ]}  # fmt: skip
    assert req.messages[2] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    for bad, param in [
        ({"role": "user", "content": "x", "tool_calls": []}, "messages[0].tool_calls"),
        ({"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}, "messages[0].tool_calls[0]"),
        ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]},
         "messages[0].tool_calls[0].function.arguments"),
        ({"role": "tool", "tool_call_id": 7, "content": "x"}, "messages[0].tool_call_id"),
        ({"role": "tool", "content": None}, "messages[0].content"),
    ]:  # fmt: skip
        with pytest.raises(APIError) as e:
            parse_chat({"model": "m", "messages": [bad]}, 16)
        assert e.value.param == param, bad


# ---------------------------------------------------------------------------------------------------- end to end

# writes the tools, each message, and an assistant's tool calls with their arguments as a dict (as HF templates do)
TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>"
    "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }}{{ c.function.arguments.city }}</call>{% endfor %}"
    "{{ m.content }}\n{% endfor %}<assistant>"
)


@pytest.fixture(scope="module")
def served_url() -> Iterator[str]:
    """This module's server: the conformance suite's tiny one, with :data:`TEMPLATE` (``client`` talks to it)."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    pytest.importorskip("llguidance")
    import _conformance_server as helpers

    with helpers.running(helpers.tiny_server(chat_template=TEMPLATE)) as url:
        yield url


def _valid(name: str, arguments: str) -> None:
    """``arguments`` is JSON text valid against tool ``name``'s schema."""
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def _streamed(client: Any, **kw: Any) -> Any:
    """The message the ``openai`` client's streaming helper rebuilds, and the choice's finish reason."""
    with client.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion()
    return final.choices[0].message, final.choices[0].finish_reason


def _calls(message: Any) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def test_none_and_rendering(client):
    c = client
    history = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_9", "content": "sunny"},
    ]  # fmt: skip
    kw = dict(model="tiny", messages=history, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    out = c.chat.completions.create(tools=TOOLS, tool_choice="none", **kw)
    msg = out.choices[0].message
    assert msg.tool_calls is None and isinstance(msg.content, str) and out.choices[0].finish_reason == "length"
    rendered = "<user>Weather in Paris?\n<assistant><call>get_weatherRome</call>\n<tool>sunny\n<assistant>"
    assert out.usage.prompt_tokens == len(rendered.encode())  # no tools offered; the tool turns rendered
    offered = c.chat.completions.create(tools=TOOLS, **kw)  # auto: the tools are in the prompt
    assert offered.usage.prompt_tokens == len(("<tools>get_weather;add;</tools>\n" + rendered).encode())


def test_required(client):
    c = client
    kw = dict(model="tiny", messages=MSGS, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
              max_tokens=150, temperature=0)  # fmt: skip
    out = c.chat.completions.create(**kw)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in SCHEMAS
    _valid(call.function.name, call.function.arguments)
    message, reason = _streamed(c, **kw)
    assert _calls(message) == _calls(choice.message) and reason == "tool_calls" and not message.content

    several = c.chat.completions.create(**{**kw, "n": 3, "temperature": 1.0, "seed": 1})
    assert sorted(ch.index for ch in several.choices) == [0, 1, 2]
    for ch in several.choices:  # each choice read by itself
        assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1, ch
        _valid(ch.message.tool_calls[0].function.name, ch.message.tool_calls[0].function.arguments)


def test_named_function(client):
    c = client
    kw = dict(model="tiny", messages=MSGS, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
              max_tokens=150, temperature=0)  # fmt: skip
    out = c.chat.completions.create(**kw)
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None  # vLLM keeps "stop" for a named choice
    assert [call.function.name for call in choice.message.tool_calls] == ["add"]
    _valid("add", choice.message.tool_calls[0].function.arguments)
    message, reason = _streamed(c, **kw)
    assert _calls(message) == _calls(choice.message) and reason == "stop"


def test_auto_reads_a_hermes_call(client):
    """The regular expression makes the random model write a Hermes call after some text; the parser reads it."""
    c = client
    call = r'\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "unit": "[cf]"\}\}'
    regex = rf"Ok\.\n<tool_call>{call}</tool_call>"
    kw = dict(model="tiny", messages=MSGS, tools=TOOLS, max_tokens=150, temperature=0,
              extra_body={"structured_outputs": {"regex": regex}})  # fmt: skip
    out = c.chat.completions.create(**kw)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Ok.", choice
    assert [call.function.name for call in choice.message.tool_calls] == ["get_weather"]
    _valid("get_weather", choice.message.tool_calls[0].function.arguments)
    message, reason = _streamed(c, **kw)
    assert _calls(message) == _calls(choice.message) and message.content == "Ok." and reason == "tool_calls"

    plain = c.chat.completions.create(**{**kw, "extra_body": {"structured_outputs": {"choice": ["<tool_call>x"]}}})
    assert plain.choices[0].message.content == "<tool_call>x" and not plain.choices[0].message.tool_calls
    assert plain.choices[0].finish_reason == "stop"  # a call that does not parse stays content


def test_bad_tools_over_http(client):
    c = client
    for kw, param in [
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools[0].function.name"),
        (dict(tool_choice="required"), "tool_choice"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, **kw)
        assert e.value.body["param"] == param and e.value.status_code == 400
    bad_schema = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}]
    with pytest.raises(openai.BadRequestError) as e:  # refused by the grammar library when compiled
        c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, tools=bad_schema, tool_choice="required")
    assert e.value.body["param"] == "tool_choice"
