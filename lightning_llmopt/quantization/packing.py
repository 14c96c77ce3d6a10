"""Bit packing of integer codes into int32 words: the one layout our kernels, GPTQ and compressed-tensors share.

Defined in :mod:`lightning_llmopt.kernels.quant_packing` (the kernels read this layout and sit below the
quantization package); re-exported here, where quantization code and users import it.
"""

from __future__ import annotations

from lightning_llmopt.kernels.quant_packing import as_kernel_bytes, pack_bits, packed_words, unpack_bits

__all__ = ["as_kernel_bytes", "pack_bits", "packed_words", "unpack_bits"]
