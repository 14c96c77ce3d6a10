"""Chat templates: where a model's template is found, and rendering messages through it (Jinja2, sandboxed).

The template is, first found: ``--chat-template`` (a file or the template itself), the tokenizer's
``chat_template`` attribute, ``chat_template.jinja`` or ``tokenizer_config.json``'s ``"chat_template"`` in the model
folder. It is rendered as Hugging Face renders it: with ``messages`` (an assistant's ``tool_calls`` hold their
arguments as a dict), ``tools``, ``add_generation_prompt=True``, ``bos_token``/``eos_token`` and ``raise_exception``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["ChatTemplate", "find_chat_template", "special_strings"]


def find_chat_template(tokenizer: Any, model_path: str | Path | None, override: str | None = None) -> str | None:
    """The template text (see the module docstring), or ``None`` when the model has none."""
    if override:
        path = Path(override)
        return path.read_text() if path.is_file() else override
    found = getattr(tokenizer, "chat_template", None)
    if isinstance(found, str) and found:
        return found
    if model_path is None:
        return None
    folder = Path(model_path)
    folder = folder if folder.is_dir() else folder.parent
    for candidate in (folder, folder.parent):
        jinja = candidate / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text()
        config = candidate / "tokenizer_config.json"
        if config.is_file():
            try:
                value = json.loads(config.read_text()).get("chat_template")
            except (OSError, ValueError):
                value = None
            if isinstance(value, list):  # named templates: the default one
                value = next((t.get("template") for t in value if t.get("name") == "default"), None)
            if isinstance(value, str) and value:
                return value
    return None


def special_strings(tokenizer: Any) -> tuple[str, str]:
    """The BOS and EOS text of ``tokenizer`` (``""`` where it has none)."""
    out = []
    for name in ("bos_id", "eos_id"):
        tid = getattr(tokenizer, name, None)
        try:
            out.append(str(tokenizer.decode([tid])) if tid is not None else "")
        except Exception:  # noqa: BLE001
            out.append("")
    return out[0], out[1]


class ChatTemplate:
    """A compiled chat template.

    Arguments:
        source: the Jinja2 template text.
        bos_token, eos_token: the strings the template may insert.
    """

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ValueError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
        self.template = env.from_string(source)
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text of ``messages`` followed by the assistant's turn (raises ``ValueError`` when the template
        refuses them, e.g. roles out of order). ``tools`` (OpenAI's ``{"type": "function", "function": {...}}``
        objects, as Hugging Face templates take them) is the template's ``tools`` variable."""
        return str(
            self.template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        )
