"""``llmopt serve`` end to end: a real uvicorn server on 127.0.0.1 (a free port), driven by the official ``openai``
client, against the offline :class:`LLMEngine` and the plain model. All traffic stays on 127.0.0.1; every wait is
bounded."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from lightning_llmopt.data.tokenizers import ByteTokenizer  # noqa: E402
from lightning_llmopt.inference import LLMEngine, SamplingParams  # noqa: E402
from lightning_llmopt.inference.serving import Server, build_app  # noqa: E402
from lightning_llmopt.models import Llama, LlamaConfig  # noqa: E402

KEY = "test-key"
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"


@contextlib.contextmanager
def running(server: Server, grace: float | None = None) -> Iterator[str]:
    """Serve ``server`` with uvicorn in a thread on a free port of 127.0.0.1; yields the base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(build_app(server), log_level="warning", timeout_graceful_shutdown=grace)
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert uv.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        uv.should_exit = True
        thread.join(30)
        assert not thread.is_alive(), "the server did not shut down"


def tiny_model(**overrides) -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig.from_preset("tiny", init_std=0.1, **overrides)).eval()


def offline(model: Llama, prompts: list, max_tokens: int) -> list:
    engine = LLMEngine(model, ByteTokenizer(), num_blocks=512, block_size=8)
    return engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


@pytest.fixture(scope="module")
def served() -> Iterator[SimpleNamespace]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the engine thread too: tiny models only lose to intra-op threads
    model = tiny_model()
    engine = LLMEngine(model, ByteTokenizer(), num_blocks=512, block_size=8, max_num_seqs=64)
    server = Server(engine, "tiny", api_key=KEY, chat_template=TEMPLATE)
    with running(server) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, http_client=httpx.Client(trust_env=False))
        yield SimpleNamespace(url=url, engine=engine, model=model, server=server, client=client)
    torch.set_num_threads(threads)


def _greedy(**kw):
    return dict(temperature=0, extra_body={"ignore_eos": True}, **kw)


def test_completions_and_chat_streamed_and_not(served):
    c, prompt = served.client, "Hello, world"
    ref = offline(served.model, [prompt], 12)[0]
    out = c.completions.create(model="tiny", prompt=prompt, max_tokens=12, **_greedy())
    assert out.choices[0].text == ref.text and out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt.encode()), 12)
    chunks = list(c.completions.create(model="tiny", prompt=prompt, max_tokens=12, stream=True, **_greedy()))
    assert "".join(ch.choices[0].text for ch in chunks) == ref.text and chunks[-1].choices[0].finish_reason == "length"

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ü"}]
    rendered = "<system>Be brief.\n<user>Hi ü\n<assistant>"
    ref = offline(served.model, [rendered], 10)[0]
    chat = c.chat.completions.create(model="tiny", messages=messages, max_tokens=10, **_greedy())
    assert chat.choices[0].message.content == ref.text and chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens == len(rendered.encode())
    stream = c.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, stream=True, stream_options={"include_usage": True}, **_greedy()
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].usage.completion_tokens == 10
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ref.text


