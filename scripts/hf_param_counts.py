#!/usr/bin/env python3
"""Parameter counts of Hugging Face GPTNeoXForCausalLM for every preset in configs/.

Builds each model on the `meta` device (no memory) from the TOML shape and counts
parameters with PyTorch; `genslm info` must print the same numbers (tests/cli_info.rs).

Usage: python3 scripts/hf_param_counts.py      (needs torch and transformers)
"""
import pathlib

import torch
from transformers import GPTNeoXForCausalLM

from neox_toml import model_table, neox_config

ROOT = pathlib.Path(__file__).resolve().parent.parent

for path in sorted((ROOT / "configs").glob("*.toml")):
    cfg = neox_config(model_table(path))
    with torch.device("meta"):
        model = GPTNeoXForCausalLM(cfg)
    n = sum(p.numel() for p in model.parameters())
    print(f"{path.stem}\t{n:,}")
