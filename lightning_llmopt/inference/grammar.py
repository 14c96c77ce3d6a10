"""Structured output in the engine: :class:`Grammars` compiles :class:`StructuredOutput` constraints with llguidance
(a maintained grammar library: JSON schemas, regular expressions and Lark grammars over a token trie) and masks a
step's logits; :class:`Matcher` follows one sequence's text.

Per step, for the rows whose request has a constraint:

1. each row's matcher computes the set of tokens that may come next as a bitmask, ``(N, ceil(V / 32))`` int32 on
   the host, the rows in parallel on llguidance's thread pool; this runs while the device computes the step's
   logits (nothing before it waits for the device);
2. the bitmask goes up in one copy and turns into ``-inf`` on the disallowed logits of those rows (columns past
   the tokenizer's vocabulary, padding of the model's, are always disallowed);
3. after the draw, :meth:`Matcher.advance` feeds the token to the matcher; the sequence ends (``"stop"``) when the
   text is complete and nothing may follow, or at an end-of-sequence token the grammar allowed.

Compiled grammars are cached by :meth:`StructuredOutput.key`; a new sequence starts from a copy of its grammar's
fresh matcher. See docs/structured_output.md.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_llmopt.inference.structured_output import StructuredOutput

__all__ = ["Grammars", "Matcher", "constrain", "grammar_text"]

_CACHE_SIZE = 512  # compiled grammars kept (least recently used first out)


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as err:
        raise ImportError(
            "structured output needs the `llguidance` package: `pip install lightning_llmopt[serve]`"
        ) from err
    return llguidance


def grammar_text(so: StructuredOutput) -> str:
    """The llguidance grammar (its JSON form) of a constraint."""
    ll = _llguidance().LLMatcher
    if so.kind in ("json_schema", "json_object"):
        schema: Any = {"type": "object"} if so.json_object else so.json_schema
        if isinstance(schema, dict):
            options = {"whitespace_flexible": so.whitespace_flexible}
            schema = {**schema, "x-guidance": {**options, **schema.get("x-guidance", {})}}
        return str(ll.grammar_from_json_schema(schema))
    if so.kind == "regex":
        return str(ll.grammar_from_regex(so.regex))
    if so.kind == "choice":
        lark = "start: " + " | ".join(json.dumps(c) for c in so.choice or ())
        return str(ll.grammar_from_lark(lark))
    return str(ll.grammar_from_lark(so.grammar))


class _ByteWrapper:
    """What llguidance's ``TokenizerWrapper`` reads of a tokenizer that lists its tokens' bytes (``token_bytes()``)
    and encodes text (``encode``)."""

    def __init__(self, tokenizer: Any, stop_ids: Sequence[int]) -> None:
        self.tokens = list(tokenizer.token_bytes())
        self.eos_token_id = stop_ids[0]
        self.bos_token_id = getattr(tokenizer, "bos_id", None)
        self.special_token_ids = [i for i in (self.bos_token_id, *stop_ids) if i is not None]
        self._tokenizer = tokenizer

    def __call__(self, text: str | bytes) -> list[int]:
        text = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        return list(self._tokenizer.encode(text))


def _ll_tokenizer(tokenizer: Any, stop_ids: Sequence[int]) -> Any:
    """An ``llguidance.LLTokenizer`` of our tokenizers (a Hugging Face folder's ``tokenizer.json``, or one with
    ``token_bytes()`` such as :class:`~lightning_llmopt.data.tokenizers.ByteTokenizer`) or of a transformers fast
    tokenizer."""
    ll = _llguidance()
    path = getattr(tokenizer, "path", None)
    if path is not None and Path(path).name.endswith(".json") and Path(path).is_file():
        return ll.LLTokenizer(Path(path).read_text(), eos_token=list(stop_ids))
    if hasattr(tokenizer, "token_bytes"):
        return ll.LLTokenizer(ll.TokenizerWrapper(_ByteWrapper(tokenizer, stop_ids)))
    if hasattr(tokenizer, "backend_tokenizer"):  # transformers' PreTrainedTokenizerFast
        import llguidance.hf

        return llguidance.hf.from_tokenizer(tokenizer, eos_token=list(stop_ids))
    raise TypeError(
        f"structured output cannot read the tokens of {type(tokenizer).__name__}: pass a Hugging Face tokenizer "
        "folder, a transformers fast tokenizer, or a tokenizer with token_bytes()"
    )


class Matcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: Any, end_ids: frozenset[int]) -> None:
        self._m, self.end_ids = matcher, end_ids

    def advance(self, token: int) -> bool:
        """Feed a sampled token; ``True`` when the text is complete and nothing may follow. A token the grammar
        refuses raises ``RuntimeError`` (the mask makes that impossible unless the caller skipped it)."""
        if not self._m.consume_token(token):
            raise RuntimeError(f"token {token} does not continue the grammar: {self._m.get_error()[:300]}")
        return bool(self._m.is_stopped())

    @property
    def handle(self) -> Any:
        return self._m


class Grammars:
    """The engine's structured-output state: llguidance's view of the tokenizer, the compiled grammars and the
    mask buffers.

    Arguments:
        tokenizer: the engine's tokenizer (see :func:`_ll_tokenizer` for what it may be).
        stop_ids: the end-of-sequence tokens (the first is the grammar's end token).
    """

    def __init__(self, tokenizer: Any, stop_ids: Sequence[int]) -> None:
        if not stop_ids:
            raise ValueError("structured output needs an end-of-sequence token: the tokenizer has no stop_ids")
        self._ll = _llguidance()
        self.tokenizer = _ll_tokenizer(tokenizer, stop_ids)
        self.words = (self.tokenizer.vocab_size + 31) // 32  # bitmask int32 words per row
        self.end_ids = frozenset(self.tokenizer.eos_tokens)
        self._fresh: dict[str, Any] = {}  # key -> matcher at the grammar's start
        self._executor = self._ll.LLExecutor()
        self._bits: Tensor | None = None  # (N, words) host buffer (pinned on CUDA), grown on demand
        self._shifts: Tensor | None = None  # 0..31 on the logits' device
        self.mask_s, self.mask_calls = 0.0, 0  # host time computing masks, and the steps that did

    def check(self, so: StructuredOutput) -> None:
        """Compile ``so`` (cached); raises ``ValueError`` naming the problem when llguidance refuses it."""
        self._start(so)

    def _start(self, so: StructuredOutput) -> Any:
        key = so.key()
        fresh = self._fresh.pop(key, None)
        if fresh is None:
            try:
                text = grammar_text(so)
            except (ValueError, RuntimeError, TypeError) as exc:
                raise ValueError(f"structured_output {so.kind}: {exc}") from None
            fresh = self._ll.LLMatcher(self.tokenizer, text)
            if fresh.is_error():
                raise ValueError(f"structured_output {so.kind}: {fresh.get_error().strip()[:500]}")
            if len(self._fresh) >= _CACHE_SIZE:
                self._fresh.pop(next(iter(self._fresh)))
        self._fresh[key] = fresh  # most recently used last
        return fresh

    def matcher(self, so: StructuredOutput) -> Matcher:
        """A new sequence's matcher, at the start of ``so``'s grammar."""
        return Matcher(self._start(so).deep_copy(), self.end_ids)

    def mask(self, logits: Tensor, rows: Sequence[int], matchers: Sequence[Matcher]) -> Tensor:
        """``logits`` ``(N, V)`` with the tokens ``matchers[i]`` refuses at row ``rows[i]`` set to ``-inf`` (a new
        tensor; the other rows unchanged). One host buffer of ``(N, words)`` bits, all set for the unconstrained
        rows, goes up in one copy: no per-step index tensors, no gather and scatter of rows."""
        n, device = logits.shape[0], logits.device
        if self._bits is None or self._bits.shape[0] < n:
            self._bits = torch.empty(max(n, 8), self.words, dtype=torch.int32, pin_memory=device.type == "cuda")
            self._shifts = None
        bits = self._bits[:n]
        start = time.perf_counter()
        if len(rows) < n:
            bits.fill_(-1)  # every token allowed
        self._executor.unsafe_compute_mask_ptr(
            [(m.handle, r) for r, m in zip(rows, matchers, strict=True)], bits.data_ptr(), self.words * 4, n
        )
        self.mask_s += time.perf_counter() - start
        self.mask_calls += 1
        if self._shifts is None or self._shifts.device != device:
            self._shifts = torch.arange(32, dtype=torch.int32, device=device)
        words = bits.to(device, non_blocking=True)
        allowed = ((words.unsqueeze(-1) >> self._shifts) & 1).bool().flatten(1)  # (N, words * 32)
        width = logits.shape[1]
        if allowed.shape[1] < width:  # model vocabulary padded past the tokenizer's
            allowed = torch.nn.functional.pad(allowed, (0, width - allowed.shape[1]), value=False)
            if len(rows) < n:  # unconstrained rows keep the padding columns as they were
                allowed[[i for i in range(n) if i not in set(rows)], self.words * 32 :] = True
        return logits.masked_fill(~allowed[:, :width], float("-inf"))


def constrain(grammars: Grammars, logits: Tensor, seqs: Sequence[Any]) -> Tensor:
    """The step's ``logits`` ``(N, V)`` (row ``i`` is ``seqs[i]``'s) with each constrained sequence's refused tokens
    at ``-inf``; a sequence's matcher is made at its first step (``seq.grammar``)."""
    rows, matchers = [], []
    for i, seq in enumerate(seqs):
        so = seq.request.params.structured_output
        if so is None:
            continue
        if seq.grammar is None:
            seq.grammar = grammars.matcher(so)
        rows.append(i)
        matchers.append(seq.grammar)
    return grammars.mask(logits, rows, matchers) if rows else logits
