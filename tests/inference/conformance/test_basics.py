"""OpenAI API conformance, basics: what OpenAI's API reference promises about completions, chat completions,
streaming, ``n``, ``stop``, ``seed``, ``logprobs``, errors and ``/v1/models``, checked through the official
``openai`` client's typed objects against one ``llmopt serve`` server (the tiny random model, the byte tokenizer:
one token per byte of text, no special tokens added; see conftest.py).

The model is seeded, so greedy outputs are fixed; the expected values come from the API's own promises (a streamed
text equals the whole one, usage adds up, a cut before the stop string), never from a recorded output.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import _conformance_server as srv  # noqa: E402  (registered by conftest.py)

MODEL = srv.MODEL
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
PROMPT = srv.render(MESSAGES)  # the chat prompt as plain text: completions and chat see the same tokens
GREEDY: dict[str, Any] = dict(temperature=0)
CONTEXT = 256  # the tiny preset's max_seq_len


def _usage_adds_up(usage: Any, prompt_tokens: int, completion_tokens: int | None = None) -> None:
    assert usage.prompt_tokens == prompt_tokens
    if completion_tokens is not None:
        assert usage.completion_tokens == completion_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def _error_body(body: Any, status: int | None = None, param: str | None = None) -> dict:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}`` (``body`` is the whole JSON, or the
    inner object as the ``openai`` client keeps it)."""
    error = body["error"] if isinstance(body, dict) and set(body) == {"error"} else body
    assert isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error), body
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    if param is not None:
        assert error["param"] == param, error
    return error


# ---------------------------------------------------------------------------------------------------- objects


def test_models_list_names_the_served_model(client):
    models = list(client.models.list())
    assert [m.id for m in models] == [MODEL]
    assert models[0].object == "model" and isinstance(models[0].owned_by, str) and isinstance(models[0].created, int)


def test_models_retrieve_the_served_model(client):
    """``GET /v1/models/{model}`` (``client.models.retrieve``): the served model's card; an unknown one is a 404."""
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_completion_object(client):
    start = int(time.time())
    out = client.completions.create(model=MODEL, prompt="Hello, world", max_tokens=8, **GREEDY)
    assert isinstance(out, openai.types.Completion)
    assert out.object == "text_completion" and out.model == MODEL and out.id.startswith("cmpl-")
    assert start - 1 <= out.created <= time.time() + 1
    (choice,) = out.choices
    assert choice.index == 0 and isinstance(choice.text, str) and choice.text
    assert choice.finish_reason == "length" and choice.logprobs is None  # max_tokens reached; logprobs not asked
    _usage_adds_up(out.usage, len(b"Hello, world"), 8)

    ids = client.completions.create(model=MODEL, prompt=[72, 105, 33], max_tokens=3, **GREEDY)  # a token-id prompt
    _usage_adds_up(ids.usage, 3, 3)
    text = client.completions.create(model=MODEL, prompt="Hi!", max_tokens=3, **GREEDY).choices[0].text
    assert ids.choices[0].text == text


def test_completion_of_a_list_of_prompts(client):
    """A list of prompts: one choice per prompt, in order (index = prompt index), each as if sent alone."""
    prompts = ["ab", "Hello", "xyz!"]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, **GREEDY)
    assert [c.index for c in out.choices] == [0, 1, 2]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=4, **GREEDY).choices[0] for p in prompts]
    assert [c.text for c in out.choices] == [c.text for c in alone]
    assert [c.finish_reason for c in out.choices] == [c.finish_reason for c in alone]
    assert out.usage.prompt_tokens == sum(len(p) for p in prompts)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_chat_completion_object(client):
    start = int(time.time())
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, **GREEDY)
    assert isinstance(out, openai.types.chat.ChatCompletion)
    assert out.object == "chat.completion" and out.model == MODEL and out.id.startswith("chatcmpl-")
    assert start - 1 <= out.created <= time.time() + 1
    (choice,) = out.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason == "length" and choice.logprobs is None
    _usage_adds_up(out.usage, len(PROMPT.encode()), 8)
    # the same prompt as plain text gives the same answer; max_completion_tokens is max_tokens' newer name
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, **GREEDY).choices[0].text
    assert choice.message.content == text
    newer = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=8, **GREEDY)
    assert newer.choices[0].message.content == text and newer.usage.completion_tokens == 8


