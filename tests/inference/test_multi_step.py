"""Several greedy decode steps per host round trip (``EngineConfig.decode_steps``), on the CPU through the eager
static-buffer layout the CUDA graphs replay (``DecodeGraphs(capture=False)``): output equals naive full recompute,
stop tokens inside a run, admission, streaming and a pool too small for a whole run; every block comes back."""

from __future__ import annotations

import pytest

from lightning_llmopt.inference import LLMEngine, SamplingParams
from lightning_llmopt.inference.cuda_graphs import DecodeGraphs

SIZES = (1, 2, 4, 8)


class _Counting(DecodeGraphs):
    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, capture=False, **kw)
        self.chained = 0

    def replay_rows(self, meta, n, ids=None):
        self.chained += 1
        return super().replay_rows(meta, n, ids)


def _engine(model, **kw) -> LLMEngine:
    kw = {"block_size": 4, "num_blocks": 96, "max_num_batched_tokens": 64, "decode_steps": 5, **kw}
    engine = LLMEngine(model, **kw)
    width = engine.blocks.blocks_for(engine.max_model_len)
    engine.graphs = _Counting(engine.runner, SIZES, width, engine.max_model_len)
    return engine


def _all_back(engine) -> None:
    engine.prefix_cache.clear()
    assert engine.blocks.allocator.num_free == engine.blocks.allocator.capacity


def test_runs_match_full_recompute(model_factory, reference, prompts_factory, monkeypatch):
    import lightning_llmopt.inference.engine as engine_module

    model = model_factory(seed=2)
    prompts = prompts_factory([3, 9, 14, 22], 320, seed=4)
    max_tokens = [17, 2, 9, 12]
    engine = _engine(model)
    run = engine_module.greedy_steps

    def checked(eng, work, k):  # after a run, every live sequence has computed all but its newest token
        out = run(eng, work, k)
        assert out is not None
        assert all(w.seq.finished or w.seq.num_computed == len(w.seq.tokens) - 1 for w in work)
        return out

    monkeypatch.setattr(engine_module, "greedy_steps", checked)
    outs = engine.generate(prompts, [SamplingParams(max_tokens=m) for m in max_tokens])
    for p, m, o in zip(prompts, max_tokens, outs, strict=True):
        assert o.token_ids == reference(model, p, m)
        assert o.outputs[0].finish_reason == "length"
    assert engine.graphs.chained > 0, "no multi-step run"
    _all_back(engine)


def test_stop_token_inside_a_run(model_factory, reference, prompts_factory):
    """A stop token in the middle of a run ends the sequence there; the others keep their runs."""
    model = model_factory(seed=3)
    prompts = prompts_factory([6, 11], 320, seed=5)
    full = [reference(model, p, 20) for p in prompts]
    stop = full[0][7]  # the 8th generated token of the first prompt
    engine = _engine(model)
    outs = engine.generate(prompts, [SamplingParams(max_tokens=20, stop_token_ids=(stop,))] * 2)
    for f, o in zip(full, outs, strict=True):
        cut = f.index(stop) if stop in f else len(f)
        assert o.token_ids == f[:cut]
        assert o.outputs[0].finish_reason == ("stop" if stop in f else "length")
    _all_back(engine)


def test_waiting_requests_and_streaming(model_factory, reference, prompts_factory):
    """More requests than running slots; streamed events add up to the output."""
    model = model_factory(seed=4)
    prompts = prompts_factory([4, 7, 5, 13, 2], 320, seed=6)
    engine = _engine(model, max_num_seqs=2)
    got: dict[str, list[int]] = {}
    for event in engine.stream(prompts, SamplingParams(max_tokens=16)):
        got.setdefault(event.request_id, []).extend(event.token_ids)
    outs = [got[k] for k in sorted(got, key=lambda r: int(r.rsplit("-", 1)[1]))]  # ids "req-<arrival>"
    assert outs == [reference(model, p, 16) for p in prompts]
    assert engine.graphs.chained > 0
    _all_back(engine)


