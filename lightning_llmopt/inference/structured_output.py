"""``StructuredOutput``: a constraint on the text a request may generate (a JSON schema, any JSON object, a regular
expression, a list of choices or a Lark grammar), validated in ``__post_init__``.

The engine enforces it token by token with a grammar library (:mod:`~lightning_llmopt.inference.grammar`, on
llguidance): before each draw the tokens that cannot continue a valid text get ``-inf``, and once the text is
complete only the end of sequence may follow. The server builds it from ``response_format`` and from ``tools`` with
``tool_choice`` ``"required"`` or a named function (docs/structured_output.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["StructuredOutput"]

_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """What the generated text must be; exactly one field is set.

    Arguments:
        json_schema: a JSON Schema (a dict, or its JSON text): the text is one JSON value valid against it.
        json_object: any JSON object (OpenAI's ``response_format={"type": "json_object"}``).
        regex: the text matches this regular expression (whole match).
        choice: the text is exactly one of these strings.
        grammar: a context-free grammar in Lark syntax (llguidance's dialect; its ``start`` rule is the text).
        whitespace_flexible: JSON may hold whitespace between tokens (any amount, as JSON allows); ``False``
            (default) allows the compact form of each value only, plus one space after ``:`` and ``,`` as Python's
            ``json.dumps`` writes them, which keeps a weak model from padding with whitespace.
    """

    json_schema: Any = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    whitespace_flexible: bool = False

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"StructuredOutput takes exactly one of {', '.join(_KINDS)}; got {given or 'none'}")
        schema = self.json_schema
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise ValueError(f"json_schema is not valid JSON ({exc}): {self.json_schema[:200]!r}") from None
        if schema is not None and not isinstance(schema, (dict, bool)):
            raise ValueError(f"json_schema must be a JSON object (a dict), got {type(schema).__name__} {schema!r}")
        object.__setattr__(self, "json_schema", schema)
        if not isinstance(self.json_object, bool):
            raise ValueError(f"json_object ({self.json_object!r}) must be a bool")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} ({value!r}) must be a non-empty string")
        if self.choice is not None:
            choice = (self.choice,) if isinstance(self.choice, str) else tuple(self.choice)
            if not choice or any(not isinstance(c, str) or not c for c in choice):
                raise ValueError(f"choice ({list(choice)!r}) must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", choice)
        if not isinstance(self.whitespace_flexible, bool):
            raise ValueError(f"whitespace_flexible ({self.whitespace_flexible!r}) must be a bool")

    @property
    def kind(self) -> str:
        """Which field is set: ``json_schema``, ``json_object``, ``regex``, ``choice`` or ``grammar``."""
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def key(self) -> str:
        """A string equal for equal constraints (the grammar cache's key)."""
        value = getattr(self, self.kind)
        return json.dumps([self.kind, value, self.whitespace_flexible], sort_keys=True, default=list)
