"""Tokenizers: a dependency-free byte tokenizer and a local Hugging Face tokenizer folder
(:class:`~lightning_llmopt.data.hf_tokenizer.HFTokenizer`).

Both expose the same small interface (:class:`Tokenizer`): ``encode``, ``decode``, ``vocab_size``, ``bos_id``,
``eos_id``, ``stop_ids`` and ``save_pretrained`` (which writes files transformers' ``AutoTokenizer`` loads).
:func:`load_tokenizer` picks one from a string spec.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from lightning_llmopt.data.hf_tokenizer import HFTokenizer

__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer", "load_tokenizer"]


@runtime_checkable
class Tokenizer(Protocol):
    """The interface shared by :class:`ByteTokenizer` and :class:`HFTokenizer`."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_id(self) -> int | None: ...

    @property
    def eos_id(self) -> int | None: ...

    @property
    def stop_ids(self) -> tuple[int, ...]: ...

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def save_pretrained(self, folder: str | Path) -> list[Path]: ...


class ByteTokenizer:
    """UTF-8 byte-level tokenizer: ids 0..255 are the bytes, 256 is ``<bos>`` and 257 is ``<eos>``.

    It needs no vocabulary file and round-trips every string exactly.

    Example::

        tok = ByteTokenizer()
        tok.encode("hé")  # [104, 195, 169]
        tok.decode([104, 195, 169, 257])  # "hé" (special tokens are dropped)
    """

    BOS_ID = 256
    EOS_ID = 257

    @property
    def vocab_size(self) -> int:
        return 258

    @property
    def bos_id(self) -> int:
        return self.BOS_ID

    @property
    def eos_id(self) -> int:
        return self.EOS_ID

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (self.EOS_ID,)

    pad_id = None
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Returns the UTF-8 bytes of ``text`` as a list of ints in ``[0, 255]``. The byte tokenizer adds no special
        tokens even when asked (``add_special_tokens`` is accepted for the common interface): the documents it
        trains on carry none but the ``<eos>`` between them."""
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        """Like :meth:`encode`, as a ``uint8`` array of shape ``(num_bytes,)`` without a Python loop."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def token_bytes(self) -> list[bytes]:
        """Each id's bytes (the byte itself; the special tokens' names), as grammar libraries read a vocabulary."""
        return [bytes([i]) for i in range(256)] + [b"<bos>", b"<eos>"]

    def decode(self, ids: Sequence[int]) -> str:
        """Decodes byte ids to text; special ids (>= 256) are dropped, invalid UTF-8 becomes U+FFFD."""
        for i in ids:
            if not 0 <= int(i) < self.vocab_size:
                raise ValueError(f"token id {int(i)} is outside the byte tokenizer's vocabulary [0, {self.vocab_size})")
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")

    def save_pretrained(self, folder: str | Path) -> list[Path]:
        """Write this tokenizer as ``tokenizer.json`` + ``tokenizer_config.json`` that ``AutoTokenizer`` (and
        :class:`HFTokenizer`) load with the same ids: a byte-level BPE without merges whose token for byte ``b``
        has id ``b`` (GPT-2's byte-to-character table), ``<bos>`` = 256, ``<eos>`` = 257. Returns the files."""
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        chars = _byte_chars()
        specials = [
            {
                "id": i,
                "content": t,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i, t in ((self.BOS_ID, "<bos>"), (self.EOS_ID, "<eos>"))
        ]
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
        spec: dict[str, Any] = {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": specials,
            "normalizer": None,
            "pre_tokenizer": byte_level,
            "post_processor": None,
            "decoder": byte_level,
            "model": {
                "type": "BPE",
                "dropout": None,
                "unk_token": None,
                "continuing_subword_prefix": None,
                "end_of_word_suffix": None,
                "fuse_unk": False,
                "byte_fallback": False,
                "ignore_merges": False,
                "vocab": {chars[b]: b for b in range(256)},
                "merges": [],
            },
        }
        config = {
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "model_max_length": 1 << 30,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": False,
        }
        files = [out / "tokenizer.json", out / "tokenizer_config.json"]
        files[0].write_text(json.dumps(spec, ensure_ascii=False, indent=2) + "\n")
        files[1].write_text(json.dumps(config, indent=2) + "\n")
        return files

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=258)"


def _byte_chars() -> list[str]:
    """GPT-2's printable character for each byte (the alphabet of byte-level BPE): printable Latin-1 bytes map to
    themselves, the other 68 to ``chr(256 + k)`` in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def load_tokenizer(spec: str | Path | None) -> ByteTokenizer | HFTokenizer:
    """Builds a tokenizer from a spec.

    Arguments:
        spec: ``None`` or ``"byte"`` for :class:`ByteTokenizer`; a ``tokenizer.json`` file, or a directory holding one
            (a Hugging Face model folder, whose ``tokenizer_config.json``, ``special_tokens_map.json`` and
            ``generation_config.json`` are read too), for :class:`HFTokenizer`.

    Raises:
        FileNotFoundError: the spec is neither ``"byte"`` nor an existing tokenizer file or folder.
    """
    if spec is None or spec == "byte":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if path.is_dir():
        candidate = path / "tokenizer.json"
        if not candidate.is_file():
            raise FileNotFoundError(f"tokenizer directory {str(path)!r} has no tokenizer.json")
        return HFTokenizer(candidate)
    if path.is_file():
        return HFTokenizer(path)
    raise FileNotFoundError(
        f"tokenizer {str(spec)!r} is neither 'byte' nor an existing tokenizer.json file or directory holding one"
    )
