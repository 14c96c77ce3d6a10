"""What a cold engine build tunes, counted (issue 53, item 4): the few-row buckets between two agreeing timed buckets
take their decision without being timed, the graphs are captured in the order that allows it, and every decision
and every greedy token stays what timing every bucket gives. No timings are asserted: the chooser's timer is a cost
model here (a GEMV whose cost does not grow with the rows from 2 to 16, cuBLAS whose cost does)."""

from __future__ import annotations

import pytest
import torch

from lightning_llmopt.inference import LLMEngine, SamplingParams
from lightning_llmopt.inference.cuda_graphs import DecodeGraphs
from lightning_llmopt.inference.linear_chooser import LinearChooser, bucket
from lightning_llmopt.inference.startup import StartupLog
from lightning_llmopt.models import Llama, LlamaConfig
from lightning_llmopt.testing.triton import triton_available, triton_interpreter_enabled

SIZES = (1, 2, 4, 8, 16, 32, 64)


def test_bucket_and_tuning_order(monkeypatch: pytest.MonkeyPatch) -> None:
    assert [bucket(m) for m in (1, 2, 3, 4, 5, 9, 16, 17)] == [1, 2, 4, 4, 8, 16, 16, 0]
    chooser = LinearChooser()
    assert chooser.inherit
    assert chooser.tuning_order(SIZES) == (1, 2, 16, 4, 8, 32, 64)
    assert chooser.tuning_order((1, 2, 4, 8)) == (1, 2, 8, 4)  # max_num_seqs 8
    assert chooser.tuning_order((1, 2, 3, 4, 6, 8, 12, 16, 24)) == (1, 2, 12, 16, 3, 4, 6, 8, 24)
    assert chooser.tuning_order((2, 1)) == (1, 2)
    assert sorted(chooser.tuning_order(SIZES)) == list(SIZES)
    monkeypatch.setenv("LLMOPT_TUNE_EVERY_BUCKET", "1")
    every = LinearChooser()
    assert not every.inherit and every.tuning_order((16, 1, 4, 2)) == (1, 2, 4, 16)


def _cost_model(costs: dict[str, tuple[float, float]], seen: list[tuple]):
    """``_measure`` as a cost model of the key: ``costs[kind] = (gemv, cublas_per_row)``; the GEMV's time is flat
    from 2 to 16 rows, cuBLAS's grows with the rows. Both candidates are run (their nested decisions are taken)."""

    def decide(self, key, triton_fn, torch_fn):
        self._key = key
        return original(self, key, triton_fn, torch_fn)

    original = LinearChooser._decide

    def measure(self, triton_fn, torch_fn):
        key = self._key
        seen.append(key)
        triton_fn()
        torch_fn()
        kind = key[0] if isinstance(key[0], str) else "linear"
        gemv, per_row = costs[kind]
        rows = key[-1]
        return (gemv if rows >= 2 else gemv / 2) < per_row * (rows + 1)

    return decide, measure


