"""Document deduplication: exact (content hash) and near-duplicate (MinHash + locality-sensitive hashing).

Near duplicates (Broder 1997; the MinHash/LSH recipe of large-corpus pipelines):

1. a document becomes the set of its shingles: ``shingle_size`` consecutive words (``unit="word"``) or characters
   (``unit="char"``), after lower-casing and collapsing whitespace;
2. each shingle is hashed to 32 bits (CRC-32), then ``num_perm`` universal hashes ``(a * x + b) mod (2^61 - 1)``
   (``a, b`` uniform over the field; the product is reduced without overflow)
   give the signature: the minimum of each over the document's shingles. Two signatures agree on a position with
   probability equal to the Jaccard similarity of the shingle sets;
3. the signature is cut into ``bands`` bands of ``rows`` values; documents that agree on a whole band share a
   bucket and become candidates. The band layout is chosen for ``threshold`` so that pairs above it collide with
   high probability and pairs well below rarely do (:func:`lsh_layout`);
4. a candidate is a duplicate when the Jaccard similarity of the two shingle sets (kept as sorted 32-bit shingle
   hashes) reaches ``threshold``: the signature only finds candidates, so its estimation noise does not decide.
   Streaming: the first document of a group is kept, later near copies are dropped.

Pure Python + torch (no NumPy, no extra dependency); deterministic across processes (no ``hash()``).
"""

from __future__ import annotations

import hashlib
import math
import re
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = [
    "DedupStats",
    "MinHashDeduplicator",
    "exact_key",
    "jaccard",
    "lsh_layout",
    "minhash_signature",
    "shingle_hashes",
    "shingles",
]

_MERSENNE = (1 << 61) - 1
_WS = re.compile(r"\s+")


def exact_key(text: str) -> str:
    """SHA-256 of the text (exact duplicates are byte-identical documents)."""
    return hashlib.sha256(text.encode("utf-8", errors="replace")).hexdigest()


def shingles(text: str, size: int = 5, unit: str = "word") -> set[str]:
    """Shingle set of ``text``: ``size`` consecutive words or characters of the normalised text."""
    if unit not in ("word", "char"):
        raise ValueError(f"unit ({unit!r}) must be 'word' or 'char'")
    norm = _WS.sub(" ", text.lower()).strip()
    if unit == "char":
        return {norm[i : i + size] for i in range(max(len(norm) - size + 1, 1))} if norm else set()
    words = norm.split(" ") if norm else []
    return {" ".join(words[i : i + size]) for i in range(max(len(words) - size + 1, 1))} if words else set()


