"""Structured output in the engine: every constrained text is valid (checked by ``jsonschema``, ``re`` and plain
Python, not by the grammar library that made it), greedy constrained decoding is token-exact against a reference
that recomputes the whole sequence and takes the argmax over the tokens a hand-written prefix check allows, and
unconstrained rows of the same batch are unchanged."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from lightning_llmopt.data.tokenizers import ByteTokenizer, load_tokenizer  # noqa: E402
from lightning_llmopt.inference import LLMEngine, SamplingParams, StructuredOutput  # noqa: E402
from lightning_llmopt.models import Llama, LlamaConfig  # noqa: E402

TOK = ByteTokenizer()

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "ok": {"type": "boolean"},
            "n": {"type": "integer", "minimum": -5, "maximum": 99},
        },
        "required": ["name", "ok", "n"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
            "kind": {"enum": ["x", "y"]},
        },
        "required": ["kind"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4},
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer", "maximum": 9, "minimum": 0}, "y": {"type": "null"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "label": {"type": "string", "pattern": "^[a-z]{2,4}$"},
        },
        "required": ["point", "label"],
        "additionalProperties": False,
    },
    {"anyOf": [{"type": "boolean"}, {"type": "string", "enum": ["none", "some"]}]},
]


def make_model(seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama(LlamaConfig.from_preset("tiny", init_std=0.1)).eval()  # peaky attention, as tests/inference/conftest


def _engine(model=None, tokenizer=TOK, **kw):
    return LLMEngine(model if model is not None else make_model(), tokenizer, num_blocks=256, block_size=8, **kw)


def test_500_schema_constrained_requests_all_validate():
    """500 sampled requests over five schemas (objects, arrays, enums, patterns, nesting, anyOf), batched together
    with different seeds: every text is complete (finish_reason "stop") and valid against its schema."""
    engine = _engine(max_num_seqs=128)
    rng = random.Random(0)
    prompts, params, schemas = [], [], []
    for i in range(500):
        schema = SCHEMAS[i % len(SCHEMAS)]
        prompts.append("".join(rng.choice("abcdefgh {}:,") for _ in range(rng.randint(1, 12))))
        so = StructuredOutput(json_schema=schema)
        params.append(SamplingParams(max_tokens=120, temperature=1.0, seed=i, structured_output=so))
        schemas.append(schema)
    outs = engine.generate(prompts, params)
    for out, schema in zip(outs, schemas, strict=True):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (c.finish_reason, c.text)
        jsonschema.validate(json.loads(c.text), schema)


@pytest.mark.parametrize(
    "so, check",
    [
        (StructuredOutput(regex=r"[a-c]{3}-[0-9]{2}"), lambda t: re.fullmatch(r"[a-c]{3}-[0-9]{2}", t)),
        (StructuredOutput(choice=("yes", "no", "maybe")), lambda t: t in ("yes", "no", "maybe")),
        (
            StructuredOutput(grammar='start: "x" yz yz? yz? "!" | "{" start "}"\nyz: "y" | "z"'),
            lambda t: re.fullmatch(r"(\{*)x[yz]{1,3}!(\}*)", t) and t.count("{") == t.count("}"),
        ),
    ],
    ids=["regex", "choice", "grammar"],
)
def test_each_kind_of_constraint(so, check):
    """Sampled (n=3) and greedy, with and without ignore_eos: the text satisfies the constraint and ends there."""
    engine = _engine()
    for params in (
        SamplingParams(max_tokens=80, temperature=1.0, seed=3, n=3, structured_output=so),
        SamplingParams(max_tokens=80, structured_output=so),
        SamplingParams(max_tokens=80, structured_output=so, ignore_eos=True),
    ):
        for out in engine.generate(["tell me", "q"], params):
            for c in out.outputs:
                assert c.finish_reason == "stop" and check(c.text), (c.finish_reason, c.text)


def test_json_object():
    """Any JSON object bounds nothing (a random model's key may run past max_tokens), so: every text that ended is
    one JSON object, a quarter of 32 samples at least end, and a text cut at max_tokens never holds a whole object."""
    engine = _engine()
    params = SamplingParams(
        max_tokens=60, temperature=1.0, seed=7, n=16, structured_output=StructuredOutput(json_object=True)
    )
    outs = [c for o in engine.generate(["hello", "{"], params) for c in o.outputs]
    ended = [c for c in outs if c.finish_reason == "stop"]
    assert len(ended) >= len(outs) // 4, [c.text for c in outs]
    for c in ended:
        assert isinstance(json.loads(c.text), dict), c.text
    for c in outs:
        if c.finish_reason == "length":
            with pytest.raises(ValueError):
                json.loads(c.text)


def _reference_choice(model, prompt: list[int], choices: list[str], max_tokens: int) -> list[int]:
    """Greedy decoding by full recompute, taking the argmax over the tokens that keep the text a prefix of one
    of ``choices`` (byte tokens), and the end token once it is one of them and nothing longer fits."""
    words = [c.encode() for c in choices]
    out: list[int] = []
    for _ in range(max_tokens):
        text = bytes(out)
        allowed = [b for b in range(256) if any(w.startswith(text + bytes([b])) for w in words)]
        if text in words:
            allowed.append(TOK.EOS_ID)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out]))[0, -1]
        best = max(allowed, key=lambda t: logits[t].item())
        if best == TOK.EOS_ID:
            break
        out.append(best)
        if text + bytes([best]) in words and not any(len(w) > len(text) + 1 for w in words if w.startswith(text)):
            break
    return out


def test_greedy_constrained_output_is_token_exact_against_a_recompute_reference():
    model = make_model(seed=2)
    engine = _engine(model)
    choices = ["apple pie", "apricot", "banana split", "band", "b"]
    so = StructuredOutput(choice=tuple(choices))
    for prompt in ("fruit: ", "x", "what would you like?"):
        ids = TOK.encode(prompt)
        got = engine.generate([ids], SamplingParams(max_tokens=20, structured_output=so))[0].outputs[0]
        assert got.token_ids == _reference_choice(model, ids, choices, 20), (prompt, got.text)
        assert got.text in choices


def test_unconstrained_rows_of_a_mixed_batch_are_unchanged():
    """Greedy requests batched with constrained ones produce the tokens they produce alone."""
    engine = _engine()
    plain = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = ["alpha", "beta gamma", "d"]
    alone = [o.outputs[0].token_ids for o in engine.generate(prompts, plain)]
    so = StructuredOutput(json_schema=SCHEMAS[0])
    mixed = engine.generate(
        prompts + ["json please", "more"],
        [plain, plain, plain, SamplingParams(max_tokens=80, structured_output=so),
         SamplingParams(max_tokens=80, temperature=0.7, seed=1, structured_output=so)],
    )  # fmt: skip
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone
    for o in mixed[3:]:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMAS[0])


def test_hugging_face_tokenizer_folder(tmp_path):
    """A tokenizer folder (tokenizer.json read by llguidance) constrains like the byte tokenizer it was saved from."""
    pytest.importorskip("tokenizers")
    TOK.save_pretrained(tmp_path)
    folder_tok = load_tokenizer(tmp_path)
    so = StructuredOutput(json_schema=SCHEMAS[3])
    params = SamplingParams(max_tokens=80, temperature=1.0, seed=5, structured_output=so)
    model = make_model()
    a = _engine(model).generate(["p", "qq"], params)
    b = _engine(model, folder_tok).generate(["p", "qq"], params)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    for o in b:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMAS[3])


def test_bad_constraints_are_refused_naming_the_problem():
    engine = _engine()
    with pytest.raises(ValueError, match="json_schema.*strin"):
        engine.generate(["x"], SamplingParams(structured_output=StructuredOutput(json_schema={"type": "strin"})))
    with pytest.raises(ValueError, match="grammar"):
        engine.generate(["x"], SamplingParams(structured_output=StructuredOutput(grammar="start: undefined_rule")))
    with pytest.raises(ValueError, match="needs a tokenizer"):
        LLMEngine(make_model(), None, num_blocks=32, block_size=8).generate(
            [[1, 2]], SamplingParams(structured_output=StructuredOutput(json_object=True))
        )
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutput(json_object=True, regex="a")
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutput(json_schema="{")
    with pytest.raises(ValueError, match="structured_output"):
        SamplingParams(structured_output={"type": "json_object"})  # type: ignore[arg-type]
    assert engine.generate(["x"], SamplingParams(max_tokens=4))[0].outputs[0].token_ids  # still serving
