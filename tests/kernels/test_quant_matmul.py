"""Weight-only quantized matmul: the Triton kernel (interpreter on CPU) against the dequantized fp64 reference.

Tolerance rule (as the flash-attention tests): ``max|kernel - ref64| <= 2 * max|torch_same_dtype - ref64| + floor``,
``ref64`` the reference in fp64, ``torch_same_dtype`` plain PyTorch dequantizing to and multiplying in the inputs'
dtype (``quant_matmul_ref(..., upcast=False)``), ``floor = 4 * eps(dtype) * max(max|ref64|, 1)`` (fp32 PyTorch is
itself within a few ulps; twice a lucky small error is not a bound another summation order can be held to).
"""

from __future__ import annotations

import pytest
import torch

from lightning_llmopt.kernels.quant_matmul import kernel_supports, quant_matmul, resolve_quant_backend
from lightning_llmopt.kernels.quant_matmul_ref import dequantize_packed, quant_matmul_ref
from lightning_llmopt.layers.quantized_linear import QuantizedLinear
from lightning_llmopt.quantization import QuantizedWeight, QuantSpec, pack_bits
from lightning_llmopt.testing.triton import triton_available, triton_interpreter_enabled

pytestmark = pytest.mark.skipif(
    not triton_available() or not (torch.cuda.is_available() or triton_interpreter_enabled()),
    reason="needs triton (and TRITON_INTERPRET=1 without CUDA)",
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weights(n: int, k: int, bits: int, group: int | None, sym: bool, seed: int):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    groups = 1 if group is None else k // group
    codes = torch.randint(0, 1 << bits, (n, k), generator=g)
    scales = torch.rand(n, groups, generator=g) * 0.05 + 0.005
    zeros = None if sym else torch.randint(0, 1 << bits, (n, groups), generator=g, dtype=torch.uint8)
    return pack_bits(codes, bits).to(DEVICE), scales.to(DEVICE), None if zeros is None else zeros.to(DEVICE)


def _check(x: torch.Tensor, qw, scales, zeros, bits: int, **kw) -> None:  # type: ignore[no-untyped-def]
    out = quant_matmul(x, qw, scales, zeros, bits=bits, backend="triton", **kw)
    ref = quant_matmul_ref(x.double(), qw, scales, zeros, bits)
    same = quant_matmul_ref(x, qw, scales, zeros, bits, upcast=False)
    assert out.shape == ref.shape and out.dtype == x.dtype
    assert not torch.isnan(out).any()
    err = (out.double() - ref).abs().max().item()
    pt_err = (same.double() - ref).abs().max().item()
    floor = 4 * torch.finfo(x.dtype).eps * max(ref.abs().max().item(), 1.0)
    assert err <= 2 * pt_err + floor, f"kernel error {err:.3g} > 2 x PyTorch {pt_err:.3g} + {floor:.3g}"


@pytest.mark.parametrize(
    "M, N, K, bits, group, sym, split_k, dtype",
    [
        (1, 17, 96, 4, 32, True, 1, torch.float32),  # batch 1, odd N, group 32
        (17, 40, 256, 4, 128, False, 2, torch.float16),  # asymmetric, group 128, split-K 2
        (5, 33, 192, 4, 64, True, 3, torch.float16),  # group 64, split-K 3 over 6 tiles
        (3, 24, 100, 8, None, True, 1, torch.float32),  # int8 per-channel, K not a multiple of the block
        (16, 48, 128, 8, None, False, 4, torch.float16),  # int8 per-channel asymmetric, split-K 4
        (2, 20, 128, 8, 32, True, 2, torch.float32),  # int8 with groups
        (33, 16, 64, 4, None, False, 1, torch.float32),  # int4 per-channel, several M tiles
    ],
)
def test_kernel_matches_dequantized_reference(M, N, K, bits, group, sym, split_k, dtype) -> None:
    qw, scales, zeros = _weights(N, K, bits, group, sym, seed=M + N + K)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(DEVICE, dtype)
    _check(x, qw, scales, zeros, bits, split_k=split_k)


def test_scales_in_half_precision_and_strided_input() -> None:
    qw, scales, _ = _weights(24, 64, 4, 32, True, seed=3)
    x = torch.randn(6, 128).to(DEVICE)[:, ::2]  # non-contiguous rows
    _check(x, qw, scales.half(), None, 4)


def test_input_gradient_matches_reference() -> None:
    qw, scales, zeros = _weights(16, 64, 4, 32, False, seed=4)
    x = torch.randn(3, 64, device=DEVICE, requires_grad=True)
    dy = torch.randn(3, 16, device=DEVICE)
    (gx,) = torch.autograd.grad(quant_matmul(x, qw, scales, zeros, bits=4, backend="triton"), x, dy)
    w = dequantize_packed(qw, scales, zeros, 4, 64, dtype=torch.float64)
    assert torch.allclose(gx.double(), dy.double() @ w, atol=1e-5)


def test_custom_op_passes_opcheck() -> None:
    qw, scales, zeros = _weights(16, 64, 4, 32, False, seed=5)
    x = torch.randn(2, 64, device=DEVICE)
    torch.library.opcheck(
        torch.ops.lightning_llmopt.quant_matmul.default,
        (x, qw, scales, zeros, 4, 0),
        test_utils=("test_schema", "test_faketensor"),
    )


@pytest.mark.parametrize("act_order, bias", [(False, True), (True, False)])
def test_quantized_linear_is_a_drop_in_linear(act_order: bool, bias: bool) -> None:
    g = torch.Generator().manual_seed(6)
    qw, scales, _ = _weights(40, 64, 4, 32, True, seed=6)
    perm = torch.randperm(64, generator=g).to(DEVICE) if act_order else None
    layer = QuantizedLinear.from_quantized(
        QuantizedWeight(qw, scales, None, 4, 32, 64, perm),
        torch.randn(40) if bias else None,
        dtype=torch.float32,
        backend="triton",
    )
    x = torch.randn(2, 5, 64, generator=g).to(DEVICE)  # (B, T, K)
    ref = torch.nn.functional.linear(x.double(), layer.dequantize(torch.float64), layer.bias.double() if bias else None)
    out = layer(x)
    assert out.shape == (2, 5, 40)
    assert torch.allclose(out.double(), ref, atol=1e-4)


def test_backend_selection() -> None:
    assert kernel_supports(4, 128, 4) and kernel_supports(8, 100, 1)
    assert not kernel_supports(3, 128, 4) and not kernel_supports(4, 96, 12)  # 3 bits; groups of 8 columns
    assert kernel_supports(8, 64, 4) and not kernel_supports(4, 64, 4)  # groups of 16: 8 bits only
    cpu = torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_quant_backend("auto", cpu) == "reference"
    with pytest.raises(ValueError, match="needs 4- or 8-bit"):
        resolve_quant_backend("triton", cpu, supported=False)
    with pytest.raises(ValueError, match="must be one of"):
        resolve_quant_backend("cutlass", cpu)
    qw = pack_bits(torch.randint(0, 8, (8, 64)), 3)  # 3-bit codes run the reference with backend auto
    x = torch.randn(2, 64)
    out = quant_matmul(x, qw, torch.ones(8, 2), bits=3)
    assert torch.allclose(out, x @ dequantize_packed(qw, torch.ones(8, 2), None, 3, 64).t(), atol=1e-5)
    with pytest.raises(ValueError, match="scales must be"):
        quant_matmul(torch.randn(2, 64), qw, torch.ones(8, 3), bits=3)


def test_spec_of_quantized_linear() -> None:
    layer = QuantizedLinear(64, 8, bits=4, group_size=None)
    assert layer.spec == QuantSpec(4, "channel", 64, True)


@pytest.mark.gpu
@pytest.mark.parametrize("bits, group, sym", [(4, 128, True), (4, 32, False), (8, None, True), (8, None, False)])
@pytest.mark.parametrize("M", [1, 16, 100])
def test_kernel_bf16_on_gpu(M: int, bits: int, group: int | None, sym: bool) -> None:
    # bf16 dots are wrong in the Triton interpreter (numpy has no bf16): bf16 is checked on a GPU only
    qw, scales, zeros = _weights(512, 1024, bits, group, sym, seed=M)
    x = torch.randn(M, 1024, generator=torch.Generator().manual_seed(M)).to(DEVICE, torch.bfloat16)
    _check(x, qw, scales.to(torch.bfloat16), zeros, bits, split_k=1 if M > 16 else 4)  # fixed configs: no autotuning


def _assert_launch_within_rule(x: torch.Tensor, qw, scales, zeros, bits: int, group: int | None, cfg) -> None:  # type: ignore[no-untyped-def]
    """One :func:`launch` at ``cfg`` against the fp64 reference by the module's tolerance rule."""
    from lightning_llmopt.kernels.quant_matmul_fwd import launch
    from lightning_llmopt.quantization.packing import as_kernel_bytes

    k = x.shape[1]
    out = launch(x, as_kernel_bytes(qw, bits, k), scales.to(x.dtype), zeros, bits, group or 0, cfg)
    ref = quant_matmul_ref(x.double(), qw, scales.to(x.dtype), zeros, bits)
    same = quant_matmul_ref(x, qw, scales.to(x.dtype), zeros, bits, upcast=False)
    assert not torch.isnan(out).any()
    err = (out.double() - ref).abs().max().item()
    pt_err = (same.double() - ref).abs().max().item()
    floor = 4 * torch.finfo(x.dtype).eps * max(ref.abs().max().item(), 1.0)
    assert err <= 2 * pt_err + floor, (cfg, x.dtype, err, pt_err)


@pytest.mark.gpu
@pytest.mark.parametrize("asm", [False, True])
@pytest.mark.parametrize(
    "bits, group, sym", [(4, 128, True), (4, 32, False), (4, None, True), (8, None, False), (8, 64, True)]
)
@pytest.mark.parametrize("block_k, split", [(256, 1), (256, 2), (1024, 2)])
@pytest.mark.parametrize("wide", [False, True])
def test_words_kernel_half_precision_on_gpu(
    asm: bool, bits: int, group: int | None, sym: bool, block_k: int, split: int, wide: bool
) -> None:
    from lightning_llmopt.kernels.quant_matmul_fwd import KernelConfig

    n, k = 300, 2048
    qw, scales, zeros = _weights(n, k, bits, group, sym, seed=bits + block_k)
    for dtype in (torch.bfloat16, torch.float16):
        for n_rows in (n, 256):  # masked rows; whole rows (4 bits: the unmasked path)
            x = torch.randn(1, k, generator=torch.Generator().manual_seed(split)).to(DEVICE, dtype)
            cfg = KernelConfig(
                "words", 1, 16, block_k, split, 4, 3, True, asm, prefetch=split > 1, wide=wide, evict=wide,
                fixed_strides=wide and split == 1,
            )  # fmt: skip
            zs = None if zeros is None else zeros[:n_rows]
            _assert_launch_within_rule(x, qw[:n_rows], scales[:n_rows], zs, bits, group, cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("asm", [False, True])
@pytest.mark.parametrize("bits, group, sym", [(4, 128, True), (4, 32, False), (8, None, False), (8, 64, True)])
@pytest.mark.parametrize("M, block_n, split", [(1, 64, 1), (7, 128, 2), (16, 64, 4), (33, 128, 1)])
def test_swapped_mma_half_precision_on_gpu(
    asm: bool, bits: int, group: int | None, sym: bool, M: int, block_n: int, split: int
) -> None:
    from lightning_llmopt.kernels.quant_matmul_fwd import KernelConfig

    if asm and (bits != 4 or not sym):
        pytest.skip("the inline-PTX tensor-core path takes symmetric 4-bit codes")
    n, k = 300, 1024
    qw, scales, zeros = _weights(n, k, bits, group, sym, seed=bits + M)
    dtypes = (torch.bfloat16,) if asm else (torch.bfloat16, torch.float16)
    for dtype in dtypes:
        x = torch.randn(M, k, generator=torch.Generator().manual_seed(M)).to(DEVICE, dtype)
        cfg = KernelConfig(
            "mma_t", 16, block_n, min(128, group or 128), split, 4, 3, True, asm, prefetch=split > 1, x_split=split == 1
        )
        _assert_launch_within_rule(x, qw, scales, zeros, bits, group, cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("kind, M", [("words", 1), ("mma", 16), ("mma_t", 5)])
def test_split_k_fixup_repeated_and_in_cuda_graphs(kind: str, M: int) -> None:
    """The last program of each split-K tile sums the partials and resets its counter: many calls in a row, with
    different split counts and tile counts, and replays of one captured graph, all give the same exact result."""
    from lightning_llmopt.kernels.quant_matmul_fwd import KernelConfig, launch
    from lightning_llmopt.quantization.packing import as_kernel_bytes

    n, k, bits, group = 520, 2048, 4, 128
    qw, scales, _ = _weights(n, k, bits, group, True, seed=M)
    w, scales = as_kernel_bytes(qw, bits, k), scales.to(torch.bfloat16)
    x = torch.randn(M, k, generator=torch.Generator().manual_seed(3)).to(DEVICE, torch.bfloat16)
    ref = quant_matmul_ref(x.double(), qw, scales, None, bits)
    results = {}
    for rep in range(3):
        for split in (2, 3, 4, 8):
            block_k = 256 if kind == "words" else 128
            cfg = KernelConfig(kind, 16, 16 if kind == "words" else 64, block_k, split, 4, 3, True)
            out = launch(x, w, scales, None, bits, group, cfg)
            rel = ((out.double() - ref).norm() / ref.norm()).item()
            assert rel < 1e-2, (split, rel)
            if rep == 0:
                results[split] = out.clone()
            else:  # the partials are summed in split order: bitwise repeatable
                assert torch.equal(out, results[split]), split
    cfg = KernelConfig(kind, 16, 16 if kind == "words" else 64, 128, 4, 4, 3, True)
    expected = launch(x, w, scales, None, bits, group, cfg)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        launch(x, w, scales, None, bits, group, cfg)  # the counters of this stream exist before the capture
        with torch.cuda.graph(graph, stream=stream):
            captured = launch(x, w, scales, None, bits, group, cfg)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(5):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("kind, M, split", [("words", 1, 1), ("words", 1, 4), ("mma", 16, 1), ("mma_t", 5, 4)])
def test_programmatic_dependent_chain_in_cuda_graph(monkeypatch: pytest.MonkeyPatch, kind: str, M: int, split: int):
    """Each product reads the one before it (and a split-K fixup reuses one counter buffer): launched as programmatic
    dependents inside a CUDA graph, the chain equals the same chain launched in order without PDL, bit for bit."""
    from lightning_llmopt.kernels.pdl import pdl_enabled
    from lightning_llmopt.kernels.quant_matmul_fwd import KernelConfig, launch
    from lightning_llmopt.quantization.packing import as_kernel_bytes

    if not pdl_enabled(torch.device(DEVICE)):
        pytest.skip("programmatic dependent launch needs compute capability 9.0 and a Triton with gdc_wait")
    n = k = 1024
    layers = []
    for i in range(6):
        qw, scales, _ = _weights(n, k, 4, 128, True, seed=10 + i)
        layers.append((as_kernel_bytes(qw, 4, k), (scales * 8 / k**0.5).to(torch.bfloat16)))
    cfg = KernelConfig(kind, 16, 16 if kind == "words" else 64, 128 if kind != "words" else 256, split, 4, 3, True)
    x0 = torch.randn(M, k, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.bfloat16)

    def chain(x: torch.Tensor) -> torch.Tensor:
        for w, s in layers:
            x = launch(x, w, s, None, 4, 128, cfg)
        return x

    monkeypatch.setenv("LLMOPT_PDL", "0")
    expected = chain(x0)
    monkeypatch.setenv("LLMOPT_PDL", "1")
    eager = chain(x0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        chain(x0)
        with torch.cuda.graph(graph, stream=stream):
            captured = chain(x0)
    torch.cuda.current_stream().wait_stream(stream)
    assert torch.isfinite(expected).all() and expected.abs().max() > 0
    assert torch.equal(eager, expected)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, expected)


@pytest.mark.parametrize(
    "kind, center, bits, group, sym, M",
    [
        ("gemv", True, 4, 32, False, 1),  # batch-1 kernel, asymmetric groups
        ("gemv", True, 8, None, True, 1),  # batch-1 kernel, int8 per channel
        ("gemv", True, 4, 64, True, 1),
        ("words", True, 4, 32, False, 1),  # batch-1 word kernel: one group per tile
        ("words", True, 4, 16, False, 1),  # groups smaller than the tile: a scale and zero point per word
        ("words", True, 8, None, True, 1),
        ("words", True, 8, 16, True, 1),
        ("mma", False, 4, 32, False, 5),  # zero points folded as (OFFSET + z) * sum(x)
        ("mma", False, 8, None, False, 3),
        ("mma_t", True, 4, 32, False, 5),  # transposed output: weights as the left operand
        ("mma_t", True, 4, None, True, 1),
        ("mma_t", False, 8, None, False, 3),
        ("mma_t", False, 4, 32, True, 17),
    ],
)
def test_kernel_variants(kind: str, center: bool, bits: int, group: int | None, sym: bool, M: int) -> None:
    from lightning_llmopt.kernels.quant_matmul_fwd import KernelConfig, launch
    from lightning_llmopt.quantization.packing import as_kernel_bytes

    N, K = 40, 128
    qw, scales, zeros = _weights(N, K, bits, group, sym, seed=bits + M)
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(DEVICE, dtype)
        for split in (1, 2):
            prefetch = split == 2 or M == 17  # the double-buffered loop, including over a split's boundary
            x_split = kind != "gemv" and kind != "words" and not prefetch and bits == 4  # reordered activations
            cfg = KernelConfig(
                kind, 16, 16, min(32, group or 32), split, 4, 1, center, prefetch=prefetch, x_split=x_split
            )
            out = launch(x, as_kernel_bytes(qw, bits, K), scales, zeros, bits, 0 if group is None else group, cfg)
            ref = quant_matmul_ref(x.double(), qw, scales, zeros, bits)
            same = quant_matmul_ref(x, qw, scales, zeros, bits, upcast=False)
            err = (out.double() - ref).abs().max().item()
            pt_err = (same.double() - ref).abs().max().item()
            floor = 4 * torch.finfo(dtype).eps * max(ref.abs().max().item(), 1.0)
            assert err <= 2 * pt_err + floor, (dtype, split, err, pt_err)


@pytest.mark.parametrize("bits, group, sym", [(4, 16, False), (4, 64, True), (8, None, False), (8, 32, True)])
@pytest.mark.parametrize("prefetch", [False, True])
def test_words_kernel_whole_tiles(bits: int, group: int | None, sym: bool, prefetch: bool) -> None:
    """The word kernel's unmasked path (every row block and K tile whole: ``EVEN``), tiles spanning groups and
    tiles inside one, split-K, against the float64 reference by the tolerance rule."""
    from lightning_llmopt.kernels.quant_matmul_fwd import KernelConfig, launch
    from lightning_llmopt.quantization.packing import as_kernel_bytes

    N, K = 32, 256
    qw, scales, zeros = _weights(N, K, bits, group, sym, seed=bits + 7)
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(1, K, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
        for block_k, split in ((64, 1), (32, 2), (128, 2)):
            cfg = KernelConfig("words", 1, 16, block_k, split, 4, 1, True, prefetch=prefetch)
            out = launch(x, as_kernel_bytes(qw, bits, K), scales, zeros, bits, group or 0, cfg)
            ref = quant_matmul_ref(x.double(), qw, scales, zeros, bits)
            same = quant_matmul_ref(x, qw, scales, zeros, bits, upcast=False)
            err = (out.double() - ref).abs().max().item()
            pt_err = (same.double() - ref).abs().max().item()
            floor = 4 * torch.finfo(dtype).eps * max(ref.abs().max().item(), 1.0)
            assert err <= 2 * pt_err + floor, (dtype, block_k, split, err, pt_err)


@pytest.mark.parametrize(
    "bits, group, sym", [(4, 16, False), (4, 64, True), (4, None, False), (8, None, True), (8, 32, False)]
)
@pytest.mark.parametrize("N, K", [(32, 256), (40, 192)])  # whole tiles (``EVEN`` for 4 bits); masked rows and K
def test_wide_words_kernel(bits: int, group: int | None, sym: bool, N: int, K: int) -> None:
    """The word kernel over int64 elements of two words (``wide``), with the codes' cache policy (``evict``) and the
    row strides compiled in (``fixed_strides``): groups of one element (16 int4 codes), tiles spanning groups and
    inside one, per-channel codes, split-K, the double-buffered loop, against the float64 reference by the rule."""
    from lightning_llmopt.kernels.quant_matmul_fwd import KernelConfig

    qw, scales, zeros = _weights(N, K, bits, group, sym, seed=bits + N)
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(1, K, generator=torch.Generator().manual_seed(K)).to(DEVICE, dtype)
        launches = ((32, 1, True, True), (64, 2, False, True), (16, 1, False, False), (128, 1, True, False))
        for block_k, split, prefetch, fixed in launches:
            if block_k % (64 // bits) or (group and group % block_k and block_k % group):
                continue
            cfg = KernelConfig(
                "words", 1, 16, block_k, split, 4, 1, True, prefetch=prefetch, wide=True, evict=fixed,
                fixed_strides=fixed,
            )  # fmt: skip
            _assert_launch_within_rule(x, qw, scales, zeros, bits, group, cfg)


@pytest.mark.parametrize("group, sym", [(16, False), (64, True), (None, False), (None, True)])
@pytest.mark.parametrize("wide", [False, True])
def test_words_kernel_remainder_tile(group: int | None, sym: bool, wide: bool) -> None:
    """4-bit codes, whole row blocks, one K slice longer than the tile but not a multiple of it (as 11008 codes in
    tiles of 2048): whole tiles without masks and the rest of the row as one masked tile, with and without the
    double-buffered loop, against the float64 reference by the tolerance rule."""
    from lightning_llmopt.kernels.quant_matmul_fwd import KernelConfig

    N, K = 32, 320  # tiles of 128 codes leave 64, tiles of 256 leave 64
    qw, scales, zeros = _weights(N, K, 4, group, sym, seed=K + (group or 0))
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(1, K, generator=torch.Generator().manual_seed(11)).to(DEVICE, dtype)
        for block_k, prefetch in ((128, False), (128, True), (256, False)):
            cfg = KernelConfig("words", 1, 16, block_k, 1, 4, 1, True, prefetch=prefetch, wide=wide, evict=wide)
            _assert_launch_within_rule(x, qw, scales, zeros, 4, group, cfg)


def test_wide_word_candidates_run() -> None:
    """Every wide word-kernel launch the batch-1 tuner tries for 4-bit codes (without inline PTX, as on the CPU)
    takes the shape and is within the rule."""
    from lightning_llmopt.kernels.quant_matmul_tune import candidate_configs

    N, K, group = 16, 2048, 128
    qw, scales, _ = _weights(N, K, 4, group, True, seed=5)
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(5)).to(DEVICE, torch.float16)
    wide = [c for c in candidate_configs(1, K, group, wide_words=True) if c.wide]
    assert len(wide) >= 4 and not any(c.wide for c in candidate_configs(1, K, group))
    for cfg in wide:
        _assert_launch_within_rule(x, qw, scales, None, 4, group, cfg)


def test_words_and_tiles_refused() -> None:
    """A wide element takes two whole words: an odd number of words per row is refused, not misread."""
    from lightning_llmopt.kernels.quant_matmul_fwd import KernelConfig, launch
    from lightning_llmopt.quantization.packing import as_kernel_bytes

    qw, scales, _ = _weights(8, 72, 4, None, True, seed=0)  # 9 int32 words a row
    x = torch.randn(1, 72).to(DEVICE)
    with pytest.raises(ValueError, match="whole 64-bit elements"):
        launch(x, as_kernel_bytes(qw, 4, 72), scales, None, 4, 0, KernelConfig("words", 1, 8, 16, wide=True))
    # 4-bit tensor-core tiles of 16 columns are refused too (two 8-column halves: wrong products on a GPU)
    with pytest.raises(ValueError, match="BLOCK_K >= 32"):
        launch(x, as_kernel_bytes(qw, 4, 72), scales, None, 4, 0, KernelConfig("mma", 16, 16, 16))


@pytest.mark.parametrize("kind", ["mma", "mma_t"])
@pytest.mark.parametrize("group, sym, M", [(32, True, 1), (32, False, 5), (None, True, 17), (64, False, 16)])
def test_widened_4bit_tiles(kind: str, group: int | None, sym: bool, M: int) -> None:
    """``widen``: the nibble planes interleaved back into column order in registers and one full-width product per
    tile (activations loaded as they are, ``x_split`` ignored); split-K up to 8 slices, the double-buffered loop."""
    from lightning_llmopt.kernels.quant_matmul_fwd import KernelConfig

    N, K = 40, 256
    qw, scales, zeros = _weights(N, K, 4, group, sym, seed=M + (group or 0))
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(DEVICE, dtype)
        for split, prefetch in ((1, False), (2, True), (8, False)):
            cfg = KernelConfig(
                kind, 16, 16, min(32, group or 32), split, 4, 1, True, prefetch=prefetch, x_split=True, widen=True
            )
            _assert_launch_within_rule(x, qw, scales, zeros, 4, group, cfg)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "kind, M, block_n, split, warps",
    [("mma", 16, 64, 8, 4), ("mma", 3, 32, 8, 2), ("mma", 16, 32, 1, 4), ("mma_t", 9, 64, 4, 4)],
)
# the inline-PTX tensor-core path takes symmetric 4-bit codes only
@pytest.mark.parametrize("asm, group, sym", [(False, 128, True), (False, 32, False), (True, 128, True)])
def test_widened_4bit_half_precision_on_gpu(
    asm: bool, kind: str, M: int, block_n: int, split: int, warps: int, group: int, sym: bool
) -> None:
    from lightning_llmopt.kernels.quant_matmul_fwd import KernelConfig

    n, k = 300, 2048
    qw, scales, zeros = _weights(n, k, 4, group, sym, seed=M + split)
    for dtype in (torch.bfloat16,) if asm else (torch.bfloat16, torch.float16):
        x = torch.randn(M, k, generator=torch.Generator().manual_seed(M)).to(DEVICE, dtype)
        cfg = KernelConfig(kind, 16, block_n, min(128, group), split, warps, 3, True, asm, widen=True)
        _assert_launch_within_rule(x, qw, scales, zeros, 4, group, cfg)
