"""The GPU smoke run's paths that go through the Python API (``python benchmarks/gpu_smoke_paths.py NAME``).

Run by :mod:`gpu_smoke` (one process per path); each prints one summary line (``engine: ...``, ``flash: ...``) and
exits non-zero on a failure, with the failing check in the exception's message.

- ``hf-source``: a random ``debug-1m`` model written as a Hugging Face folder (``to_hf``) for quantize/generate;
- ``serve``: ``llmopt serve --preset debug-1m`` queried by the official ``openai`` client (completion, chat,
  streaming, ``response_format`` with a JSON schema, ``tools`` with ``tool_choice="required"``), greedy text equal
  between the streamed and the plain completion;
- ``engine-gqa`` / ``engine-mla`` / ``engine-patterns``: a model trained for a few seconds to continue a period-16
  pattern (wide greedy margins, so bf16 rounding cannot flip a token), then the engine token-exact against plain
  full-recompute greedy decoding: CUDA graphs with the prefix cache (second pass hits it), eager, int8 KV
  (calibrated; agreement reported, >= 95% of tokens), speculative decoding with a draft model and with prompt
  lookup. Options a model family refuses by name are reported as refused, not failed;
- ``flash``: flash attention forward and backward at odd shapes (lengths 1, 17, 113, 1023; head dims 64, 80, 128,
  192; GQA; packed; window) against fp64, error at most twice plain PyTorch's in the same dtype;
- ``step-single`` / ``step-zero1|2|3`` / ``step-nd``: three training steps of ``CausalLMModule`` with the fused
  kernels (the CUDA default) under each single-process path, for Llama, MLA, MoE and a layer pattern, bf16-mixed with
  gradient clipping, the loss finite.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch

PERIOD, VOCAB = 16, 64


# ---------------------------------------------------------------------------------------------------- quantize source
def hf_source(device: str, workdir: Path) -> None:
    from lightning_llmopt.data.tokenizers import ByteTokenizer
    from lightning_llmopt.models import Llama, LlamaConfig, to_hf

    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_preset("debug-1m"))
    out = to_hf(model, workdir / "hf", dtype=torch.bfloat16, tokenizer=ByteTokenizer())
    print(f"source: debug-1m written to {out}")


# ---------------------------------------------------------------------------------------------------- serve
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve(device: str, workdir: Path) -> None:
    import openai

    port = _free_port()
    template = workdir / "chat_template.jinja"  # a byte-level model has none of its own
    template.write_text("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>")
    cmd = [sys.executable, "-m", "lightning_llmopt.cli", "serve", "--preset", "debug-1m", "--tokenizer", "byte",
           "--port", str(port), "--host", "127.0.0.1", "--num-blocks", "256", "--max-num-seqs", "8", "--device", device,
           "--served-model-name", "smoke", "--tuning-cache-dir", str(workdir / "tuning"),
           "--chat-template", str(template)]
    log = open(workdir / "server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    start = time.perf_counter()
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llmopt serve exited {proc.returncode}: "
                                   f"{(workdir / 'server.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.perf_counter() - start > 180:
                raise TimeoutError("llmopt serve did not become ready in 180 s")
            time.sleep(0.5)
        ready = time.perf_counter() - start
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        models = [m.id for m in client.models.list().data]
        assert models == ["smoke"], f"/v1/models lists {models}"
        done = client.completions.create(model="smoke", prompt="def main(", max_tokens=16, temperature=0)
        text = done.choices[0].text
        assert done.usage is not None and done.usage.completion_tokens == 16, f"usage {done.usage}"
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="smoke", prompt="def main(", max_tokens=16, temperature=0, stream=True) if c.choices)
        assert streamed == text, f"streamed {streamed!r} != plain {text!r} (both greedy)"
        chat = client.chat.completions.create(model="smoke", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=12, temperature=0)
        assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens > 0, chat
        chunks = list(client.chat.completions.create(model="smoke", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=12, temperature=0, stream=True))
        chat_streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chat_streamed == chat.choices[0].message.content, "streamed chat differs from plain chat (greedy)"
        schema = {"type": "object", "additionalProperties": False, "required": ["ok", "n"],
                  "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}}}
        shaped = client.chat.completions.create(
            model="smoke", messages=[{"role": "user", "content": "json"}], max_tokens=48, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
        value = json.loads(shaped.choices[0].message.content)
        assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 99, value
        tool = {"type": "function", "function": {"name": "lookup", "parameters": schema}}
        called = client.chat.completions.create(
            model="smoke", messages=[{"role": "user", "content": "call"}], max_tokens=96, temperature=0,
            tools=[tool], tool_choice="required", parallel_tool_calls=False)
        calls = called.choices[0].message.tool_calls
        assert calls and calls[0].function.name == "lookup" and called.choices[0].finish_reason == "tool_calls", called
        assert set(json.loads(calls[0].function.arguments)) == {"ok", "n"}, calls
        print(f"serve: ready in {ready:.1f} s; completion, stream, chat, chat stream ok ({len(chunks)} chunks); "
              f"response_format json_schema {value}, tool_choice required {calls[0].function.arguments}")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        for line in (workdir / "server.log").read_text(errors="replace").splitlines():  # the start-up phases
            if "llmopt serve: loading:" in line or "engine ready" in line:
                print(line, flush=True)


# ---------------------------------------------------------------------------------------------------- engine
FAMILIES: dict[str, dict[str, Any]] = {
    "gqa": {},
    "mla": dict(mla=dict(kv_lora_rank=32, qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=16)),
    "patterns": dict(n_layers=4, layer_types=["local:20", "local:24", "global", "global"], kv_sources=[0, 1, 2, 2]),
}


def _periodic(g: torch.Generator, batch: int, length: int) -> torch.Tensor:
    base = torch.randint(0, VOCAB, (batch, PERIOD), generator=g)
    return base.repeat(1, length // PERIOD + 1)[:, :length]


def _model(family: str, device: str) -> Any:
    """On CUDA a model trained on the period-16 copy task, in bf16; on CPU a random fp32 one (exact arithmetic)."""
    from lightning_llmopt.models import Llama, LlamaConfig

    torch.manual_seed(0)
    values = dict(vocab_size=VOCAB, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=256, max_seq_len=256)
    model = Llama(LlamaConfig(**{**values, **FAMILIES[family]})).to(device)
    if device == "cpu":
        return model.eval()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    for _ in range(400):
        x = _periodic(g, 64, 176).to(device)
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits[:, PERIOD - 1:].reshape(-1, VOCAB).float(),
                                                 x[:, PERIOD:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    if loss.item() > 0.05:
        raise AssertionError(f"the copy task did not train for {family} (loss {loss.item():.3f})")
    return model.to(torch.bfloat16).eval()


def engine(family: str, device: str) -> None:
    from lightning_llmopt.inference import LLMEngine, SamplingParams
    from lightning_llmopt.inference.speculative import SpeculativeConfig
    from lightning_llmopt.models import greedy_generate

    t0 = time.perf_counter()
    model = _model(family, device)
    print(f"[{family}] model trained in {time.perf_counter() - t0:.1f} s", flush=True)
    g = torch.Generator().manual_seed(2)
    prompts = [_periodic(g, 1, n)[0].tolist() for n in (17, 33, 48, 90)]
    new = 48
    refs = [greedy_generate(model, torch.tensor([p], device=device), new, use_cache=False)[0, len(p):].tolist()
            for p in prompts]
    params = [SamplingParams(max_tokens=new)] * len(prompts)
    base = dict(block_size=16, num_blocks=256, max_num_seqs=4, max_num_batched_tokens=64)
    report: list[str] = []
    failures: list[str] = []

    def check(name: str, build: Any, exact: bool = True, passes: int = 1) -> None:
        t0 = time.perf_counter()
        try:
            eng = build()
        except ValueError as exc:  # an option this family refuses by name (docs say which)
            if "not supported" not in str(exc):
                raise
            report.append(f"{name}: refused ({exc})")
            return
        built = time.perf_counter() - t0
        totals = eng.startup.summary()["totals"]
        print(f"[{family}] {name}: built in {built:.1f} s (start-up totals {totals})", flush=True)
        cached = 0
        for i in range(passes):
            completions = eng.generate(prompts, params)
            outs = [o.token_ids for o in completions]
            cached = sum(o.metrics.cached_tokens for o in completions)
            same = sum(a == b for o, r in zip(outs, refs, strict=True) for a, b in zip(o, r, strict=True))
            total = sum(len(r) for r in refs)
            if exact and outs != refs:
                failures.append(f"{name} pass {i}: {same}/{total} tokens equal to plain greedy")
            elif not exact and device == "cuda" and same < 0.95 * total:  # CPU: a random model, margins tiny
                failures.append(f"{name}: only {same}/{total} tokens equal to plain greedy (bound 95%)")
        graphs = getattr(eng, "graphs", None)
        used = f", {len(graphs.graphs)} graphs" if graphs is not None and graphs.graphs else ""
        if passes > 1 and eng.prefix_cache is not None and not cached:
            failures.append(f"{name}: the second pass hit no cached prefix")
        hits = f", {cached} prompt tokens from the prefix cache" if passes > 1 else ""
        report.append(f"{name}: {'exact' if exact else f'{same}/{total}'}{used}{hits}")
        print(f"[{family}] {name}: done in {time.perf_counter() - t0:.1f} s", flush=True)

    check("graphs+prefix", lambda: LLMEngine(model, **base), passes=2)
    check("eager", lambda: LLMEngine(model, **base, cuda_graphs=False, enable_prefix_caching=False))

    def int8() -> Any:
        eng = LLMEngine(model, **base, kv_dtype="int8")
        eng.calibrate_kv(prompts)
        return eng

    check("int8-kv", int8, exact=False)
    check("spec-draft", lambda: LLMEngine(model, **base, speculative=SpeculativeConfig(
        "draft", draft_model=model, num_tokens=3)))
    check("spec-lookup", lambda: LLMEngine(model, **base, speculative=SpeculativeConfig(
        "prompt_lookup", num_tokens=3)))
    print(f"engine: {family}: " + "; ".join(report))
    if failures:
        raise AssertionError("; ".join(failures))


# ---------------------------------------------------------------------------------------------------- flash attention
def flash(device: str, workdir: Path) -> None:
    backend = "triton" if device == "cuda" else "reference"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cases = [  # (batch, S_q, S_k, heads, kv_heads, head dim, causal, window)
        (2, 1, 1, 4, 2, 64, True, None),
        (2, 17, 17, 4, 4, 80, False, None),
        (1, 113, 113, 8, 2, 128, True, None),
        (1, 1023, 1023, 4, 1, 64, True, None),
        (1, 257, 257, 4, 4, 192, True, None),  # MLA prefill's head dim (128 + 64)
        (2, 300, 300, 4, 2, 128, True, 64),
    ]
    worst = 0.0
    for case in cases:
        t0 = time.perf_counter()
        worst = max(worst, _flash_case(*case, device=device, dtype=dtype, backend=backend))
        print(f"[flash] B,Sq,Sk,H,Hkv,D,causal,window={case}: {time.perf_counter() - t0:.1f} s", flush=True)
    print(f"flash: {len(cases)} shapes fwd+bwd ({backend}, {dtype}); worst error / bound = {worst:.2f}")


def _flash_case(b: int, sq: int, sk: int, h: int, hkv: int, d: int, causal: bool, window: int | None, *,
                device: str, dtype: torch.dtype, backend: str) -> float:
    """Forward and backward of one shape: our kernel's error against fp64 at most twice plain PyTorch's in ``dtype``
    (plus 1e-5 of the largest reference value, for entries plain PyTorch gets exactly); returns the worst ratio."""
    import torch.nn.functional as F

    from lightning_llmopt.kernels.flash_attention import flash_attention

    g = torch.Generator(device=device).manual_seed(d * 1000 + sq)
    q, k, v = (torch.randn(b, s, n, d, generator=g, device=device) for s, n in ((sq, h), (sk, hkv), (sk, hkv)))
    do = torch.randn(b, sq, h, d, generator=g, device=device)
    mask = None
    if causal:
        i = torch.arange(sq, device=device)[:, None] + (sk - sq)
        j = torch.arange(sk, device=device)[None, :]
        mask = (j <= i) & ((i - j < window) if window else True)

    def plain(qq: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor) -> torch.Tensor:
        rep = h // hkv
        qt, kt, vt = (qq.transpose(1, 2), kk.transpose(1, 2).repeat_interleave(rep, 1),
                      vv.transpose(1, 2).repeat_interleave(rep, 1))
        return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask).transpose(1, 2)

    def ours(qq: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor) -> torch.Tensor:
        return flash_attention(qq, kk, vv, causal=causal, window=window, backend=backend)

    def run(fn: Any, dt: torch.dtype) -> tuple[torch.Tensor, ...]:
        qq, kk, vv = (t.detach().to(dt).clone().requires_grad_() for t in (q, k, v))
        out = fn(qq, kk, vv)
        out.backward(do.to(dt))
        return tuple(t.detach().double() for t in (out, qq.grad, kk.grad, vv.grad))

    worst = 0.0
    ref, base, mine = run(plain, torch.float64), run(plain, dtype), run(ours, dtype)
    for name, r, p, o in zip(("out", "dq", "dk", "dv"), ref, base, mine, strict=True):
        err_p, err_o = (p - r).abs().max().item(), (o - r).abs().max().item()
        bound = 2 * err_p + 1e-5 * r.abs().max().item()
        worst = max(worst, err_o / max(bound, 1e-12))
        if not err_o <= bound:
            raise AssertionError(f"flash {name} at B={b} S={sq}/{sk} H={h}/{hkv} D={d} causal={causal} "
                                 f"window={window}: error {err_o:.3g} > bound {bound:.3g} (plain {err_p:.3g})")
    return worst


# ---------------------------------------------------------------------------------------------------- training steps
STEP_MODELS: dict[str, dict[str, Any]] = {
    "llama": {},
    "mla": FAMILIES["mla"],
    "moe": dict(moe=dict(num_experts=4, top_k=2)),
    "patterns": dict(n_layers=4, sliding_window=32, layer_types=["local", "local", "global", "global"],
                     kv_sources=[0, 0, 2, 2]),
}


def _keep_losses() -> Any:
    import lightning as L

    class KeepLosses(L.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
            self.losses.append(float(outputs["loss"]))

    return KeepLosses()


def step(strategy: str, device: str) -> None:
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_llmopt import CausalLMModule
    from lightning_llmopt.testing.data import RandomTokens

    cuda = device == "cuda"
    lines = []
    for name, overrides in STEP_MODELS.items():
        module = CausalLMModule("tiny", model_overrides=dict(overrides, max_seq_len=256), learning_rate=1e-3)
        strat: Any = "auto"
        if strategy in ("zero1", "zero2", "zero3"):
            strat = strategy
        elif strategy == "nd":
            from lightning_llmopt.strategies import NDParallelStrategy

            strat = NDParallelStrategy(zero_stage=3)
        trainer = L.Trainer(accelerator="gpu" if cuda else "cpu", devices=1, strategy=strat,
                            precision="bf16-mixed" if cuda else "32-true", max_steps=3, gradient_clip_val=1.0,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        keep = _keep_losses()
        trainer.callbacks.append(keep)
        data = DataLoader(RandomTokens(320, 128, 16), batch_size=4)
        trainer.fit(module, data)
        kernels = module.config.fused_kernels
        if cuda and not kernels:
            raise AssertionError(f"{strategy}/{name}: no fused kernels on CUDA (got {kernels})")
        losses = keep.losses
        if len(losses) != 3 or not all(x == x and abs(x) < 1e4 for x in losses):
            raise AssertionError(f"{strategy}/{name}: losses {losses}")
        lines.append(f"{name} {losses[0]:.3f}->{losses[-1]:.3f}")
    print(f"step: {strategy}: " + ", ".join(lines) + f" (fused: {','.join(kernels) or 'none'})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--workdir", default=".")
    args = parser.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    name = args.name
    if name == "hf-source":
        hf_source(args.device, workdir)
    elif name == "serve":
        serve(args.device, workdir)
    elif name.startswith("engine-") and name[7:] in FAMILIES:
        engine(name[7:], args.device)
    elif name == "flash":
        flash(args.device, workdir)
    elif name.startswith("step-") and name[5:] in ("single", "zero1", "zero2", "zero3", "nd"):
        step(name[5:], args.device)
    else:
        raise SystemExit(f"unknown path {name!r}")


if __name__ == "__main__":
    main()
