"""Structured output: which grammar library (``backends``), and what constraining costs the engine (``engine``).

Families:

- ``backends`` (CPU): llguidance, xgrammar and outlines-core on one byte-level BPE tokenizer of 32,000 tokens
  (trained here with the ``tokenizers`` library on the Python sources of this environment: no download): the
  tokenizer's conversion, one JSON schema's compilation, and the mask of every step along a valid instance of it
  (p50 and max, and whether every token of the instance was allowed); then 64 matchers' masks at once (one
  step of a batch of 64), llguidance on its thread pool and xgrammar one after the other.
- ``engine`` (GPU): batch-64 decode of a randomly initialised ``llama2-7b``-shaped model in bf16 with the same
  tokenizer, without a constraint and with two JSON schemas (an array of strings, an array of records; neither can
  close before ``max_tokens``), so every row decodes for the same number of tokens. Decode tokens/s is
  ``64 (N2 - N1) / (t2 - t1)`` from runs of N1 and N2 tokens (the prefill cancels out); the cost is
  ``1 - constrained / unconstrained`` (goal <= 10%), with the host's mask time per step.

Usage: ``pip install xgrammar outlines-core`` (the peers, not dependencies of the package), then
``python benchmarks/bench_structured.py --family backends`` / ``--family engine`` (records in
benchmarks/results/); ``--smoke`` runs ``engine`` on CPU with the tiny preset (records in a temporary folder).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ holds scripts, not a package
import records  # noqa: E402

from lightning_llmopt.inference import LLMEngine, SamplingParams, StructuredOutput  # noqa: E402

VOCAB = 32000
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
        "score": {"type": "number"},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "address", "score", "active"],
    "additionalProperties": False,
}
INSTANCE = {
    "name": "Ada Lovelace",
    "age": 36,
    "tags": ["math", "engine", "poetry"],
    "address": {"city": "London", "zip": "12345"},
    "score": 9.5,
    "active": True,
}
LONG_STRINGS = {"type": "array", "items": {"type": "string"}, "minItems": 10000}  # mostly inside strings; never closes
RECORDS = {
    "type": "array",
    "minItems": 10000,  # cannot close within max_tokens: every row decodes to the end
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "name": {"type": "string", "maxLength": 12},
            "kind": {"enum": ["a", "b", "c"]},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "name", "kind", "ok"],
        "additionalProperties": False,
    },
}


def train_tokenizer(path: Path, vocab: int = VOCAB, files: int = 6000) -> Path:
    """A byte-level BPE ``tokenizer.json`` of ``vocab`` tokens (``<s>``, ``</s>`` first) trained on up to ``files``
    of this environment's Python files (deterministic for one environment), written to ``path`` once."""
    if path.is_file():
        return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = sorted(glob.glob(str(Path(sysconfig.get_paths()["purelib"]) / "**" / "*.py"), recursive=True))[:files]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train(files, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"], initial_alphabet=alphabet))
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def _hf_tokenizer(path: Path) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(path), bos_token="<s>", eos_token="</s>")


def _walk(fill: Any, allowed: Any, consume: Any, ids: list[int]) -> dict[str, Any]:
    times, ok = [], True
    for t in ids:
        start = time.perf_counter()
        fill()
        times.append(time.perf_counter() - start)
        ok = ok and allowed(t)
        consume(t)
    return {"mask_p50_us": statistics.median(times) * 1e6, "mask_max_us": max(times) * 1e6, "instance_ok": ok}