@pytest.mark.parametrize("policy", ["continuous", "static"])
@pytest.mark.parametrize("admission", [1, 2])
def test_runs_while_requests_wait_keep_the_admission_steps(model_factory, reference, prompts_factory, policy,
                                                           admission):
    """Requests waiting for a slot do not stop runs, and every request is admitted at the same step (counted in
    single decode steps) as with one step per round trip: a run ends when its first sequence does."""
    model = model_factory(seed=6)
    prompts = prompts_factory([4, 7, 5, 13, 2, 9, 3], 320, seed=9)
    max_tokens = [9, 3, 14, 6, 11, 2, 8]
    params = [SamplingParams(max_tokens=m) for m in max_tokens]
    firsts = {}
    for steps in (1, 5):
        engine = _engine(model, max_num_seqs=3, decode_steps=steps, policy=policy, admission_batch=admission)
        waiting_runs = []
        replay = engine.graphs.replay_rows

        def spy(meta, n, ids=None, engine=engine, replay=replay, waiting_runs=waiting_runs):
            waiting_runs.append(bool(engine.scheduler.waiting) and ids is not None)
            return replay(meta, n, ids)

        engine.graphs.replay_rows = spy
        first_step, outs = {}, {}
        for event in engine.stream(prompts, params):
            first_step.setdefault(event.request_id, engine.stats.steps)
            outs.setdefault(event.request_id, []).extend(event.token_ids)
        assert [outs[f"req-{i}"] for i in range(len(prompts))] == [
            reference(model, p, m) for p, m in zip(prompts, max_tokens, strict=True)
        ]
        if steps > 1:
            assert any(waiting_runs), "no run while requests waited"
        firsts[steps] = first_step
        _all_back(engine)
    assert firsts[5] == firsts[1]


def test_a_pool_too_small_for_a_run_falls_back(model_factory, reference, prompts_factory, monkeypatch):
    """Two sequences that end at 5 blocks each in a pool of 9: a run of 5 steps for both runs out of blocks before
    single steps do; the engine then takes single steps (and preempts as usual), and output is unchanged."""
    import lightning_llmopt.inference.engine as engine_module

    model = model_factory(seed=4)
    prompts = prompts_factory([3, 3], 320, seed=8)
    engine = _engine(model, num_blocks=10, enable_prefix_caching=False)
    refused = []
    run = engine_module.greedy_steps

    def spy(*a):
        out = run(*a)
        refused.append(out is None)
        return out

    monkeypatch.setattr(engine_module, "greedy_steps", spy)
    outs = engine.generate(prompts, SamplingParams(max_tokens=16))
    assert [o.token_ids for o in outs] == [reference(model, p, 16) for p in prompts]
    assert any(refused) and not all(refused)
    assert engine.blocks.allocator.num_free == engine.blocks.allocator.capacity


def test_sampled_and_speculative_requests_take_one_step(model_factory, prompts_factory):
    from lightning_llmopt.inference.multi_step import steps_for
    from lightning_llmopt.inference.scheduler import Work

    model = model_factory(seed=5)
    engine = _engine(model)
    engine.add_request(prompts_factory([5], 320, seed=7)[0], SamplingParams(max_tokens=8, temperature=0.7, seed=1))
    engine.step()  # prefill
    seq = engine.scheduler.running[0]
    assert steps_for(engine, [Work(seq, seq.num_computed, 1)]) == 1
    engine.config.decode_steps = 1
    assert steps_for(engine, [Work(seq, seq.num_computed, 1)]) == 1


def test_decode_steps_is_validated():
    from lightning_llmopt.inference import EngineConfig

    with pytest.raises(ValueError, match="decode_steps"):
        EngineConfig(decode_steps=0)


def test_speculative_engine_runs_plain_steps_while_drafting_is_ruled_out(model_factory, prompts_factory, monkeypatch):
    """A speculative engine whose controller rules drafting out (draft cost 50 target steps) decodes in multi-step
    runs like a plain engine between its probes; output equals plain decoding, the probes still draft, and neither
    the target's nor the drafter's blocks leak (sequences finishing inside a run are released)."""
    from lightning_llmopt.inference.speculative import SpeculativeConfig

    model = model_factory(seed=4)
    draft = model_factory(seed=9, n_layers=1, dim=32, n_heads=2)
    spec = SpeculativeConfig("draft", draft_model=draft, num_tokens=3, draft_cost=50.0, probe_every=2)
    engine = _engine(model, speculative=spec)
    plain = LLMEngine(model, block_size=4, num_blocks=96)
    import lightning_llmopt.inference.engine as engine_module

    runs = []
    run = engine_module.greedy_steps
    monkeypatch.setattr(engine_module, "greedy_steps", lambda eng, work, k: runs.append(k) or run(eng, work, k))
    prompts = prompts_factory([6, 11, 3, 9], 320, seed=8)
    params = [SamplingParams(max_tokens=n) for n in (13, 40, 21, 30)]  # finishing on different steps
    outs = [o.token_ids for o in engine.generate(prompts, params)]
    assert outs == [o.token_ids for o in plain.generate(prompts, params)]
    assert runs and max(runs) > 1, "no multi-step run"
    assert engine.stats.spec_draft_tokens > 0  # the probes drafted
    _all_back(engine)
    drafter = engine.spec.drafter
    assert drafter.blocks.allocator.num_free == drafter.blocks.allocator.capacity
    assert not drafter.state
