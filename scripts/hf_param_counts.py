#!/usr/bin/env python3
"""Parameter counts of Hugging Face GPTNeoXForCausalLM for every preset in configs/.

Builds each model on the `meta` device (no memory) from the TOML shape and counts
parameters with PyTorch; `genslm info` must print the same numbers (tests/info_cli.rs).

Usage: python3 scripts/hf_param_counts.py      (needs torch and transformers)
"""
import pathlib
import tomllib

import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

ROOT = pathlib.Path(__file__).resolve().parent.parent

for path in sorted((ROOT / "configs").glob("*.toml")):
    m = tomllib.loads(path.read_text())["model"]
    cfg = GPTNeoXConfig(
        vocab_size=m["vocab_size"],
        hidden_size=m["hidden_size"],
        num_hidden_layers=m["num_layers"],
        num_attention_heads=m["num_heads"],
        intermediate_size=m["intermediate_size"],
        max_position_embeddings=m["max_position_embeddings"],
        rotary_pct=m["rotary_pct"],
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = GPTNeoXForCausalLM(cfg)
    n = sum(p.numel() for p in model.parameters())
    print(f"{path.stem}\t{n:,}")
