"""Per-rank memory estimate of data-parallel training: model states by ZeRO stage, activations by checkpointing policy.

Model states follow ZeRO (Rajbhandari et al., arXiv 1910.02054). With Ψ parameters, N data-parallel ranks and
mixed-precision Adam the paper counts 2Ψ (fp16 parameters) + 2Ψ (fp16 gradients) + 12Ψ (fp32 master, momentum,
variance) = 16Ψ bytes, of which stage 1 shards the 12Ψ (4Ψ + 12Ψ/N), stage 2 also the gradients (2Ψ + 14Ψ/N)
and stage 3 everything (16Ψ/N). ``accounting="paper"`` reproduces exactly that.

``accounting="ours"`` (the default) counts what this codebase stores (see docs/memory_estimate.md):

- ``32-true``, ``bf16-mixed``, ``16-mixed``: Lightning's mixed precision is autocast over fp32 weights, so a
  parameter costs 4 (fp32 weight, which is also the master) + 4 (fp32 gradient) + 8 (Adam m, v) = 16 bytes; autocast
  adds bf16/fp16 copies of the weights, counted with the activations because autograd keeps them for backward.
- ``bf16-true``: 2 (bf16 weight) + 2 (bf16 gradient), and a plain torch optimizer keeps bf16 state (4) with no master;
  the ZeRO engine keeps fp32 master shards (4Ψ/N) and fp32 state (8Ψ/N).
- stage 0 is DDP: full copies everywhere, plus DDP's gradient buckets (another full gradient, alive between steps)
  when N > 1 (``gradient_as_bucket_view=False``, torch's default).
- stage 1 (:mod:`lightning_llmopt.parallel.zero`) keeps the full averaged gradient in persistent flat buffers and
  shards master and state; stage 2 keeps only a gradient shard in the master dtype (4Ψ/N); stage 3 is FSDP2
  ``fully_shard``: parameters, gradients and state all 1/N, plus the root unit (embedding, final norm, head), which
  FSDP2 keeps gathered from forward to backward. Under ``bf16-mixed`` stage 3 gathers bf16 weights
  (``MixedPrecisionPolicy(param_dtype=bf16)``), so the model computes on bf16 weights: a bf16 residual stream, no
  autocast weight copies (activations as for bf16 weights, but with the fp32 RoPE table).
- ``offload_optimizer`` moves master shards, optimizer state and the gradient shard fed to the CPU step to host
  memory (reported as ``cpu``); ``offload_parameters`` (stage 3 only) also moves parameters and gradients there.

Activations are counted analytically from what autograd saves in our :class:`~lightning_llmopt.models.llama.Llama`
(one forward, plain causal SDPA flash attention); :func:`activation_bytes` lists every term. The peak is the larger
of two moments of the training loop (``loop``): the end of forward, while the cross-entropy runs, and the start of
backward. ``"lightning"`` (``CausalLMModule`` under the Trainer) calls ``zero_grad`` after ``training_step``, so the
previous step's gradients are still alive at the end of forward, and the logits are freed when ``training_step``
returns; ``"plain"`` (``logits = model(x); loss = ...; loss.backward(); opt.step(); opt.zero_grad()``) keeps the
logits through backward and frees gradients after the step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_llmopt.models.config import LlamaConfig
from lightning_llmopt.parallel.activation_checkpointing import POLICIES, select_blocks
from lightning_llmopt.parallel.layer_costs import embedding_params, layer_counts
from lightning_llmopt.parallel.memory_attention import attention_saved_bytes, norm_saved_bytes

__all__ = ["PRECISIONS", "MemoryEstimate", "activation_bytes", "estimate_memory", "parameter_counts"]

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
ACCOUNTINGS = ("ours", "paper")
LOOPS = ("lightning", "plain")
# Optimizer state bytes per parameter held by the optimizer in fp32 (the paper's K without the master copy).
_STATE_BYTES = {"adamw": 8, "adam": 8, "sgd_momentum": 4, "sgd": 0}
_GIB = 2**30


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank bytes of one training step (device memory unless stated).

    Arguments:
        parameters: parameter storage (sharded for stage 3).
        gradients: gradient storage at the optimizer step, including persistent communication buffers.
        optimizer_state: optimizer state plus fp32 master copies that are not the parameters themselves.
        master_weights: the part of ``optimizer_state`` that is master copies.
        activations: bytes kept for backward by one forward of the model (what ``activation_memory`` measures).
        loss: logits and cross-entropy buffers alive when backward starts (fp32 logits for the loss).
        total: ``parameters + gradients + optimizer_state + activations``.
        peak: modelled peak allocation: static states (stage 3: with its gathered root unit), plus the largest of
            activations + the cross-entropy's forward buffers (+ last step's gradients under ``loop="lightning"``)
            at the end of forward, activations + ``loss`` at the start of backward, and the gradients of the step.
        cpu: host bytes of offloaded states.
        paper_model_states: the paper's figure (2+2+K bytes per parameter divided by stage) for comparison.
        num_params: Ψ, parameters counted once (tied embeddings once).
    """

    parameters: int
    gradients: int
    optimizer_state: int
    master_weights: int
    activations: int
    loss: int
    total: int
    peak: int
    cpu: int
    paper_model_states: int
    num_params: int
    stage: int
    world_size: int
    precision: str
    activation_checkpointing: str
    accounting: str
    loop: str = "lightning"

    @property
    def model_states(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state

    def __str__(self) -> str:
        rows = [("parameters", self.parameters), ("gradients", self.gradients),
                ("optimizer state", self.optimizer_state), ("  of which masters", self.master_weights),
                ("model states", self.model_states), ("activations", self.activations),
                ("logits + loss", self.loss), ("total", self.total), ("peak (modelled)", self.peak)]
        if self.cpu:
            rows.append(("cpu (offloaded)", self.cpu))
        head = (f"memory per rank: {self.num_params / 1e6:.1f}M params, stage {self.stage}, world_size "
                f"{self.world_size}, {self.precision}, activation checkpointing {self.activation_checkpointing!r}, "
                f"{self.accounting} accounting")
        lines = [head] + [f"  {name:<18} {nbytes / _GIB:>10.3f} GiB  {nbytes / 1e9:>10.3f} GB" for name, nbytes in rows]
        lines.append(f"  ZeRO paper model states: {self.paper_model_states / 1e9:.3f} GB")
        return "\n".join(lines)


def parameter_counts(config: LlamaConfig) -> tuple[int, int, int, int]:
    """``(total, per block, per block in Linear weights, embedding)`` parameter counts of :class:`Llama`; the block
    figures are the first block's (blocks differ with ``kv_sources`` or MoE layers: :func:`layer_counts` has each)."""
    blocks = layer_counts(config)
    total = sum(b.params for b in blocks) + embedding_params(config)
    return total, blocks[0].params, blocks[0].linear, config.vocab_size * config.dim


def _dtype_bytes(precision: str) -> tuple[int, int, bool]:
    """``(parameter bytes, compute bytes, autocast)``: bf16-mixed computes matmuls in bf16 over fp32 weights."""
    return {"32-true": (4, 4, False), "bf16-mixed": (4, 2, True), "16-mixed": (4, 2, True),
            "bf16-true": (2, 2, False)}[precision]


def activation_bytes(config: LlamaConfig, *, precision: str, micro_batch: int, seq_len: int,
                     activation_checkpointing: str = "none", every_n: int = 2, bf16_gathered: bool = False) -> int:
    """Bytes autograd keeps for backward after one forward of :class:`Llama` (no loss), per rank.

    Per token of a block that is not checkpointed, with ``p``/``c`` the parameter/compute dtype bytes (4/4 fp32,
    4/2 autocast, 2/2 bf16-true), ``d`` the width, ``q = H*D``, ``kv = H_kv*D``, ``f`` the SwiGLU width:

    - each RMSNorm: an fp32 input ``4d`` (the residual itself when it is fp32, else its fp32 copy), the fp32
      ``rsqrt`` (4) and the normalised value before the weight (``4d``, or ``2d`` cast back to bf16);
    - the q/k/v inputs: under autocast three separate ``c*d`` casts (activations are not cached), else the norm
      output once (``p*d``); w1/w3 alike (two casts);
    - RoPE: the gathered ``(cos, sin)`` table rows, ``p * D`` per call, for q and for k;
    - attention: q and k after RoPE, v (``c*(q + 2kv)``), the flash output ``c*q`` and its fp32 logsumexp ``4H``,
      and the ``(B, T, H*D)`` copy made by ``transpose().reshape()`` for ``wo`` (``c*q``);
    - SwiGLU: the SiLU input, its output, the up projection and the product fed to w2 (``4*c*f``);
    - under autocast, the bf16 copies of the block's Linear weights (``2 * linear params``, per block, not per token).

    A checkpointed block keeps its input (``p*d``); a ``"selective"`` block also the matmul outputs
    (``c*(q + 2kv + 2d + 2f)``) and the attention output and logsumexp (``c*q + 4H``). The head keeps the final
    norm's saved tensors and the output projection's input (and, under autocast, its weight copy); the int64 token
    ids are counted, and the ``(T,)`` positions when some block is checkpointed (the RoPE gather saves nothing
    since the table needs no gradient). Sliding windows, packed documents and q/k/v biases are not modelled.
    A layer reading another layer's K/V keeps only its query terms; an MLA layer keeps its own set
    (:mod:`~lightning_llmopt.parallel.memory_attention` lists both).

    ``bf16_gathered=True`` (stage 3 under ``bf16-mixed``: FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16)``) computes
    on gathered bf16 weights under autocast: the embedding output and so the residual stream are bf16 (``p = 2``),
    autocast has nothing to cast (no weight copies, one shared bf16 input per norm), while buffers are not cast, so
    the RoPE rows stay fp32 (``4 * D`` per call). The saved weights are the gathered units, freed by
    ``reshard_after_forward`` and counted by :func:`estimate_memory`, not here.
    """
    _check_activation_args(precision, micro_batch, seq_len, activation_checkpointing, every_n)
    assert config.head_dim is not None and config.n_kv_heads is not None and config.ffn_hidden_dim is not None
    p, c, autocast = _dtype_bytes(precision)
    buffer = p  # RoPE table bytes: bf16-true casts buffers with the module, FSDP2's param_dtype does not
    if bf16_gathered and precision == "bf16-mixed":
        p, autocast, buffer = 2, False, 4
    d, f = config.dim, config.ffn_hidden_dim
    norm = norm_saved_bytes(d, p)
    ffn_in, head_in = (2 * c * d, c * d) if autocast else (p * d, p * d)
    swiglu = 4 * c * f
    embedding = config.vocab_size * d

    tokens = micro_batch * seq_len
    checkpointed = set(select_blocks(config.n_layers, activation_checkpointing, every_n))
    total = 0
    for i, layer in enumerate(layer_counts(config)):  # each block its own attention (GQA, K/V reader, MLA)
        attn, attn_selective = attention_saved_bytes(config, layer, p, c, autocast, buffer)
        if i not in checkpointed:
            total += (2 * norm + attn + ffn_in + swiglu) * tokens + (2 * layer.linear if autocast else 0)
            sources = config.kv_sources or []
            if layer.kv_reader and sources[i] in checkpointed:  # the source saved no k, v: this layer does
                assert config.n_kv_heads is not None and config.head_dim is not None
                total += 2 * c * config.n_kv_heads * config.head_dim * tokens
        elif activation_checkpointing == "selective":
            total += (p * d + attn_selective + c * (2 * d + 2 * f)) * tokens
        else:
            total += p * d * tokens
    total += (norm + head_in) * tokens + (2 * embedding if autocast else 0)
    # int64 token ids (kept by the embedding) and the (T,) positions (kept as an input of checkpointed blocks)
    return total + 8 * tokens + (8 * seq_len if checkpointed else 0)


def loss_bytes(config: LlamaConfig, *, precision: str, micro_batch: int, seq_len: int, loop: str = "plain",
               moment: str = "backward") -> int:
    """Logits and fp32 cross-entropy buffers of ``F.cross_entropy(logits.float(), labels)`` at one moment.

    ``moment="backward"`` (backward starts): the saved log-softmax output plus the two gradient buffers (of nll and
    of log-softmax) that backward allocates while it is still alive (``3 * 4V`` per token), plus the logits in the
    compute dtype (``c*V``) when the caller still holds them (``loop="plain"``; Lightning's ``training_step`` has
    returned and freed them). ``moment="forward"`` (inside the cross-entropy): the logits, their fp32 copy and the
    log-softmax output (``c*V + 8V``). Both add the int64 labels.
    """
    _, c, _ = _dtype_bytes(precision)
    v = config.vocab_size
    if moment == "forward":
        per_token = c * v + 8 * v
    else:
        per_token = 12 * v + (c * v if loop == "plain" else 0)
    return micro_batch * seq_len * (per_token + 8)


@dataclass(frozen=True)
class _States:
    parameters: int
    gradients: int
    persistent_gradients: int  # part of ``gradients`` alive between steps (stage 1 buckets, DDP buckets)
    optimizer_state: int
    master_weights: int
    cpu: int
    gathered: int  # stage 3: unsharded units alive at the peak (the root unit)


def _paper_states(psi: int, stage: int, n: int, k: int) -> _States:
    """ZeRO paper: 2Ψ fp16 parameters, 2Ψ fp16 gradients, KΨ fp32 optimizer states (master included)."""
    params = 2 * psi // (n if stage >= 3 else 1)
    grads = 2 * psi // (n if stage >= 2 else 1)
    state = k * psi // (n if stage >= 1 else 1)
    return _States(params, grads, 0, state, 4 * psi // (n if stage >= 1 else 1), 0, 0)


def _our_states(config: LlamaConfig, psi: int, stage: int, n: int, precision: str, state_bytes: int,
                offload_optimizer: bool, offload_parameters: bool) -> _States:
    """What this codebase stores. Stage 0 is DDP; a bf16-mixed gradient lands in fp32 ``param.grad``."""
    p, _, _ = _dtype_bytes(precision)
    shard = math.ceil(psi / n)
    if stage == 0:
        # Plain torch optimizer: state in the parameter dtype, the parameter is the master.
        params, grads = p * psi, p * psi
        ddp_buckets = p * psi if n > 1 else 0
        return _States(params, grads + ddp_buckets, ddp_buckets, state_bytes * psi * p // 4, 0, 0, 0)
    if stage == 3:
        gathered = 2 if precision == "bf16-mixed" else p  # FSDP2 param_dtype (strategies/zero.py)
        return _fsdp_states(config, psi, n, p, gathered, state_bytes, offload_optimizer, offload_parameters)
    # Our ZeRO-1/2: state over fp32 master shards; a master shard is the parameter slice itself for fp32 parameters.
    master = 0 if (p == 4 and not offload_optimizer) else 4 * shard
    state = state_bytes * shard
    if stage == 1:
        grads = p * psi + (4 * shard if p != 4 else 0)  # full flat buffers (+ the fp32 shard fed to the optimizer)
        persistent = p * psi
    else:
        grads, persistent = 4 * shard, 0  # the reduce-scattered shard, in the master dtype
    cpu = 0
    if offload_optimizer:  # masters, state and the shard's gradient live on the CPU
        moved = 4 * shard if (stage == 2 or p != 4) else 0  # stage 1 fp32 keeps its flat buffers on the device
        cpu, grads, master, state = master + state + 4 * shard, grads - moved, 0, 0
    return _States(p * psi, grads, persistent, master + state, master, cpu, 0)


def _fsdp_states(config: LlamaConfig, psi: int, n: int, p: int, g: int, state_bytes: int, offload_optimizer: bool,
                 offload_parameters: bool) -> _States:
    """FSDP2 ``fully_shard`` (``g``: gathered bytes per parameter): the sharded parameter is what the optimizer updates.

    The peak (end of forward / start of backward) holds no block unit: each block is resharded after its forward
    and re-gathered (with one prefetched) only once backward reaches it, when the loss buffers and its activations
    are being freed. The root unit (embedding, final norm, head) is not resharded after forward (FSDP2 keeps the
    root gathered since backward needs it at once), so it is alive at the peak: ``g`` bytes per root parameter.
    """
    shard = math.ceil(psi / n)
    params, grads, state = p * shard, p * shard, state_bytes * shard * p // 4
    gathered = g * embedding_params(config)  # embedding, final norm and (untied) output head
    cpu = 0
    if offload_optimizer:
        cpu, state = state, 0
    if offload_parameters:
        cpu, params, grads = cpu + params + grads, 0, 0
    return _States(params, grads, 0, state, 0, cpu, gathered)


def estimate_memory(config: LlamaConfig, *, stage: int, world_size: int, precision: str, micro_batch: int,
                    seq_len: int, activation_checkpointing: str = "none", every_n: int = 2, optimizer: str = "adamw",
                    offload_optimizer: bool = False, offload_parameters: bool = False,
                    accounting: str = "ours", loop: str = "lightning") -> MemoryEstimate:
    """Per-rank memory of training ``Llama(config)`` with ZeRO ``stage`` on ``world_size`` data-parallel ranks.

    Arguments:
        config: the model's :class:`LlamaConfig`.
        stage: 0 (DDP), 1, 2 (:mod:`lightning_llmopt.parallel.zero`) or 3 (FSDP2).
        world_size: data-parallel ranks N.
        precision: ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"`` or ``"bf16-true"`` (Lightning's names).
        micro_batch: sequences per rank per forward.
        seq_len: tokens per sequence.
        activation_checkpointing: ``"none"``, ``"full"``, ``"every_n"``, ``"sqrt"`` or ``"selective"`` (see
            :mod:`lightning_llmopt.parallel.activation_checkpointing`).
        every_n: the stride of ``"every_n"``.
        optimizer: ``"adamw"``/``"adam"`` (8 bytes of state per parameter), ``"sgd_momentum"`` (4) or ``"sgd"`` (0).
        offload_optimizer: ZeRO-Offload (stage >= 1): master shards and optimizer state on the CPU.
        offload_parameters: stage 3 only: parameters and gradients on the CPU too.
        accounting: ``"ours"`` (what this codebase stores) or ``"paper"`` (2+2+K bytes per parameter, ZeRO §5).
        loop: ``"lightning"`` (``zero_grad`` after ``training_step``, logits freed before backward) or ``"plain"``
            (logits held through backward, ``zero_grad`` after the step); see the module docstring.

    Returns: a :class:`MemoryEstimate` (bytes per rank). Activations depend on the stage only through stage 3's
    bf16 gathered weights under ``bf16-mixed``.
    """
    _check_state_args(stage, world_size, precision, optimizer, offload_optimizer, offload_parameters, accounting)
    if loop not in LOOPS:
        raise ValueError(f"loop ({loop!r}) must be one of {LOOPS}")
    bf16_gathered = stage == 3 and accounting == "ours"
    activations = activation_bytes(config, precision=precision, micro_batch=micro_batch, seq_len=seq_len,
                                   activation_checkpointing=activation_checkpointing, every_n=every_n,
                                   bf16_gathered=bf16_gathered)
    kw = dict(precision=precision, micro_batch=micro_batch, seq_len=seq_len, loop=loop)
    loss = loss_bytes(config, moment="backward", **kw)  # type: ignore[arg-type]
    forward_loss = loss_bytes(config, moment="forward", **kw)  # type: ignore[arg-type]
    psi = parameter_counts(config)[0]
    state_bytes = _STATE_BYTES[optimizer]
    paper = _paper_states(psi, stage, world_size, 4 + state_bytes)
    if accounting == "paper":
        s = paper
    else:
        s = _our_states(config, psi, stage, world_size, precision, state_bytes, offload_optimizer, offload_parameters)
    static = s.parameters + s.optimizer_state + s.persistent_gradients + s.gathered
    transient_grads = s.gradients - s.persistent_gradients
    stale_grads = transient_grads if loop == "lightning" else 0  # last step's, until zero_grad before backward
    forward_end = activations + forward_loss + stale_grads
    peak = static + max(forward_end, activations + loss, transient_grads)
    total = s.parameters + s.gradients + s.optimizer_state + activations
    return MemoryEstimate(
        parameters=s.parameters, gradients=s.gradients, optimizer_state=s.optimizer_state,
        master_weights=s.master_weights, activations=activations, loss=loss, total=total, peak=peak, cpu=s.cpu,
        paper_model_states=paper.parameters + paper.gradients + paper.optimizer_state, num_params=psi, stage=stage,
        world_size=world_size, precision=precision, activation_checkpointing=activation_checkpointing,
        accounting=accounting, loop=loop,
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_activation_args(precision: str, micro_batch: int, seq_len: int, policy: str, every_n: int) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision ({precision!r}) must be one of {PRECISIONS}")
    for name, value in (("micro_batch", micro_batch), ("seq_len", seq_len)):
        if not _is_int(value) or value < 1:
            raise ValueError(f"{name} ({value!r}) must be a positive integer")
    if policy not in POLICIES:
        raise ValueError(f"activation_checkpointing ({policy!r}) must be one of {POLICIES}")
    if not _is_int(every_n) or every_n < 1:
        raise ValueError(f"every_n ({every_n!r}) must be a positive integer")


def _check_state_args(stage: int, world_size: int, precision: str, optimizer: str, offload_optimizer: bool,
                      offload_parameters: bool, accounting: str) -> None:
    if not _is_int(stage) or stage not in (0, 1, 2, 3):
        raise ValueError(f"stage ({stage!r}) must be 0 (DDP), 1, 2 or 3")
    if not _is_int(world_size) or world_size < 1:
        raise ValueError(f"world_size ({world_size!r}) must be a positive integer")
    if precision not in PRECISIONS:
        raise ValueError(f"precision ({precision!r}) must be one of {PRECISIONS}")
    if optimizer not in _STATE_BYTES:
        raise ValueError(f"optimizer ({optimizer!r}) must be one of {tuple(_STATE_BYTES)}")
    if accounting not in ACCOUNTINGS:
        raise ValueError(f"accounting ({accounting!r}) must be one of {ACCOUNTINGS}")
    if offload_optimizer and stage == 0:
        raise ValueError(f"offload_optimizer=True needs ZeRO stage >= 1, got stage ({stage})")
    if offload_parameters and stage != 3:
        raise ValueError(f"offload_parameters=True needs stage 3, got stage ({stage})")
    if accounting == "paper" and (offload_optimizer or offload_parameters):
        raise ValueError("accounting='paper' models no offload; use accounting='ours' with offload_* options")