def test_parallel_samples_seeds_logprobs_and_stops(served):
    c = served.client
    kw = dict(model="tiny", prompt="abc", max_tokens=8, temperature=1.0, top_p=0.95, n=3, seed=7)
    first = c.completions.create(**kw)
    assert sorted(ch.index for ch in first.choices) == [0, 1, 2] and first.usage.completion_tokens <= 24
    again = c.completions.create(**kw)
    assert [ch.text for ch in again.choices] == [ch.text for ch in first.choices]
    other = c.completions.create(**{**kw, "seed": 8})
    assert [ch.text for ch in other.choices] != [ch.text for ch in first.choices]
    both = c.completions.create(**{**kw, "prompt": ["xyz", "abc"]})  # choice index = prompt * n + i
    assert sorted(ch.index for ch in both.choices) == list(range(6))
    assert [ch.text for ch in sorted(both.choices, key=lambda ch: ch.index)[3:]] == [ch.text for ch in first.choices]

    # logprobs: the greedy token's is the top of the model's own log-softmax over the prompt
    rendered = "<user>x\n<assistant>"
    with torch.no_grad():
        ref = torch.log_softmax(served.model(torch.tensor([list(rendered.encode())]))[0, -1].double(), -1)
    chat = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4, logprobs=True, top_logprobs=3,
        **_greedy(),
    )  # fmt: skip
    first_lp = chat.choices[0].logprobs.content[0]
    top3 = ref.topk(3).values.tolist()
    assert abs(first_lp.logprob - top3[0]) < 1e-4  # fp32 paged forward vs the plain forward of a tiny model
    assert [round(t.logprob, 4) for t in first_lp.top_logprobs] == [round(v, 4) for v in top3]
    out = c.completions.create(model="tiny", prompt="abc", max_tokens=6, logprobs=2, **_greedy())
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == 6 and all(v <= 0 for v in lp.token_logprobs) and lp.text_offset[0] == 0

    full = offline(served.model, ["The stop"], 40)[0]
    start = next(i for i in range(2, len(full.text) - 2) if "\ufffd" not in full.text[i : i + 2])
    stop = full.text[start : start + 2]
    for stream in (False, True):
        res = c.completions.create(model="tiny", prompt="The stop", max_tokens=40, stop=[stop], stream=stream,
                                   **_greedy())  # fmt: skip
        chunks = list(res) if stream else [res]
        assert "".join(ch.choices[0].text for ch in chunks) == full.text[: full.text.index(stop)]
        assert chunks[-1].choices[0].finish_reason == "stop"
    tid = full.token_ids[5]
    res = c.completions.create(model="tiny", prompt="The stop", max_tokens=40, temperature=0,
                               extra_body={"ignore_eos": True, "stop_token_ids": [tid]})  # fmt: skip
    assert res.usage.completion_tokens == full.token_ids.index(tid) and res.choices[0].finish_reason == "stop"


async def _clients(url: str, prompts: list[list[int]], leave: set[int]) -> list:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, http_client=httpx.AsyncClient(trust_env=False))

    async def one(i: int) -> tuple[str, int] | None:
        stream = await client.completions.create(
            model="tiny", prompt=prompts[i], max_tokens=200 if i in leave else 16, stream=True,
            stream_options={"include_usage": True}, **_greedy(),
        )  # fmt: skip
        text, used = [], -1
        async for ch in stream:
            if i in leave:  # disconnect after the first chunk
                await stream.close()
                return None
            text += [c.text for c in ch.choices]
            used = ch.usage.completion_tokens if ch.usage else used
        return "".join(text), used

    try:
        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(len(prompts)))), 120)
    finally:
        await client.close()


def test_concurrent_streams_with_disconnects(served):
    engine = served.engine
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (int(n),), generator=g).tolist() for n in torch.randint(3, 40, (50,), generator=g)]
    leave = set(range(0, 50, 5))  # 20% disconnect mid-stream
    cancelled, before = engine.stats.cancelled, _metrics(served.url)
    results = asyncio.run(_clients(served.url, prompts, leave))
    deadline = time.monotonic() + 20
    while (served.server.core.in_flight or engine.has_unfinished()) and time.monotonic() < deadline:
        time.sleep(0.02)
    while _delta(after := _metrics(served.url), before, "", "abort") < len(leave) and time.monotonic() < deadline:
        time.sleep(0.02)
    # each request counted once: those that left as "abort", the others as "length" (16 tokens, ignore_eos)
    assert _delta(after, before, "", "abort") == len(leave) and _delta(after, before, "", "length") == 50 - len(leave)
    assert _delta(after, before, "llmopt_e2e_request_latency_seconds_count") == 50
    assert served.server.core.in_flight == 0 and not engine.has_unfinished()
    assert engine.stats.cancelled - cancelled == len(leave)  # 200 tokens each: all still running when they left
    assert engine.blocks.num_available() == engine.blocks.allocator.capacity  # free, or evictable prefix entries
    kept = [i for i in range(50) if i not in leave]
    refs = offline(served.model, [prompts[i] for i in kept], 16)
    assert [results[i] for i in kept] == [(r.text, len(r.token_ids)) for r in refs]


