"""Reference Llama-family decoder: RMSNorm, RoPE, GQA attention (optional sliding window), SwiGLU MLP.

The model has no parallel layers and makes no ``torch.distributed`` calls: parallelism is applied to a finished
model by functions in :mod:`lightning_llmopt.parallel`. Blocks live in a ``ModuleDict`` keyed ``"0".."L-1"`` so that
pipeline stages can drop blocks (and the embedding, final norm or head, set to ``None``) and keep their names.

Parameter names: ``tok_embeddings``, ``layers.{i}.attention_norm``, ``layers.{i}.attention.{wq,wk,wv,wo}``,
``layers.{i}.ffn_norm``, ``layers.{i}.feed_forward.{w1 (gate), w2 (down), w3 (up)}``, ``norm``, ``output``.

:class:`RMSNorm` and :class:`FeedForward` are defined in :mod:`~lightning_llmopt.models.blocks` (shared with
:mod:`~lightning_llmopt.models.mla` and :mod:`~lightning_llmopt.models.moe`) and importable from here.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_llmopt.models.attention import AttentionMask, attention
from lightning_llmopt.models.blocks import FeedForward, RMSNorm
from lightning_llmopt.models.config import LlamaConfig
from lightning_llmopt.models.init import draw_base_seed, init_param_, local_tensor, to_empty
from lightning_llmopt.models.kv_cache import KVCache
from lightning_llmopt.models.layer_pattern import SharedKV, attended_keys, layer_windows
from lightning_llmopt.models.mla import MLAttention
from lightning_llmopt.models.moe import MoEFeedForward
from lightning_llmopt.models.rope import apply_rope, rope_table

KernelStep = Callable[[nn.Module], object]
_KERNEL_STEP: KernelStep | None = None


def set_kernel_step(step: KernelStep) -> None:
    """Register the function that swaps ``config.fused_kernels`` into a new :class:`Llama` (called with the model at
    the end of its construction). The fused modules live above this module (``layers/``), so they are handed in
    rather than imported: :mod:`lightning_llmopt.optimize` registers its step when imported."""
    global _KERNEL_STEP
    _KERNEL_STEP = step


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, layer_id: int) -> None:
        super().__init__()
        assert config.n_kv_heads is not None and config.head_dim is not None
        self.layer_id = layer_id
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.window = config.layer_window(layer_id)
        # Cross-layer KV sharing: a layer reading another layer's keys/values has no wk/wv of its own.
        self.kv_source = config.kv_source(layer_id)
        self.backend = config.attn_backend
        self.wq = nn.Linear(config.dim, self.n_heads * self.head_dim, bias=config.qkv_bias)
        self.wk: nn.Linear | None = None
        self.wv: nn.Linear | None = None
        if self.kv_source == layer_id:
            self.wk = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=config.qkv_bias)
            self.wv = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.wo = nn.Linear(self.n_heads * self.head_dim, config.dim, bias=False)
        # Hook for a fused rotation, ``rotary(q, k, table, positions) -> (q, k)``; None: ``apply_rope``.
        self.rotary: nn.Module | None = None
        # One GEMM for q, k and v over the concatenated weights (set by ``optimize_model``; parameters unchanged).
        self.pack_qkv = False

    def _packable(self) -> bool:
        """Whether q, k and v can come from one GEMM: three plain ``nn.Linear`` without hooks (not a tensor-parallel
        layout, LoRA or quantized module), plain-tensor weights of one dtype, biases on all or none."""
        if self.wk is None or self.wv is None:
            return False
        lins = (self.wq, self.wk, self.wv)
        if not all(type(m) is nn.Linear and not m._forward_hooks and not m._forward_pre_hooks for m in lins):
            return False
        weights = [m.weight for m in lins]
        if any(type(w) not in (nn.Parameter, Tensor) for w in weights) or len({w.dtype for w in weights}) > 1:
            return False
        return len({m.bias is None for m in lins}) == 1

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(wq x, wk x, wv x)``. Packed: one GEMM over ``cat(wq, wk, wv)`` (the input's gradient is then one GEMM
        too, where three projections need two extra passes to sum theirs), split into views; ``v`` made contiguous
        (a small copy) so attention sees the layout of the unpacked path."""
        assert self.wk is not None and self.wv is not None
        if not (self.pack_qkv and self._packable()):
            return self.wq(x), self.wk(x), self.wv(x)
        lins = (self.wq, self.wk, self.wv)
        weight = torch.cat([m.weight for m in lins])
        bias = None if self.wq.bias is None else torch.cat([m.bias for m in lins])  # type: ignore[misc]
        q, k, v = F.linear(x, weight, bias).split([m.weight.shape[0] for m in lins], dim=-1)
        return q, k, v.contiguous()

    def forward(
        self, x: Tensor, rope: Tensor, positions: Tensor, mask: AttentionMask, kv_cache: KVCache | None = None
    ) -> Tensor:
        if self.kv_source != self.layer_id:
            return self._forward_shared(x, rope, positions, mask, kv_cache)
        B, T, _ = x.shape
        q, k, v = self._project(x)
        # Heads from the output size, not the config, so a tensor-parallel shard with fewer local heads works.
        q = q.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H_kv, T, D)
        v = v.view(B, T, -1, self.head_dim).transpose(1, 2)
        if self.rotary is not None:
            q, k = self.rotary(q, k, rope, positions)
        else:
            q, k = apply_rope(q, rope, positions), apply_rope(k, rope, positions)
        if kv_cache is not None:
            k, v, k_positions = kv_cache.update(self.layer_id, k, v, positions)
            if k_positions is not None:  # None: no cache behind a SharedKV (training), the training mask holds
                mask = AttentionMask(positions, k_positions, window=self.window)
        out = attention(q, k, v, mask, backend=self.backend)  # (B, H, T, D)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))

    def _forward_shared(
        self, x: Tensor, rope: Tensor, positions: Tensor, mask: AttentionMask, kv_cache: KVCache | None
    ) -> Tensor:
        """Attention over the keys/values layer ``kv_source`` stored this pass (cross-layer KV sharing)."""
        if not isinstance(kv_cache, SharedKV):
            raise RuntimeError(f"layer {self.layer_id} reads layer {self.kv_source}'s K/V: run it through Llama")
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        rotate = getattr(self.rotary, "rotate", None)  # the fused rotation of one tensor, if set
        q = rotate(q, rope, positions) if rotate is not None else apply_rope(q, rope, positions)
        k, v, k_positions = kv_cache.shared(self.kv_source)  # (B, H_kv, S, D)
        if k_positions is not None:
            mask = AttentionMask(positions, k_positions, window=self.window)
        out = attention(q, k, v, mask, backend=self.backend)  # (B, H, T, D)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


