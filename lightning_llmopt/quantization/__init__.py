"""Weight-only quantization: observers, round to nearest, GPTQ, mixed precision, QAT, export and import.

See docs/quantization.md. Importing this package imports neither Triton nor transformers.

- :class:`QuantSpec` / :class:`QuantConfig`: what a quantized tensor is / which layers of a model are quantized how;
- observers (:class:`MinMaxObserver`, :class:`MSEObserver`, :class:`PercentileObserver`,
  :class:`CrossEntropyObserver`) choose ranges per tensor, channel or group;
- :func:`rtn_quantize` and :func:`gptq_quantize` quantize one weight into a :class:`QuantizedWeight`;
  :func:`quantize_model` does it for every linear layer of a model (ours or transformers'), replacing them with
  :class:`~lightning_llmopt.layers.quantized_linear.QuantizedLinear`;
- :func:`layer_sensitivity` + :func:`allocate_bits`: mixed precision under a size budget;
- :func:`prepare_qat` / :func:`convert_qat`: quantization-aware training (the Lightning callback is
  :class:`lightning_llmopt.callbacks.qat.QuantizationAwareTraining`);
- :func:`save_gptq`, :func:`save_compressed_tensors`, :func:`load_quantized`: checkpoints other tools load, and
  back into our model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_llmopt._lazy import lazy_exports

if TYPE_CHECKING:  # the names below, for type checkers and IDEs
    from lightning_llmopt.quantization.apply import QuantizationReport, quantize_model
    from lightning_llmopt.quantization.config import QuantConfig
    from lightning_llmopt.quantization.evaluate import causal_lm_loss, perplexity
    from lightning_llmopt.quantization.export_ct import save_compressed_tensors
    from lightning_llmopt.quantization.export_gptq import save_gptq
    from lightning_llmopt.quantization.gptq import HessianAccumulator, gptq_quantize
    from lightning_llmopt.quantization.load import load_quantized
    from lightning_llmopt.quantization.mixed_precision import Allocation, allocate_bits, layer_sensitivity
    from lightning_llmopt.quantization.observers import (
        CrossEntropyObserver,
        MinMaxObserver,
        MSEObserver,
        Observer,
        PercentileObserver,
        get_observer,
    )
    from lightning_llmopt.quantization.packing import pack_bits, unpack_bits
    from lightning_llmopt.quantization.qat import (
        FakeQuantLinear,
        convert_qat,
        fake_quantize_ste,
        prepare_qat,
        remove_qat,
    )
    from lightning_llmopt.quantization.spec import QParams, QuantSpec, fake_quantize
    from lightning_llmopt.quantization.weight import QuantizedWeight, rtn_quantize

# Lazy (PEP 562): the kernels import quantization.packing, and the layers import the kernels, so eager imports here
# would be circular; they also keep ``import lightning_llmopt.quantization`` cheap.
_EXPORTS: dict[str, str] = {
    "QuantizationReport": "apply",
    "quantize_model": "apply",
    "QuantConfig": "config",
    "causal_lm_loss": "evaluate",
    "perplexity": "evaluate",
    "save_compressed_tensors": "export_ct",
    "save_gptq": "export_gptq",
    "HessianAccumulator": "gptq",
    "gptq_quantize": "gptq",
    "load_quantized": "load",
    "Allocation": "mixed_precision",
    "allocate_bits": "mixed_precision",
    "layer_sensitivity": "mixed_precision",
    "CrossEntropyObserver": "observers",
    "MSEObserver": "observers",
    "MinMaxObserver": "observers",
    "Observer": "observers",
    "PercentileObserver": "observers",
    "get_observer": "observers",
    "pack_bits": "packing",
    "unpack_bits": "packing",
    "FakeQuantLinear": "qat",
    "convert_qat": "qat",
    "fake_quantize_ste": "qat",
    "prepare_qat": "qat",
    "remove_qat": "qat",
    "QParams": "spec",
    "QuantSpec": "spec",
    "fake_quantize": "spec",
    "QuantizedWeight": "weight",
    "rtn_quantize": "weight",
}

__all__ = [
    "Allocation",
    "CrossEntropyObserver",
    "FakeQuantLinear",
    "HessianAccumulator",
    "MSEObserver",
    "MinMaxObserver",
    "Observer",
    "PercentileObserver",
    "QParams",
    "QuantConfig",
    "QuantSpec",
    "QuantizationReport",
    "QuantizedWeight",
    "allocate_bits",
    "causal_lm_loss",
    "convert_qat",
    "fake_quantize",
    "fake_quantize_ste",
    "get_observer",
    "gptq_quantize",
    "layer_sensitivity",
    "load_quantized",
    "pack_bits",
    "perplexity",
    "prepare_qat",
    "quantize_model",
    "remove_qat",
    "rtn_quantize",
    "save_compressed_tensors",
    "save_gptq",
    "unpack_bits",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
