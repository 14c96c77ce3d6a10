"""Rendering a Hugging Face chat template (Jinja) without transformers.

transformers renders ``tokenizer_config.json``'s ``chat_template`` (or a ``chat_template.jinja`` file) in a
sandboxed Jinja environment with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, the globals
``raise_exception`` and ``strftime_now`` and a ``tojson`` filter that keeps non-ASCII characters; the template sees
``messages``, ``add_generation_prompt``, ``tools``, ``documents`` and the special tokens (``bos_token``,
``eos_token``, ...). This module reproduces that environment with jinja2, which torch already depends on.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

__all__ = ["find_chat_template", "render_chat_template"]


def find_chat_template(folder: Path, tokenizer_config: dict[str, Any], name: str = "default") -> str | None:
    """The chat template of a tokenizer folder: ``chat_template.jinja``, else ``tokenizer_config["chat_template"]``
    (a string, or a list of ``{"name", "template"}`` from which ``name`` is picked), else ``None``."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {str(t.get("name")): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get(name)
    return template if isinstance(template, str) else None


class _TemplateError(Exception):
    pass


def _raise(message: str) -> None:
    raise _TemplateError(message)


@lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    try:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as err:  # jinja2 comes with torch; kept for a clear message
        raise ImportError("rendering a chat template needs jinja2: pip install jinja2") from err

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
    )
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    special_tokens: dict[str, str | None],
    add_generation_prompt: bool = False,
    **kwargs: Any,
) -> str:
    """The text of ``messages`` (``[{"role": ..., "content": ...}, ...]``) rendered by ``template``.

    Arguments:
        special_tokens: ``{"bos_token": "<s>", "eos_token": "</s>", ...}`` as the template expects them.
        add_generation_prompt: end with the header of an assistant turn.
        kwargs: further template variables (``tools``, ``documents``, ...).

    Raises ``ValueError`` with the template's own message when it calls ``raise_exception``.
    """
    variables = {"tools": None, "documents": None, **special_tokens, **kwargs}
    try:
        return str(
            _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
        )
    except _TemplateError as exc:
        raise ValueError(f"chat template refused the messages: {exc}") from None
