"""``LLMEngine``: requests in, tokens out, over a paged KV cache with continuous batching and prefix caching.

    engine = LLMEngine.from_pretrained("runs/ckpts")           # our checkpoint, a Lightning .ckpt or an HF folder
    outs = engine.generate(["Hello"], SamplingParams(max_tokens=32))
    for event in engine.stream(["Hello"], SamplingParams(max_tokens=32, temperature=0.8, seed=1)):
        print(event.text, end="")

One :meth:`LLMEngine.step` schedules (:mod:`~lightning_llmopt.inference.scheduler`), copies shared blocks that are
about to be written, runs the paged forward pass (:mod:`~lightning_llmopt.inference.runner`; decode-only steps
replay a CUDA graph on GPU), samples, and finishes sequences at a stop token or their length limit. Bad input
raises ``ValueError`` in :meth:`add_request` / :meth:`generate` before anything is queued, so requests in flight
are never disturbed.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lightning_llmopt.inference.block_manager import BlockManager
from lightning_llmopt.inference.config import EngineConfig
from lightning_llmopt.inference.cuda_graphs import DecodeGraphs, graph_sizes, step_logits
from lightning_llmopt.inference.engine_outputs import EngineOutputs
from lightning_llmopt.inference.grammar import constrain
from lightning_llmopt.inference.inputs import Prompt, encode_prompt, prepare_batch, validate_prompt
from lightning_llmopt.inference.kv_groups import GroupedPool, make_kv
from lightning_llmopt.inference.kv_pool import KVPool, KVScales
from lightning_llmopt.inference.multi_step import greedy_steps, steps_for
from lightning_llmopt.inference.prefix_cache import RadixCache
from lightning_llmopt.inference.quant import calibrate_kv_scales
from lightning_llmopt.inference.request import Completion, Request, RequestMetrics, StreamEvent, now
from lightning_llmopt.inference.request import Sequence as Seq
from lightning_llmopt.inference.runner import ModelRunner, to_device
from lightning_llmopt.inference.sampling import SamplingParams, sample_batch
from lightning_llmopt.inference.scheduler import Schedule, Scheduler, Work
from lightning_llmopt.inference.spec_chain import capture_rounds, speculative_rounds
from lightning_llmopt.inference.startup import StartupLog, watch_triton
from lightning_llmopt.inference.stats import EngineStats
from lightning_llmopt.inference.tuning_cache import attach as attach_tuning_cache
from lightning_llmopt.models.layer_pattern import kv_window
from lightning_llmopt.models.llama import Llama

if TYPE_CHECKING:
    from lightning_llmopt.inference.spec_decode import SpecItem

__all__ = ["LLMEngine"]


class LLMEngine(EngineOutputs):
    """Serve a :class:`~lightning_llmopt.models.llama.Llama` (see the module docstring).

    Arguments:
        model: the decoder, on the device and in the dtype to serve with (put in eval mode).
        tokenizer: optional, with ``encode(text, add_special_tokens=...)``/``decode``/``eos_id`` (needed for string
            prompts, which get its special tokens as transformers adds them, and for text output).
        config: an :class:`EngineConfig`; keyword ``overrides`` replace its fields.
        kv_scales: calibrated :class:`KVScales` for ``kv_dtype="int8"`` (or call :meth:`calibrate_kv` later).
        startup: a :class:`~lightning_llmopt.inference.startup.StartupLog` to record the build's phases in (one that
            already timed the model's loading); kept as ``engine.startup``.
    """

    def __init__(
        self,
        model: Llama,
        tokenizer: Any = None,
        config: EngineConfig | None = None,
        *,
        kv_scales: KVScales | None = None,
        startup: StartupLog | None = None,
        **overrides: Any,
    ) -> None:
        if config is None:
            config = EngineConfig(**overrides)
        elif overrides:
            config = EngineConfig(**{**config.__dict__, **overrides})
        if not isinstance(model, Llama):
            raise TypeError(f"LLMEngine serves a lightning_llmopt Llama, got {type(model).__name__}")
        if isinstance(tokenizer, EngineConfig):
            raise TypeError(
                "LLMEngine(model, tokenizer, config): got an EngineConfig as the tokenizer; pass it as "
                "config=EngineConfig(...)"
            )
        self.config = config
        self.model = model.eval()
        self.tokenizer = tokenizer
        cfg = model.config
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.max_model_len = min(config.max_model_len or cfg.max_seq_len, cfg.max_seq_len)
        assert cfg.n_kv_heads is not None and cfg.head_dim is not None
        kv_dtype = torch.int8 if config.kv_dtype == "int8" else self.dtype
        self.startup = startup = startup if startup is not None else StartupLog()
        if self.device.type == "cuda":
            watch_triton(startup)
        startup.mark("kv pool")
        self.pool: KVPool | GroupedPool
        if cfg.mla is not None:  # multi-head latent attention: a latent pool and the absorbed-form runner
            from lightning_llmopt.inference import mla_cache

            mla_cache.check_mla_engine(config)
            self.pool = mla_cache.latent_pool(cfg, config, self.max_model_len, self.device, kv_dtype)
            self.blocks = BlockManager(self.pool.num_blocks, config.block_size)
        else:
            # the layers that compute K/V only (cross-layer KV sharing); a pool per window when local and global mix
            self.pool, self.blocks = make_kv(cfg, config, self.max_model_len, self.device, kv_dtype)
        if kv_scales is not None:
            self.pool.set_scales(kv_scales)  # type: ignore[union-attr]
        self.prefix_cache: RadixCache | None = None
        if config.enable_prefix_caching:  # KV groups: a cache that keeps the local groups' companion blocks too
            make = getattr(self.blocks, "new_prefix_cache", None)
            self.prefix_cache = make() if make is not None else RadixCache(self.blocks.allocator, config.block_size)
        self.blocks.prefix_cache = self.prefix_cache
        self.scheduler = Scheduler(
            self.blocks,
            self.prefix_cache,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.policy,
            kv_window(cfg),  # blocks older than every layer's window are released
            config.admission,
        )
        startup.mark("runner")
        runner_cls = ModelRunner
        if cfg.mla is not None:
            runner_cls = mla_cache.MLARunner
        self.runner = runner_cls(model, self.pool, config.attention_backend, config.fused_kernels)
        self.tuning_cache = attach_tuning_cache(config.tuning_cache, self.runner, self.device, startup)
        self.graphs = None
        spec_tokens = config.speculative.num_tokens if config.speculative is not None else 0
        sizes = graph_sizes(config.graph_batch_sizes, config.max_num_seqs, spec_tokens)
        if config.cuda_graphs and self.device.type == "cuda" and sizes:  # KV groups: static inputs per group
            width = self.blocks.blocks_for(self.max_model_len)
            self.graphs = DecodeGraphs(self.runner, sizes, width, self.max_model_len)
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.stats = EngineStats()
        self.spec = None
        if config.speculative is not None:
            from lightning_llmopt.inference.spec_decode import SpeculativeDecoder

            startup.mark("speculative")
            self.spec = SpeculativeDecoder(
                config.speculative,
                model,
                self.blocks,
                self.max_model_len,
                config.max_num_batched_tokens,
                self.generator,
                self.stats,
                config.attention_backend,
                self.graphs.sizes if self.graphs is not None else None,
            )
        drafter_runner = getattr(self.spec.drafter, "runner", None) if self.spec is not None else None
        if drafter_runner is not None:  # the draft model's choices: same store, its own counters
            attach_tuning_cache(self.tuning_cache or False, drafter_runner, self.device, startup, shared_counters=False)
        # An int8 KV cache without scales yet (calibrate_kv later) cannot run a step: its graphs are captured once
        # calibrate_kv installs the scales.
        self._capture_pending = config.capture_graphs_at_start
        if self._capture_pending and not self._kv_unscaled():
            self._capture_graphs(startup.mark)
        startup.done()
        self._requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._seq_ids = itertools.count()

    def _kv_unscaled(self) -> bool:
        """Whether the KV cache is int8 with no scales installed yet."""
        return bool(getattr(self.pool, "quantized", False)) and getattr(self.pool, "scales", None) is None

    def _capture_graphs(self, mark: Callable[[str | None], Any]) -> None:
        """Capture every decode graph size (the drafter's and the speculative round graphs too) now rather than on
        first use mid-serving; ``mark`` names each phase (:meth:`StartupLog.mark`)."""
        self._capture_pending = False
        for graphs in (self.graphs, getattr(self.spec.drafter, "graphs", None) if self.spec else None):
            if graphs is not None:
                graphs.capture_all(mark)
        mark("speculative round graphs" if self.spec is not None else None)
        capture_rounds(self)

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        tokenizer: Any = None,
        trust_pickle: bool = False,
        **engine_kwargs: Any,
    ) -> LLMEngine:
        """Load a model (our ``step-N`` checkpoint or its root, a Lightning ``.ckpt``, or a Hugging Face folder)."""
        from lightning_llmopt.inference.loading import load_model

        device = device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
        startup = engine_kwargs.pop("startup", None) or StartupLog()
        startup.mark("load weights")
        model, found_tokenizer = load_model(path, dtype=dtype, device=device, trust_pickle=trust_pickle)
        return cls(model, tokenizer if tokenizer is not None else found_tokenizer, startup=startup, **engine_kwargs)

    # ------------------------------------------------------------------ requests
    def _validate(
        self, prompt: Prompt, params: SamplingParams, truncate: bool, add_special_tokens: bool = True
    ) -> tuple[list[int], int]:
        tokens, dropped = validate_prompt(
            prompt, params, truncate, self.tokenizer, self.model.config.vocab_size, self.max_model_len,
            add_special_tokens,
        )  # fmt: skip
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop strings {list(params.stop)!r} need a tokenizer to detokenise the output")
        if params.structured_output is not None:
            self.grammars().check(params.structured_output)
        need = self.blocks.blocks_for(len(tokens) + params.max_tokens)
        if need > self.blocks.allocator.capacity:
            raise ValueError(
                f"this request needs {need} KV blocks but the pool holds {self.blocks.allocator.capacity}"
                "; raise num_blocks or lower max_tokens"
            )
        self.pool.check_ready()
        return tokens, dropped

    def check_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        truncate: bool = False,
        add_special_tokens: bool = True,
    ) -> list[int]:
        """Validate a request as :meth:`add_request` does, queueing nothing; returns the prompt's token ids. It only
        reads the engine's configuration, so another thread (an HTTP handler) may call it while the engine steps."""
        params = params if params is not None else SamplingParams()
        return self._validate(prompt, params, truncate, add_special_tokens)[0]

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` is queued, running, or finished and not collected by :meth:`result` yet."""
        return request_id in self._requests

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        truncate: bool = False,
        add_special_tokens: bool = True,
    ) -> str:
        """Queue one prompt; returns its id. Raises ``ValueError`` (queueing nothing) for bad input. A string prompt
        gets the tokenizer's special tokens (its BOS) unless ``add_special_tokens=False`` (text that already holds
        them, e.g. a rendered chat template); ``truncate=True`` keeps the end of a prompt too long for the context."""
        params = params if params is not None else SamplingParams()
        tokens, dropped = self._validate(prompt, params, truncate, add_special_tokens)
        return self._enqueue(tokens, params, request_id, dropped)

    def _enqueue(self, tokens: list[int], params: SamplingParams, request_id: str | None, dropped: int) -> str:
        arrival = next(self._arrivals)
        rid = request_id if request_id is not None else f"req-{arrival}"
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use")
        req = Request(rid, tokens, params, arrival, RequestMetrics(len(tokens), arrival_time=now()), truncated=dropped)
        self._requests[rid] = req
        seq = Seq(next(self._seq_ids), req, list(tokens), 0, self._generator(params, 0))
        req.seqs.append(seq)
        self.scheduler.add(seq)
        return rid

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        if params.greedy:
            return None
        if params.seed is None:
            return self.generator
        return torch.Generator(device=self.device).manual_seed(params.seed * 1_000_003 + index)

    def cancel(self, request_id: str) -> bool:
        """Stop a request; its blocks go back to the pool. Returns False if it is unknown or already finished."""
        req = self._requests.get(request_id)
        if req is None or req.finished:
            return False
        for seq in req.seqs:
            if not seq.finished:
                self.scheduler.finish(seq, "cancelled")
        req.cancelled = True
        if self.spec is not None:
            self.spec.release({s.seq_id for s in self.scheduler.running})
        req.metrics.finish_time = now()
        self.stats.cancelled += 1
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[StreamEvent]:
        """Run one scheduling + forward + sampling step; returns the new tokens of every sequence that got one."""
        start = now()
        sched = self.scheduler.schedule()
        if not sched.work:
            if self.scheduler.has_work() and not self.scheduler.running:
                raise RuntimeError("the scheduler could not admit any request (KV pool too small?)")
            return []
        wanted = self.spec.plan(sched) if self.spec is not None else []
        if wanted and (events := speculative_rounds(self, sched, wanted)) is not None:  # greedy rounds on device
            return self._account(sched, start, events)
        items = self.spec.extend(sched, wanted) if self.spec is not None and wanted else []
        self.pool.copy_blocks(sched.copies)
        work = ModelRunner.order(sched.work)
        decode_only = all(w.samples and w.seq.num_output > 0 and w.start == w.seq.num_computed for w in work)
        decode_only = decode_only and all(w.num_tokens == w.num_logits for w in work)
        k = steps_for(self, work, speculating=bool(items)) if decode_only else 1
        if k > 1:  # several greedy steps in one host round trip
            t_run = now()
            events = greedy_steps(self, work, k)
            if events is not None:
                if self.spec is not None:  # a run is the plain path the drafts must beat: its cost per step
                    self.spec.observe_step(len(work), (now() - t_run) / k)
                    self.spec.observe_outcome(len(work), events, now() - start, False)
                    if sched.preempted or any(e.finished for e in events):  # drafter state of the finished
                        self.spec.release({s.seq_id for s in self.scheduler.running})
                return self._account(sched, start, events)
        t0 = now()
        work, logits = step_logits(self.graphs, self.runner, work, self.config.mixed_steps == "split")
        if self.spec is not None:
            events = self._speculative_sample(work, logits, items, sched)
            if decode_only:  # sampling read the tokens back, so the step's device work has finished
                self.spec.observe_step(sum(w.num_logits for w in work), now() - t0)
        else:
            self.scheduler.complete(sched)
            events = self._sample(work, logits)
        if decode_only:
            self.stats.record_decode(len(work), events, now() - start, bool(items))
            if self.spec is not None:
                self.spec.observe_outcome(len(work), events, now() - start, bool(items))
        self.stats.steps += 1
        return self._account(sched, start, events)

    def _account(self, sched: Schedule, start: float, events: list[StreamEvent]) -> list[StreamEvent]:
        self.stats.preemptions += len(sched.preempted)
        self.stats.busy_s += now() - start
        return events

    def _speculative_sample(
        self, work: list[Work], logits: torch.Tensor, items: list[SpecItem], sched: Schedule
    ) -> list[StreamEvent]:
        """Verify the speculating sequences' drafts, roll back the rejected ones, then sample the others."""
        assert self.spec is not None
        if not items:  # nobody speculated: the plain path (every logit row is one sampled sequence's)
            self.scheduler.complete(sched)
            events = self._sample(work, logits)
            if sched.preempted or any(e.finished for e in events):  # else every drafter state is still live
                self.spec.release({s.seq_id for s in self.scheduler.running})
            return events
        spec_of = {id(it.work): it for it in items}
        plain_rows, plain_work, spec_rows = [], [], []
        row = 0
        for w in work:
            if not w.samples:
                continue
            if id(w) in spec_of:
                spec_rows.append(logits[row : row + w.num_logits])
            else:
                plain_rows.append(row)
                plain_work.append(w)
            row += w.num_logits
        ordered = [spec_of[id(w)] for w in work if id(w) in spec_of]
        if ordered:
            self.spec.verify(ordered, spec_rows)  # shrinks each work to its accepted tokens
        self.scheduler.complete(sched)
        events = []
        if plain_work:
            plain = logits.index_select(0, to_device(torch.tensor(plain_rows), logits.device))
            events = self._sample(plain_work, plain)
        for it in ordered:
            seq = it.work.seq
            del seq.tokens[it.base_len :]  # the accepted drafts are appended again below, with stop checks
            events.append(self._append_tokens(seq, [*it.drafts[: it.accepted], it.next_token]))
            if not seq.finished:
                self.blocks.truncate(seq, len(seq.tokens))  # blocks that only held rejected drafts
        self.spec.release({s.seq_id for s in self.scheduler.running})
        return events

    def _sample(self, work: list[Work], logits: torch.Tensor) -> list[StreamEvent]:
        rows, seqs = [], []
        for r, w in enumerate(w for w in work if w.samples):
            seq = w.seq
            req = seq.request
            if req.params.n > 1 and seq.index == 0 and seq.num_output == 0 and len(req.seqs) == 1:
                for i in range(1, req.params.n):  # parallel sampling: children share the prompt's blocks
                    child = Seq(next(self._seq_ids), req, list(seq.tokens), i, self._generator(req.params, i))
                    self.blocks.fork(seq, child)
                    req.seqs.append(child)
                    self.scheduler.add_running(child)
                    rows.append(r)
                    seqs.append(child)
            rows.append(r)
            seqs.append(seq)
        if not seqs:
            return []
        if rows != list(range(logits.shape[0])):
            logits = logits.index_select(0, to_device(torch.tensor(rows), logits.device))
        params = [s.request.params for s in seqs]
        if any(p.structured_output is not None for p in params):
            logits = constrain(self.grammars(), logits, seqs)
        histories = [(s.tokens, s.prompt_len) for s in seqs] if any(p.penalised for p in params) else None
        out = sample_batch(logits, params, [s.generator for s in seqs], histories)
        return [self._append(seq, tok, lp) for seq, tok, lp in zip(seqs, out.tokens, out.logprobs, strict=True)]

    # ------------------------------------------------------------------ batch API
    def _prepare_batch(
        self,
        prompts: Prompt | Iterable[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None,
        truncate: bool,
        add_special_tokens: bool = True,
    ) -> list[tuple[list[int], SamplingParams, int]]:
        return prepare_batch(
            prompts, params, lambda prompt, sp: self._validate(prompt, sp, truncate, add_special_tokens)
        )

    def stream(
        self,
        prompts: Prompt | Iterable[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        truncate: bool = False,
        add_special_tokens: bool = True,
    ) -> Iterator[StreamEvent]:
        """Yield :class:`StreamEvent` s of these prompts as tokens are produced (all prompts are validated first;
        ``truncate`` and ``add_special_tokens`` as in :meth:`add_request`)."""
        batch = self._prepare_batch(prompts, params, truncate, add_special_tokens)
        ids = [self._enqueue(t, p, None, d) for t, p, d in batch]
        mine = set(ids)
        try:
            while any(not self._requests[r].finished for r in mine):
                if not self.scheduler.has_work():
                    break
                for event in self.step():
                    if event.request_id in mine:
                        yield event
        finally:  # a consumer that stops early cancels what is left
            for r in ids:
                self.cancel(r)

    def generate(
        self,
        prompts: Prompt | Iterable[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        truncate: bool = False,
        add_special_tokens: bool = True,
    ) -> list[Completion]:
        """Complete every prompt; results in prompt order. All prompts are validated before any is queued
        (``truncate`` and ``add_special_tokens`` as in :meth:`add_request`)."""
        batch = self._prepare_batch(prompts, params, truncate, add_special_tokens)
        ids = [self._enqueue(t, p, None, d) for t, p, d in batch]
        while any(not self._requests[r].finished for r in ids) and self.scheduler.has_work():
            self.step()
        return [self.result(r) for r in ids]

    # ------------------------------------------------------------------ prefix pins, int8 calibration
    def pin_prefix(self, prompt: Prompt) -> list[int]:
        """Compute ``prompt`` into the prefix cache and pin it (never evicted); returns its tokens."""
        if self.prefix_cache is None:
            raise RuntimeError("pin_prefix needs enable_prefix_caching=True")
        tokens = encode_prompt(prompt, self.tokenizer)
        self.generate([tokens], SamplingParams(max_tokens=1, ignore_eos=True))
        self.prefix_cache.pin(tokens)
        return tokens

    def unpin_prefix(self, tokens: Sequence[int]) -> None:
        if self.prefix_cache is None:
            raise RuntimeError("unpin_prefix needs enable_prefix_caching=True")
        self.prefix_cache.unpin(list(tokens))

    def calibrate_kv(self, prompts: Iterable[Prompt], margin: float = 1.0) -> KVScales:
        """Calibrate (and install) the int8 KV scales from the keys/values the model produces on ``prompts``."""
        scales = calibrate_kv_scales(self.model, [encode_prompt(p, self.tokenizer) for p in prompts], margin)
        if self.pool.quantized:
            self.pool.set_scales(scales)
            if self._capture_pending:  # deferred at start for want of scales
                self._capture_graphs(lambda name: None)
        return scales