class TransformerBlock(nn.Module):
    def __init__(self, config: LlamaConfig, layer_id: int) -> None:
        super().__init__()
        assert config.ffn_hidden_dim is not None
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention: nn.Module
        if config.mla is not None:  # multi-head latent attention (DeepSeek-V2/V3)
            self.attention = MLAttention(config, layer_id)
        else:
            self.attention = Attention(config, layer_id)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward: nn.Module
        if config.moe is not None and config.moe.is_moe_layer(layer_id):
            self.feed_forward = MoEFeedForward(config.dim, config.ffn_hidden_dim, config.moe)
        else:
            self.feed_forward = FeedForward(config.dim, config.ffn_hidden_dim)

    def forward(
        self, x: Tensor, rope: Tensor, positions: Tensor, mask: AttentionMask, kv_cache: KVCache | None = None
    ) -> Tensor:
        norm_residual = getattr(self.attention_norm, "forward_residual", None)  # a fused norm: x passed through
        if norm_residual is not None:  # so the residual stream's gradient joins the norm's in its backward kernel
            x, normed = norm_residual(x)
        else:
            normed = self.attention_norm(x)
        a = self.attention(normed, rope, positions, mask, kv_cache)
        add_norm = getattr(self.ffn_norm, "forward_add", None)  # a fused norm: the residual add in the same pass
        if add_norm is not None:
            h, normed = add_norm(x, a)
        else:
            h = x + a
            normed = self.ffn_norm(h)
        return h + self.feed_forward(normed)


