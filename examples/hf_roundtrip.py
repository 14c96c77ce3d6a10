"""Round trip between transformers and lightning_llmopt: import a tiny random Llama, compare logits, export it back.

Runs in a few seconds on CPU and downloads nothing:

    python examples/hf_roundtrip.py [--out DIR]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import transformers

from lightning_llmopt.models.hf import from_hf, to_hf


def main(out: Path) -> None:
    hf_config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager").eval()
    tokens = torch.randint(0, hf_config.vocab_size, (2, 33))

    # transformers -> lightning_llmopt (tensors are shared with hf_model, no copy)
    ours = from_hf(hf_model).eval()
    with torch.no_grad():
        reference = hf_model(input_ids=tokens).logits
        logits = ours(tokens)
    print(f"imported {ours.num_params():,} parameters; max |logits diff| vs transformers: "
          f"{(logits - reference).abs().max().item():.2e}")

    # lightning_llmopt -> a folder transformers loads (sharded to show the index file)
    to_hf(ours, out, arch="llama", max_shard_size="100KB")
    print(f"exported to {out}: {sorted(p.name for p in out.iterdir())}")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        again = reloaded(input_ids=tokens).logits
    print(f"max |logits diff| after reloading with transformers: {(again - logits).abs().max().item():.2e}")
    if not torch.allclose(again, reference, atol=1e-4, rtol=0):
        raise SystemExit("round trip changed the logits")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="export folder (default: a temporary folder)")
    args = parser.parse_args()
    if args.out is not None:
        main(args.out)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            main(Path(tmp))
