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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["TextState"]

_PROMPT_CONTEXT = 5  # prompt tokens the first window starts with (a leading space of the first output token)
_REPLACEMENT = "\ufffd"


class TextState:
    """The detokenised output of one sequence (see the module docstring).

    Arguments:
        tokenizer: with ``decode(ids) -> str`` (and optionally ``vocab_size``: larger ids are skipped).
        prompt: the prompt's token ids (its last few start the decoding window).
        stop: stop strings.
    """

    def __init__(self, tokenizer: Any, prompt: Sequence[int], stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.size = getattr(tokenizer, "vocab_size", None)
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
        return str(self.tokenizer.decode([t for t in ids if self.size is None or t < self.size]))

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
