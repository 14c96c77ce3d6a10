"""Finding and reading the model in every checkpoint the package writes, in one process, without a process group.

Used by ``llmopt consolidate`` (:mod:`lightning_llmopt.cli.consolidate`) and by
:func:`~lightning_llmopt.inference.loading.load_model` (``llmopt generate``, ``LLMEngine.from_pretrained``).

What :func:`find_checkpoint` accepts, and what it reads:

- a Lightning ``.ckpt`` file (Lightning's single-device and DDP strategies): ``state_dict`` with the module's
  ``model.`` keys, the config under ``hyper_parameters["model"]``;
- a sharded DCP checkpoint folder ``step-N`` (:class:`~lightning_llmopt.strategies.ZeroStrategy` at any stage,
  :class:`~lightning_llmopt.strategies.NDParallelStrategy` with TP, PP, CP or EP), verified through its
  ``COMPLETE`` marker;
- a folder of such checkpoints (``root/step-N``), e.g. ``last.ckpt/step-00000020``, which ``ModelCheckpoint``
  writes under these strategies: the newest complete one;
- a run folder (``runs/tiny_cpu`` or ``runs/tiny_cpu/checkpoints``, ``lightning_logs/version_0``): the checkpoints
  above found up to :data:`SEARCH_DEPTH` levels below it; ``last`` (``ModelCheckpoint(save_last=True)``'s
  ``last.ckpt``, or ``last-vN.ckpt``) wins, else the newest by modification time.

Readers (:class:`DCPReader`, :class:`LightningReader`) give the saved config, the names, shapes and dtypes of the
model tensors (no data), the tensors of a chosen subset (DCP reads only the pieces it needs; a ``.ckpt`` is
memory-mapped) and the tokenizer the training run remembered.
"""

from lightning_llmopt.checkpoint_io.dcp_state import (
    _get,
    _load,
    _model_keys,
    _nested,
    checkpoint_tokenizer,
    config_from_checkpoint,
    lightning_entry,
    lightning_tokenizer,
)
from lightning_llmopt.checkpoint_io.find import (
    SEARCH_DEPTH,
    CheckpointNotFoundError,
    FoundCheckpoint,
    find_checkpoint,
    resolve_checkpoint,
)
from lightning_llmopt.checkpoint_io.readers import (
    DCPReader,
    LightningReader,
    TensorInfo,
    config_from_hparams,
    open_checkpoint,
)

__all__ = [
    "SEARCH_DEPTH",
    "CheckpointNotFoundError",
    "DCPReader",
    "FoundCheckpoint",
    "LightningReader",
    "TensorInfo",
    "_get",
    "_load",
    "_model_keys",
    "_nested",
    "checkpoint_tokenizer",
    "config_from_checkpoint",
    "config_from_hparams",
    "find_checkpoint",
    "lightning_entry",
    "lightning_tokenizer",
    "open_checkpoint",
    "resolve_checkpoint",
]
