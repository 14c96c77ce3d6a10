"""Device-side speculative rounds (``spec_chain``) on the CPU, through the static-buffer step layout of the CUDA
graphs run eagerly (``DecodeGraphs(capture=False)``): greedy output equals naive full recompute and the host path,
over many sequences of different lengths, draft lengths 1 to 4, stop tokens inside a run, a pool too small for a
run, and the draft's cache resumed between runs."""

from __future__ import annotations

import pytest

from lightning_llmopt.inference import LLMEngine, SamplingParams
from lightning_llmopt.inference.cuda_graphs import DecodeGraphs
from lightning_llmopt.inference.speculative import SpeculativeConfig

SIZES = (1, 2, 4, 8, 16, 32, 64)
LENGTHS = [2, 5, 12, 17, 30]
MAX_TOKENS = [14, 3, 20, 9, 17]


class _Eager(DecodeGraphs):
    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, capture=False, **kw)


def _engine(model, draft, k: int, device_rounds: bool = True, **kw) -> LLMEngine:
    spec = SpeculativeConfig("draft", draft_model=draft, num_tokens=k, adaptive=False)
    kw = {"block_size": 4, "num_blocks": 96, "max_num_batched_tokens": 64, **kw}
    engine = LLMEngine(model, speculative=spec, **kw)
    width = engine.blocks.blocks_for(engine.max_model_len)
    engine.graphs = _Eager(engine.runner, SIZES, width, engine.max_model_len)
    drafter = engine.spec.drafter
    draft_width = drafter.blocks.blocks_for(engine.max_model_len)
    drafter.graphs = _Eager(drafter.runner, SIZES, draft_width, engine.max_model_len)
    engine.spec.device_rounds = device_rounds
    return engine


def _count_rounds(engine, monkeypatch) -> list[int]:
    import lightning_llmopt.inference.spec_chain as chain

    runs: list[int] = []
    real = chain._launch

    def spy(engine_, graph, seqs, k, rounds, starts):
        runs.append(rounds)
        return real(engine_, graph, seqs, k, rounds, starts)

    monkeypatch.setattr(chain, "_launch", spy)
    return runs


