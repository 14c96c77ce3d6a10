"""Incremental detokenisation and stop strings.

A token's text is not the decoding of that token alone: byte-level vocabularies split a multi-byte character over
several tokens (a lone piece decodes to U+FFFD), and SentencePiece vocabularies drop a word's leading space at the
start of a decode. :class:`TextState` therefore decodes a short window: ``decode(ids[prefix:])`` minus
``decode(ids[prefix:read])``, where ``read`` is where the text emitted so far ends and ``prefix`` a few tokens
before it (the window starts in the prompt's last tokens). A window whose text ends in U+FFFD waits for the next
token, so emitted text never splits a character (at the end of the sequence what is left is emitted anyway).

Stop strings are searched in the text as it grows, across token boundaries: the search starts ``len(stop) - 1``
characters before the new text. On a match the text is cut before it and the sequence stops. While streaming, the
end of the text that could still be the beginning of a stop string is held back until it is known not to be.

Special tokens (a Hugging Face tokenizer's added special tokens: ``<|im_start|>``, a BOS/EOS sampled under
``ignore_eos``) are left out of the text unless ``skip_special_tokens=False`` (vLLM's default and field), through
the tokenizer's own ``decode(ids, skip_special_tokens=...)``; a tokenizer whose ``decode`` takes no such argument
(:class:`~lightning_llmopt.data.tokenizers.ByteTokenizer` always drops its specials) decodes as it does.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

__all__ = ["TextState", "decode_text"]

_PROMPT_CONTEXT = 5  # prompt tokens the first window starts with (a leading space of the first output token)
_REPLACEMENT = "\ufffd"


def _takes_skip(tokenizer: Any) -> bool:
    """Whether ``tokenizer.decode`` accepts ``skip_special_tokens`` (by name or through ``**kwargs``)."""
    decode = getattr(tokenizer, "decode", None)
    if decode is None:
        return False
    try:
        params = inspect.signature(decode).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    return any(p.name == "skip_special_tokens" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def decode_text(tokenizer: Any, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """``tokenizer.decode(ids)``, with its special tokens left out when ``skip_special_tokens`` (and the tokenizer
    takes the argument); ids at or past its ``vocab_size`` (a vocabulary padded for the model) are dropped."""
    size = getattr(tokenizer, "vocab_size", None)
    known = [t for t in ids if size is None or t < size]
    if _takes_skip(tokenizer):
        return str(tokenizer.decode(known, skip_special_tokens=skip_special_tokens))
    return str(tokenizer.decode(known))


class TextState:
    """The detokenised output of one sequence (see the module docstring).

    Arguments:
        tokenizer: with ``decode(ids) -> str`` (and optionally ``vocab_size``: larger ids are skipped).
        prompt: the prompt's token ids (its last few start the decoding window).
        stop: stop strings.
        skip_special_tokens: leave the tokenizer's special tokens out of the text.
    """

    def __init__(
        self, tokenizer: Any, prompt: Sequence[int], stop: Sequence[str] = (), skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.size = getattr(tokenizer, "vocab_size", None)
        self.skip_special_tokens = skip_special_tokens
        self._skip_kw = {"skip_special_tokens": skip_special_tokens} if _takes_skip(tokenizer) else {}
        self.ids = list(prompt[-_PROMPT_CONTEXT:])
        self.prefix = 0
        self.read = len(self.ids)
        self.text = ""
        self.stop = tuple(stop)
        self.longest_stop = max((len(s) for s in self.stop), default=0)
        self.emitted = 0  # characters of ``text`` handed out by :meth:`take`
        self.stopped = False
        self.failed = False  # the tokenizer raised: text is unknown from here on

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode([t for t in ids if self.size is None or t < self.size], **self._skip_kw))

    def add(self, token: int) -> bool:
        """Append a sampled token; returns True when its text completes a stop string (the text is cut there)."""
        if self.failed or self.stopped:
            return self.stopped
        self.ids.append(token)
        try:
            before = self._decode(self.ids[self.prefix : self.read])
            after = self._decode(self.ids[self.prefix :])
        except Exception:  # noqa: BLE001 - text is a convenience; token ids are the result
            self.failed = True
            return False
        if len(after) <= len(before) or after.endswith(_REPLACEMENT):
            return False  # an incomplete character (or no text yet): wait for the next token
        return self._grow(after[len(before) :], len(self.ids))

    def flush(self) -> None:
        """At the end of the sequence: emit what an incomplete character held back."""
        if self.failed or self.stopped or self.read == len(self.ids):
            return
        try:
            before = self._decode(self.ids[self.prefix : self.read])
            after = self._decode(self.ids[self.prefix :])
        except Exception:  # noqa: BLE001
            self.failed = True
            return
        if len(after) > len(before):
            self._grow(after[len(before) :], len(self.ids))

    def _grow(self, new: str, read: int) -> bool:
        start = max(0, len(self.text) - self.longest_stop + 1)
        self.text += new
        self.prefix, self.read = self.read, read
        if not self.stop:
            return False
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
        return self.stopped

    def _held(self) -> int:
        """Characters at the end of the text that could begin a stop string."""
        for n in range(min(self.longest_stop - 1, len(self.text)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def take(self, final: bool) -> str | None:
        """The text not handed out yet (``None`` if the tokenizer failed); ``final`` also releases what could
        still have begun a stop string."""
        if self.failed:
            return None
        end = len(self.text) if final or self.stopped else len(self.text) - self._held()
        end = max(end, self.emitted)
        piece = self.text[self.emitted : end]
        self.emitted = end
        return piece