# ---------------------------------------------------------------------------------------------------- n, stop, seed


def test_n_choices(client):
    kw: dict[str, Any] = dict(model=MODEL, max_tokens=6, temperature=1.0, seed=11, n=3)
    out = client.completions.create(prompt=PROMPT, logprobs=1, **kw)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.text for c in out.choices}) > 1  # three samples of 6 tokens at temperature 1
    tokens = [len(c.logprobs.tokens) for c in out.choices]  # each choice's own token count
    assert all(1 <= t <= 6 for t in tokens) and out.usage.completion_tokens == sum(tokens)
    assert all((c.finish_reason == "length") == (t == 6) for c, t in zip(out.choices, tokens, strict=True))
    _usage_adds_up(out.usage, len(PROMPT.encode()))  # the prompt counted once, not per choice

    chat = client.chat.completions.create(messages=MESSAGES, logprobs=True, **kw)
    assert [c.index for c in chat.choices] == [0, 1, 2] and all(c.message.role == "assistant" for c in chat.choices)
    assert len({c.message.content for c in chat.choices}) > 1
    assert chat.usage.completion_tokens == sum(len(c.logprobs.content) for c in chat.choices)
    _usage_adds_up(chat.usage, len(PROMPT.encode()))


def _clean_stops(text: str, count: int) -> list[str]:
    """``count`` two-character printable ASCII substrings of ``text`` after its first character, first ones first."""
    pairs = [text[i : i + 2] for i in range(1, len(text) - 1)]
    found = [p for p in pairs if p.isascii() and p.isprintable()]
    assert len(found) >= count, repr(text)  # the seeded model's greedy answer has them
    return found[:count]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_stop_strings(client, stream):
    """``stop`` (a string or a list): the text ends right before the first match, which is left out; finish_reason
    is "stop"; fewer tokens than max_tokens are counted."""
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, **GREEDY).choices[0].text
    first, second = _clean_stops(full, 2)
    # a list: the earliest match of any of its strings wins, whatever their order in the list
    for stop in (second, [second, first], [first, "never-there"]):
        strings = [stop] if isinstance(stop, str) else stop
        cut = min(full.index(s) for s in strings if s in full)
        for endpoint in ("completions", "chat"):
            if endpoint == "completions":
                res = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, stop=stop, stream=stream,
                                                **GREEDY)  # fmt: skip
            else:
                res = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, stop=stop,
                                                     stream=stream, **GREEDY)  # fmt: skip
            text, reason = _text_and_reason(res, stream, endpoint)
            assert text == full[:cut], (endpoint, stop)
            assert reason == "stop", (endpoint, stop)
            if not stream:
                assert res.usage.completion_tokens < 16
                _usage_adds_up(res.usage, len(PROMPT.encode()))


def _text_and_reason(res: Any, stream: bool, endpoint: str) -> tuple[str, str | None]:
    if not stream:
        choice = res.choices[0]
        return (choice.text if endpoint == "completions" else choice.message.content), choice.finish_reason
    chunks = [ch for ch in res if ch.choices]
    if endpoint == "completions":
        text = "".join(ch.choices[0].text for ch in chunks)
    else:
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    return text, chunks[-1].choices[0].finish_reason


def test_seed_makes_sampling_repeatable(client):
    """Same seed, temperature 1: the same text twice; different seeds: not all the same text."""
    kw: dict[str, Any] = dict(model=MODEL, max_tokens=8, temperature=1.0)
    a = client.completions.create(prompt=PROMPT, seed=1234, **kw).choices[0].text
    assert client.completions.create(prompt=PROMPT, seed=1234, **kw).choices[0].text == a
    seeded = {client.completions.create(prompt=PROMPT, seed=s, **kw).choices[0].text for s in range(5)}
    assert len(seeded) > 1

    c = client.chat.completions.create(messages=MESSAGES, seed=1234, **kw).choices[0].message.content
    assert client.chat.completions.create(messages=MESSAGES, seed=1234, **kw).choices[0].message.content == c
    seeded = {client.chat.completions.create(messages=MESSAGES, seed=s, **kw).choices[0].message.content
              for s in range(5)}  # fmt: skip
    assert len(seeded) > 1


