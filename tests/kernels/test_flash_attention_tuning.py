"""Autotuning key of the flash-attention kernels: one configuration search per power-of-two length bucket."""

from __future__ import annotations

import torch

from lightning_llmopt.kernels import flash_attention_bwd, flash_attention_fwd
from lightning_llmopt.kernels.flash_attention_common import DKDV_TUNE_KEY, TUNE_KEY, Geometry, tune_bucket


def test_tune_bucket_rounds_up_to_powers_of_two_from_16() -> None:
    assert [tune_bucket(n) for n in (0, 1, 15, 16, 17, 100, 4096, 4097)] == [16, 16, 16, 16, 32, 128, 4096, 8192]


def test_geometry_tune_args_bucket_both_lengths() -> None:
    geo = Geometry(batch=3, seq_q=37, seq_k=1000, num_heads=4, group=1, head_dim=64, block_d=64)
    assert geo.tune_args == (64, 1024)
    # a sliding window caps the key length's bucket: the call visits about `window` keys per query block
    assert geo.tuning(None) == (64, 1024) and geo.tuning(100) == (64, 128) and geo.tuning(5000) == (64, 1024)


def test_autotuners_key_on_buckets_not_exact_lengths() -> None:
    """Exact lengths in the key re-ran the search for every new longest sequence (an engine's verify steps took
    a median 18 ms against 1.4 ms for a plain decode step, H100, 2026-11-22)."""
    from lightning_llmopt.kernels import flash_attention_bwd_wgmma

    tuners = [
        (flash_attention_fwd._tuned_fwd_kernel(), TUNE_KEY),
        (flash_attention_bwd._tuned_kernel("dkdv"), DKDV_TUNE_KEY),
        (flash_attention_bwd_wgmma._make_tuner(), DKDV_TUNE_KEY),
        (flash_attention_bwd._tuned_kernel("dq"), TUNE_KEY),
    ]
    for tuner, keys in tuners:
        assert list(tuner.keys) == keys
        assert "seq_q" not in tuner.keys and "seq_k" not in tuner.keys
        assert set(keys) <= set(tuner.arg_names)
    # the dK/dV passes' work per program grows with the query heads it sums: group and split are in their key
    assert DKDV_TUNE_KEY == [*TUNE_KEY, "group", "split"]


def test_autotuning_lists_are_chosen_by_head_dim_class() -> None:
    """The autotuners hold the union of the lists; each call keeps only its head-dim class's configurations."""
    from types import SimpleNamespace

    from lightning_llmopt.kernels.flash_attention_common import launch_configs, prune_for_head_dim

    def as_triton(cfg):  # the attributes early_config_prune reads from a triton.Config
        return SimpleNamespace(kwargs=cfg[0], num_warps=cfg[1], num_stages=cfg[2])

    for kernel in ("fwd", "dkdv", "dq"):
        union = launch_configs(kernel)
        assert len({(c[0]["BLOCK_M"], c[0]["BLOCK_N"], c[1], c[2]) for c in union}) == len(union)
        for block_d in (32, 64, 128, 256):
            wanted = launch_configs(kernel, block_d)
            kept = prune_for_head_dim(kernel)([as_triton(c) for c in union], {}, BLOCK_D=block_d)
            key = lambda c: (c[0]["BLOCK_M"], c[0]["BLOCK_N"], c[1], c[2])  # noqa: E731
            assert sorted(((c.kwargs, c.num_warps, c.num_stages) for c in kept), key=key) == sorted(wanted, key=key)
            assert all(c in union for c in wanted)
    # the dK/dV configuration that ran 2.3x behind the best at head dim 128 is not on the wide list
    assert ({"BLOCK_M": 32, "BLOCK_N": 128}, 4, 3) not in launch_configs("dkdv", 128)


def test_chosen_configs_search_once_then_launch_the_choice_directly() -> None:
    """After the autotuner's search for a key, launches skip ``Autotuner.run`` and use the chosen configuration."""
    from types import SimpleNamespace

    from lightning_llmopt.kernels.flash_attention_common import ChosenConfigs, tune_key

    calls: list[tuple] = []

    class FakeJit:
        def __getitem__(self, grid):
            return lambda *args, **kw: calls.append(("direct", grid, args, kw))

    class FakeTuner:
        fn = FakeJit()
        best_config = None

        def __getitem__(self, grid):
            def run(*args, **kw):
                calls.append(("tuned", grid({"BLOCK_M": 64}), args, kw))
                # what triton's Autotuner.run leaves behind: the configuration it picked
                self.best_config = SimpleNamespace(
                    kwargs={"BLOCK_M": 128}, all_kwargs=lambda: {"BLOCK_M": 128, "num_warps": 8, "num_stages": 3}
                )

            return run

    tuner = FakeTuner()
    chosen = ChosenConfigs(lambda: tuner)
    geo = Geometry(batch=2, seq_q=1000, seq_k=1000, num_heads=4, group=1, head_dim=128, block_d=128)
    consts = dict(HEAD_D=128, BLOCK_D=128, IS_CAUSAL=True, HAS_WINDOW=False, IS_VARLEN=False, IEEE=False)
    key = tune_key(geo, consts, torch.bfloat16)
    assert key == (1024, 1024, 128, True, False, False, torch.bfloat16)
    grid = lambda meta: (1000 // meta["BLOCK_M"], 8)  # noqa: E731
    for _ in range(3):
        chosen.launch(key, grid, ("a", 1), consts)
    assert [c[0] for c in calls] == ["tuned", "direct", "direct"]
    assert calls[1][1] == (1000 // 128, 8)  # the grid of the chosen blocks
    assert calls[1][3] == {**consts, "BLOCK_M": 128, "num_warps": 8, "num_stages": 3}
    chosen.launch(tune_key(geo, {**consts, "IS_CAUSAL": False}, torch.bfloat16), grid, ("a", 1), consts)
    assert calls[-1][0] == "tuned"  # another key searches again
    win = {**consts, "HAS_WINDOW": True}
    assert tune_key(geo, win, torch.bfloat16, 256) != tune_key(geo, win, torch.bfloat16, 64)  # one per window bucket
