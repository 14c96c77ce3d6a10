"""Sequence packing: bin-packing of documents into fixed-length rows, and the tensors of a packed batch.

Framework-free (torch only). Rows have a capacity of ``C`` tokens (the model's sequence length ``T``). A document of
length ``L`` fills ``L`` input slots; inside a row, each document keeps its own positions (restarting at 0) and its own
document id, so attention never crosses documents and labels never point into the next document.

Documents longer than ``C`` are split into ``L // C`` full pieces of ``C`` tokens, each alone in its row, and one
remainder piece of ``L % C`` tokens (when non-zero) that is packed like any other document. A document index therefore
appears once per piece in the packings below; its pieces are taken in order as the rows are read in order (the full
pieces come first). Each piece is its own attention segment (positions restart), but the last token of a non-final
piece keeps its true next token as label, as in the concatenated-chunks layout.

Algorithms (Johnson, "Near-optimal bin packing algorithms", MIT 1973; Dósa 2007 for the tight FFD bound):

- :func:`first_fit_decreasing`: sort pieces by length, longest first (ties by index); put each into the first row
  (lowest index) with room, opening a new row when none has. Uses at most ``11/9 OPT + 6/9`` rows.
- :func:`best_fit`: pieces in input order; put each into the row with the least room left that still fits it (ties:
  lowest row index). Online, at most ``1.7 OPT`` rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

IGNORE_INDEX = -100
ALGORITHMS = ("ffd", "best_fit")

Rows = list[list[int]]


def _check(lengths: Sequence[int], capacity: int) -> None:
    if not isinstance(capacity, int) or capacity <= 0:
        raise ValueError(f"capacity ({capacity!r}) must be a positive integer")
    for i, length in enumerate(lengths):
        if int(length) < 1:
            raise ValueError(f"document {i} has length {length!r}: every document needs at least one token")


def _split(lengths: Sequence[int], capacity: int) -> tuple[Rows, list[tuple[int, int]]]:
    """Rows of full ``capacity``-long pieces, and the ``(index, length)`` items left to pack."""
    full: Rows = []
    items: list[tuple[int, int]] = []
    for i, length in enumerate(lengths):
        n_full, rest = divmod(int(length), capacity)
        full.extend([i] for _ in range(n_full))
        if rest:
            items.append((i, rest))
    return full, items


class _MaxTree:
    """Segment tree over row free space: the leftmost row with at least ``need`` free tokens in ``O(log n)``."""

    def __init__(self, size: int) -> None:
        self.size = 1
        while self.size < max(size, 1):
            self.size *= 2
        self.tree = [0] * (2 * self.size)

    def set(self, i: int, value: int) -> None:
        i += self.size
        self.tree[i] = value
        while i > 1:
            i //= 2
            self.tree[i] = max(self.tree[2 * i], self.tree[2 * i + 1])

    def leftmost(self, need: int) -> int | None:
        if self.tree[1] < need:
            return None
        i = 1
        while i < self.size:
            i = 2 * i if self.tree[2 * i] >= need else 2 * i + 1
        return i - self.size


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> Rows:
    """Packs documents into rows of ``capacity`` tokens with First-Fit Decreasing.

    Arguments:
        lengths: token count of each document (``>= 1``).
        capacity: tokens per row ``C``.

    Returns:
        Document indices per row (a document longer than ``C`` appears once per piece; see the module docstring).
    """
    _check(lengths, capacity)
    full, items = _split(lengths, capacity)
    items.sort(key=lambda item: (-item[1], item[0]))
    tree = _MaxTree(len(items))
    rows: Rows = []
    free: list[int] = []
    for index, length in items:
        row = tree.leftmost(length)
        if row is None:
            row = len(rows)
            rows.append([])
            free.append(capacity)
        rows[row].append(index)
        free[row] -= length
        tree.set(row, free[row])
    return full + rows


def best_fit(lengths: Sequence[int], capacity: int) -> Rows:
    """Packs documents into rows of ``capacity`` tokens with (online) Best-Fit, in input order.

    Arguments and result as for :func:`first_fit_decreasing`.
    """
    import bisect

    _check(lengths, capacity)
    full, items = _split(lengths, capacity)
    rows: Rows = []
    by_free: list[tuple[int, int]] = []  # sorted (free tokens, row index)
    for index, length in items:
        k = bisect.bisect_left(by_free, (length, -1))
        if k < len(by_free):
            free, row = by_free.pop(k)
        else:
            free, row = capacity, len(rows)
            rows.append([])
        rows[row].append(index)
        if free - length > 0:
            bisect.insort(by_free, (free - length, row))
    return full + rows


def pack(lengths: Sequence[int], capacity: int, algorithm: str = "ffd") -> Rows:
    """Runs the named algorithm (``"ffd"`` or ``"best_fit"``)."""
    if algorithm == "ffd":
        return first_fit_decreasing(lengths, capacity)
    if algorithm == "best_fit":
        return best_fit(lengths, capacity)
    raise ValueError(f"packing algorithm ({algorithm!r}) must be one of {ALGORITHMS}")


@dataclass(frozen=True)
class Piece:
    """A contiguous span of one document inside a row: tokens ``[start, start + length)`` of document ``doc``;
    ``last`` is True when the span ends the document."""

    doc: int
    start: int
    length: int
    last: bool


def row_pieces(rows: Sequence[Sequence[int]], lengths: Sequence[int], capacity: int) -> list[list[Piece]]:
    """Resolves each document occurrence of ``rows`` to the span it stands for (pieces taken in row order).

    Raises ``ValueError`` when a row overflows ``capacity`` or the rows do not cover every document exactly.
    """
    cursor = [0] * len(lengths)
    out: list[list[Piece]] = []
    for r, row in enumerate(rows):
        pieces = []
        for doc in row:
            start = cursor[doc]
            length = min(capacity, int(lengths[doc]) - start)
            if length <= 0:
                raise ValueError(f"row {r} holds document {doc} more often than its {lengths[doc]} tokens allow")
            cursor[doc] = start + length
            pieces.append(Piece(doc, start, length, cursor[doc] == int(lengths[doc])))
        used = sum(p.length for p in pieces)
        if used > capacity:
            raise ValueError(f"row {r} holds {used} tokens, more than the capacity ({capacity})")
        out.append(pieces)
    missing = [i for i, (c, n) in enumerate(zip(cursor, lengths, strict=True)) if c != int(n)]
    if missing:
        raise ValueError(f"the rows do not cover documents {missing[:10]} completely")
    return out


def build_row(
    tokens: Tensor, offsets: Sequence[int], pieces: Sequence[Piece], seq_len: int, pad_id: int = 0
) -> dict[str, Tensor]:
    """The four ``(T,)`` int64 tensors of one packed row from a flat token stream.

    Arguments:
        tokens: ``(N,)`` all documents back to back.
        offsets: start of each document in ``tokens``.
        pieces: the spans of this row, in order.
        seq_len: row length ``T``; the tail after the last piece is padding.
        pad_id: token id of padding inputs.

    Returns:
        ``input_ids``, ``labels`` (next token of the same document; ``-100`` after a document's last token and on
        padding), ``positions`` (restarting at 0 per piece and for the padding), ``doc_ids`` (``0..k-1`` for the
        ``k`` pieces, ``k`` for the padding).
    """
    input_ids = torch.full((seq_len,), pad_id, dtype=torch.int64)
    labels = torch.full((seq_len,), IGNORE_INDEX, dtype=torch.int64)
    positions = torch.zeros(seq_len, dtype=torch.int64)
    doc_ids = torch.full((seq_len,), len(pieces), dtype=torch.int64)
    at = 0
    for k, p in enumerate(pieces):
        begin = offsets[p.doc] + p.start
        end = begin + p.length
        input_ids[at : at + p.length] = tokens[begin:end]
        stop = end if p.last else end + 1  # a non-final piece keeps the true next token of its last token
        labels[at : at + stop - begin - 1] = tokens[begin + 1 : stop]
        positions[at : at + p.length] = torch.arange(p.length)
        doc_ids[at : at + p.length] = k
        at += p.length
    if at > seq_len:
        raise ValueError(f"pieces hold {at} tokens, more than seq_len ({seq_len})")
    positions[at:] = torch.arange(seq_len - at)
    return {"input_ids": input_ids, "labels": labels, "positions": positions, "doc_ids": doc_ids}


def pack_rows(
    documents: Sequence[Tensor | Sequence[int]], rows: Sequence[Sequence[int]], seq_len: int, pad_id: int = 0
) -> dict[str, Tensor]:
    """Builds a packed batch from documents and a packing of them (from :func:`pack` or :class:`StreamingPacker`).

    Arguments:
        documents: token ids of each document.
        rows: document indices per row.
        seq_len: row length ``T`` (the packing's capacity).
        pad_id: token id of padding inputs (their labels are ``-100``).

    Returns:
        ``{"input_ids", "labels", "positions", "doc_ids"}``: int64 tensors of shape ``(R, T)``, see :func:`build_row`.
    """
    docs = [torch.as_tensor(d, dtype=torch.int64).reshape(-1) for d in documents]
    lengths = [d.numel() for d in docs]
    _check(lengths, seq_len)
    offsets = [0]
    for n in lengths[:-1]:
        offsets.append(offsets[-1] + n)
    stream = torch.cat(docs) if docs else torch.zeros(0, dtype=torch.int64)
    built = [build_row(stream, offsets, p, seq_len, pad_id) for p in row_pieces(rows, lengths, seq_len)]
    if not built:
        return {k: torch.zeros(0, seq_len, dtype=torch.int64) for k in ("input_ids", "labels", "positions", "doc_ids")}
    return {key: torch.stack([b[key] for b in built]) for key in built[0]}


@dataclass(frozen=True)
class PaddingWaste:
    """Fraction of row slots holding padding: ``before`` with one document per row (long documents split into rows
    of ``capacity``), ``after`` packing."""

    before: float
    after: float
    rows_before: int
    rows_after: int


def padding_waste(lengths: Sequence[int], capacity: int, packed_rows: Sequence[Sequence[int]] | int) -> PaddingWaste:
    """Padding statistics of a packing.

    Arguments:
        lengths: token count of each document.
        capacity: tokens per row.
        packed_rows: the packing (or its number of rows).
    """
    _check(lengths, capacity)
    total = sum(int(n) for n in lengths)
    rows_before = sum(-(-int(n) // capacity) for n in lengths)
    rows_after = packed_rows if isinstance(packed_rows, int) else len(packed_rows)
    if rows_after * capacity < total:
        raise ValueError(f"{rows_after} rows of {capacity} tokens cannot hold {total} tokens")

    def waste(rows: int) -> float:
        return 1.0 - total / (rows * capacity) if rows else 0.0

    return PaddingWaste(waste(rows_before), waste(rows_after), rows_before, rows_after)


class StreamingPacker:
    """Packs a stream of documents with a bounded buffer, deterministically.

    Documents are buffered until ``buffer_size`` of them are held; the buffer is then packed with ``algorithm`` and
    every row except the least filled one is emitted (in the algorithm's row order); the documents of that row stay
    buffered and are packed again with the next documents. When the input ends, everything left is packed and
    emitted. A document longer than ``capacity`` emits its full pieces at once (one row each); only its remainder is
    buffered.

    :meth:`pack_lengths` yields rows as lists of :class:`Piece` (``doc`` = index in the input stream); calling the
    packer on token sequences yields the row tensors directly.

    Arguments:
        capacity: tokens per row.
        buffer_size: most documents held at once (``>= 1``).
        algorithm: ``"ffd"`` or ``"best_fit"``.
    """

    def __init__(self, capacity: int, buffer_size: int = 1024, algorithm: str = "ffd") -> None:
        if not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"capacity ({capacity!r}) must be a positive integer")
        if not isinstance(buffer_size, int) or buffer_size < 1:
            raise ValueError(f"buffer_size ({buffer_size!r}) must be a positive integer")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"packing algorithm ({algorithm!r}) must be one of {ALGORITHMS}")
        self.capacity = capacity
        self.buffer_size = buffer_size
        self.algorithm = algorithm
        self.max_buffered = 0  # the most documents held at once so far

    def pack_lengths(self, lengths: Iterable[int]) -> Iterator[list[Piece]]:
        """Yields rows (lists of :class:`Piece`, ``doc`` = index in the input) for a stream of document lengths."""
        buffer: list[Piece] = []  # pieces of at most `capacity` tokens that end their document
        for index, length in enumerate(lengths):
            length = int(length)
            if length < 1:
                raise ValueError(f"document {index} has length {length!r}: every document needs at least one token")
            n_full, rest = divmod(length, self.capacity)
            for k in range(n_full):
                yield [Piece(index, k * self.capacity, self.capacity, rest == 0 and k == n_full - 1)]
            if rest == 0:
                continue
            buffer.append(Piece(index, n_full * self.capacity, rest, True))
            self.max_buffered = max(self.max_buffered, len(buffer))
            if len(buffer) >= self.buffer_size:
                rows = self._pack(buffer)
                keep = min(range(len(rows)), key=lambda r: (sum(p.length for p in rows[r]), -r))
                yield from (row for r, row in enumerate(rows) if r != keep or len(rows) == 1)
                buffer = rows[keep] if len(rows) > 1 else []
        if buffer:
            yield from self._pack(buffer)

    def _pack(self, buffer: list[Piece]) -> list[list[Piece]]:
        rows = pack([p.length for p in buffer], self.capacity, self.algorithm)
        return [[buffer[i] for i in row] for row in rows]

    def __call__(self, documents: Iterable[Tensor | Sequence[int]], pad_id: int = 0) -> Iterator[dict[str, Tensor]]:
        """Yields packed rows ``{"input_ids", "labels", "positions", "doc_ids"}`` (each ``(T,)`` int64) from a
        stream of documents' token ids, holding at most ``buffer_size`` documents."""
        held: dict[int, Tensor] = {}

        def lengths() -> Iterator[int]:
            for index, doc in enumerate(documents):
                held[index] = torch.as_tensor(doc, dtype=torch.int64).reshape(-1)
                yield held[index].numel()

        for row in self.pack_lengths(lengths()):
            docs = sorted({p.doc for p in row})
            local = {d: i for i, d in enumerate(docs)}
            stream = torch.cat([held[d] for d in docs])
            offsets = [0]
            for d in docs[:-1]:
                offsets.append(offsets[-1] + held[d].numel())
            yield build_row(
                stream, offsets, [Piece(local[p.doc], p.start, p.length, p.last) for p in row], self.capacity, pad_id
            )
            for p in row:
                if p.last:
                    del held[p.doc]