def _error(exc_info) -> dict:
    return exc_info.value.body


def test_bad_requests(served):
    c = served.client
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert _error(e)["code"] == "model_not_found" and _error(e)["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt="x", max_tokens=0)
    assert _error(e)["param"] == "max_tokens" and _error(e)["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt="x" * 300, max_tokens=4)
    assert _error(e)["code"] == "context_length_exceeded" and "max_model_len" in _error(e)["message"]
    for field, value in (("echo", True), ("logit_bias", {"1": 5}), ("suffix", "z")):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={field: value})
        assert _error(e)["param"] == field and _error(e)["code"] == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt="x", max_tokens=2, n=2, temperature=0)
    assert _error(e)["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [{"type": "image_url"}]}])
    assert _error(e)["param"] == "messages[0].content"
    bad = openai.OpenAI(base_url=f"{served.url}/v1", api_key="wrong", http_client=httpx.Client(trust_env=False))
    with pytest.raises(openai.AuthenticationError) as e:
        bad.completions.create(model="tiny", prompt="x", max_tokens=2)
    assert _error(e)["code"] == "invalid_api_key"
    with httpx.Client(trust_env=False) as h:
        r = h.post(f"{served.url}/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert h.get(f"{served.url}/health").json() == {"status": "ok"}
    assert [m.id for m in c.models.list()] == ["tiny"]


def test_metrics_parse(served):
    from prometheus_client.parser import text_string_to_metric_families

    served.client.completions.create(model="tiny", prompt="m", max_tokens=3, stream=True, **_greedy()).close()
    served.client.completions.create(model="tiny", prompt="m", max_tokens=3, **_greedy())
    with httpx.Client(trust_env=False) as h:
        text = h.get(f"{served.url}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    names = ["llmopt_requests", "llmopt_generation_tokens", "llmopt_time_to_first_token_seconds"]
    names += ["llmopt_inter_token_latency_seconds", "llmopt_kv_blocks_free", "llmopt_requests_rejected"]
    for name in names:
        assert name in families, sorted(families)
    samples = {s.name: s.value for f in families.values() for s in f.samples if not s.labels}
    assert samples["llmopt_generation_tokens_total"] >= 3 and samples["llmopt_engine_ready"] == 1
    assert samples["llmopt_kv_blocks_total"] == served.engine.blocks.allocator.capacity


def test_loading_back_pressure_and_shutdown():
    model, go = tiny_model(max_seq_len=4096), threading.Event()  # room for a request that outlasts the test
    box = {}

    def build() -> LLMEngine:
        assert go.wait(30)
        box["engine"] = LLMEngine(model, ByteTokenizer(), num_blocks=600, block_size=8, max_num_seqs=1)
        return box["engine"]

    server = Server(build, "tiny", max_queue=0, grace_s=0.2)
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
    with httpx.Client(trust_env=False, timeout=30) as h, contextlib.ExitStack() as streams:
        with running(server, grace=1) as url:
            assert h.get(f"{url}/health").json()["status"] == "loading"
            r = h.post(f"{url}/v1/completions", json=body)
            assert r.status_code == 503 and "Retry-After" in r.headers
            go.set()
            deadline = time.monotonic() + 30
            while h.get(f"{url}/health").status_code != 200 and time.monotonic() < deadline:
                time.sleep(0.02)
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
            r = h.post(f"{url}/v1/chat/completions", json=chat)
            assert r.status_code == 400 and r.json()["error"]["code"] == "no_chat_template"
            with pytest.raises(httpx.ReadTimeout):  # a non-streamed client that gives up: its request is cancelled
                h.post(f"{url}/v1/completions", json=body, timeout=0.5)
            deadline = time.monotonic() + 10
            while server.core.in_flight and time.monotonic() < deadline:
                time.sleep(0.02)
            assert server.core.in_flight == 0 and box["engine"].stats.cancelled == 1
            first = streams.enter_context(h.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}))
            lines = first.iter_lines()  # kept: a dropped line iterator closes the connection (a disconnect)
            line = next(lines)
            assert line.startswith("data: {") and "error" not in line  # the first request is running
            r = h.post(f"{url}/v1/completions", json=body)
            assert r.status_code == 503 and r.headers["Retry-After"] == "1", (line, server.core.in_flight)
            assert r.json()["error"]["code"] == "overloaded"
        # the server shut down with the stream still open: the request was cancelled, its blocks freed
        engine = box["engine"]
        assert server.core.state == "stopped" and not engine.has_unfinished() and engine.stats.cancelled == 2
        assert engine.blocks.num_available() == engine.blocks.allocator.capacity


def test_chat_uses_the_tokenizers_own_template(tmp_path):
    """Without --chat-template, a tokenizer folder's template renders the messages (HFTokenizer.apply_chat_template)."""
    import json

    from lightning_llmopt.data.tokenizers import load_tokenizer

    ByteTokenizer().save_pretrained(tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    config["chat_template"] = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}[assistant]"
    config_path.write_text(json.dumps(config))
    tok = load_tokenizer(tmp_path)
    model = tiny_model()
    ref = LLMEngine(model, tok, num_blocks=64, block_size=8).generate(
        ["[user]hi[assistant]"], SamplingParams(max_tokens=6, ignore_eos=True)
    )[0]
    server = Server(LLMEngine(model, tok, num_blocks=64, block_size=8), "tiny")
    with running(server) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", http_client=httpx.Client(trust_env=False))
        out = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, **_greedy()
        )
    assert out.choices[0].message.content == ref.text and out.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_serve_command_builds_the_engine():
    from lightning_llmopt.cli.serve import build_engine, build_parser, main

    args = build_parser().parse_args(
        ["--preset", "tiny", "--tokenizer", "byte", "--device", "cpu", "--num-blocks", "32", "--max-model-len", "64"]
    )
    engine = build_engine(args)
    assert isinstance(engine.tokenizer, ByteTokenizer) and engine.max_model_len == 64
    assert engine.blocks.allocator.num_blocks == 32 and engine.device.type == "cpu"
    with pytest.raises(SystemExit, match="exactly one of MODEL"):
        main(["--tokenizer", "byte"])


