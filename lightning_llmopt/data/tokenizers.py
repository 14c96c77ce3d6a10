"""Tokenizers: a dependency-free byte tokenizer and a wrapper around a local Hugging Face ``tokenizer.json``.

Both expose the same small interface (:class:`Tokenizer`): ``encode``, ``decode``, ``vocab_size``, ``bos_id`` and
``eos_id``. :func:`load_tokenizer` picks one from a string spec.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

# Names under which tokenizers commonly store their special tokens, most common first.
_BOS_NAMES = ("<s>", "<|begin_of_text|>", "<|startoftext|>", "<bos>")
_EOS_NAMES = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>")


@runtime_checkable
class Tokenizer(Protocol):
    """The interface shared by :class:`ByteTokenizer` and :class:`HFTokenizer`."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_id(self) -> int | None: ...

    @property
    def eos_id(self) -> int | None: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


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

    def encode(self, text: str) -> list[int]:
        """Returns the UTF-8 bytes of ``text`` as a list of ints in ``[0, 255]``."""
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        """Like :meth:`encode`, as a ``uint8`` array of shape ``(num_bytes,)`` without a Python loop."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids: Sequence[int]) -> str:
        """Decodes byte ids to text; special ids (>= 256) are dropped, invalid UTF-8 becomes U+FFFD."""
        for i in ids:
            if not 0 <= int(i) < self.vocab_size:
                raise ValueError(f"token id {int(i)} is outside the byte tokenizer's vocabulary [0, {self.vocab_size})")
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=258)"


class HFTokenizer:
    """Wraps a local ``tokenizer.json`` through the ``tokenizers`` library (installed by ``lightning_llmopt[hf]``).

    ``encode`` adds no special tokens; ``bos_id``/``eos_id`` are looked up among common names (``<s>``/``</s>``,
    ``<|begin_of_text|>``/``<|end_of_text|>``, ``<|endoftext|>``) and are ``None`` when the vocabulary has none.

    Arguments:
        path: a ``tokenizer.json`` file.
    """

    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer as _RustTokenizer
        except ImportError as err:
            raise ImportError(
                "HFTokenizer needs the `tokenizers` package: `pip install lightning_llmopt[hf]`"
                " (or use the dependency-free tokenizer='byte')"
            ) from err
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"tokenizer file {str(self.path)!r} does not exist")
        self._tokenizer: Any = _RustTokenizer.from_file(str(self.path))
        self._bos_id = self._first_known(_BOS_NAMES)
        self._eos_id = self._first_known(_EOS_NAMES)

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

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without special tokens added."""
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode` for many texts at once (parallelised inside the Rust library)."""
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [list(e.ids) for e in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        """Decodes ids to text, keeping special tokens."""
        return str(self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False))

    def __repr__(self) -> str:
        return f"HFTokenizer(path={str(self.path)!r}, vocab_size={self.vocab_size})"


def load_tokenizer(spec: str | Path | None) -> ByteTokenizer | HFTokenizer:
    """Builds a tokenizer from a spec.

    Arguments:
        spec: ``None`` or ``"byte"`` for :class:`ByteTokenizer`; a ``tokenizer.json`` file, or a directory holding one
            (a Hugging Face model folder), for :class:`HFTokenizer`.

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
