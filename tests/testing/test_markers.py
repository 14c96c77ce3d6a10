"""Markers skip cleanly by hardware; the Triton interpreter runs a kernel on CPU tensors."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from lightning_llmopt.testing import triton as triton_helpers
from lightning_llmopt.testing.markers import RunIf, cuda_device_count, skip_unavailable

try:
    import triton
    import triton.language as tl
except ImportError:  # the kernel tests below skip
    triton = None


def _skip_reason(mark: pytest.MarkDecorator) -> str | None:
    (condition,) = mark.args
    return mark.kwargs["reason"] if condition else None


def test_runif_reasons_name_the_missing_requirement() -> None:
    n = cuda_device_count()
    reason = _skip_reason(RunIf(min_cuda_gpus=n + 1))
    assert reason == f"needs {n + 1} CUDA GPU(s), found {n}"
    assert _skip_reason(RunIf()) is None
    assert "needs torch >= 99.0" in _skip_reason(RunIf(min_torch="99.0"))
    assert _skip_reason(RunIf(min_torch="1.0")) is None


def test_runif_triton_follows_interpreter_setting(monkeypatch) -> None:
    if not triton_helpers.triton_available() or cuda_device_count() > 0:
        pytest.skip("checks the CPU-without-CUDA path with triton installed")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "TRITON_INTERPRET=1" in _skip_reason(RunIf(triton=True))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _skip_reason(RunIf(triton=True)) is None


def test_conftest_enabled_interpreter_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("the interpreter is enabled only without CUDA")
    assert triton_helpers.triton_interpreter_enabled()


def test_triton_interpret_context_restores_environment(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with triton_helpers.triton_interpret():
        assert triton_helpers.triton_interpreter_enabled()
    assert not triton_helpers.triton_interpreter_enabled()


def test_package_import_does_not_load_pytest_or_triton() -> None:
    code = textwrap.dedent(
        """
        import sys
        import lightning_llmopt  # what the package itself loads (lightning pulls in triton) is not our concern here
        before = set(sys.modules)
        import lightning_llmopt.testing as t
        added = set(sys.modules) - before
        assert not {m for m in added if m.split(".")[0] in ("pytest", "_pytest", "triton")}, sorted(added)
        assert callable(t.RunIf) and "pytest" in sys.modules  # the lazy attribute loads the markers
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(_repo_root()))


def _repo_root():
    from pathlib import Path

    return Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- gpu / multigpu markers


_MARKED_TESTS = """
import pytest

@pytest.mark.gpu
def test_needs_gpu():
    pass

@pytest.mark.multigpu
def test_needs_two_gpus():
    pass

def test_plain():
    pass
"""


def test_gpu_marks_are_skipped_with_reason_without_cuda(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        "from lightning_llmopt.testing.markers import register_markers, skip_unavailable\n"
        "def pytest_configure(config):\n    register_markers(config)\n"
        "def pytest_collection_modifyitems(config, items):\n    skip_unavailable(items)\n"
    )
    pytester.makepyfile(test_marked=_MARKED_TESTS)
    result = pytester.runpytest("-rs", "--strict-markers", "-p", "no:cacheprovider")
    n = cuda_device_count()
    expected_skipped = (n < 1) + (n < 2)
    result.assert_outcomes(passed=3 - expected_skipped, skipped=expected_skipped)
    if n == 0:
        result.stdout.fnmatch_lines(["*marked gpu: needs 1 CUDA GPU, found 0*", "*marked multigpu*found 0*"])


def test_skip_unavailable_leaves_unmarked_items_alone() -> None:
    class _Item:
        def __init__(self, marks: set[str]) -> None:
            self.marks = marks
            self.added: list[pytest.MarkDecorator] = []

        def get_closest_marker(self, name: str) -> object | None:
            return name if name in self.marks else None

        def add_marker(self, mark: pytest.MarkDecorator) -> None:
            self.added.append(mark)

    plain, gpu, multi = _Item(set()), _Item({"gpu"}), _Item({"multigpu", "gpu"})
    skip_unavailable([plain, gpu, multi])  # type: ignore[list-item]
    n = cuda_device_count()
    assert plain.added == []
    assert len(gpu.added) == (n < 1)
    assert len(multi.added) == (n < 2)
    if n == 0:
        assert "multigpu" in multi.added[0].kwargs["reason"]


# --------------------------------------------------------------------------- Triton interpreter on CPU

if triton is not None:

    @triton.jit
    def _add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask)
        y = tl.load(y_ptr + offs, mask=mask)
        tl.store(out_ptr + offs, x + y, mask=mask)


def _launch_add(kernel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    n = x.numel()
    kernel[(triton.cdiv(n, 128),)](x, y, out, n, BLOCK=128)
    return out


def _kernel_device(kernel) -> str:
    from triton.runtime.interpreter import InterpretedFunction

    return "cpu" if isinstance(kernel, InterpretedFunction) else "cuda"


@pytest.mark.skipif(triton is None, reason="needs triton")
@pytest.mark.parametrize("n", [1, 17, 1023])
def test_module_level_kernel_matches_torch(n: int) -> None:
    device = _kernel_device(_add_kernel)  # interpreted on CPU-only machines, thanks to tests/conftest.py
    g = torch.Generator().manual_seed(n)
    x, y = (torch.randn(n, generator=g).to(device) for _ in range(2))
    torch.testing.assert_close(_launch_add(_add_kernel, x, y), x + y, rtol=0, atol=0)  # one fp32 add: exact


def test_triton_interpret_fixture_interprets_kernels_decorated_inside(triton_interpret) -> None:
    from triton.runtime.interpreter import InterpretedFunction

    kernel = triton.jit(_add_kernel.fn)  # re-decorate the plain Python function under TRITON_INTERPRET=1
    assert isinstance(kernel, InterpretedFunction)
    x = torch.arange(300, dtype=torch.float32)
    y = torch.full((300,), -0.5)
    out = _launch_add(kernel, x, y)
    assert out.device.type == "cpu"
    torch.testing.assert_close(out, x + y, rtol=0, atol=0)
