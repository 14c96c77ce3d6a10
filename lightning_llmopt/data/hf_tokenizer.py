"""``HFTokenizer``: a Hugging Face tokenizer folder read as transformers reads it, through the ``tokenizers`` library.

What comes from where (transformers 5 behaves the same way; 4.x agrees on every folder transformers itself writes):

- the ids: ``tokenizer.json`` (normalizer, pre-tokenizer, model); special tokens are added by its post-processor
  when ``add_special_tokens=True``, so a Llama-3 or Llama-2 folder gets its BOS and a Qwen2 folder none;
- ``bos_id``/``eos_id``/``pad_id``: the ``bos_token``/``eos_token``/``pad_token`` of ``tokenizer_config.json``, else
  of ``special_tokens_map.json`` (a string or ``{"content": ...}``; ``null`` means none); a bare ``tokenizer.json``
  falls back to common names (``<s>``/``</s>``, ``<|begin_of_text|>``/``<|end_of_text|>``, ``<|endoftext|>``);
- ``stop_ids``: ``eos_id`` plus ``generation_config.json``'s ``eos_token_id`` (an int or a list): Llama-3 instruct
  stops at ``<|eot_id|>`` and ``<|end_of_text|>``, Qwen2 instruct at ``<|im_end|>`` and ``<|endoftext|>``;
- the chat template: ``chat_template.jinja`` or ``tokenizer_config.json``'s ``chat_template``, rendered by
  ``transformers.AutoTokenizer`` when transformers is installed, else by
  :func:`~lightning_llmopt.data.chat_template.render_chat_template`.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_llmopt.data.chat_template import find_chat_template, render_chat_template

__all__ = ["TOKENIZER_FILES", "HFTokenizer"]

# Names under which tokenizers commonly store their special tokens, most common first (bare tokenizer.json only).
_BOS_NAMES = ("<s>", "<|begin_of_text|>", "<|startoftext|>", "<bos>")
_EOS_NAMES = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>")

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
"""The files of a Hugging Face tokenizer folder (copied as they are by :meth:`HFTokenizer.save_pretrained`)."""


def _byte_table() -> dict[str, int]:
    """GPT-2's byte-level table inverted: the printable character standing for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = {chr(b): b for b in printable}, 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open() as f:
        value = json.load(f)
    return value if isinstance(value, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token as written in the config files: a string, ``{"content": ...}`` or ``None``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


class HFTokenizer:
    """A local Hugging Face tokenizer (``tokenizer.json`` plus the files beside it; see the module docstring).

    ``encode`` adds no special tokens unless asked (``add_special_tokens=True`` does what the folder's
    post-processor says, as ``AutoTokenizer.encode`` does).

    Arguments:
        path: a ``tokenizer.json`` file or the folder holding it.
    """

    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer as _RustTokenizer
        except ImportError as err:
            raise ImportError(
                "HFTokenizer needs the `tokenizers` package: `pip install lightning_llmopt[hf]`"
                " (or use the dependency-free tokenizer='byte')"
            ) from err
        path = Path(path)
        self.path = path / "tokenizer.json" if path.is_dir() else path
        if not self.path.is_file():
            raise FileNotFoundError(f"tokenizer file {str(self.path)!r} does not exist")
        self.folder = self.path.parent
        self._tokenizer: Any = _RustTokenizer.from_file(str(self.path))
        self.config = _read_json(self.folder / "tokenizer_config.json")
        special_map = _read_json(self.folder / "special_tokens_map.json")
        generation = _read_json(self.folder / "generation_config.json")
        self.special_tokens: dict[str, str | None] = {}
        for kind in ("bos_token", "eos_token", "pad_token", "unk_token"):
            source = self.config if kind in self.config else special_map
            self.special_tokens[kind] = _token_text(source.get(kind))
        has_configs = bool(self.config or special_map)
        self._bos_id = self._id_of("bos_token") if has_configs else self._first_known(_BOS_NAMES)
        self._eos_id = self._id_of("eos_token") if has_configs else self._first_known(_EOS_NAMES)
        self.pad_id = self._id_of("pad_token")
        extra = [i for i in _as_ids(generation.get("eos_token_id")) if i != self._eos_id]
        self.stop_ids: tuple[int, ...] = tuple(([self._eos_id] if self._eos_id is not None else []) + extra)
        self.chat_template = find_chat_template(self.folder, self.config)
        self._auto: Any = None

    def _id_of(self, kind: str) -> int | None:
        text = self.special_tokens.get(kind)
        token_id = self._tokenizer.token_to_id(text) if text is not None else None
        return int(token_id) if token_id is not None else None

    def _first_known(self, names: Sequence[str]) -> int | None:
        for name in names:
            token_id = self._tokenizer.token_to_id(name)
            if token_id is not None:
                return int(token_id)
        return None

    @property
    def vocab_size(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_id(self) -> int | None:
        return self._eos_id

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` applies the post-processor (BOS/EOS as transformers)."""
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        """:meth:`encode` for many texts at once (parallelised inside the Rust library)."""
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [list(e.ids) for e in encodings]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Decodes ids to text (special tokens kept unless ``skip_special_tokens``)."""
        return str(self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens))

    def token_bytes(self) -> list[bytes]:
        """Each id's bytes, as the model writes them: byte-level BPE tokens through GPT-2's byte table, SentencePiece
        tokens with ``\u2581`` as a space and ``<0xNN>`` as that byte, added tokens as their UTF-8 (computed once)."""
        if getattr(self, "_token_bytes", None) is None:
            decoder = json.loads(self._tokenizer.to_str()).get("decoder") or {}
            kinds = {d.get("type") for d in [decoder, *decoder.get("decoders", [])]}
            table = _byte_table() if "ByteLevel" in kinds else None
            added = {t.content for t in self._tokenizer.get_added_tokens_decoder().values()}
            out = []
            for i in range(self.vocab_size):
                piece = self._tokenizer.id_to_token(i) or ""
                if piece in added:
                    out.append(piece.encode())
                elif table is not None:
                    out.append(bytes(table[c] for c in piece) if all(c in table for c in piece) else piece.encode())
                elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                    out.append(bytes([int(piece[3:5], 16)]))
                else:
                    out.append(piece.replace("\u2581", " ").encode())
            self._token_bytes: list[bytes] | None = out
        return list(self._token_bytes or [])

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = False,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """``messages`` rendered with the folder's chat template: the text, or its ids when ``tokenize`` (encoded
        without added special tokens, as transformers does: the template writes them itself)."""
        if self.chat_template is None:
            raise ValueError(f"tokenizer folder {str(self.folder)!r} has no chat template")
        auto = self._auto_tokenizer()
        if auto is not None:
            text = auto.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
            )
        else:
            text = render_chat_template(
                self.chat_template, messages, self.special_tokens, add_generation_prompt, **kwargs
            )
        return self.encode(str(text)) if tokenize else str(text)

    def _auto_tokenizer(self) -> Any:
        """``transformers.AutoTokenizer`` over the same folder (loaded once), or ``None`` without transformers or when
        transformers cannot read the folder (the jinja2 path renders the template then)."""
        if self._auto is None:
            from lightning_utilities.core.imports import RequirementCache

            if not RequirementCache("transformers") or self.path.name != "tokenizer.json":
                return None
            from transformers import AutoTokenizer

            try:
                self._auto = AutoTokenizer.from_pretrained(str(self.folder))
            except (OSError, ValueError, KeyError, ImportError):  # e.g. a tokenizer_class this version lacks
                self._auto = False
        return self._auto or None

    def save_pretrained(self, folder: str | Path) -> list[Path]:
        """Copy this tokenizer's files (:data:`TOKENIZER_FILES` that exist) into ``folder``; returns them."""
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        written = []
        for name in TOKENIZER_FILES:
            src = self.folder / name if name != "tokenizer.json" else self.path
            if src.is_file() and src.resolve() != (out / name).resolve():
                shutil.copyfile(src, out / name)
                written.append(out / name)
        return written

    def __repr__(self) -> str:
        return f"HFTokenizer(path={str(self.path)!r}, vocab_size={self.vocab_size})"
