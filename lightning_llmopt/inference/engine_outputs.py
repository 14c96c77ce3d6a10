"""Turning sampled tokens into a request's output: stop checks, streaming events, text and completions.

:class:`EngineOutputs` is the part of :class:`~lightning_llmopt.inference.engine.LLMEngine` that appends sampled
tokens to a sequence (stopping at a stop token, ``max_tokens`` or ``max_model_len``), finishes it with the
scheduler, records its metrics, and builds :class:`StreamEvent` and :class:`Completion` objects.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_llmopt.inference.request import Completion, CompletionOutput, Request, StreamEvent, now
from lightning_llmopt.inference.request import Sequence as Seq

if TYPE_CHECKING:
    from lightning_llmopt.inference.scheduler import Scheduler
    from lightning_llmopt.inference.stats import EngineStats

__all__ = ["EngineOutputs"]


class EngineOutputs:
    """Output side of the engine; the engine sets the attributes annotated here."""

    tokenizer: Any
    scheduler: Scheduler
    stats: EngineStats
    max_model_len: int
    _requests: dict[str, Request]

    def _append(self, seq: Seq, token: int) -> StreamEvent:
        return self._append_tokens(seq, [token])

    def _append_tokens(self, seq: Seq, tokens: list[int]) -> StreamEvent:
        """Append sampled ``tokens`` in order, stopping at a stop token or the length limit (later ones dropped)."""
        req, p = seq.request, seq.request.params
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now()
        eos = getattr(self.tokenizer, "eos_id", None)
        reason = None
        for token in tokens:
            if token in p.stop_token_ids or (not p.ignore_eos and eos is not None and token == eos):
                reason = "stop"
                break
            seq.tokens.append(token)
            if seq.num_output >= p.max_tokens or len(seq.tokens) >= self.max_model_len:
                reason = "length"
                break
        if reason is not None:
            seq.num_computed = min(seq.num_computed, len(seq.tokens))  # accepted drafts past a stop: not kept
            self.scheduler.finish(seq, reason)
            if req.finished:
                req.metrics.finish_time = now()
                self.stats.record(req.metrics, sum(s.num_output for s in req.seqs))
        new = seq.output_tokens[seq.num_streamed :]
        seq.num_streamed = seq.num_output
        return StreamEvent(req.request_id, seq.index, new, self._decode(new), reason is not None, reason)

    def _decode(self, tokens: list[int]) -> str | None:
        """Text of ``tokens``; ids the tokenizer does not know (a model vocabulary padded past the tokenizer's) are
        skipped, and a tokenizer error gives ``None`` rather than breaking the step for every other request."""
        if self.tokenizer is None:
            return None
        size = getattr(self.tokenizer, "vocab_size", None)
        known = [t for t in tokens if size is None or t < size]
        try:
            return str(self.tokenizer.decode(known))
        except Exception:  # noqa: BLE001 - text is a convenience; token ids are the result
            return None

    def result(self, request_id: str) -> Completion:
        """The completion of a request (pops it from the engine once finished)."""
        req = self._requests[request_id]
        outs = [
            CompletionOutput(s.index, s.output_tokens, self._decode(s.output_tokens), s.finish_reason)
            for s in sorted(req.seqs, key=lambda s: s.index)
        ]
        if req.finished:
            del self._requests[request_id]
        return Completion(req.request_id, req.prompt_token_ids, outs, req.metrics)