# ---------------------------------------------------------------------------------------------------- logprobs


def test_completion_logprobs(client):
    """``logprobs=k``: per generated token its text, its logprob and a dict of the k most likely tokens (logprobs
    <= 0); greedy, so the sampled token is the most likely one and its logprob is the dict's largest value."""
    k = 3
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, logprobs=k, **GREEDY)
    choice = out.choices[0]
    lp = choice.logprobs
    n = out.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n == 8
    assert all(v <= 0 for v in lp.token_logprobs)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == k, (token, top)
        assert all(v <= 0 for v in top.values())
        assert token in top and top[token] == pytest.approx(logprob) and logprob == pytest.approx(max(top.values()))


def test_chat_logprobs(client):
    """``logprobs=True, top_logprobs=k``: one ``content`` entry per generated token, each with its token, logprob,
    UTF-8 bytes and the k most likely alternatives, most likely first; greedy, so the token is the first of them.
    The tokens' bytes, joined, are the answer's UTF-8 (what ``bytes`` is for: characters split over tokens)."""
    k = 3
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, logprobs=True, top_logprobs=k,
                                         **GREEDY)  # fmt: skip
    choice = out.choices[0]
    content = choice.logprobs.content
    assert len(content) == out.usage.completion_tokens == 8
    for entry in content:
        assert isinstance(entry.token, str) and entry.logprob <= 0 and len(entry.top_logprobs) == k
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True) and all(v <= 0 for v in tops)
        assert entry.token == entry.top_logprobs[0].token and entry.logprob == pytest.approx(tops[0])
    joined = b"".join(bytes(entry.bytes) for entry in content)
    assert joined.decode("utf-8", errors="replace") == choice.message.content


def test_chat_logprobs_on_a_multibyte_answer(client):
    """``bytes`` of tokens that each hold part of a character: joined, they give back the character (here the
    seeded model's greedy answer to this prompt holds one; the assertion on it says so if that changes)."""
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=16,
                                         logprobs=True, **GREEDY)  # fmt: skip
    text = out.choices[0].message.content
    assert any(ord(ch) > 127 and ch != "\ufffd" for ch in text), repr(text)  # a real multi-byte character
    joined = b"".join(bytes(entry.bytes) for entry in out.choices[0].logprobs.content)
    assert joined.decode("utf-8", errors="replace") == text


# ---------------------------------------------------------------------------------------------------- streaming


def _check_chunks(chunks: list, obj: str, with_usage: bool) -> list:
    """Every chunk: one id, the object type, the model; with ``include_usage`` every chunk but the last has
    ``usage`` null and the last has no choices. Returns the chunks that carry choices."""
    assert chunks and len({ch.id for ch in chunks}) == 1
    assert all(ch.object == obj and ch.model == MODEL for ch in chunks)
    if with_usage:
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert all(ch.usage is None for ch in chunks[:-1])
        body = chunks[:-1]
    else:
        assert all(ch.choices and ch.usage is None for ch in chunks)
        body = chunks
    assert body and all(ch.choices for ch in body)
    return body