class Llama(nn.Module):
    """Llama-family decoder.

    Arguments:
        config: a :class:`LlamaConfig`.

    Build on the meta device and materialise with ``model.to_empty(device=...)`` then ``model.init_weights()``;
    eager construction initialises the same way. ``config.fused_kernels`` swaps in the fused Triton modules at
    construction through the kernel step registered with :func:`set_kernel_step` (the package registers
    :func:`lightning_llmopt.optimize.apply_config_kernels` once this module has loaded, see
    :mod:`lightning_llmopt._registration`; this module imports nothing above it). The
    parallel plan (:func:`lightning_llmopt.parallel.parallelize.parallelize`) runs the same step after tensor and
    context parallelism, where the fused modules learn their shard's layout.
    """

    # Methods that run the model besides ``forward`` (they share ``_trunk``, never call each other): wrappers that
    # hook the forward (FSDP2's parameter gathering) register these too.
    forward_methods: tuple[str, ...] = ("hidden_states", "loss")

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        # The seed of every parameter's generator (models/init.py), drawn before anything else so that it is the
        # same whether the model is built here, on the meta device, or sharded later; two models built one after
        # the other get different seeds.
        self.init_seed = draw_base_seed()
        device = torch.empty(0).device  # where the caller builds (a torch.device context, or the meta device)
        with torch.device("meta"):  # no throw-away default initialisation: init_weights sets every value below
            self._build(config)
        if device.type != "meta":
            to_empty(self, device)  # not nn.Module.to_empty: from meta it imports sympy (see models/init.py)
            self.init_weights()

    def _build(self, config: LlamaConfig) -> None:
        # built on the meta device: an explicit weight skips Embedding's own normal_ init, whose meta kernel imports
        # torch._dynamo (seconds); init_weights sets every value
        weight = torch.empty(config.vocab_size, config.dim)
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(config.vocab_size, config.dim, _weight=weight)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(config, i) for i in range(config.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(config.dim, config.norm_eps)
        self.output: nn.Linear | None = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        assert config.head_dim is not None
        self.rope: Tensor
        # the (max_seq_len, rope_dim / 2, 2) table: laid out only, here on the meta device (computing it there runs
        # Python meta kernels that import torch._dynamo); reset_buffers computes it wherever the model materialises
        self.register_buffer(
            "rope", torch.empty(config.max_seq_len, config.rope_dim // 2, 2, dtype=torch.float32), persistent=False
        )
        # Set to a fused linear + cross-entropy module by optimize_model(fused_ce=True); used by :meth:`loss`.
        self.fused_loss: nn.Module | None = None
        if config.fused_kernels:
            if _KERNEL_STEP is None:
                raise RuntimeError(
                    f"fused_kernels ({config.fused_kernels}) needs the kernel step: import lightning_llmopt.optimize"
                )
            _KERNEL_STEP(self)

    # ------------------------------------------------------------------ initialisation
    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """(Re)initialise every parameter and buffer in place; works after ``to_empty`` from the meta device and on
        sharded parameters (``DTensor``, expert shards, pipeline stages).

        Linear and embedding weights ~ N(0, init_std); each block's output projections (``wo``, ``w2``) use
        ``init_std / sqrt(2 * n_layers)``; biases are zero and norm weights one. Each random weight comes from its
        own generator seeded by ``(self.init_seed, its name)`` and is generated whole, then this process keeps its
        shard (:mod:`lightning_llmopt.models.init`): the values do not depend on how the model is sharded.
        ``buffer_device``: where buffers go and where weights are generated (default: each parameter's device).
        """
        cfg = self.config
        self.reset_buffers(buffer_device)
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        device = buffer_device if buffer_device is not None and torch.device(buffer_device).type != "meta" else None
        done: set[int] = set()  # a tied head is its embedding: initialised once, under the embedding's name

        def normal(param: Tensor, name: str, std: float) -> None:
            if id(param) not in done:
                done.add(id(param))
                init_param_(param, name, self.init_seed, lambda t, g: t.normal_(0.0, std, generator=g), device=device)

        for name, module in self.named_modules():
            if isinstance(module, nn.Embedding):
                normal(module.weight, f"{name}.weight", cfg.init_std)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                normal(module.weight, f"{name}.weight", out_std if name.endswith((".wo", ".w2")) else cfg.init_std)
                if module.bias is not None:
                    local_tensor(module.bias).zero_()
            elif isinstance(module, RMSNorm):
                local_tensor(module.weight).fill_(1.0)
            elif hasattr(module, "init_experts"):  # MoEFeedForward: stacked expert weights, balance bias
                module.init_experts(cfg.init_std, out_std, prefix=name, seed=self.init_seed, device=device)
        if cfg.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def reset_buffers(self, device: torch.device | str | None = None) -> None:
        """Recompute the (non-persistent) RoPE table, e.g. after ``to_empty`` or ``load_state_dict(assign=True)``."""
        cfg = self.config
        assert cfg.head_dim is not None
        device = device if device is not None else self.rope.device
        if torch.device(device).type == "meta":
            device = next((p.device for p in self.parameters() if not p.is_meta), torch.device("cpu"))
        self.rope = rope_table(cfg.max_seq_len, cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling, device=device)

    # ------------------------------------------------------------------ forward
    def hidden_states(
        self,
        tokens: Tensor,
        positions: Tensor | None = None,
        doc_ids: Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> Tensor:
        """Final-norm hidden states ``(B, T, dim)``.

        Arguments:
            tokens: ``(B, T)`` int64 token ids, or ``(B, T, dim)`` hidden states for a pipeline stage without
                the embedding.
            positions: ``(B, T)`` int64 positions (default ``arange(T)``; per document when packing).
            doc_ids: ``(B, T)`` document index of each token of packed rows; attention never crosses documents.
                Positions default to restarting at each document.
            kv_cache: a :class:`~lightning_llmopt.models.kv_cache.KVCache` to store and read keys/values.
        """
        return self._trunk(tokens, positions, doc_ids, kv_cache)

    def _trunk(
        self, tokens: Tensor, positions: Tensor | None, doc_ids: Tensor | None, kv_cache: KVCache | None
    ) -> Tensor:
        """The body of :meth:`hidden_states`, shared by every entry point (:attr:`forward_methods` call it rather
        than each other, so a wrapper that hooks each entry point runs its hooks once per call)."""
        B, T = tokens.shape[:2]
        plain = positions is None and doc_ids is None and kv_cache is None
        if positions is None:
            if doc_ids is not None:
                from lightning_llmopt.models.attention import positions_from_doc_ids

                positions = positions_from_doc_ids(doc_ids)
            else:
                positions = torch.arange(T, device=tokens.device).expand(B, T)
        self._check_positions(positions, given=not plain)
        windows = layer_windows(self.config)  # one mask per distinct window (layer patterns)
        masks = {
            w: AttentionMask(positions, positions, doc_ids, doc_ids, window=w, plain_causal=plain and w is None)
            for w in set(windows)
        }
        if self.config.kv_sources is not None:
            kv_cache = SharedKV(kv_cache)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for key, block in self.layers.items():
            h = block(h, self.rope, positions, masks[windows[int(key)]], kv_cache)
        return self.norm(h) if self.norm is not None else h

    def _check_positions(self, positions: Tensor, given: bool) -> None:
        limit = self.config.max_seq_len
        if positions.shape[1] > limit and not given:
            raise ValueError(f"sequence length ({positions.shape[1]}) exceeds max_seq_len ({limit})")
        # Explicit positions are checked on the host (one sync), except where that is impossible.
        if given and positions.numel() and not positions.is_meta and not torch.compiler.is_compiling():
            top = int(positions.max())
            if top >= limit:
                raise ValueError(f"position {top} is beyond max_seq_len ({limit})")

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor | None = None,
        doc_ids: Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> Tensor:
        """Logits ``(B, T, vocab_size)`` in the parameters' dtype; see :meth:`hidden_states` for the arguments."""
        h = self._trunk(tokens, positions, doc_ids, kv_cache)
        return self.output(h) if self.output is not None else h

    def loss(
        self,
        tokens: Tensor,
        labels: Tensor,
        positions: Tensor | None = None,
        doc_ids: Tensor | None = None,
        ignore_index: int = -100,
    ) -> Tensor:
        """Mean cross-entropy of ``labels`` ``(B, T)`` (``ignore_index`` skipped), fp32 scalar.

        With :attr:`fused_loss` set (``optimize_model(fused_ce=True)`` or ``fused_kernels``), the head and the loss
        run chunk by chunk and the ``(B, T, vocab_size)`` logits never exist; otherwise
        ``cross_entropy(self(tokens).float(), labels)``. Other arguments as :meth:`hidden_states`.
        """
        if self.output is None:
            raise ValueError("loss() needs the output head (this model has output=None)")
        h = self._trunk(tokens, positions, doc_ids, None)
        if self.fused_loss is not None:
            return self.fused_loss(h, self.output.weight, labels, ignore_index=ignore_index)
        logits = self.output(h)
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=ignore_index)

    # ------------------------------------------------------------------ accounting
    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Number of distinct parameters (tied weights counted once)."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings and self.tok_embeddings is not None:
            n -= self.tok_embeddings.weight.numel()
        return n

    def flops_per_token(self, seq_len: int, training: bool = True) -> float:
        """Model FLOPs per token (PaLM appendix B): ``6 N + 6 L H D T`` for training (causal attention, half the
        ``12 L H D T`` of full attention), ``2 N + 2 L H D T`` for a forward pass; ``N`` excludes the embedding
        lookup but includes the output head. A windowed layer counts the keys its window lets each query see
        (:func:`~lightning_llmopt.models.layer_pattern.attended_keys`) instead of ``T / 2``.
        """
        cfg = self.config
        assert cfg.head_dim is not None
        n = sum(p.numel() for p in self.parameters())
        if not cfg.tie_embeddings:
            n -= cfg.vocab_size * cfg.dim  # the embedding lookup does no matmul
        for block in self.layers.values():  # MoE: only top_k of the num_experts experts run per token
            ffn = block.feed_forward
            if hasattr(ffn, "init_experts"):
                e = ffn.experts
                per_expert = (e.w1.numel() + e.w2.numel() + e.w3.numel()) // e.w1.shape[0]
                n -= per_expert * (e.w1.shape[0] - ffn.config.top_k * e.w1.shape[0] / ffn.num_experts)
        ctx = sum(2 * attended_keys(seq_len, w) for w in layer_windows(cfg))  # seq_len per global layer
        head = (cfg.mla.qk_head_dim + cfg.mla.v_head_dim) / 2 if cfg.mla is not None else cfg.head_dim  # q.k, p.v
        attn = cfg.n_heads * head * ctx
        return (6 * n + 6 * attn) if training else (2 * n + 2 * attn)
