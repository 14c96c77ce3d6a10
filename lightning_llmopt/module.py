"""``CausalLMModule``: next-token training of the reference decoder inside Lightning."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType, rank_zero_info
from torch import Tensor
from torchmetrics import MeanMetric
from torchmetrics.text import Perplexity
from typing_extensions import override

from lightning_llmopt.data.datamodule import data_parallel_position
from lightning_llmopt.models import Llama, LlamaConfig
from lightning_llmopt.models.config import FUSED_KERNELS, _check_fused_kernels
from lightning_llmopt.models.moe import moe_aux_loss, update_balance_bias
from lightning_llmopt.parallel.compile import compile_blocks
from lightning_llmopt.parallel.float8 import (
    FLOAT8_RECIPES,
    apply_float8,
    check_float8_device,
    is_float8_linear,
    precompute_scales,
)
from lightning_llmopt.parallel.vocab_parallel import is_vocab_sharded, vocab_parallel_cross_entropy

IGNORE_INDEX = -100


class CausalLMModule(L.LightningModule):
    """Causal language modelling with AdamW, linear warm-up and cosine decay.

    Batches are dicts with ``input_ids`` ``(B, T)`` int64 and ``labels`` ``(B, T)`` int64 (``-100`` is ignored), and
    optionally ``positions`` and ``doc_ids`` ``(B, T)`` for packed rows.

    Arguments:
        model: a preset name (see :data:`lightning_llmopt.models.PRESETS`), a :class:`LlamaConfig`, or its dict;
            default ``"debug-1m"`` (unless ``pretrained`` is given; with ``pretrained``, only the resolved config
            that checkpoints store is accepted here).
        pretrained: a Hugging Face Llama, Mistral or Qwen2 folder (``config.json`` + safetensors, e.g. a Hub
            download): the model is built from its config and starts from its weights (fp32 master weights; the
            precision plugin casts as configured). Under a sharded strategy (the model built on the meta device)
            each rank reads only its own part of every weight from the safetensors files once the strategy has
            sharded the model (:meth:`load_pretrained`, at the start of fit/validate/test/predict). The folder's
            tokenizer is remembered in checkpoints.
        model_overrides: fields that replace the preset's (e.g. ``{"attn_backend": "eager"}``).
        learning_rate: peak learning rate.
        weight_decay: AdamW decay, applied to matrices only (not norms, biases or embeddings).
        betas: AdamW betas.
        eps: AdamW epsilon.
        warmup_steps: linear warm-up from 0 to ``learning_rate``.
        max_steps: end of the cosine decay; ``None`` takes the trainer's step budget.
        min_lr_ratio: the learning rate at ``max_steps`` as a fraction of the peak.
        fused_kernels: which fused Triton kernels the decoder runs (:data:`~lightning_llmopt.models.config.
            FUSED_KERNELS`). ``"auto"`` (default): all of them when the trainer's device is a CUDA GPU and Triton is
            installed -- the fastest configuration measured on one H100 (``benchmarks/results/e2e-kernels-1b-*``:
            1.50x plain Lightning bf16, 1.02x it under ``torch.compile``) -- unless the model's config already names
            some; on CPU and other devices only what the config names (as before). ``"none"`` turns them off on
            every device; a name list (or ``"all"``) picks them. The choice is made in :meth:`configure_model` and
            runs under every strategy (the kernels step of the parallel plan).
        fused_optimizer: AdamW's ``fused`` implementation. ``None`` (default): fused when every parameter is on a
            CUDA device (plain tensors or DTensors), the fastest measured path; ``True``/``False`` force it (torch
            also has a fused AdamW on the CPU). Gradient clipping works with both
            (:meth:`configure_gradient_clipping`).
        float8: FP8 training of the linear layers on GPUs with FP8 tensor cores (compute capability 8.9+), with
            the dynamic-scaling recipe named (:data:`~lightning_llmopt.parallel.float8.FLOAT8_RECIPES`:
            ``"tensorwise"``, ``"rowwise"``, ``"rowwise_with_gw_hp"``); ``None`` (default): the trainer's precision
            everywhere. The LM head, MoE routers and layers whose widths are not multiples of 16 stay in high
            precision; the log names what converted. Needs the ``fp8`` extra (torchao). Parameters, checkpoints and
            the Hugging Face export are unchanged (:func:`~lightning_llmopt.parallel.float8.apply_float8`).
        float8_emulate: emulate the FP8 GEMMs (same rounding and scales, high-precision GEMM) on any device: for
            tests and CPU references. Without it, ``float8`` on a device without FP8 tensor cores raises.
        float8_all_gather: under ``zero3`` (``ZeroStrategy(stage=3)``, parameters on the GPU) with the
            ``"tensorwise"`` recipe, FSDP2 all-gathers the FP8 linears' weights already cast to FP8 (half the bytes
            of bf16), with each weight's scale from its whole tensor (one all-reduce for all of them after each
            optimizer step): the same FP8 weights as without it. ``None`` (default): on exactly there; ``True``:
            required (a named error elsewhere); ``False``: off.
        compile: ``torch.compile`` each decoder block (after the kernels and FP8 steps, before a ZeRO strategy shards
            them), which fuses FP8's scaling and casting into neighbouring kernels. For one device, DDP and the
            ``zero*`` strategies; ``NDParallelStrategy`` compiles in its own plan (its ``compile`` argument), after
            tensor parallelism, and refuses this one.
    """

    def __init__(
        self,
        model: str | LlamaConfig | dict[str, Any] | None = None,
        pretrained: str | None = None,
        model_overrides: dict[str, Any] | None = None,
        learning_rate: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        warmup_steps: int = 100,
        max_steps: int | None = None,
        min_lr_ratio: float = 0.1,
        fused_kernels: str | list[str] | None = "auto",
        fused_optimizer: bool | None = None,
        float8: str | None = None,
        float8_emulate: bool = False,
        float8_all_gather: bool | None = None,
        compile: bool = False,
    ) -> None:
        super().__init__()
        _check_kernel_choice(fused_kernels)
        if float8 is not None and float8 not in FLOAT8_RECIPES:
            raise ValueError(f"float8 ({float8!r}) must be None or one of {', '.join(FLOAT8_RECIPES)}")
        if pretrained is not None and isinstance(model, str):
            raise ValueError(f"pass one of model ({model!r}) and pretrained ({pretrained!r}), not both")
        if pretrained is not None and model is None:
            self.config = _pretrained_config(pretrained, model_overrides)
        elif model is None or isinstance(model, str):
            self.config = LlamaConfig.from_preset(model or "debug-1m", **(model_overrides or {}))
        else:
            values = model.to_dict() if isinstance(model, LlamaConfig) else dict(model)
            self.config = LlamaConfig(**{**values, **(model_overrides or {})})
        for name, value in (("learning_rate", learning_rate), ("warmup_steps", warmup_steps + 1)):
            if value <= 0:
                raise ValueError(f"{name} ({value}) must be positive")
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio ({min_lr_ratio}) must be in [0, 1]")
        self.save_hyperparameters(ignore=["model", "model_overrides"])
        self.hparams["model"] = self.config.to_dict()  # the resolved config, so load_from_checkpoint rebuilds it
        self.model: Llama | None = None
        self.val_loss = MeanMetric()
        self.val_ppl = Perplexity(ignore_index=IGNORE_INDEX)
        self.tokens_seen = 0
        self._tokens_seen_counter: Tensor | None = None  # tokens_seen on the device, for logging without a sync
        self.moe_stats: dict[str, Tensor] = {}  # last MoE load statistics (on_before_zero_grad)

    # ------------------------------------------------------------------ construction
    @override
    def configure_model(self) -> None:
        """Build the decoder inside the strategy's init context (the meta device for sharded strategies)."""
        if self.model is None:
            self.config.fused_kernels = resolve_fused_kernels(
                self.hparams.get("fused_kernels", "auto"), self.config.fused_kernels, self._device_type()
            )
            if self.config.fused_kernels:
                rank_zero_info(f"fused kernels: {', '.join(self.config.fused_kernels)}")
        pretrained = self.hparams.get("pretrained")
        streamable = pretrained is not None and any(Path(pretrained).glob("*.safetensors"))
        if self.model is None and streamable and torch.empty(0).is_meta:
            # A sharded strategy's init context: build on meta as usual; once the strategy has sharded the model,
            # each rank reads only its own part of the weights (load_pretrained, at the start of fit/validate/...).
            self.model = Llama(self.config)
            self._pretrained_pending = True
        elif self.model is None and pretrained:  # a plain strategy, or .bin weights (read whole, then sharded)
            from lightning_llmopt.models.hf import from_hf

            self.model = from_hf(self.hparams["pretrained"], dtype=torch.float32, device="cpu", config=self.config)
        elif self.model is None:
            self.model = Llama(self.config)
        if self.hparams.get("float8") and not any(is_float8_linear(m) for m in self.model.modules()):
            self._apply_float8()
        if self.hparams.get("compile") and not getattr(self, "_blocks_compiled", False):
            self._compile_blocks()

    def _compile_blocks(self) -> None:
        """The compile step of the plan: each block's forward through ``torch.compile`` (``nn.Module.compile``)."""
        assert self.model is not None
        strategy = type(self.trainer.strategy).__name__ if self._trainer is not None else ""
        if strategy == "NDParallelStrategy":
            raise ValueError(
                "CausalLMModule(compile=True) compiles before tensor parallelism; under NDParallelStrategy pass "
                "compile=True to the strategy instead (it compiles after TP and CP)"
            )
        compile_blocks(self.model.layers.values())
        self._blocks_compiled = True
        rank_zero_info(f"compile: {len(self.model.layers)} decoder blocks through torch.compile")

    def _apply_float8(self) -> None:
        """The FP8 step of the plan: after the model (and its fused kernels) is built, before the strategy's tensor
        parallelism, compile and ZeRO-3 (torchao's order)."""
        assert self.model is not None
        emulate = bool(self.hparams.get("float8_emulate"))
        check_float8_device(self._device_type() if not emulate else "cpu", emulate)
        self._float8_all_gather = self._wants_float8_all_gather()
        report = apply_float8(
            self.model, self.hparams["float8"], emulate=emulate, fsdp_all_gather=self._float8_all_gather
        )
        rank_zero_info(
            report.describe() + ("; FSDP2 all-gathers their weights in FP8" if self._float8_all_gather else "")
        )

    def _wants_float8_all_gather(self) -> bool:
        """``float8_all_gather`` resolved against the recipe and the strategy (see the class docstring)."""
        choice = self.hparams.get("float8_all_gather")
        strategy = self.trainer.strategy if self._trainer is not None else None
        recipe = self.hparams["float8"]
        why_not = None
        if recipe != "tensorwise":
            why_not = f"float8={recipe!r} (FP8 all-gather needs float8='tensorwise')"
        elif getattr(strategy, "stage", None) != 3 or hasattr(strategy, "dims"):  # NDParallelStrategy has dims
            why_not = f"strategy {type(strategy).__name__} (FP8 all-gather needs ZeroStrategy(stage=3), 'zero3')"
        elif getattr(strategy, "offload_parameters", False):
            why_not = "parameters offloaded to the CPU (zero3_offload)"
        if choice is True and why_not is not None:
            raise ValueError(f"float8_all_gather=True does not apply with {why_not}")
        return choice is not False and why_not is None

    def _device_type(self) -> str:
        """The trainer's device type (``"cuda"``, ``"cpu"``...); without a trainer, CUDA if one is visible."""
        if self._trainer is not None:
            return self.trainer.strategy.root_device.type
        return "cuda" if torch.cuda.is_available() else "cpu"

    @override
    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        vocab = getattr(datamodule, "vocab_size", None)
        if vocab is not None and vocab > self.config.vocab_size:
            raise ValueError(
                f"the tokenizer's vocabulary ({vocab}) is larger than the model's vocab_size "
                f"({self.config.vocab_size}); choose a larger vocab_size or a smaller tokenizer"
            )

    # ------------------------------------------------------------------ steps
    def _logits(self, batch: dict[str, Tensor]) -> Tensor:
        assert self.model is not None, "configure_model() has not run"
        return self.model(batch["input_ids"], positions=batch.get("positions"), doc_ids=batch.get("doc_ids"))

    @staticmethod
    def loss_fn(logits: Tensor, labels: Tensor) -> Tensor:
        """Mean next-token cross-entropy over labels != -100, in fp32 (vocab-parallel for tensor-parallel logits)."""
        if is_vocab_sharded(logits):
            return vocab_parallel_cross_entropy(logits, labels, ignore_index=IGNORE_INDEX)
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)

    @override
    def forward(self, input_ids: Tensor, **kwargs: Any) -> Tensor:
        assert self.model is not None, "configure_model() has not run"
        return self.model(input_ids, **kwargs)

    def train_loss(self, batch: dict[str, Tensor]) -> Tensor:
        """The training loss of one batch (fp32 scalar); through ``Llama.loss`` (no full logits) when the model has a
        fused loss. The extension point for callbacks that change the objective (``Distillation`` replaces it on the
        instance during ``fit``); MoE auxiliary losses are added by ``training_step``."""
        assert self.model is not None, "configure_model() has not run"
        if getattr(self.model, "fused_loss", None) is not None and self.model.output is not None:
            return self.model.loss(
                batch["input_ids"],
                batch["labels"],
                positions=batch.get("positions"),
                doc_ids=batch.get("doc_ids"),
                ignore_index=IGNORE_INDEX,
            )
        return self.loss_fn(self._logits(batch), batch["labels"])

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.train_loss(batch)
        aux = moe_aux_loss(self.model) if self.model is not None else None
        if aux is not None:  # Mixture-of-Experts balance and z-losses of this forward
            self.log("train/moe_aux_loss", aux.detach())
            loss = loss + aux
        self.log("train/loss", loss, prog_bar=True)
        return loss

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.model is not None and getattr(self, "_float8_all_gather", False):
            # the next forward's FP8 weight scales, from the weights the optimizer step just wrote (one all-reduce;
            # not in on_before_zero_grad, which Lightning calls after the next forward)
            precompute_scales(self.model)
        # Here rather than in training_step: every rank runs this hook once per batch, pipeline stages included
        # (under pipeline parallelism training_step runs per micro-batch on the last stage only).
        n = batch["input_ids"].numel() * data_parallel_position(self.trainer)[0]
        self.tokens_seen += n
        # Logged from a counter that lives on the device: logging a Python number copies it from pageable host
        # memory, which synchronises the stream every step (the GPU drains and waits for the host).
        counter = self._tokens_seen_counter
        if counter is None or counter.device != self.device:
            dtype = torch.float32 if self.device.type == "mps" else torch.float64  # exact past 2**24 tokens
            counter = torch.tensor(float(self.tokens_seen), dtype=dtype, device=self.device)
        else:
            counter.add_(n)
        self._tokens_seen_counter = counter
        self.log("train/tokens_seen", counter)

    @override
    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        logits = self._logits(batch)
        labels = batch["labels"]
        loss = self.loss_fn(logits, labels)
        self.val_loss.update(loss, weight=(labels != IGNORE_INDEX).sum())
        if is_vocab_sharded(logits):  # tensor parallelism: the metric needs whole rows (validation only)
            logits = logits.full_tensor()  # type: ignore[attr-defined]
        self.val_ppl.update(logits.float(), labels)
        self.log("val/loss", self.val_loss, prog_bar=True)
        self.log("val/ppl", self.val_ppl)

    # ------------------------------------------------------------------ optimisation
    def _total_steps(self) -> int:
        max_steps = self.hparams.get("max_steps")
        if max_steps:
            return int(max_steps)
        if self._trainer is not None and self.trainer.max_steps > 0:
            return int(self.trainer.max_steps)
        if self._trainer is not None:
            return int(self.trainer.estimated_stepping_batches)
        return 10_000

    def lr_lambda(self, step: int) -> float:
        """Multiplier of the peak rate: linear warm-up, then cosine decay to ``min_lr_ratio`` at max_steps."""
        hp: Any = self.hparams
        if step < hp.warmup_steps:
            return (step + 1) / (hp.warmup_steps + 1)
        total = max(self._total_steps(), hp.warmup_steps + 1)
        progress = min(1.0, (step - hp.warmup_steps) / max(1, total - hp.warmup_steps))
        return hp.min_lr_ratio + (1 - hp.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    @override
    def configure_optimizers(self) -> Any:
        assert self.model is not None
        decay: list[torch.nn.Parameter] = []
        no_decay: list[torch.nn.Parameter] = []
        for name, p in self.model.named_parameters():
            if not p.requires_grad:
                continue
            (decay if p.ndim >= 2 and "tok_embeddings" not in name else no_decay).append(p)
        hp: Any = self.hparams
        groups = [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        fused = hp.get("fused_optimizer")
        if fused is None:  # DTensors (FSDP2, TP) are fine: torch shards the fused AdamW ops like other pointwise ops
            fused = all(p.is_cuda for p in decay + no_decay) and len(decay + no_decay) > 0
        optimizer = torch.optim.AdamW(groups, lr=hp.learning_rate, betas=tuple(hp.betas), eps=hp.eps, fused=fused)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self.lr_lambda)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    @override
    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: int | float | None = None, gradient_clip_algorithm: str | None = None
    ) -> None:
        """Clip as Lightning does, also for an optimizer that unscales inside its step (fused AdamW, the default on
        CUDA), which Lightning's ``MixedPrecision`` refuses to clip: :func:`clip_with_amp_scaling_optimizer`."""
        plugin = self.trainer.precision_plugin if self._trainer is not None else None
        if clip_with_amp_scaling_optimizer(plugin, optimizer, gradient_clip_val, gradient_clip_algorithm):
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    # ------------------------------------------------------------------ checkpoint extras
    @override
    def on_before_zero_grad(self, optimizer: Any) -> None:
        """After each optimizer step: MoE load statistics over all ranks and the auxiliary-loss-free bias update
        (``moe_stats``, logged by :class:`~lightning_llmopt.callbacks.TrainingMonitor`)."""
        if self.model is None or self.config.moe is None:
            return
        strategy = self.trainer.strategy
        self.moe_stats = update_balance_bias(self.model, reduce=lambda t: strategy.reduce(t, reduce_op="sum"))

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["tokens_seen"] = self.tokens_seen
        checkpoint["llmopt_tokenizer"] = self.tokenizer_spec()

    def tokenizer_spec(self) -> str | None:
        """What ``llmopt generate`` should load as this model's tokenizer: the data module's ``tokenizer`` (``"byte"``
        or an absolute path), else the ``pretrained`` folder when it holds a ``tokenizer.json``, else ``None``."""
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        hparams = getattr(datamodule, "hparams", None)
        if hparams is not None and "tokenizer" in hparams:
            spec = hparams["tokenizer"]
            return "byte" if spec in (None, "byte") else str(Path(spec).expanduser().resolve())
        pretrained = self.hparams.get("pretrained")
        if pretrained and (Path(pretrained) / "tokenizer.json").is_file():
            return str(Path(pretrained).expanduser().resolve())
        return None

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.tokens_seen = int(checkpoint.get("tokens_seen", 0))
        self._tokens_seen_counter = None

    def load_pretrained(self) -> None:
        """Read the ``pretrained`` weights into a model built on meta and sharded by the strategy (each rank its own
        part, :func:`~lightning_llmopt.models.hf_shards.load_sharded`); nothing when resuming from a checkpoint,
        whose weights the strategy has already restored."""
        if not getattr(self, "_pretrained_pending", False):
            return
        self._pretrained_pending = False
        if self._trainer is not None and self.trainer.ckpt_path is not None:
            return
        from lightning_llmopt.models.hf_shards import load_sharded

        assert self.model is not None
        self.pretrained_elements_read = load_sharded(self.model, self.hparams["pretrained"])

    @override
    def on_validation_start(self) -> None:
        self.load_pretrained()

    @override
    def on_test_start(self) -> None:
        self.load_pretrained()

    @override
    def on_predict_start(self) -> None:
        self.load_pretrained()

    @override
    def on_fit_start(self) -> None:
        self.load_pretrained()
        assert self.model is not None
        rank_zero_info(f"model {self.config.name}: {self.model.num_params() / 1e6:.2f}M parameters")