def _bit(bits: torch.Tensor, t: int) -> bool:
    return bool((int(bits[0, t // 32]) >> (t % 32)) & 1)


def _llguidance(tok: Any, ids: list[int]) -> dict[str, Any]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    t0 = time.perf_counter()
    ll_tok = llguidance.hf.from_tokenizer(tok)
    t1 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    m = llguidance.LLMatcher(ll_tok, grammar)
    t2 = time.perf_counter()
    bits = lt.allocate_token_bitmask(1, ll_tok.vocab_size)
    row = _walk(lambda: lt.fill_next_token_bitmask(m, bits), lambda t: _bit(bits, t), m.consume_token, ids)
    batch = [llguidance.LLMatcher(ll_tok, grammar) for _ in range(64)]
    for b in batch:
        b.consume_tokens(ids[: len(ids) // 2])  # mid-instance, as in decode
    big = lt.allocate_token_bitmask(64, ll_tok.vocab_size)
    ex = llguidance.LLExecutor()
    timed = [records_wall(lambda: lt.fill_next_token_bitmask_par(ex, [(b, i) for i, b in enumerate(batch)], big))
             for _ in range(20)]  # fmt: skip
    row.update(variant="llguidance", setup_ms=(t1 - t0) * 1e3, compile_ms=(t2 - t1) * 1e3,
               batch64_mask_ms=statistics.median(timed) * 1e3, batch64="thread pool")  # fmt: skip
    return row


def _xgrammar(tok: Any, ids: list[int]) -> dict[str, Any]:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    compiler = xgr.GrammarCompiler(info)
    t1 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    t2 = time.perf_counter()
    m = xgr.GrammarMatcher(compiled)
    bits = xgr.allocate_token_bitmask(1, len(tok))
    row = _walk(lambda: m.fill_next_token_bitmask(bits), lambda t: _bit(bits, t), m.accept_token, ids)
    batch = [xgr.GrammarMatcher(compiled) for _ in range(64)]
    for b in batch:
        for t in ids[: len(ids) // 2]:
            b.accept_token(t)
    big = xgr.allocate_token_bitmask(64, len(tok))
    timed = [records_wall(lambda: [b.fill_next_token_bitmask(big, i) for i, b in enumerate(batch)]) for _ in range(20)]
    row.update(variant="xgrammar", setup_ms=(t1 - t0) * 1e3, compile_ms=(t2 - t1) * 1e3,
               batch64_mask_ms=statistics.median(timed) * 1e3, batch64="one after the other")  # fmt: skip
    return row


def _byte_level_bytes(token: str) -> bytes:
    """A byte-level BPE token's bytes (GPT-2's printable stand-ins for the 256 bytes, inverted)."""
    from lightning_llmopt.data.hf_tokenizer import _byte_table

    table = _byte_table()
    return bytes(table[c] for c in token) if all(c in table for c in token) else token.encode()


def _outlines(tok: Any, ids: list[int]) -> dict[str, Any]:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    t0 = time.perf_counter()
    vocab: dict[bytes, list[int]] = {}
    for i in range(len(tok)):
        if i != tok.eos_token_id:
            vocab.setdefault(_byte_level_bytes(tok.convert_ids_to_tokens(i)), []).append(i)
    voc = Vocabulary(tok.eos_token_id, vocab)
    t1 = time.perf_counter()
    index = Index(build_regex_from_schema(json.dumps(SCHEMA)), voc)
    t2 = time.perf_counter()
    guide, allowed = Guide(index), set()

    def fill() -> None:
        allowed.clear()
        allowed.update(guide.get_tokens())

    def consume(t: int) -> None:
        if t != tok.eos_token_id:
            guide.advance(t)

    row = _walk(fill, lambda t: t in allowed, consume, ids)
    row.update(variant="outlines-core", setup_ms=(t1 - t0) * 1e3, compile_ms=(t2 - t1) * 1e3,
               notes="allowed tokens as a list (no bitmask); schema -> regex -> index over the vocabulary")  # fmt: skip
    return row


def records_wall(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def family_backends(tokenizer: Path) -> list[dict]:
    tok = _hf_tokenizer(train_tokenizer(tokenizer))
    ids = tok.encode(json.dumps(INSTANCE), add_special_tokens=False) + [tok.eos_token_id]
    rows, notes = [], []
    for fn in (_llguidance, _xgrammar, _outlines):
        try:
            rows.append(fn(tok, ids))
            print(json.dumps(rows[-1]), flush=True)
        except Exception as exc:  # noqa: BLE001 - a library that fails is recorded, not fatal
            notes.append(f"{fn.__name__[1:]} failed: {type(exc).__name__}: {exc}"[:300])
            print(notes[-1], flush=True)
    ours = [r for r in rows if r["variant"] == "llguidance"]
    cfg = {"vocab": len(tok), "instance_tokens": len(ids), "schema": SCHEMA,
           "tokenizer": "byte-level BPE, trained here", "threads": torch.get_num_threads()}  # fmt: skip
    notes.append(
        "chosen: llguidance. It has no dependencies (one abi3 wheel), the fastest compilation (a new schema per "
        "request is the tools case), a thread pool for a batch's masks, and JSON schema, regex and Lark grammars in "
        "one. xgrammar's per-step masks are faster (mask_p50_us, batch64_mask_ms), but the engine computes masks "
        "while the device runs the step, so they are off the critical path as long as they take less than the step "
        "(the engine family measures that on the GPU). outlines-core compiles the slowest and returns lists of "
        "tokens, not a bitmask."
    )
    rec = records.make_record("structured-backends", cfg, ours, [r for r in rows if r["variant"] != "llguidance"],
                              benchmark="structured", ratio_metric="compile_ms", notes=notes)  # fmt: skip
    return [rec]


def _decode_rate(run: Any, n1: int, n2: int, rows: int) -> dict[str, float]:
    run(n1)  # warm-up: graphs, tuning, the grammar's first masks
    run(n2)
    t1 = statistics.median(records_wall(lambda: run(n1)) for _ in range(3))
    t2 = statistics.median(records_wall(lambda: run(n2)) for _ in range(3))
    return {"decode_tok_s": rows * (n2 - n1) / (t2 - t1), "t_n1_s": t1, "t_n2_s": t2}


def family_engine(smoke: bool, tokenizer: Path, batch: int) -> list[dict]:
    from lightning_llmopt.data.tokenizers import load_tokenizer
    from lightning_llmopt.inference.loading import random_model
    from lightning_llmopt.models import LlamaConfig

    dev, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    folder = train_tokenizer(tokenizer, *((512, 200) if smoke else (VOCAB, 6000))).parent
    tok = load_tokenizer(folder)
    cfg = LlamaConfig.from_preset("tiny" if smoke else "llama2-7b", vocab_size=tok.vocab_size)
    torch.manual_seed(0)
    model = random_model(cfg, dev, dtype)
    prompt_len, n1, n2 = (8, 4, 12) if smoke else (64, 32, 160)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, tok.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(batch)]
    engine = LLMEngine(model, tok, num_blocks=batch * (math.ceil((prompt_len + n2) / 16) + 1) + 8,
                       max_num_seqs=batch, enable_prefix_caching=False)  # fmt: skip
    results, peers = [], []
    steps = engine.config.decode_steps
    for name, so, k in (("unconstrained", None, steps), ("unconstrained-1-step", None, 1),
                        ("json-strings", StructuredOutput(json_schema=LONG_STRINGS), steps),
                        ("json-records", StructuredOutput(json_schema=RECORDS), steps)):  # fmt: skip
        # greedy unconstrained rows run decode_steps steps per host round trip (multi_step.py); constrained rows
        # cannot (each mask needs the token before): the 1-step peer isolates what masking itself costs
        engine.config.decode_steps = k
        def run(n: int, so: StructuredOutput | None = so, name: str = name) -> Any:
            params = SamplingParams(max_tokens=n, ignore_eos=True, structured_output=so)
            outs = engine.generate(prompts, params)
            short = [o.outputs[0].finish_reason for o in outs if len(o.outputs[0].token_ids) != n]
            if short:
                raise RuntimeError(f"{name}: {len(short)} rows ended before {n} tokens ({short[:3]})")
            return outs

        g = engine._grammars
        before = (g.mask_s, g.mask_calls) if g is not None else (0.0, 0)
        r = _decode_rate(run, n1, n2, batch)
        r["variant"] = name
        g = engine._grammars
        if so is not None and g is not None:
            r["host_mask_ms_per_step"] = (g.mask_s - before[0]) / max(1, g.mask_calls - before[1]) * 1e3
            r["sample_text"] = run(24)[0].outputs[0].text[:200]
        (peers if so is None else results).append(r)
        print(json.dumps(r), flush=True)
    for r in results:
        r["cost"] = 1 - r["decode_tok_s"] / peers[0]["decode_tok_s"]
        r["cost_vs_1_step"] = 1 - r["decode_tok_s"] / peers[1]["decode_tok_s"]
    config = {"preset": cfg.name if hasattr(cfg, "name") else ("tiny" if smoke else "llama2-7b"), "dtype": str(dtype),
              "batch": batch, "prompt_len": prompt_len, "n1": n1, "n2": n2, "vocab": tok.vocab_size,
              "schemas": {"json-strings": LONG_STRINGS, "json-records": RECORDS}}  # fmt: skip
    notes = ["goal: cost <= 10% of decode tok/s at batch 64 (cost: against the default, unconstrained greedy with "
             f"decode_steps={steps}; cost_vs_1_step: against one step per round trip, the path constrained rows take)"]
    rec = records.make_record("structured-engine", config, results, peers, benchmark="structured",
                              ratio_metric="decode_tok_s", notes=notes)  # fmt: skip
    return [rec]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=["backends", "engine"], required=True)
    parser.add_argument("--smoke", action="store_true", help="engine: CPU, tiny preset, records in a temp dir")
    parser.add_argument("--batch", type=int, default=64)
    default_tok = Path(tempfile.gettempdir()) / "llmopt-bpe32k" / "tokenizer.json"
    parser.add_argument("--tokenizer", type=Path, default=default_tok,
                        help="the tokenizer.json to use (trained there when missing)")  # fmt: skip
    parser.add_argument("--results-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.smoke:
        args.tokenizer = Path(tempfile.mkdtemp()) / "tokenizer.json"
    recs = family_backends(args.tokenizer) if args.family == "backends" else \
        family_engine(args.smoke, args.tokenizer, args.batch)  # fmt: skip
    out = args.results_dir or (Path(tempfile.mkdtemp()) if args.smoke else None)
    for rec in recs:
        print("wrote", records.write_record(rec, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
