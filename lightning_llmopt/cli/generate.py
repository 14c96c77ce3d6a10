"""``llmopt generate``: complete prompts with the inference engine.

    llmopt generate runs/ckpts --prompt "Once upon a time" --max-tokens 64 [--temperature 0.8 --top-p 0.9 --seed 1]
    llmopt generate hf_out/ --prompt-file prompts.txt --stream
    llmopt generate model.ckpt --tokens 1,5,9 --tokens 4,4 --json
    llmopt generate --preset tiny --tokens 1,2,3            # a randomly initialised model (smoke tests)

The model comes from our checkpoint folder (``step-N`` or its root), a Lightning ``.ckpt`` or a Hugging Face folder
(see :func:`lightning_llmopt.inference.load_model`), quantized folders included. Text prompts need a tokenizer: the
folder's tokenizer files, the one a ``.ckpt`` remembers from training, or ``--tokenizer`` (``byte`` or a path). Text
prompts are encoded as transformers would (the folder's BOS added), and generation stops at every stop id of the
tokenizer (``generation_config.json``'s ``eos_token_id`` too) unless ``--ignore-eos``. Each prompt and completion is
labelled::

    === prompt 0 ===
    def fib(n):
    --- completion 0.0 (length, 64 tokens) ---
        return ...

While the engine builds, each start-up phase prints a line to stderr (``llmopt generate: loading: ...``: its
seconds, the kernel searches timed and Triton compilations in it, as ``llmopt serve`` prints them; ``--quiet`` turns
them off): a cold start tunes and compiles kernels for a while before the first token. The run ends with one line of
engine figures (stderr): prefix-cache hits, time to first token and throughput.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_llmopt.cli import options, threads

__all__ = ["build_parser", "main"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def build_parser() -> argparse.ArgumentParser:
    p = options.parser("llmopt generate", "Complete prompts with the inference engine.")
    p.add_argument(
        "model", nargs="?", default=None, help="checkpoint folder (ours), Lightning .ckpt, or Hugging Face folder"
    )
    p.add_argument("--preset", default=None, help="use a randomly initialised model of this preset instead")
    p.add_argument("--prompt", action="append", default=[], help="a text prompt (repeatable)")
    p.add_argument("--prompt-file", default=None, help="a file with one text prompt per line")
    p.add_argument("--tokens", action="append", default=[], help="a prompt as comma-separated token ids (repeatable)")
    options.add_tokenizer(p)
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per completion, at most")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy")
    p.add_argument("--top-k", type=int, default=None, help="sample from the k likeliest tokens (default: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set holding this mass")
    p.add_argument(
        "--seed", type=int, default=None, help="seed of each request's own generator (default: the engine's, seeded 0)"
    )
    p.add_argument("--stop-token-id", type=int, action="append", default=[], help="stop at this token id (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the tokenizer's end-of-sequence ids")
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--truncate", action="store_true", help="keep the end of prompts longer than the context")
    p.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    p.add_argument("--json", action="store_true", help="print one JSON object per completion")
    p.add_argument("--device", default=None, help="device to run on (default: cuda when available, else cpu)")
    p.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="weights' dtype (default: as stored; bf16 for --preset)"
    )
    p.add_argument("--num-blocks", type=int, default=None, help="KV-cache blocks (default: from free GPU memory)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences decoded together, at most")
    p.add_argument(
        "--kv-int8-calibration",
        default=None,
        help="store the KV cache in int8, with scales calibrated on this file's lines",
    )
    p.add_argument("--no-prefix-cache", action="store_true", help="do not reuse the KV cache of shared prefixes")
    p.add_argument("--no-cuda-graphs", action="store_true", help="decode without CUDA graphs")
    p.add_argument("--trust-pickle", action="store_true", help="allow full unpickling of a Lightning .ckpt")
    options.add_num_threads(p)
    p.add_argument("--quiet", action="store_true", help="no start-up progress lines on stderr")
    return p


def _load_engine(args: argparse.Namespace) -> Any:
    from lightning_llmopt.data.tokenizers import load_tokenizer
    from lightning_llmopt.inference import LLMEngine
    from lightning_llmopt.inference.loading import load_model
    from lightning_llmopt.inference.startup import StartupLog
    from lightning_llmopt.models import Llama, LlamaConfig

    quiet = getattr(args, "quiet", False)
    startup = StartupLog(on_line=None if quiet else (
        lambda line: print(f"llmopt generate: loading: {line}", file=sys.stderr, flush=True)))
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype] if args.dtype else None
    if (args.model is None) == (args.preset is None):
        raise SystemExit("pass exactly one of MODEL (a checkpoint path) and --preset NAME")
    if device.type == "cpu":
        plan = threads.configure(num_threads=getattr(args, "num_threads", None), flag="--num-threads")
        if not quiet:
            print(f"llmopt generate: {plan.describe()}", file=sys.stderr, flush=True)
    tokenizer = None
    startup.mark("random init" if args.preset is not None else "load weights")
    if args.preset is not None:
        torch.manual_seed(0)
        model = Llama(LlamaConfig.from_preset(args.preset)).to(
            device=device, dtype=dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        )
    else:
        model, tokenizer = load_model(args.model, dtype=dtype, device=device, trust_pickle=args.trust_pickle)
    if args.tokenizer is not None:
        tokenizer = load_tokenizer(args.tokenizer)
    if tokenizer is None and (args.prompt or args.prompt_file):
        where = f"{args.model} names none" if args.model else "--preset has none"
        raise SystemExit(
            f"text prompts need a tokenizer and {where}: pass --tokenizer byte|PATH (a tokenizer.json or its folder), "
            "or prompts as token ids with --tokens 1,2,3"
        )
    kw: dict[str, Any] = dict(
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=not args.no_prefix_cache,
        cuda_graphs=not args.no_cuda_graphs,
    )
    if args.kv_int8_calibration:
        kw["kv_dtype"] = "int8"
    engine = LLMEngine(model, tokenizer, startup=startup, **kw)
    if not quiet:
        print(f"llmopt generate: engine ready in {startup.total_s or 0.0:.1f} s", file=sys.stderr, flush=True)
    if args.kv_int8_calibration:
        if tokenizer is None:
            raise SystemExit("--kv-int8-calibration needs a tokenizer to encode its text")
        lines = [ln for ln in Path(args.kv_int8_calibration).read_text().splitlines() if ln.strip()]
        engine.calibrate_kv(lines)
    return engine


def _prompts(args: argparse.Namespace) -> list[Any]:
    prompts: list[Any] = list(args.prompt)
    if args.prompt_file:
        prompts += [ln for ln in Path(args.prompt_file).read_text().splitlines() if ln.strip()]
    for spec in args.tokens:
        try:
            prompts.append([int(t) for t in spec.split(",") if t.strip()])
        except ValueError:
            raise SystemExit(f"--tokens {spec!r}: expected comma-separated integers") from None
    if not prompts:
        raise SystemExit("no prompt: pass --prompt, --prompt-file or --tokens")
    return prompts


def _encode(engine: Any, prompts: list[Any]) -> list[Any]:
    """Text prompts as ids with the tokenizer's special tokens (BOS where transformers adds one): the engine's own
    encoding (:func:`~lightning_llmopt.inference.inputs.encode_prompt`), the one ``/v1/completions`` uses too."""
    from lightning_llmopt.inference.inputs import encode_prompt

    return [encode_prompt(p, engine.tokenizer, add_special_tokens=True) if isinstance(p, str) else p for p in prompts]


def _show(i: int, prompt: Any, completion: Any) -> None:
    """Print prompt ``i`` and its completions, each labelled."""
    shown = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
    print(f"=== prompt {i} ===\n{shown}")
    for o in completion.outputs:
        body = o.text if o.text is not None else " ".join(map(str, o.token_ids))
        print(f"--- completion {i}.{o.index} ({o.finish_reason}, {len(o.token_ids)} tokens) ---")
        print(body)
    print()


def main(argv: Sequence[str] | None = None) -> list[Any]:
    """Entry point of ``llmopt generate``; returns the completions (or stream events with ``--stream``)."""
    from lightning_llmopt.inference import SamplingParams

    args = build_parser().parse_args(argv)
    prompts = _prompts(args)
    values: dict[str, Any] = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop_token_ids=tuple(args.stop_token_id),
        ignore_eos=args.ignore_eos,
        n=args.n,
    )
    try:
        params = SamplingParams(**values)  # checked before the model is loaded
    except ValueError as exc:
        raise SystemExit(f"invalid sampling parameters: {exc}") from None
    num_threads = torch.get_num_threads()
    try:
        return _generate(args, prompts, values, params)
    finally:  # a caller in this process (a test, a notebook) keeps its own thread count
        if torch.get_num_threads() != num_threads:
            torch.set_num_threads(num_threads)


def _generate(args: argparse.Namespace, prompts: list[Any], values: dict[str, Any], params: Any) -> list[Any]:
    from lightning_llmopt.inference import SamplingParams

    engine = _load_engine(args)
    if engine.tokenizer is not None and not args.ignore_eos:  # every stop id of the tokenizer, not only eos_id
        stops = [*args.stop_token_id, *getattr(engine.tokenizer, "stop_ids", ())]
        params = SamplingParams(**{**values, "stop_token_ids": tuple(dict.fromkeys(int(i) for i in stops))})
    encoded = _encode(engine, prompts) if engine.tokenizer is not None else prompts
    results: list[Any] = []
    try:
        if args.stream:
            for event in engine.stream(encoded, params, truncate=args.truncate):
                results.append(event)
                piece = event.text if event.text is not None else " ".join(map(str, event.token_ids))
                sys.stdout.write(piece if event.text is not None else (piece + " " if piece else ""))
                if event.finished:
                    sys.stdout.write(f"\n[{event.request_id}.{event.index} {event.finish_reason}]\n")
                sys.stdout.flush()
        else:
            results = engine.generate(encoded, params, truncate=args.truncate)
            for i, (prompt, c) in enumerate(zip(prompts, results, strict=True)):
                for o in c.outputs:
                    if args.json:
                        print(
                            json.dumps(
                                {
                                    "request_id": c.request_id,
                                    "index": o.index,
                                    "token_ids": o.token_ids,
                                    "text": o.text,
                                    "finish_reason": o.finish_reason,
                                    "cached_tokens": c.metrics.cached_tokens,
                                }
                            )
                        )
                if not args.json:
                    _show(i, prompt, c)
    except ValueError as exc:
        raise SystemExit(f"rejected: {exc}") from None
    s = engine.stats.summary()
    print(
        f"[engine] requests={s['requests']} prompt_tokens={s['prompt_tokens']} cached_tokens={s['cached_tokens']} "
        f"hit_rate={s['hit_rate']:.3f} ttft_mean={s['ttft_mean_s'] * 1e3:.1f}ms "
        f"throughput={s['throughput_tok_s']:.1f} tok/s",
        file=sys.stderr,
    )
    return results


if __name__ == "__main__":
    main()