def _pretrained_config(folder: str, overrides: dict[str, Any] | None) -> LlamaConfig:
    """The :class:`LlamaConfig` of a Hugging Face folder, with ``overrides``; a missing folder is named."""
    from lightning_llmopt.models.hf_config import config_from_hf
    from lightning_llmopt.models.hf_files import read_config

    path = Path(folder).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"pretrained ({folder!r}) is not a folder (expected a Hugging Face model folder)")
    config, _ = config_from_hf(read_config(path), **(overrides or {}))
    return config


def clip_with_amp_scaling_optimizer(
    plugin: Any, optimizer: Any, clip_val: int | float | None, algorithm: str | None
) -> bool:
    """Clip the gradients of ``optimizer`` by norm or value under Lightning's ``MixedPrecision`` when the optimizer
    handles loss scaling in its step (``_step_supports_amp_scaling``: torch's fused Adam/AdamW/SGD); returns whether
    it did. Anything else (other plugins, such as the ZeRO/N-D strategies' own, which unscale before clipping and
    step the optimizer directly; other optimizers; no clipping) is left to Lightning (``False``).

    With fp16 the gradients are first unscaled by ``GradScaler.unscale_``, which also records the inf/NaN check;
    ``GradScaler.step`` then sees the optimizer as already unscaled and passes the fused step no ``grad_scale`` but
    that ``found_inf`` (the step is still skipped on overflow). Nothing is unscaled when no parameter has a gradient
    (a skipped backward), so the scaler is never left unscaled without a step."""
    if not clip_val or clip_val <= 0 or not isinstance(plugin, MixedPrecision):
        return False
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    if not any(p.grad is not None for group in optimizer.param_groups for p in group["params"]):
        return True
    if plugin.scaler is not None:
        plugin.scaler.unscale_(optimizer)
    how = GradClipAlgorithmType(algorithm.lower() if isinstance(algorithm, str) else (algorithm or "norm"))
    Precision.clip_gradients(plugin, optimizer, clip_val, how)  # MixedPrecision's own override is the refusal
    return True


def _check_kernel_choice(choice: str | list[str] | None) -> None:
    if choice is None or (isinstance(choice, str) and choice in ("auto", "none")):
        return
    _check_fused_kernels(choice)  # raises ValueError naming unknown kernels


def resolve_fused_kernels(choice: str | list[str] | None, configured: list[str], device_type: str) -> list[str]:
    """The kernels a :class:`CausalLMModule` builds its decoder with (see its ``fused_kernels`` argument).

    ``"auto"``: ``configured`` if it names any, else all of them on a CUDA device with Triton installed, else none.
    ``"none"`` / ``None``: none. Names (or ``"all"``): those.
    """
    if choice is None or choice == "none":
        return []
    if choice != "auto":
        return _check_fused_kernels(choice)
    if configured:
        return list(configured)
    if device_type == "cuda" and importlib.util.find_spec("triton") is not None:
        return list(FUSED_KERNELS)
    return []