def _wait_status(h, url: str, status: int, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while (r := h.get(f"{url}/health")).status_code != status and time.monotonic() < deadline:
        time.sleep(0.02)
    return r


def test_health_shows_the_loading_phases_then_ready():
    """A build made slow by an injected wait: /health is 503 "loading" with the phases done and the one running,
    /v1 requests get OpenAI-style 503s with Retry-After; once built, 200 and requests are served."""
    from lightning_llmopt.inference.startup import StartupLog

    model, go = tiny_model(), threading.Event()
    startup = StartupLog()

    def build() -> LLMEngine:
        startup.mark("load weights")
        startup.mark("injected delay")
        assert go.wait(30)
        return LLMEngine(model, ByteTokenizer(), num_blocks=64, block_size=8, tuning_cache=False, startup=startup)

    server = Server(build, "tiny", startup=startup)
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    with httpx.Client(trust_env=False, timeout=30) as h, running(server) as url:
        r = _wait_status(h, url, 503)
        deadline = time.monotonic() + 30
        while r.json()["startup"]["current"] != "injected delay" and time.monotonic() < deadline:
            r = h.get(f"{url}/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        info = r.json()["startup"]
        assert info["current"] == "injected delay" and [p["name"] for p in info["phases"]] == ["load weights"]
        for route, payload in (("completions", body), ("chat/completions", {"model": "tiny", "messages": []})):
            r = h.post(f"{url}/v1/{route}", json=payload)
            assert r.status_code == 503 and r.headers["Retry-After"] == "5", r.text
            err = r.json()["error"]
            assert err["code"] == "unavailable" and err["type"] == "server_error" and "injected delay" in err["message"]
        go.set()
        r = _wait_status(h, url, 200)
        assert r.json() == {"status": "ok"}
        out = h.post(f"{url}/v1/completions", json=body)
        assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 3
    names = [p.name for p in server.core.engine.startup.phases]
    assert names == ["load weights", "injected delay", "kv pool", "runner"]


def test_a_failed_build_is_reported():
    from lightning_llmopt.inference.startup import StartupLog

    startup, failures = StartupLog(), []

    def build() -> LLMEngine:
        startup.mark("load weights")
        raise FileNotFoundError("checkpoint 'nowhere' does not exist")

    server = Server(build, "tiny", startup=startup, on_failed=failures.append)
    with httpx.Client(trust_env=False, timeout=30) as h, running(server) as url:
        r = _wait_status(h, url, 500)
        assert r.status_code == 500 and r.json()["status"] == "failed"
        assert r.json()["error"] == "FileNotFoundError: checkpoint 'nowhere' does not exist (in phase 'load weights')"
        assert r.json()["startup"]["current"] == "load weights"
        r = h.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi"})
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_failed"
        assert "does not exist" in r.json()["error"]["message"]
    assert failures == [r.json()["error"]["message"].removeprefix("the engine failed to load: ")]


def test_serve_command_exits_nonzero_when_the_build_fails(tmp_path):
    from lightning_llmopt.cli.serve import main

    missing = tmp_path / "no-such-checkpoint"
    with pytest.raises(SystemExit) as exc:
        main([str(missing), "--port", "0", "--device", "cpu", "--log-level", "warning"])
    message = exc.value.code
    assert isinstance(message, str)
    assert message.startswith("llmopt serve: building the engine failed: FileNotFoundError")
    assert str(missing) in message and "(in phase 'load weights')" in message


def test_serve_command_prints_the_phases(tmp_path, capsys):
    from lightning_llmopt.cli.serve import build_engine, build_parser
    from lightning_llmopt.inference.startup import StartupLog

    args = build_parser().parse_args(
        ["--preset", "tiny", "--device", "cpu", "--num-blocks", "16", "--tuning-cache-dir", str(tmp_path)]
    )
    lines: list[str] = []
    engine = build_engine(args, StartupLog(on_line=lines.append))
    assert [p.name for p in engine.startup.phases] == ["random init", "kv pool", "runner"]
    assert [line.split(":")[0] for line in lines] == ["random init", "kv pool", "runner"]
    assert engine.tuning_cache is not None and engine.tuning_cache.directory == tmp_path
    assert next(engine.model.parameters()).dtype == torch.float32 and engine.device.type == "cpu"
    args = build_parser().parse_args(["--preset", "tiny", "--device", "cpu", "--num-blocks", "16", "--no-tuning-cache"])
    assert build_engine(args).tuning_cache is None


def _metrics(url: str) -> dict[tuple[str, tuple], float]:
    """``/metrics`` parsed by prometheus_client: ``{(sample name, sorted labels): value}``."""
    from prometheus_client.parser import text_string_to_metric_families

    with httpx.Client(trust_env=False) as h:
        text = h.get(f"{url}/metrics").text
    families = text_string_to_metric_families(text)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


def _finished(samples: dict, reason: str) -> float:
    return samples.get(("llmopt_requests_total", (("finish_reason", reason),)), 0.0)


def _delta(after: dict, before: dict, name: str, reason: str | None = None) -> float:
    if reason is not None:
        return _finished(after, reason) - _finished(before, reason)
    return after.get((name, ()), 0.0) - before.get((name, ()), 0.0)


def test_a_disconnected_stream_is_counted_as_abort(served):
    """A client that leaves mid-stream: its request is cancelled and counted once in /metrics with
    finish_reason="abort", its prompt, the tokens generated until the cancel and its latency; requests read to
    their end are counted exactly once, streamed or not."""
    before = _metrics(served.url)
    prompt = "leave early"
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 240, "temperature": 0, "ignore_eos": True, "stream": True}
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(trust_env=False, timeout=30, headers=auth) as h:
        with h.stream("POST", f"{served.url}/v1/completions", json=body) as r:
            line = next(r.iter_lines())
            assert r.status_code == 200 and line.startswith("data: {") and "error" not in line
        # leaving the block closes the connection with the stream unread: a disconnect
    deadline = time.monotonic() + 20
    while _delta(after := _metrics(served.url), before, "", "abort") < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _delta(after, before, "", "abort") == 1, after
    assert _delta(after, before, "", "length") == 0 and _delta(after, before, "", "stop") == 0
    assert _delta(after, before, "llmopt_prompt_tokens_total") == len(prompt.encode())
    generated = _delta(after, before, "llmopt_generation_tokens_total")
    assert 1 <= generated < 240  # the first chunk's token(s), and cancelled before the end
    assert _delta(after, before, "llmopt_e2e_request_latency_seconds_count") == 1
    assert served.server.core.in_flight == 0 and served.engine.stats.cancelled >= 1

    # the normal paths still count once each (3 tokens each; nothing more turns up later)
    served.client.completions.create(model="tiny", prompt="m", max_tokens=3, **_greedy())
    assert len(list(served.client.completions.create(model="tiny", prompt="m", max_tokens=3, stream=True,
                                                     **_greedy()))) == 3  # fmt: skip
    time.sleep(0.2)
    done = _metrics(served.url)
    assert _delta(done, after, "", "length") == 2 and _delta(done, after, "", "abort") == 0
    assert _delta(done, after, "llmopt_generation_tokens_total") == 6
    assert _delta(done, after, "llmopt_e2e_request_latency_seconds_count") == 2


def test_special_tokens_are_skipped_in_text_unless_asked(tmp_path):
    """A model that emits a special token (``<bos>`` of a Hugging Face byte-level tokenizer, made likely by copying
    a greedy token's output row to it): by default the text leaves it out, with ``skip_special_tokens: false`` it
    is in; streamed and whole responses, completions and chat (a template that renders the prompt as it is), agree
    with the tokenizers library's decode."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer

    from lightning_llmopt.data.tokenizers import load_tokenizer

    ByteTokenizer().save_pretrained(tmp_path)
    tok, reference = load_tokenizer(tmp_path), Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    bos, prompt = ByteTokenizer.BOS_ID, "special"
    ids_prompt = list(prompt.encode())  # what the chat template below renders, encoded without special tokens
    model = tiny_model()
    engine = LLMEngine(model, tok, num_blocks=64, block_size=8)
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    first = engine.generate([ids_prompt], greedy)[0].token_ids
    with torch.no_grad():
        model.output.weight[bos] = model.output.weight[first[2]] * 1.5
    ids = engine.generate([ids_prompt], greedy)[0].token_ids
    assert bos in ids and any(t < bos for t in ids[ids.index(bos) + 1 :]), ids  # text on both sides of it
    known = [t for t in ids if t < tok.vocab_size]

    template = "{{ messages[0]['content'] }}"
    server = Server(LLMEngine(model, tok, num_blocks=64, block_size=8), "tiny", chat_template=template)
    with running(server) as url:
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", http_client=httpx.Client(trust_env=False))
        for skip, extra in ((True, {}), (True, {"skip_special_tokens": True}), (False, {"skip_special_tokens": False})):
            want = reference.decode(known, skip_special_tokens=skip)
            assert ("<bos>" in want) is not skip
            kw = dict(model="tiny", max_tokens=12, temperature=0, extra_body={"ignore_eos": True, **extra})
            assert c.completions.create(prompt=ids_prompt, **kw).choices[0].text == want
            chunks = c.completions.create(prompt=ids_prompt, stream=True, **kw)
            assert "".join(ch.choices[0].text for ch in chunks) == want
            messages = [{"role": "user", "content": prompt}]
            assert c.chat.completions.create(messages=messages, **kw).choices[0].message.content == want
            chunks = c.chat.completions.create(messages=messages, stream=True, **kw)
            assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="tiny", prompt=prompt, max_tokens=2, extra_body={"skip_special_tokens": 1})
        assert _error(e)["param"] == "skip_special_tokens" and "expected bool" in _error(e)["message"]
