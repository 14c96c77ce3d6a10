"""Constrain what the engine generates: a JSON schema, any JSON object, a regular expression, choices or a grammar.

    python examples/structured_output.py                     # a random tiny model with the byte tokenizer, on CPU
    python examples/structured_output.py --model runs/ckpts  # a checkpoint (ours, a Lightning .ckpt or an HF folder)

A random model writes nonsense, but nonsense in the required shape: every text below parses. Over HTTP the same
constraints come from OpenAI's ``response_format`` and ``tools`` (docs/serving.md). Needs
``pip install 'lightning_llmopt[serve]'`` (llguidance). See docs/structured_output.md.
"""

from __future__ import annotations

import argparse
import json

import torch

from lightning_llmopt.data.tokenizers import ByteTokenizer
from lightning_llmopt.inference import LLMEngine, SamplingParams, StructuredOutput
from lightning_llmopt.models import Llama, LlamaConfig

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "languages": {"type": "array", "items": {"enum": ["en", "fr", "de", "ja"]}, "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}

ARITHMETIC = """start: expr
expr: NUMBER | "(" expr OP expr ")"
OP: "+" | "*"
NUMBER: /[0-9]{1,3}/
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a checkpoint folder (default: a random tiny model)")
    args = parser.parse_args()
    if args.model is not None:
        engine = LLMEngine.from_pretrained(args.model)
    else:
        torch.manual_seed(0)
        engine = LLMEngine(Llama(LlamaConfig.from_preset("tiny")), ByteTokenizer(), num_blocks=256)

    people = engine.generate(
        ["Describe a person as JSON: "],
        SamplingParams(
            max_tokens=120, temperature=0.8, seed=0, n=3, structured_output=StructuredOutput(json_schema=PERSON)
        ),
    )[0]
    for out in people.outputs:
        print("json_schema:", out.text, "->", json.loads(out.text))  # parses, and follows the schema

    for so in (
        StructuredOutput(regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),  # a date (\d would take any script's digits)
        StructuredOutput(choice=("positive", "negative", "neutral")),
        StructuredOutput(
            grammar='start: expr\nexpr: NUMBER | "(" expr OP expr ")"\nOP: "+" | "*"\nNUMBER: /[0-9]{1,3}/'
        ),
    ):
        text = engine.generate(["Answer: "], SamplingParams(max_tokens=60, structured_output=so))[0].outputs[0].text
        print(f"{so.kind}:", text)


if __name__ == "__main__":
    main()
