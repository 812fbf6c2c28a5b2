#!/usr/bin/env python3
"""The PyTorch peer of `genslm bench embed` and `genslm bench generate`: Hugging Face GPT-NeoX
inference on CPU with the same model shape, to time the two side by side on one machine.

  embed CONFIG.toml SEQ_LEN SEQUENCES BATCH [THREADS]
      Mean of the final hidden states (after the final LayerNorm, as genslm embed's default)
      of SEQUENCES random codon sequences of SEQ_LEN, BATCH per forward, under torch.no_grad,
      after one warm-up batch. Prints tokens/s.
  generate CONFIG.toml CODONS [THREADS]
      model.generate from one codon with the KV cache, GenSLM's sampling (top-k 50, top-p
      0.95, temperature 1) and exactly CODONS new tokens. Prints codons/s.

fp32, sdpa attention, weights initialised by transformers (speed does not depend on them).
"""
import sys
import time

import torch
from transformers import GPTNeoXForCausalLM

from neox_toml import model_table, neox_config


def build(cfg_path, seq):
    m = model_table(cfg_path)
    cfg = neox_config(m, max_position_embeddings=max(m["max_position_embeddings"], seq),
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    return m, GPTNeoXForCausalLM(cfg).eval()


def embed(cfg_path, seq, n, batch, threads):
    torch.set_num_threads(threads)
    m, model = build(cfg_path, seq)
    x = torch.randint(5, 69, (n, seq))
    with torch.no_grad():
        model.gpt_neox(input_ids=x[:batch]).last_hidden_state.mean(1)
        start = time.perf_counter()
        for i in range(0, n, batch):
            model.gpt_neox(input_ids=x[i:i + batch]).last_hidden_state.mean(1)
        secs = time.perf_counter() - start
    print(f"pytorch embed {m['name']} seq {seq} sequences {n} batch {batch} threads {threads}: "
          f"{n * seq / secs:.0f} tokens/s")


def generate(cfg_path, codons, threads):
    torch.set_num_threads(threads)
    m, model = build(cfg_path, codons + 1)
    x = torch.tensor([[5]])
    with torch.no_grad():
        start = time.perf_counter()
        out = model.generate(x, do_sample=True, top_k=50, top_p=0.95, temperature=1.0,
                             max_new_tokens=codons, min_new_tokens=codons, use_cache=True,
                             pad_token_id=3)
        secs = time.perf_counter() - start
    new = out.shape[1] - 1
    print(f"pytorch generate {m['name']} codons {new} threads {threads}: {new / secs:.1f} codons/s")


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "embed":
        t = int(sys.argv[6]) if len(sys.argv) > 6 else torch.get_num_threads()
        embed(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), t)
    elif mode == "generate":
        t = int(sys.argv[4]) if len(sys.argv) > 4 else torch.get_num_threads()
        generate(sys.argv[2], int(sys.argv[3]), t)
    else:
        sys.exit(__doc__)
