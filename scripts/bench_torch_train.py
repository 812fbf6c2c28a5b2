#!/usr/bin/env python3
"""The PyTorch peer of `genslm bench train`: Hugging Face GPT-NeoX training steps on CPU with the
same model shape, so the two can be timed side by side on one machine.

Builds GPTNeoXForCausalLM from a genslm config (TOML), fp32, sdpa attention, AdamW, batch 1 of
random codon tokens at SEQ_LEN, and times STEPS optimizer steps after one warm-up step. Prints
one line: tokens/s (predicted tokens per second, as genslm counts them), peak RSS in MiB and
the instruction set ATen's kernels use (ATEN_CPU_CAPABILITY=avx2 forces AVX2).

Usage: python3 scripts/bench_torch_train.py CONFIG.toml SEQ_LEN [STEPS] [THREADS]
With DEVICE=cuda: on the GPU, fp32 master weights with bf16 autocast (PyTorch's usual mixed
precision, the peer of genslm's `--precision bf16`), timed between CUDA synchronisations; the
line gives peak allocated GPU memory instead of RSS.
"""
import os
import resource
import sys
import time

import torch
from transformers import GPTNeoXForCausalLM

from neox_toml import model_table, neox_config


def main():
    cfg_path, seq = sys.argv[1], int(sys.argv[2])
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    threads = int(sys.argv[4]) if len(sys.argv) > 4 else torch.get_num_threads()
    torch.set_num_threads(threads)
    m = model_table(cfg_path)
    cfg = neox_config(
        m, max_position_embeddings=max(m["max_position_embeddings"], seq), attn_implementation="sdpa"
    )
    torch.manual_seed(0)
    dev = os.environ.get("DEVICE", "cpu")
    gpu = dev != "cpu"
    model = GPTNeoXForCausalLM(cfg).train().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.01)
    x = torch.randint(5, 69, (1, seq), device=dev)

    def step():
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=gpu):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def sync():
        if gpu:
            torch.cuda.synchronize()

    step()  # warm-up
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    secs = (time.perf_counter() - start) / steps
    if gpu:
        where = f"peak GPU {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB allocated " \
                f"[{torch.cuda.get_device_name()}, bf16 autocast, torch {torch.__version__}]"
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        where = f"peak RSS {peak:.0f} MiB [cpu capability {torch.backends.cpu.get_cpu_capability()}]"
    print(f"pytorch {m['name']} seq {seq} threads {threads}: "
          f"{(seq - 1) / secs:.1f} tokens/s, {secs:.3f} s/step, {where}")


if __name__ == "__main__":
    main()
