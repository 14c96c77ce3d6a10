"""RandomTokens: deterministic per row, labels are the next tokens, bad sizes are named."""

import pytest
import torch

from lightning_llmopt.testing import RandomTokens


def test_rows_are_deterministic_and_shifted():
    data = RandomTokens(vocab_size=50, seq_len=9, length=4, seed=3)
    a, b = data[2], RandomTokens(50, 9, 4, seed=3)[2]
    assert torch.equal(a["input_ids"], b["input_ids"]) and a["input_ids"].shape == (9,)
    assert torch.equal(a["input_ids"][1:], a["labels"][:-1])
    assert not torch.equal(data[1]["input_ids"], data[2]["input_ids"])
    assert int(a["input_ids"].max()) < 50 and len(data) == 4
    with pytest.raises(ValueError, match=r"seq_len \(0\)"):
        RandomTokens(50, 0, 4)
