"""Inference engine: paged KV cache, continuous batching, prefix caching, int8 KV, CUDA-graph decode.

- :class:`LLMEngine` (``generate``, ``stream``, ``add_request``/``step``/``cancel``), built from a model in memory or
  with :meth:`LLMEngine.from_pretrained` from our checkpoint folders, a Lightning ``.ckpt`` or a Hugging Face folder;
- :class:`SamplingParams`: greedy, temperature, top-k, top-p, min-p, penalties, seed, max tokens, stop tokens and
  strings, logprobs, parallel samples, :class:`StructuredOutput` (JSON schema, JSON object, regex, choice,
  grammar); :func:`sample_batch` is the batched device sampler;
- :class:`EngineConfig`: block size, pool size, token budget, int8 KV, prefix caching, CUDA graphs, policy;
- :class:`SpeculativeConfig` (``EngineConfig.speculative``): speculative decoding with a draft model, prompt lookup
  or the target's quantized copy, adaptive draft length; :func:`speculative_verify` is the exact acceptance rule;
- building blocks: :class:`BlockManager` / :class:`BlockAllocator` (reference counts, copy-on-write),
  :class:`RadixCache` (prefix tree, LRU), :class:`Scheduler`, :class:`KVPool`, :class:`PagedKVCache` (the models'
  KV-cache protocol over pages), :func:`calibrate_kv_scales`.

See docs/inference.md; the HTTP server is :mod:`lightning_llmopt.inference.serving` (docs/serving.md). Importing this
package imports no Triton, no transformers and no FastAPI.
"""

from lightning_llmopt.inference.block_manager import NULL_BLOCK, BlockAllocator, BlockManager, OutOfBlocks
from lightning_llmopt.inference.config import EngineConfig
from lightning_llmopt.inference.engine import LLMEngine
from lightning_llmopt.inference.kv_pool import KVPool, KVScales
from lightning_llmopt.inference.loading import load_model
from lightning_llmopt.inference.paged_cache import PagedKVCache
from lightning_llmopt.inference.prefix_cache import RadixCache
from lightning_llmopt.inference.quant import calibrate_kv_scales
from lightning_llmopt.inference.request import Completion, CompletionOutput, RequestMetrics, StreamEvent
from lightning_llmopt.inference.sampling import SamplingParams, TokenLogprobs, sample, sample_batch
from lightning_llmopt.inference.scheduler import Scheduler
from lightning_llmopt.inference.speculative import SpeculativeConfig, speculative_verify
from lightning_llmopt.inference.stats import EngineStats
from lightning_llmopt.inference.structured_output import StructuredOutput

__all__ = [
    "NULL_BLOCK",
    "BlockAllocator",
    "BlockManager",
    "Completion",
    "CompletionOutput",
    "EngineConfig",
    "EngineStats",
    "KVPool",
    "KVScales",
    "LLMEngine",
    "OutOfBlocks",
    "PagedKVCache",
    "RadixCache",
    "RequestMetrics",
    "SamplingParams",
    "Scheduler",
    "SpeculativeConfig",
    "StreamEvent",
    "StructuredOutput",
    "TokenLogprobs",
    "calibrate_kv_scales",
    "load_model",
    "sample",
    "sample_batch",
    "speculative_verify",
]
