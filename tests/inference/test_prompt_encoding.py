"""One prompt encoding everywhere: a text prompt gets the tokenizer's BOS through ``llmopt generate``, the engine's
text API and ``/v1/completions`` exactly as transformers encodes it, so greedy output agrees with transformers'
``generate`` on a tiny random ``LlamaForCausalLM``; vLLM's ``add_special_tokens`` and ``truncate_prompt_tokens``
request fields; OpenAI's id prefixes; the web framework's own errors (404, 405, 500) as OpenAI error objects.

The server runs in-process (Starlette's ``TestClient``, an ``httpx.Client`` over the app, lifespan included) and is
driven by the official ``openai`` client through it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
pytest.importorskip("tokenizers")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
transformers = pytest.importorskip("transformers")

from starlette.testclient import TestClient  # noqa: E402

from lightning_llmopt.cli.generate import main as generate_main  # noqa: E402
from lightning_llmopt.data.tokenizers import ByteTokenizer  # noqa: E402
from lightning_llmopt.inference import LLMEngine, SamplingParams  # noqa: E402
from lightning_llmopt.inference.serving import Server, build_app  # noqa: E402

PROMPT = "Once upon a time"
BOS = ByteTokenizer.BOS_ID
TEMPLATE = "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
MESSAGES = [{"role": "user", "content": "hi there"}]
N = 10  # new tokens per request
ENGINE = dict(device="cpu", num_blocks=96, block_size=8)
# fp32 on both sides, the same math in another op order: log-probs agree to ~1e-6; 1e-4 leaves margin while a
# different token (or a prompt without its BOS) moves them by O(0.1) or more
ATOL = 1e-4


def _write_folder(folder: Path) -> Path:
    """A tiny random transformers Llama with a byte-level tokenizer whose post-processor adds ``<bos>`` (as a
    Llama-3 folder's does) and a chat template that writes it itself."""
    from tokenizers import Tokenizer, processors

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=258, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=BOS, eos_token_id=ByteTokenizer.EOS_ID,
        tie_word_embeddings=False,
        initializer_range=0.15,  # peaky logits: greedy choices far from ties
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    ByteTokenizer().save_pretrained(folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B:1", special_tokens=[("<bos>", BOS)]
    )
    tok.save(str(folder / "tokenizer.json"))
    config_path = folder / "tokenizer_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "chat_template": TEMPLATE}))
    return folder


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    folder = _write_folder(tmp_path_factory.mktemp("bos_llama"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    model = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    model.generation_config.eos_token_id = None  # N tokens, as ignore_eos on our side
    return SimpleNamespace(folder=folder, tokenizer=tokenizer, model=model)


def hf_greedy(hf: SimpleNamespace, ids: list[int], n: int = N) -> tuple[list[int], list[float]]:
    """transformers' greedy ``generate`` from ``ids``: the new tokens and each one's log-probability."""
    with torch.no_grad():
        prompt = torch.tensor([ids])
        out = hf.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, do_sample=False)
        new = out[0, len(ids) :].tolist()
        logp = torch.log_softmax(hf.model(out).logits[0].double(), -1)
    return new, [float(logp[len(ids) - 1 + i, t]) for i, t in enumerate(new)]


@pytest.fixture(scope="module")
def api(hf: SimpleNamespace) -> Iterator[SimpleNamespace]:
    server = Server(LLMEngine.from_pretrained(hf.folder, **ENGINE), "bos-llama")
    with TestClient(build_app(server), raise_server_exceptions=False) as http:
        client = openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="none", http_client=http, max_retries=0)
        yield SimpleNamespace(server=server, http=http, client=client)


def _greedy(**extra: object) -> dict:
    return dict(temperature=0, logprobs=0, extra_body={"ignore_eos": True, **extra})


def _error(exc_info: pytest.ExceptionInfo) -> dict:
    return exc_info.value.body


def test_bos_parity_generate_server_engine_and_transformers(hf, api, capsys):
    ids = hf.tokenizer(PROMPT)["input_ids"]
    assert ids == [BOS, *PROMPT.encode()]  # the folder's tokenizer adds a BOS, as a Llama folder's does
    want, want_lp = hf_greedy(hf, ids)

    cli = generate_main([str(hf.folder), "--prompt", PROMPT, "--max-tokens", str(N), "--ignore-eos", "--quiet",
                         "--json", "--device", "cpu", "--num-blocks", "96", "--block-size", "8"])  # fmt: skip
    capsys.readouterr()
    assert cli[0].prompt_token_ids == ids and cli[0].outputs[0].token_ids == want

    engine = LLMEngine.from_pretrained(hf.folder, **ENGINE)  # the Python API given a string
    params = SamplingParams(max_tokens=N, ignore_eos=True)
    out = engine.generate(PROMPT, params)[0]
    assert out.prompt_token_ids == ids and out.outputs[0].token_ids == want
    streamed = [t for ev in engine.stream([PROMPT], params) for t in ev.token_ids]
    assert streamed == want

    for stream in (False, True):
        usage = {"stream_options": {"include_usage": True}} if stream else {}
        got = api.client.completions.create(model="bos-llama", prompt=PROMPT, max_tokens=N, stream=stream, **usage,
                                            **_greedy())  # fmt: skip
        chunks = list(got) if stream else [got]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        lps = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
        assert chunks[-1].usage.prompt_tokens == len(ids)  # 17, BOS included: not 16
        assert text == engine.tokenizer.decode(want)
        assert lps == pytest.approx(want_lp, abs=ATOL)


def test_add_special_tokens_false_is_honoured(hf, api):
    ids = hf.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    assert ids == list(PROMPT.encode())
    want, want_lp = hf_greedy(hf, ids)
    got = api.client.completions.create(model="bos-llama", prompt=PROMPT, max_tokens=N,
                                        **_greedy(add_special_tokens=False))  # fmt: skip
    assert got.usage.prompt_tokens == len(ids)
    assert got.choices[0].logprobs.token_logprobs == pytest.approx(want_lp, abs=ATOL)
    # token-id prompts are taken as given, whatever the field says
    as_ids = api.client.completions.create(model="bos-llama", prompt=ids, max_tokens=N, **_greedy())
    assert as_ids.usage.prompt_tokens == len(ids) and as_ids.choices[0].text == got.choices[0].text
    engine = LLMEngine.from_pretrained(hf.folder, **ENGINE)
    out = engine.generate([PROMPT], SamplingParams(max_tokens=N, ignore_eos=True), add_special_tokens=False)[0]
    assert out.prompt_token_ids == ids and out.outputs[0].token_ids == want


def test_chat_has_one_bos_unless_asked_for_more(hf, api):
    ids = hf.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert ids[0] == BOS and ids[1] != BOS  # the template wrote the one BOS
    want, want_lp = hf_greedy(hf, ids)
    chat = api.client.chat.completions.create(model="bos-llama", messages=MESSAGES, max_tokens=N, temperature=0,
                                              logprobs=True, extra_body={"ignore_eos": True})  # fmt: skip
    assert chat.usage.prompt_tokens == len(ids)
    assert [c.logprob for c in chat.choices[0].logprobs.content] == pytest.approx(want_lp, abs=ATOL)
    doubled = api.client.chat.completions.create(model="bos-llama", messages=MESSAGES, max_tokens=N, temperature=0,
                                                 logprobs=True, extra_body={"ignore_eos": True,
                                                                            "add_special_tokens": True})  # fmt: skip
    _, double_lp = hf_greedy(hf, [BOS, *ids])  # as vLLM: the tokenizer's BOS before the template's
    assert doubled.usage.prompt_tokens == len(ids) + 1
    assert [c.logprob for c in doubled.choices[0].logprobs.content] == pytest.approx(double_lp, abs=ATOL)


def test_truncate_prompt_tokens_and_the_message_that_names_it(hf, api, capsys):
    long = "x" * 300  # 301 tokens with the BOS; max_model_len is 256
    with pytest.raises(openai.BadRequestError) as e:
        api.client.completions.create(model="bos-llama", prompt=long, max_tokens=N)
    err = _error(e)
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert '"truncate_prompt_tokens": 246' in err["message"] and "truncate=True" not in err["message"]

    ids = hf.tokenizer(long)["input_ids"]
    for keep, kept in ((20, 20), (-1, 256 - N)):  # the message's own advice, then vLLM's -1
        got = api.client.completions.create(model="bos-llama", prompt=long, max_tokens=N,
                                            **_greedy(truncate_prompt_tokens=keep))  # fmt: skip
        assert got.usage.prompt_tokens == kept
        assert got.choices[0].logprobs.token_logprobs == pytest.approx(hf_greedy(hf, ids[-kept:])[1], abs=ATOL)
    with pytest.raises(openai.BadRequestError) as e:  # still too long after truncation: the message says how far
        api.client.completions.create(model="bos-llama", prompt=long, max_tokens=N,
                                      extra_body={"truncate_prompt_tokens": 250})  # fmt: skip
    assert _error(e)["code"] == "context_length_exceeded" and '"truncate_prompt_tokens": 246' in _error(e)["message"]
    with pytest.raises(openai.BadRequestError) as e:
        api.client.completions.create(model="bos-llama", prompt=long, extra_body={"truncate_prompt_tokens": 0})
    assert _error(e)["param"] == "truncate_prompt_tokens" and _error(e)["code"] == "invalid_value"

    messages = [{"role": "user", "content": long}]  # chat takes it too
    with pytest.raises(openai.BadRequestError) as e:
        api.client.chat.completions.create(model="bos-llama", messages=messages, max_tokens=N)
    assert _error(e)["param"] == "messages" and '"truncate_prompt_tokens"' in _error(e)["message"]
    chat = api.client.chat.completions.create(model="bos-llama", messages=messages, max_tokens=N,
                                              extra_body={"truncate_prompt_tokens": 30})  # fmt: skip
    assert chat.usage.prompt_tokens == 30

    # each surface names its own remedy, and that remedy works there
    engine = LLMEngine.from_pretrained(hf.folder, **ENGINE)
    with pytest.raises(ValueError, match=r"truncate=True"):
        engine.generate([long], SamplingParams(max_tokens=N))
    assert len(engine.generate([long], SamplingParams(max_tokens=N), truncate=True)[0].prompt_token_ids) == 256 - N
    args = [str(hf.folder), "--prompt", long, "--max-tokens", str(N), "--quiet", "--device", "cpu",
            "--num-blocks", "96", "--block-size", "8"]  # fmt: skip
    with pytest.raises(SystemExit, match="--truncate"):
        generate_main(args)
    assert len(generate_main([*args, "--truncate"])[0].prompt_token_ids) == 256 - N
    capsys.readouterr()


def test_ids_have_openai_prefixes(api):
    c = api.client
    assert c.completions.create(model="bos-llama", prompt="a", max_tokens=2).id.startswith("cmpl-")
    chat = c.chat.completions.create(model="bos-llama", messages=MESSAGES, max_tokens=2)
    assert chat.id.startswith("chatcmpl-")
    chunks = list(c.chat.completions.create(model="bos-llama", messages=MESSAGES, max_tokens=2, stream=True))
    assert chunks and all(ch.id == chunks[0].id and ch.id.startswith("chatcmpl-") for ch in chunks)
    chunks = list(c.completions.create(model="bos-llama", prompt="a", max_tokens=2, stream=True))
    assert chunks and all(ch.id == chunks[0].id and ch.id.startswith("cmpl-") for ch in chunks)


def _is_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def test_framework_errors_are_openai_error_objects(api, monkeypatch):
    http = api.http
    err = _is_openai_error(http.get("/v1/nothing-here"), 404)
    assert err["code"] == "not_found" and "/v1/nothing-here" in err["message"]
    _is_openai_error(http.post("/v2/completions", json={}), 404)
    with pytest.raises(openai.NotFoundError) as e:  # an OpenAI route we do not serve, through the official client
        api.client.embeddings.create(model="bos-llama", input="x")
    assert _error(e)["code"] == "not_found"

    r = http.get("/v1/completions")  # GET on a POST route
    err = _is_openai_error(r, 405)
    assert err["code"] == "method_not_allowed" and "GET" in err["message"] and r.headers["allow"] == "POST"
    methods = {"GET", "POST", "PUT", "DELETE", "PATCH"}
    routes = [rt for rt in api.http.app.routes if getattr(rt, "methods", None)]
    served = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"}
    assert {rt.path for rt in routes} >= served
    for route in routes:  # every route, each method it does not take: the Allow header names those it does
        for method in sorted(methods - route.methods):
            r = http.request(method, route.path)
            err = _is_openai_error(r, 405)
            assert err["code"] == "method_not_allowed" and route.path in err["message"]
            assert {m.strip() for m in r.headers["allow"].split(",")} == route.methods, (route.path, r.headers)

    _is_openai_error(http.post("/v1/completions", content=b"{not json"), 400)

    def broken() -> str:
        raise RuntimeError("injected")

    monkeypatch.setattr(api.server.metrics, "render", broken)  # an unexpected exception in a handler
    err = _is_openai_error(http.get("/metrics"), 500)
    assert err["type"] == "server_error" and "RuntimeError" in err["message"] and "injected" not in err["message"]
