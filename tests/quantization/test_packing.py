"""Packing: bit-exact round trips for every width, against an independent bit-by-bit decoder and against
compressed-tensors' own packer; the GPTQ and compressed-tensors tensor layouts round-trip exactly."""

from __future__ import annotations

import pytest
import torch

from lightning_llmopt.quantization import QuantizedWeight, QuantSpec, pack_bits, rtn_quantize, unpack_bits
from lightning_llmopt.quantization.export_ct import ct_tensors, from_ct_tensors
from lightning_llmopt.quantization.export_gptq import from_gptq_tensors, gptq_tensors
from lightning_llmopt.quantization.packing import as_kernel_bytes, packed_words

COLS = (1, 7, 31, 33, 130)


def _codes(rows: int, cols: int, bits: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (rows, cols), generator=g)
    codes[0, 0] = (1 << bits) - 1  # both extremes present
    codes[-1, -1] = 0
    return codes


def _decode_bit_by_bit(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """The layout spelled out: element c of a row is bits [c*bits, (c+1)*bits) of the row's little-endian stream."""
    out = torch.zeros(packed.shape[0], cols, dtype=torch.int64)
    for r in range(packed.shape[0]):
        words = [int(w) & 0xFFFFFFFF for w in packed[r].tolist()]
        for c in range(cols):
            value = 0
            for j in range(bits):
                p = c * bits + j
                value |= ((words[p // 32] >> (p % 32)) & 1) << j
            out[r, c] = value
    return out


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_unpack_round_trip_is_bit_exact(bits: int) -> None:
    for i, cols in enumerate(COLS):
        codes = _codes(5, cols, bits, seed=bits * 10 + i)
        packed = pack_bits(codes, bits)
        assert packed.dtype == torch.int32 and packed.shape == (5, packed_words(cols, bits))
        assert torch.equal(unpack_bits(packed, bits, cols), codes.to(torch.uint8))
        assert torch.equal(_decode_bit_by_bit(packed[:2], bits, cols), codes[:2])


@pytest.mark.parametrize("bits", range(1, 9))
def test_packing_matches_compressed_tensors(bits: int) -> None:
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    codes = _codes(4, 70, bits, seed=bits)
    signed = (codes - (1 << (bits - 1))).to(torch.int8)  # compressed-tensors packs value + 2**(bits-1)
    assert torch.equal(pack_bits(codes, bits), helpers.pack_to_int32(signed, bits))


def test_kernel_byte_view_puts_even_columns_in_low_nibbles() -> None:
    codes = _codes(3, 16, 4, seed=0)
    view = as_kernel_bytes(pack_bits(codes, 4), 4, 16)  # (3, 8) uint8
    assert view.shape == (3, 8)
    assert torch.equal((view & 0xF).long(), codes[:, 0::2])
    assert torch.equal((view >> 4).long(), codes[:, 1::2])
    view8 = as_kernel_bytes(pack_bits(codes, 8), 8, 16)
    assert torch.equal(view8.long(), codes)


def test_pack_rejects_out_of_range_codes() -> None:
    with pytest.raises(ValueError, match="codes must lie in"):
        pack_bits(torch.tensor([[16]]), 4)
    with pytest.raises(ValueError, match="cannot hold"):
        unpack_bits(torch.zeros(1, 1, dtype=torch.int32), 4, 9)


def _same_weight(a: QuantizedWeight, b: QuantizedWeight) -> None:
    assert torch.equal(a.dequantize(), b.dequantize())
    assert torch.equal(a.scales.float(), b.scales.float())
    assert (a.zeros is None) == (b.zeros is None)


@pytest.mark.parametrize(
    "bits, group, sym", [(4, 32, True), (4, 64, False), (8, None, True), (3, 32, True), (2, 32, False)]
)
def test_gptq_tensors_round_trip(bits: int, group: int | None, sym: bool) -> None:
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(bits))
    spec = QuantSpec(bits, "group" if group else "channel", group or 128, sym)
    qw = rtn_quantize(w, spec)
    if not sym:  # v1 cannot store a zero point of 0; keep this case to the convention's range
        qw = QuantizedWeight.from_codes(qw.codes(), qw.scales, qw.zeros.clamp(min=1), bits, qw.group_size)
    for fmt in ("gptq", "gptq_v2"):
        t = gptq_tensors(qw, fmt)
        k, n, groups = 128, 64, 128 // qw.group_size
        assert t["qweight"].shape == (k * bits // 32, n) and t["qzeros"].shape == (groups, n * bits // 32)
        _same_weight(from_gptq_tensors(t, bits, sym, fmt), qw)


def test_gptq_tensors_act_order_round_trip() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 64, generator=g)
    base = rtn_quantize(w, QuantSpec(4, "group", 16))
    perm = torch.randperm(64, generator=g)
    qw = QuantizedWeight(base.packed, base.scales, None, 4, 16, 64, perm)
    t = gptq_tensors(qw)
    assert torch.equal(t["g_idx"][perm].long(), torch.arange(64) // 16)  # stored column j is in group j // 16
    back = from_gptq_tensors(t, 4, True)
    assert back.perm is not None
    assert torch.equal(back.dequantize(), qw.dequantize())


def test_gptq_v1_refuses_zero_point_zero() -> None:
    qw = rtn_quantize(torch.rand(32, 32) + 1.0, QuantSpec(4, "group", 32, symmetric=False))  # all >= 0: zero 0
    assert int(qw.zeros.min()) == 0
    with pytest.raises(ValueError, match="zero point of 0"):
        gptq_tensors(qw, "gptq")
    _same_weight(from_gptq_tensors(gptq_tensors(qw, "gptq_v2"), 4, False, "gptq_v2"), qw)


@pytest.mark.parametrize("bits, group, sym", [(4, 32, True), (4, 32, False), (8, None, False), (8, 64, True)])
def test_compressed_tensors_round_trip(bits: int, group: int | None, sym: bool) -> None:
    w = torch.randn(40, 128, generator=torch.Generator().manual_seed(bits))
    qw = rtn_quantize(w, QuantSpec(bits, "group" if group else "channel", group or 128, sym))
    t = ct_tensors(qw, torch.float16)
    assert t["weight_packed"].shape == (40, 128 * bits // 32) and t["weight_shape"].tolist() == [40, 128]
    if not sym:
        assert t["weight_zero_point"].shape == (40 * bits // 32, qw.scales.shape[1])
    _same_weight(from_ct_tensors(t, bits, sym), qw)
