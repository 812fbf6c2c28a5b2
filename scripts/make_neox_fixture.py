#!/usr/bin/env python3
"""Parity fixture from Hugging Face transformers: a small random GPTNeoXForCausalLM.

Writes tests/fixtures/hf_neox_tiny/: config.json + model.safetensors (save_pretrained) and
expected.json with fixed input ids, the logits and the causal-LM loss computed by
transformers on CPU in float32 with eager attention. The Rust test loads the directory through
genslm's checkpoint loader and must reproduce the logits.

Usage: python3 scripts/make_neox_fixture.py     (needs torch, transformers, safetensors)
"""
import json
import pathlib

import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "hf_neox_tiny"


def main():
    torch.manual_seed(1234)
    cfg = GPTNeoXConfig(
        vocab_size=69,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        rotary_pct=0.25,
        rotary_emb_base=10000,
        layer_norm_eps=1e-5,
        hidden_act="gelu_fast",
        use_parallel_residual=True,
        tie_word_embeddings=False,
        initializer_range=0.2,
        attn_implementation="eager",
    )
    model = GPTNeoXForCausalLM(cfg).eval()
    # Random LayerNorm affine parameters and biases, so every term of the forward matters.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name or "layer_norm" in name or name.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if name.endswith("weight") else 0.0))
    g = torch.Generator().manual_seed(99)
    ids = torch.randint(5, 69, (2, 24), generator=g)
    ids[1, 5] = 0  # an [UNK] inside
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
    OUT.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(OUT, safe_serialization=True)
    expected = {
        "input_ids": ids.tolist(),
        "logits": [round(x, 7) for x in out.logits.flatten().tolist()],
        "logits_shape": list(out.logits.shape),
        "loss": out.loss.item(),
        "transformers": __import__("transformers").__version__,
        "torch": torch.__version__,
    }
    (OUT / "expected.json").write_text(json.dumps(expected) + "\n")
    print(f"wrote {OUT}: loss {out.loss.item():.6f}")


if __name__ == "__main__":
    main()