@pytest.mark.parametrize("with_usage", [False, True], ids=["plain", "include_usage"])
def test_streamed_completion_equals_the_whole_one(client, with_usage):
    kw: dict[str, Any] = dict(model=MODEL, prompt=PROMPT, max_tokens=12, **GREEDY)
    whole = client.completions.create(**kw)
    options = {"stream_options": {"include_usage": True}} if with_usage else {}
    chunks = list(client.completions.create(stream=True, **options, **kw))
    body = _check_chunks(chunks, "text_completion", with_usage)
    assert "".join(ch.choices[0].text for ch in body) == whole.choices[0].text
    assert all(ch.choices[0].index == 0 for ch in body)
    assert body[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"
    assert all(ch.choices[0].finish_reason is None for ch in body[:-1])
    if with_usage:
        assert chunks[-1].usage == whole.usage


def test_streamed_n_choices_equal_the_whole_ones(client):
    """``n=2`` with a seed, streamed: each index's deltas join to the text of the same request not streamed."""
    kw: dict[str, Any] = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=5, n=2)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    body = _check_chunks(chunks, "text_completion", True)
    for choice in whole.choices:
        mine = [ch.choices[0] for ch in body if ch.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text
        assert mine[-1].finish_reason == choice.finish_reason and all(c.finish_reason is None for c in mine[:-1])
    assert {ch.choices[0].index for ch in body} == {0, 1}
    assert chunks[-1].usage == whole.usage


@pytest.mark.parametrize("with_usage", [False, True], ids=["plain", "include_usage"])
def test_streamed_chat_equals_the_whole_one(client, with_usage):
    kw: dict[str, Any] = dict(model=MODEL, messages=MESSAGES, max_tokens=12, **GREEDY)
    whole = client.chat.completions.create(**kw)
    options = {"stream_options": {"include_usage": True}} if with_usage else {}
    chunks = list(client.chat.completions.create(stream=True, **options, **kw))
    body = _check_chunks(chunks, "chat.completion.chunk", with_usage)
    assert body[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in body) == whole.choices[0].message.content
    assert all(ch.choices[0].index == 0 for ch in body)
    assert body[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"
    assert all(ch.choices[0].finish_reason is None for ch in body[:-1])
    if with_usage:
        assert chunks[-1].usage == whole.usage


# ---------------------------------------------------------------------------------------------------- errors


def _create(client: Any, endpoint: str, **kw: Any) -> Any:
    if endpoint == "completions":
        return client.completions.create(prompt=kw.pop("prompt", "Hi"), **kw)
    return client.chat.completions.create(messages=kw.pop("messages", MESSAGES), **kw)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_unknown_model_is_not_found(client, endpoint):
    with pytest.raises(openai.NotFoundError) as e:
        _create(client, endpoint, model="gpt-4", max_tokens=2)
    assert e.value.status_code == 404 and e.value.param == "model"
    _error_body(e.value.body, param="model")


BAD_PARAMETERS = [
    ("temperature", dict(temperature=-1)),
    ("n", dict(n=0)),
    ("max_tokens", dict(max_tokens=0)),
    ("top_p", dict(top_p=1.5)),
    ("presence_penalty", dict(presence_penalty=3)),
    ("no_such_field", dict(extra_body={"no_such_field": 1})),
]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize(("param", "kw"), BAD_PARAMETERS, ids=[p for p, _ in BAD_PARAMETERS])
def test_bad_parameter_is_a_bad_request_naming_it(client, endpoint, param, kw):
    with pytest.raises(openai.BadRequestError) as e:
        _create(client, endpoint, model=MODEL, **{"max_tokens": 2, **kw})
    assert e.value.status_code == 400 and e.value.param == param, e.value.body
    _error_body(e.value.body, param=param)
    assert e.value.type == "invalid_request_error"


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("prompt_len", [CONTEXT + 40, CONTEXT - 8], ids=["prompt", "prompt+max_tokens"])
def test_over_the_context_length_is_a_bad_request(client, endpoint, prompt_len):
    text = "x" * prompt_len
    kw = dict(prompt=text) if endpoint == "completions" else dict(messages=[{"role": "user", "content": text}])
    with pytest.raises(openai.BadRequestError) as e:
        _create(client, endpoint, model=MODEL, max_tokens=16, **kw)
    assert e.value.status_code == 400 and e.value.code == "context_length_exceeded", e.value.body
    _error_body(e.value.body)


def test_http_errors_have_openai_bodies(served_url):
    with httpx.Client(base_url=served_url, trust_env=False, timeout=30) as h:
        for route in ("/v1/completions", "/v1/chat/completions"):
            r = h.get(route)  # a POST route
            assert r.status_code == 405 and "POST" in r.headers["allow"], r.text
            _error_body(r.json())
        r = h.get("/v1/no-such-route")
        assert r.status_code == 404
        _error_body(r.json())
        r = h.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400
        _error_body(r.json())
        r = h.post("/v1/completions", json={"model": MODEL, "max_tokens": 2})
        assert r.status_code == 400
        _error_body(r.json(), param="prompt")
        r = h.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2})
        assert r.status_code == 400
        _error_body(r.json(), param="messages")