def test_bracketed_buckets_take_the_agreeing_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys decided directly: a weight whose endpoints agree is timed at 2 and 16 only; one whose endpoints disagree
    is timed at 4 and 8 too; the decisions equal those of timing every bucket."""
    seen: list[tuple] = []
    decide, measure = _cost_model({"linear": (10.0, 4.0), "swiglu": (10.0, 1.0)}, seen)
    monkeypatch.setattr(LinearChooser, "_decide", decide)
    monkeypatch.setattr(LinearChooser, "_measure", measure)
    keys = [((64, 32), torch.float32), ("swiglu", (96, 32), (96, 32), torch.float32)]

    def run(inherit: bool) -> LinearChooser:
        chooser = LinearChooser()
        chooser.inherit = inherit
        for rows in chooser.tuning_order(SIZES):
            for stem in keys:
                if bucket(rows):
                    chooser._choose((*stem, bucket(rows)), lambda: None, lambda: None)
        return chooser

    every = run(False)
    assert every.tunings == 2 * 5 and every.inherited == 0
    seen.clear()
    bracketed = run(True)
    assert bracketed.use_gemv == every.use_gemv
    # linear: GEMV at 2 (10 < 12) and at 16 (10 < 68): 4 and 8 inherited. swiglu: cuBLAS at 2 (10 < 3 fails), GEMV
    # at 16 (10 < 17): 4 is timed (cuBLAS), then 8 lies between 4 (cuBLAS) and 16 (GEMV): timed too (cuBLAS)
    assert [k[-1] for k in seen if k[0] == "swiglu"] == [1, 2, 16, 4, 8]
    assert [k[-1] for k in seen if k[0] != "swiglu"] == [1, 2, 16]
    assert bracketed.tunings == 8 and bracketed.inherited == 2
    assert bracketed.tunings + bracketed.inherited == every.tunings


def test_store_keeps_measured_decisions_only(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple] = []
    decide, measure = _cost_model({"linear": (10.0, 4.0)}, seen)
    monkeypatch.setattr(LinearChooser, "_decide", decide)
    monkeypatch.setattr(LinearChooser, "_measure", measure)

    class Store(dict):
        def get(self, kind, key):  # type: ignore[override]
            return super().get(key)

        def put(self, kind, key, value):
            self[key] = value

    chooser = LinearChooser()
    chooser.store = Store()
    for rows in chooser.tuning_order((2, 4, 8, 16)):
        chooser._choose(((64, 32), torch.float32, rows), lambda: None, lambda: None)
    assert sorted(k[-1] for k in chooser.store) == [2, 16] and chooser.inherited == 2


@pytest.mark.skipif(not triton_available() or not triton_interpreter_enabled(), reason="needs TRITON_INTERPRET=1")
@pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")
def test_graph_warmups_count_and_greedy_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode graphs' warm-ups of a tiny model (the GPU's choice path, interpreted; capture replaced by eager
    steps): the build with bracketing times fewer decisions, takes the same ones, records every graph phase, and
    generates the same greedy tokens as timing every bucket and as the reference path."""
    seen: list[tuple] = []
    costs = {k: (10.0, 4.0) for k in ("linear", "qkv", "norm+qkv")} | {
        k: (10.0, 1.0) for k in ("swiglu", "norm+swiglu")
    }
    decide, measure = _cost_model(costs, seen)
    monkeypatch.setattr(LinearChooser, "_on_device", lambda self, x: True)
    monkeypatch.setattr(LinearChooser, "_decide", decide)
    monkeypatch.setattr(LinearChooser, "_measure", measure)
    captured: list[int] = []

    def eager_capture(self, b):  # what _capture does before capturing: its warm-up passes
        captured.append(b)
        for _ in range(2):
            self.runner.forward(self._inputs(b), max_context=self.max_context)
        self.graphs[b] = type("Replay", (), {"replay": lambda self: None})()
        self.outputs[b] = None

    monkeypatch.setattr(DecodeGraphs, "_capture", eager_capture)
    torch.manual_seed(0)
    cfg = dict(n_layers=2, dim=32, n_heads=2, n_kv_heads=1, vocab_size=64, multiple_of=16, init_std=0.1)
    model = Llama(LlamaConfig.from_preset("tiny", **cfg)).eval()
    prompts = [[5, 6, 7], [9, 10], [11, 3, 4, 8], [2]]
    params = SamplingParams(max_tokens=3, ignore_eos=True)

    def build(inherit: bool) -> tuple[LLMEngine, StartupLog, list]:
        monkeypatch.setenv("LLMOPT_TUNE_EVERY_BUCKET", "0" if inherit else "1")
        startup = StartupLog()
        engine = LLMEngine(model, num_blocks=64, block_size=8, fused_kernels=True, attention_backend="reference",
                           tuning_cache=False, startup=startup)  # fmt: skip
        graphs = DecodeGraphs(engine.runner, (1, 2, 4, 8, 16), 8, engine.max_model_len, capture=False)
        graphs.capture = True
        captured.clear()
        seen.clear()
        startup.current = "runner"  # reopen the build (the engine closed its log)
        graphs.capture_all(startup.mark)
        startup.done()
        assert sorted(captured) == [1, 2, 4, 8, 16]
        assert [p.name for p in startup.phases if p.name.startswith("cuda graph")] == [
            f"cuda graph {b} rows" for b in captured
        ]
        out = [c.token_ids for c in engine.generate(prompts, params)]
        return engine, startup, out

    every, every_log, out_every = build(False)
    bracketed, log, out = build(True)
    assert captured == [1, 2, 16, 4, 8]
    a, b = every.runner.linear, bracketed.runner.linear
    assert a.inherited == 0 and b.inherited > 0
    # the same kernel wherever the bracketed build runs one; it decides fewer keys, since an inferred decision runs
    # neither candidate and so takes none of the nested ones its timing would (the unfused path's q/k/v, gate/up)
    assert b.use_gemv.items() <= a.use_gemv.items()
    assert b.tunings + b.inherited == len(b.use_gemv) and len(a.use_gemv) == a.tunings
    assert b.tunings < a.tunings - b.inherited
    totals = log.summary()["totals"]
    assert totals["linear_tunings"] == b.tunings and totals["linear_inherited"] == b.inherited
    by_phase = {p.name: p.counts for p in log.phases}
    # at 4 rows only the keys whose endpoints disagree (gate/up here: cuBLAS at 2, the GEMV at 16) are timed
    assert 0 < by_phase["cuda graph 4 rows"]["linear_tunings"] < by_phase["cuda graph 2 rows"]["linear_tunings"]
    assert by_phase["cuda graph 4 rows"]["linear_inherited"] > 0
    assert {k[0] for k in seen if k[-1] == 4} == {"swiglu", "norm+swiglu"}
    ref = [c.token_ids for c in LLMEngine(model, num_blocks=64, block_size=8).generate(prompts, params)]
    assert out == out_every == ref