def _prompts(prompts_factory):
    out = []
    for i, p in enumerate(prompts_factory(LENGTHS, 320, seed=3)):
        out.append((p + p[: max(1, len(p) // 3)] * 3)[: len(p) + 2 * i])
    return out


@pytest.mark.parametrize("k", [1, 2, 4])
def test_device_rounds_greedy_match_full_recompute(k, model_factory, reference, prompts_factory, monkeypatch):
    model = model_factory(seed=1)
    engine = _engine(model, model_factory(seed=9, n_layers=1, dim=32, n_heads=2), k)
    runs = _count_rounds(engine, monkeypatch)
    prompts = _prompts(prompts_factory)
    lengths = [m + 3 * k for m in MAX_TOKENS]  # a run's rounds stay within the shortest sequence's tokens left
    outs = engine.generate(prompts, [SamplingParams(max_tokens=m) for m in lengths])
    for p, m, o in zip(prompts, lengths, outs, strict=True):
        assert o.token_ids == reference(model, p, m), f"prompt of {len(p)} tokens"
    assert runs and max(runs) > 1, "no multi-round device run"
    assert engine.stats.spec_verifications > 0
    engine.prefix_cache.clear()
    assert engine.blocks.allocator.num_free == engine.blocks.allocator.capacity
    drafter = engine.spec.drafter
    assert drafter.num_sequences == 0 and drafter.blocks.allocator.num_free == drafter.blocks.allocator.capacity


def test_device_rounds_equal_host_path_with_high_acceptance(model_factory, prompts_factory, monkeypatch):
    """A draft equal to the target accepts every draft: rounds that end with ``m = k`` (the draft cache one
    key/value behind) alternate with rejections from a second, different draft; both give the host path's tokens
    and its acceptance counts."""
    target = model_factory(seed=1)
    prompts = _prompts(prompts_factory)
    params = [SamplingParams(max_tokens=m + 10) for m in MAX_TOKENS]
    for draft in (model_factory(seed=1), model_factory(seed=9, n_layers=1, dim=32, n_heads=2)):
        results = []
        for device_rounds in (True, False):
            engine = _engine(target, draft, 3, device_rounds)
            runs = _count_rounds(engine, monkeypatch)
            outs = [o.token_ids for o in engine.generate(prompts, params)]
            results.append((outs, engine.stats.spec_accepted, engine.stats.spec_draft_tokens))
            assert bool(runs) == device_rounds
        assert results[0][0] == results[1][0]
        if draft.config.dim == target.config.dim:
            assert results[0][1] == results[0][2] > 0, "a copy of the target must accept every draft"


def test_device_rounds_stop_tokens_and_short_pool(model_factory, reference, prompts_factory, monkeypatch):
    """A stop token inside a run ends the sequence there (later rounds are dropped); a pool too small for a whole
    run falls back to the host path, changing nothing."""
    model = model_factory(seed=2)
    draft = model_factory(seed=2)
    prompts = prompts_factory([6, 9, 4], 320, seed=5)
    ref = [reference(model, p, 30) for p in prompts]
    stop = ref[0][7]
    engine = _engine(model, draft, 2)
    runs = _count_rounds(engine, monkeypatch)
    outs = engine.generate(prompts, SamplingParams(max_tokens=30, stop_token_ids=(stop,)))
    for r, o in zip(ref, outs, strict=True):
        want = r[: r.index(stop)] if stop in r else r
        assert o.token_ids == want
    assert runs
    import lightning_llmopt.inference.spec_chain as chain

    small = _engine(model, draft, 2, num_blocks=24)  # 23 blocks of 4 tokens: too few for 3 sequences' runs
    runs_small = _count_rounds(small, monkeypatch)
    planned = []
    rounds_for = chain.rounds_for
    monkeypatch.setattr(chain, "rounds_for", lambda *a: planned.append(rounds_for(*a)[1]) or rounds_for(*a))
    outs = small.generate(prompts, SamplingParams(max_tokens=30))
    assert [o.token_ids for o in outs] == ref
    assert runs_small and sum(r > 0 for r in planned) > len(runs_small), "no run fell back for lack of blocks"


def test_probe_steps_take_the_host_path(model_factory, reference, prompts_factory):
    """When the measured costs rule speculation out, the adaptive controller's probe steps (``k = 1`` kept only to
    re-measure) run one host-path step each, never a multi-round device run."""
    model = model_factory(seed=1)
    spec = SpeculativeConfig(
        "draft",
        draft_model=model_factory(seed=9, n_layers=1, dim=32, n_heads=2),
        num_tokens=3,
        draft_cost=5.0,
        probe_every=2,
    )
    engine = LLMEngine(model, speculative=spec, block_size=4, num_blocks=96, max_num_batched_tokens=64)
    width = engine.blocks.blocks_for(engine.max_model_len)
    engine.graphs = _Eager(engine.runner, SIZES, width, engine.max_model_len)
    drafter = engine.spec.drafter
    drafter.graphs = _Eager(drafter.runner, SIZES, width, engine.max_model_len)
    prompts = prompts_factory([7, 11], 320, seed=4)
    outs = engine.generate(prompts, SamplingParams(max_tokens=80))
    assert [o.token_ids for o in outs] == [reference(model, p, 80) for p in prompts]
    assert engine.stats.spec_verifications > 0, "no probe ran"
    assert engine.spec.device_runs == 0


def _follow_spies(monkeypatch) -> tuple[list, list]:
    import lightning_llmopt.inference.spec_chain as chain

    followed, taken = [], []
    follow, read = chain._follow, chain._read

    def spy_follow(engine_, run, tokens):
        nxt = follow(engine_, run, tokens)
        if nxt is not None:
            followed.append(nxt)  # the objects, not their ids: an id is reused once its run is collected
        return nxt

    monkeypatch.setattr(chain, "_follow", spy_follow)
    monkeypatch.setattr(chain, "_read", lambda run: taken.append(any(run is f for f in followed)) or read(run))
    return followed, taken


def test_runs_launched_behind_the_last_one(model_factory, reference, prompts_factory, monkeypatch):
    """A run is launched right behind the previous one, before that one's tokens are committed, and the next step
    takes it: output still equals full recompute, with a stop token ending one sequence (no run follows one that
    stops) and the others running on."""
    model = model_factory(seed=2)
    engine = _engine(model, model_factory(seed=2), 3, num_blocks=400)
    followed, taken = _follow_spies(monkeypatch)
    prompts = prompts_factory([6, 9, 4, 12, 7], 320, seed=5)
    refs = [reference(model, p, 90) for p in prompts]
    stop = refs[1][20]
    outs = engine.generate(prompts, SamplingParams(max_tokens=90, stop_token_ids=(stop,)))
    for r, o in zip(refs, outs, strict=True):
        assert o.token_ids == (r[: r.index(stop)] if stop in r else r)
    assert any(taken), "no step took a run launched behind the last one"
    engine.prefix_cache.clear()
    assert engine.blocks.allocator.num_free == engine.blocks.allocator.capacity


def test_run_in_flight_is_dropped_when_the_step_differs(model_factory, reference, prompts_factory, monkeypatch):
    """A request arriving while a run is in flight is admitted at the next step; the run in flight (computed for
    the old batch) is dropped, and every output still equals full recompute."""
    model = model_factory(seed=2)
    engine = _engine(model, model_factory(seed=2), 3, num_blocks=400)
    followed, taken = _follow_spies(monkeypatch)
    prompts = prompts_factory([6, 9], 320, seed=6)
    first = engine.add_request(prompts[0], SamplingParams(max_tokens=80))
    while not followed:
        engine.step()
    second = engine.add_request(prompts[1], SamplingParams(max_tokens=40))
    while engine.has_unfinished():
        engine.step()
    assert engine.result(first).outputs[0].token_ids == reference(model, prompts[0], 80)
    assert engine.result(second).outputs[0].token_ids == reference(model, prompts[1], 40)
    assert len(followed) > sum(taken), "the run in flight was not dropped"
    engine.prefix_cache.clear()
    assert engine.blocks.allocator.num_free == engine.blocks.allocator.capacity
