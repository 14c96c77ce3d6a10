"""Turning sampled tokens into a request's output: stop checks, streaming events, text and completions.

:class:`EngineOutputs` is the part of :class:`~lightning_llmopt.inference.engine.LLMEngine` that appends sampled
tokens to a sequence (stopping at a stop token, ``max_tokens`` or ``max_model_len``), finishes it with the
scheduler, records its metrics, and builds :class:`StreamEvent` and :class:`Completion` objects.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_llmopt.inference.detokenize import TextState, decode_text
from lightning_llmopt.inference.request import Completion, CompletionOutput, Request, StreamEvent, now
from lightning_llmopt.inference.request import Sequence as Seq
from lightning_llmopt.inference.sampling import TokenLogprobs

if TYPE_CHECKING:
    from lightning_llmopt.inference.grammar import Grammars
    from lightning_llmopt.inference.scheduler import Scheduler
    from lightning_llmopt.inference.stats import EngineStats

__all__ = ["EngineOutputs"]


class EngineOutputs:
    """Output side of the engine; the engine sets the attributes annotated here."""

    tokenizer: Any
    _end_cache: tuple[Any, frozenset[int]]  # (tokenizer, its end-of-sequence ids)
    scheduler: Scheduler
    stats: EngineStats
    max_model_len: int
    _requests: dict[str, Request]
    _grammars: Grammars | None = None

    def _append(self, seq: Seq, token: int, logprobs: TokenLogprobs | None = None) -> StreamEvent:
        return self._append_tokens(seq, [token], None if logprobs is None else [logprobs])

    def _append_tokens(
        self, seq: Seq, tokens: list[int], logprobs: list[TokenLogprobs | None] | None = None
    ) -> StreamEvent:
        """Append sampled ``tokens`` in order, stopping at a stop token, a stop string or the length limit (later
        ones dropped). ``logprobs`` holds each token's log-probabilities when its request asked for them."""
        req, p = seq.request, seq.request.params
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now()
        if seq.text is None and self.tokenizer is not None:
            seq.text = TextState(self.tokenizer, req.prompt_token_ids, p.stop, p.skip_special_tokens)
        eos = self._end_ids() if not p.ignore_eos else ()
        reason = None
        start = seq.num_output
        grammar = seq.grammar
        for i, token in enumerate(tokens):
            if token in p.stop_token_ids or token in eos or (grammar is not None and token in grammar.end_ids):
                reason = "stop"  # a grammar's end token ends its text even with ignore_eos
                break
            seq.tokens.append(token)
            if p.logprobs is not None and logprobs is not None and logprobs[i] is not None:
                seq.logprobs.append(logprobs[i])  # type: ignore[arg-type]
            if seq.text is not None and seq.text.add(token):
                reason = "stop"
                break
            if grammar is not None and grammar.advance(token):  # the text is complete: nothing may follow
                reason = "stop"
                break
            if seq.num_output >= p.max_tokens or len(seq.tokens) >= self.max_model_len:
                reason = "length"
                break
        if reason is not None:
            seq.num_computed = min(seq.num_computed, len(seq.tokens))  # accepted drafts past a stop: not kept
            self.scheduler.finish(seq, reason)
            if seq.text is not None:
                seq.text.flush()
            if req.finished:
                req.metrics.finish_time = now()
                self.stats.record(req.metrics, sum(s.num_output for s in req.seqs))
        new = seq.output_tokens[seq.num_streamed :]
        seq.num_streamed = seq.num_output
        text = seq.text.take(reason is not None) if seq.text is not None else None
        lps = seq.logprobs[start:] if p.logprobs is not None else None
        return StreamEvent(req.request_id, seq.index, new, text, reason is not None, reason, lps)

    def _end_ids(self) -> frozenset[int]:
        """Tokens that end a sequence unless ``ignore_eos``: the tokenizer's ``eos_id`` and its ``stop_ids`` (a
        Hugging Face folder's ``generation_config.json`` ``eos_token_id``: Llama-3 instruct's ``<|eot_id|>``)."""
        tok = self.tokenizer
        cached = getattr(self, "_end_cache", None)
        if cached is None or cached[0] is not tok:
            ids = {int(t) for t in getattr(tok, "stop_ids", ()) or ()}
            eos = getattr(tok, "eos_id", None)
            cached = (tok, frozenset(ids | ({int(eos)} if eos is not None else set())))
            self._end_cache = cached
        return cached[1]

    def grammars(self) -> Grammars:
        """The structured-output state (:class:`~lightning_llmopt.inference.grammar.Grammars`), built on first use:
        llguidance's view of the tokenizer takes ~0.5 s for a 32k vocabulary."""
        if self._grammars is None:
            from lightning_llmopt.inference.grammar import Grammars

            if self.tokenizer is None:
                raise ValueError("structured_output needs a tokenizer (the engine was built without one)")
            eos = getattr(self.tokenizer, "eos_id", None)
            ends = sorted(self._end_ids())
            self._grammars = Grammars(self.tokenizer, [eos, *[t for t in ends if t != eos]] if eos in ends else ends)
        return self._grammars

    def _decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str | None:
        """Text of ``tokens`` (special tokens left out when ``skip_special_tokens``); ids the tokenizer does not know
        (a model vocabulary padded past the tokenizer's) are skipped, and a tokenizer error gives ``None`` rather
        than breaking the step for every other request."""
        if self.tokenizer is None:
            return None
        try:
            return decode_text(self.tokenizer, tokens, skip_special_tokens)
        except Exception:  # noqa: BLE001 - text is a convenience; token ids are the result
            return None

    def result(self, request_id: str) -> Completion:
        """The completion of a request (pops it from the engine once finished)."""
        req = self._requests[request_id]
        outs = [
            CompletionOutput(
                s.index,
                s.output_tokens,
                (
                    s.text.text
                    if s.text is not None and not s.text.failed
                    else self._decode(s.output_tokens, req.params.skip_special_tokens)
                ),
                s.finish_reason,
                list(s.logprobs) if req.params.logprobs is not None else None,
            )
            for s in sorted(req.seqs, key=lambda s: s.index)
        ]
        if req.finished:
            del self._requests[request_id]
        return Completion(req.request_id, req.prompt_token_ids, outs, req.metrics)
