"""The step layout CUDA graphs replay (one decode row per token, ``DecodeGraphs``), run eagerly on the CPU
(``capture=False``): greedy output through it equals naive full recompute, for plain decoding and for speculative
decoding, where the target's verify steps (1 + k rows per sequence) and the draft model's steps take that layout
too. On a GPU the same layout is captured and replayed (tests/inference/test_gpu.py)."""

from __future__ import annotations

import pytest

from lightning_llmopt.inference import LLMEngine, SamplingParams
from lightning_llmopt.inference.cuda_graphs import DecodeGraphs
from lightning_llmopt.inference.runner import decode_rows, sampled_rows
from lightning_llmopt.inference.scheduler import Work
from lightning_llmopt.inference.speculative import SpeculativeConfig

LENGTHS = [1, 5, 12, 17, 30]
MAX_TOKENS = [14, 3, 20, 9, 17]
SIZES = (1, 2, 4, 8, 16, 32, 64)


class _Spy(DecodeGraphs):
    """Eager static-buffer steps that count the rows they served."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, capture=False, **kw)
        self.steps = 0
        self.multi = 0
        self.chained = 0

    def run(self, work):
        self.steps += 1
        self.multi += any(w.num_tokens > 1 for w in work)
        return super().run(work)

    def replay_rows(self, meta, n, ids=None):
        self.chained += 1
        return super().replay_rows(meta, n, ids)


def _rows_engine(model, **kw) -> LLMEngine:
    engine = LLMEngine(model, block_size=4, num_blocks=96, max_num_batched_tokens=64, **kw)
    width = engine.blocks.blocks_for(engine.max_model_len)
    engine.graphs = _Spy(engine.runner, SIZES, width, engine.max_model_len)
    drafter = engine.spec.drafter if engine.spec is not None else None
    if engine.spec is not None:  # the host path's row layout (device-side rounds: test_spec_chain.py)
        engine.spec.device_rounds = False
    if drafter is not None and hasattr(drafter, "runner"):
        drafter.graphs = _Spy(
            drafter.runner, SIZES, drafter.blocks.blocks_for(engine.max_model_len), engine.max_model_len
        )
    return engine


def _prompts(prompts_factory):
    out = []
    for i, p in enumerate(prompts_factory(LENGTHS, 320, seed=3)):
        out.append((p + p[: max(1, len(p) // 3)] * 3)[: len(p) + 2 * i])
    return out


@pytest.mark.parametrize("method", [None, "draft", "int8"])
def test_row_layout_greedy_matches_full_recompute(method, model_factory, reference, prompts_factory):
    model = model_factory(seed=1)
    spec = None
    if method == "draft":
        spec = SpeculativeConfig(
            "draft", draft_model=model_factory(seed=9, n_layers=1, dim=32, n_heads=2), num_tokens=4, adaptive=False
        )
    elif method == "int8":
        spec = SpeculativeConfig("self_quantized", quant_bits=8, num_tokens=4, adaptive=False)
    engine = _rows_engine(model, speculative=spec)
    prompts = _prompts(prompts_factory)
    outs = engine.generate(prompts, [SamplingParams(max_tokens=m) for m in MAX_TOKENS])
    for p, m, o in zip(prompts, MAX_TOKENS, outs, strict=True):
        assert o.token_ids == reference(model, p, m), f"prompt of {len(p)} tokens"
    assert engine.graphs.steps > 0
    if spec is not None:
        assert engine.stats.spec_verifications > 0
        assert engine.graphs.multi > 0, "no verify step took the row layout"
        assert engine.spec.drafter.graphs.steps > 0, "no draft step took the row layout"
        if method == "draft":
            assert engine.spec.drafter.graphs.chained > 0, "no draft rounds were chained on the device"
    engine.prefix_cache.clear()
    assert engine.blocks.allocator.num_free == engine.blocks.allocator.capacity


class _Seq:
    def __init__(self, tokens, table):
        self.tokens, self.block_table = tokens, table


def test_decode_rows_and_sampled_rows():
    a = _Seq(list(range(10, 20)), [5, 6, 7])  # 10 tokens, block size 4
    b = _Seq([1, 2, 3], [9])
    work = [Work(b, 2, 1), Work(a, 6, 4, num_logits=4)]  # a decode, then a verify of 1 + 3 drafts
    rows, tables = decode_rows(work, 4)
    assert rows[:, 0].tolist() == [3, 2, 9, 2, 3]
    assert rows[0, 1:].tolist() == [16, 17, 18, 19]
    assert rows[1, 1:].tolist() == [6, 7, 8, 9]
    assert rows[2, 1:].tolist() == [6, 6, 7, 7]
    assert rows[3, 1:].tolist() == [2, 3, 0, 1]
    assert rows[4, 1:].tolist() == [7, 8, 9, 10]
    assert tables == [[9], [5, 6, 7], [5, 6, 7], [5, 6, 7], [5, 6, 7]]
    assert sampled_rows(work) is None  # every row sampled, in order
    catch_up = [Work(a, 7, 3), Work(b, 2, 1)]  # a draft model catching up: only the last row of each
    assert sampled_rows(catch_up) == [2, 3]


@pytest.mark.parametrize("mode", ["split", "merged"])
def test_mixed_steps_split_between_graph_and_eager(model_factory, reference, prompts_factory, monkeypatch, mode):
    """Continuous batching: a step with decodes and a long prefill chunk runs the decodes through the graph layout
    and only the chunk eagerly (``mixed_steps="split"``), or everything in one eager pass (``"merged"``); greedy
    output still equals full recompute."""
    model = model_factory(seed=4)
    engine = _rows_engine(model, max_num_seqs=4, mixed_steps=mode)
    graph_steps, eager_steps = set(), set()
    run, forward = engine.graphs.run, engine.runner.forward
    inside = []  # the CPU "graph" runs the runner eagerly too: those calls are not the prefill path

    def spy_run(work):
        graph_steps.add(engine.stats.steps)
        inside.append(True)
        try:
            return run(work)
        finally:
            inside.pop()

    def spy_forward(inp, max_context=None):
        if not inside:
            eager_steps.add(engine.stats.steps)
        return forward(inp, max_context)

    monkeypatch.setattr(engine.graphs, "run", spy_run)
    monkeypatch.setattr(engine.runner, "forward", spy_forward)
    prompts = prompts_factory([40, 3, 55, 24, 70, 33], 320, seed=8)  # more requests than slots: late admissions
    max_tokens = [12, 30, 8, 25, 10, 18]
    outs = engine.generate(prompts, [SamplingParams(max_tokens=m) for m in max_tokens])
    for p, m, o in zip(prompts, max_tokens, outs, strict=True):
        assert o.token_ids == reference(model, p, m)
    if mode == "split":
        assert graph_steps & eager_steps, "no step was split between the graph and the eager prefill path"
    else:
        assert graph_steps and eager_steps and not graph_steps & eager_steps, "a mixed step used the graph"


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_chained_draft_rounds_equal_round_by_round(temperature, model_factory, prompts_factory):
    """A draft model's rounds chained on the device (rows staged up front, tokens fed back without the host, one
    read at the end) propose what the round-by-round loop proposes: the same seeded requests give the same tokens,
    greedy and sampled (the draft distributions and the draws are the same, in the same order)."""
    outs = []
    for chain in (True, False):
        spec = SpeculativeConfig(
            "draft", draft_model=model_factory(seed=9, n_layers=1, dim=32, n_heads=2), num_tokens=3, adaptive=False
        )
        engine = _rows_engine(model_factory(seed=1), speculative=spec)
        engine.spec.drafter.chain_rounds = chain
        prompts = _prompts(prompts_factory)
        params = [SamplingParams(max_tokens=m, temperature=temperature, seed=i) for i, m in enumerate(MAX_TOKENS)]
        outs.append([o.token_ids for o in engine.generate(prompts, params)])
        assert (engine.spec.drafter.graphs.chained > 0) == chain
    assert outs[0] == outs[1]