def _permutations(num_perm: int, seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(1, _MERSENNE, (num_perm,), generator=g, dtype=torch.int64)
    b = torch.randint(0, _MERSENNE, (num_perm,), generator=g, dtype=torch.int64)
    return a, b


def _mulmod(a: Tensor, x: Tensor) -> Tensor:
    """``(a * x) mod (2^61 - 1)`` for ``a < 2^61``, ``x < 2^32`` without int64 overflow.

    ``a = a_hi * 2^31 + a_lo``; ``(a_hi * x mod p) * 2^31`` is reduced with ``2^61 = 1 (mod p)``. Every
    intermediate stays below ``2^63``.
    """
    a_hi, a_lo = a >> 31, a & ((1 << 31) - 1)
    t = (a_hi * x) % _MERSENNE  # < 2^61
    shifted = (((t & ((1 << 30) - 1)) << 31) + (t >> 30)) % _MERSENNE  # t * 2^31 mod p
    return (shifted + (a_lo * x) % _MERSENNE) % _MERSENNE


def shingle_hashes(items: set[str]) -> Tensor:
    """Sorted unique CRC-32 hashes of a shingle set, int64 ``(n,)``."""
    x = torch.tensor([zlib.crc32(s.encode("utf-8", errors="replace")) for s in items], dtype=torch.int64)
    return torch.unique(x)


def minhash_signature(hashes: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``(num_perm,)`` int64 MinHash signature of shingle hashes (all ``2^61 - 1`` for an empty set).

    The permutations are ``(a * x + b) mod (2^61 - 1)`` with ``a, b`` drawn over the whole field, computed by
    :func:`_mulmod` (a product ``a * x`` that never wraps would be monotone in ``x``: every "permutation" would
    pick the smallest hash).
    """
    if hashes.numel() == 0:
        return torch.full_like(a, _MERSENNE)
    return ((_mulmod(a[None, :], hashes[:, None]) + b[None, :]) % _MERSENNE).min(dim=0).values


def jaccard(x: Tensor, y: Tensor) -> float:
    """Jaccard similarity of two sorted unique hash tensors."""
    if x.numel() == 0 and y.numel() == 0:
        return 1.0
    inter = int(torch.isin(x, y).sum())
    return inter / (x.numel() + y.numel() - inter)


def lsh_layout(threshold: float, num_perm: int, fn_weight: float = 0.9) -> tuple[int, int]:
    """``(bands, rows)`` with ``bands * rows <= num_perm`` minimising ``(1 - fn_weight)`` x the false-positive plus
    ``fn_weight`` x the false-negative probability mass around ``threshold``, for pairs of Jaccard similarity ``s``
    colliding with probability ``1 - (1 - s^rows)^bands``. Candidates are verified afterwards, so missed pairs
    (false negatives) cost more than extra candidates: the default weighs them 9:1."""
    if not 0.0 < threshold < 1.0:
        raise ValueError(f"threshold ({threshold}) must be in (0, 1)")

    def collide(s: float, b: int, r: int) -> float:
        return 1.0 - (1.0 - s**r) ** b

    grid = [i / 200 for i in range(1, 200)]
    best, best_err = (1, num_perm), math.inf
    for r in range(1, num_perm + 1):
        b = num_perm // r
        fp = sum(collide(s, b, r) for s in grid if s < threshold) / len(grid)
        fn = sum(1.0 - collide(s, b, r) for s in grid if s >= threshold) / len(grid)
        err = (1.0 - fn_weight) * fp + fn_weight * fn
        if err < best_err:
            best, best_err = (b, r), err
    return best


@dataclass
class DedupStats:
    """What deduplication removed."""

    seen: int = 0
    exact_duplicates: int = 0
    near_duplicates: int = 0
    removed_examples: list[tuple[int, int]] = field(default_factory=list)  # (dropped index, kept index), first 20

    @property
    def kept(self) -> int:
        return self.seen - self.exact_duplicates - self.near_duplicates


class MinHashDeduplicator:
    """Streaming exact + near-duplicate filter: :meth:`is_duplicate` says whether a document repeats an earlier one.

    Arguments:
        threshold: estimated Jaccard similarity at or above which a document is a near duplicate.
        num_perm: signature length.
        shingle_size, unit: see :func:`shingles`.
        exact: also drop byte-identical documents (cheaper, checked first).
        near: run the MinHash stage.
        seed: seeds the hash permutations.
    """

    def __init__(self, threshold: float = 0.8, num_perm: int = 128, shingle_size: int = 5, unit: str = "word",
                 exact: bool = True, near: bool = True, seed: int = 0) -> None:
        if num_perm < 2:
            raise ValueError(f"num_perm ({num_perm}) must be >= 2")
        if shingle_size < 1:
            raise ValueError(f"shingle_size ({shingle_size}) must be >= 1")
        shingles("", shingle_size, unit)  # validates unit
        self.threshold, self.num_perm, self.shingle_size, self.unit = threshold, num_perm, shingle_size, unit
        self.exact, self.near = exact, near
        self.bands, self.rows = lsh_layout(threshold, num_perm)
        self._a, self._b = _permutations(num_perm, seed)
        self._hashes: dict[str, int] = {}
        self._buckets: list[dict[bytes, list[int]]] = [{} for _ in range(self.bands)]
        self._shingles: list[Tensor] = []  # sorted shingle hashes of each kept document
        self._index_of: list[int] = []  # kept document index per stored signature
        self.stats = DedupStats()

    def signature(self, text: str) -> Tensor:
        return minhash_signature(shingle_hashes(shingles(text, self.shingle_size, self.unit)), self._a, self._b)

    def is_duplicate(self, text: str) -> bool:
        """Check ``text`` against every kept document and remember it if it is new."""
        index = self.stats.seen
        self.stats.seen += 1
        if self.exact:
            key = exact_key(text)
            if key in self._hashes:
                self.stats.exact_duplicates += 1
                self._example(index, self._hashes[key])
                return True
            self._hashes[key] = index
        if not self.near:
            return False
        hashes = shingle_hashes(shingles(text, self.shingle_size, self.unit))
        sig = minhash_signature(hashes, self._a, self._b)
        keys = [sig[i * self.rows : (i + 1) * self.rows].numpy().tobytes() for i in range(self.bands)]
        candidates = {c for i, k in enumerate(keys) for c in self._buckets[i].get(k, ())}
        for c in sorted(candidates):
            if jaccard(self._shingles[c], hashes) >= self.threshold:
                self.stats.near_duplicates += 1
                self._example(index, self._index_of[c])
                return True
        slot = len(self._shingles)
        self._shingles.append(hashes)
        self._index_of.append(index)
        for i, k in enumerate(keys):
            self._buckets[i].setdefault(k, []).append(slot)
        return False

    def _example(self, dropped: int, kept: int) -> None:
        if len(self.stats.removed_examples) < 20:
            self.stats.removed_examples.append((dropped, kept))

    def filter(self, documents: Iterable[str]) -> Iterator[str]:
        """The documents that are not duplicates of earlier ones, in order."""
        for text in documents:
            if not self.is_duplicate(text):
                yield text
