#!/usr/bin/env python3
"""Numbers for the GPU scripts (scripts/gpu-probe.sh, scripts/gpu-smoke.sh), from genslm's
metrics.jsonl files and from PyTorch on the same GPU. Standard library only, except `sdpa`,
which needs torch (the GPU machine's python3 has it).

  gap REF GOT LIMIT      worst per-step relative loss gap of GOT against REF; exit 3 above LIMIT
  rate METRICS [SKIP]    mean tokens/s and TFLOPS of the steps after the first SKIP (2)
  compile METRICS        first step's seconds less the median of the steps after it: an
                         estimate of the kernel compilation the first step pays
  kernels LOG [SKIP]     cubecl's per-step kernel tables (CUBECL_DEBUG_OPTION=profile, one
                         table per training step): GPU time and launches per step over the
                         tables after the first SKIP (2), and the kernels that take most of it
  sdpa --seq N ...       torch scaled_dot_product_attention forward and forward+backward,
                         timed like `genslm bench attention --seq` (best of --iters after one
                         warm-up; FLOPs 4·b·h·s²·d forward, 3.5× for both, halved when causal)
"""
import argparse
import json
import re
import statistics
import sys


def steps(path):
    rows = []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if "step" in r and "loss" in r:
                rows.append(r)
    return rows


def gap(a):
    ref, got = steps(a.ref), steps(a.got)
    if not ref or len(ref) != len(got):
        print(f"step counts differ: reference {len(ref)}, run {len(got)}")
        return 3
    worst, at = 0.0, 0
    for r, g in zip(ref, got):
        if g["loss"] is None:
            print(f"step {g['step']}: loss is not finite")
            return 3
        e = abs(g["loss"] - r["loss"]) / abs(r["loss"])
        if e > worst:
            worst, at = e, g["step"]
    ok = worst <= a.limit
    print(f"{'pass' if ok else 'FAIL'}: worst step loss gap {worst:.2e} at step {at} of "
          f"{len(ref)} (limit {a.limit:.0e}); last loss {got[-1]['loss']:.4f} vs {ref[-1]['loss']:.4f}")
    return 0 if ok else 3


def rate(a):
    rows = steps(a.metrics)
    rows = rows[a.skip:] or rows
    tps = statistics.mean(r["tokens_per_s"] for r in rows)
    tfl = statistics.mean(r["tflops"] for r in rows)
    print(f"{tps:.0f} {tfl:.2f}")
    return 0


def compile_time(a):
    rows = steps(a.metrics)
    secs = [r["tokens"] / r["tokens_per_s"] for r in rows if r["tokens_per_s"]]
    if len(secs) < 2:
        print("n/a")
        return 0
    rest = statistics.median(secs[1:])
    print(f"{max(secs[0] - rest, 0.0):.1f} s (first step {secs[0]:.1f} s, later {rest:.2f} s)")
    return 0


UNITS = {"s": 1.0, "ms": 1e-3, "µs": 1e-6, "us": 1e-6, "ns": 1e-9}


def seconds(text):
    """A Rust Duration's Debug form (1.5s, 2.25ms, 310.4µs, 80ns) in seconds."""
    m = re.fullmatch(r"([0-9.]+)(s|ms|µs|us|ns)", text.strip())
    if not m:
        raise ValueError(f"not a duration: {text!r}")
    return float(m.group(1)) * UNITS[m.group(2)]


def kernel_tables(path):
    """Each summary table in cubecl's profiling log as {kernel: (seconds, launches)}."""
    tables, cur = [], None
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.rstrip()
            if not line.startswith("| ") or not line.endswith("|"):
                continue
            fields = [x.strip() for x in line[2:-1].rsplit(" | ", 3)]
            if len(fields) != 4:
                continue
            name, dur, n, _ratio = fields
            if name == "Name":
                cur = {}
                tables.append(cur)
            elif name != "Total" and cur is not None:
                t, k = cur.get(name, (0.0, 0))
                cur[name] = (t + seconds(dur), k + int(n))
    return tables


def kernels(a):
    tables = kernel_tables(a.log)[a.skip:]
    if not tables:
        print("no kernel tables after the first %d (was CUBECL_DEBUG_OPTION=profile set, and "
              "cubecl.toml's [profiling.logger] file found?)" % a.skip)
        return 3
    n = len(tables)
    total = {}
    for t in tables:
        for name, (sec, k) in t.items():
            s0, k0 = total.get(name, (0.0, 0))
            total[name] = (s0 + sec, k0 + k)
    gpu = sum(s for s, _ in total.values()) / n
    launches = sum(k for _, k in total.values()) / n
    print(f"GPU time in kernels {gpu * 1e3:.1f} ms per step, {launches:.0f} launches per step "
          f"({n} steps)")
    print()
    print("| kernel | ms / step | launches / step | share |")
    print("|---|---|---|---|")
    for name, (sec, k) in sorted(total.items(), key=lambda kv: -kv[1][0])[:a.top]:
        short = name if len(name) <= 110 else name[:107] + "..."
        print(f"| `{short.replace('|', '/')}` | {sec / n * 1e3:.2f} | {k / n:.1f} | "
              f"{100 * sec / n / gpu:.1f}% |")
    return 0


def sdpa(a):
    import time

    import torch
    import torch.nn.functional as F

    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[a.dtype]
    shape = (a.batch, a.heads, a.seq, a.head_dim)
    q, k, v, d_o = (torch.randn(shape, device="cuda", dtype=dt, requires_grad=i < 3)
                    for i in range(4))
    mask = None
    if a.alibi:
        # GPT-NeoX's ALiBi slopes (2^(-8i/h) for a power of two h), as an additive bias: SDPA
        # takes a materialised [h, s, s] bias, so this times its efficient-attention path.
        slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / a.heads) for i in range(a.heads)],
                              device="cuda")
        pos = torch.arange(a.seq, device="cuda")
        dist = (pos[:, None] - pos[None, :]).float()
        dist = dist if a.causal else dist.abs()
        mask = (-slopes[:, None, None] * dist).to(dt)
        if a.causal:
            mask = mask.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    causal = a.causal and mask is None

    def once():
        torch.cuda.synchronize()
        t = time.perf_counter()
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        torch.cuda.synchronize()
        f = time.perf_counter() - t
        o.backward(d_o)
        torch.cuda.synchronize()
        return f, time.perf_counter() - t

    once()
    fwd, both = zip(*(once() for _ in range(a.iters)))
    flops = 4.0 * a.batch * a.heads * a.seq ** 2 * a.head_dim * (0.5 if a.causal else 1.0)
    peak = torch.cuda.max_memory_allocated() / 2 ** 20
    print(f"sdpa {a.dtype} b {a.batch} h {a.heads} seq {a.seq} d {a.head_dim} causal {a.causal} "
          f"alibi {a.alibi}: fwd {min(fwd):.4f} s ({flops / min(fwd) / 1e12:.3f} TFLOPS), "
          f"fwd+bwd {min(both):.4f} s ({3.5 * flops / min(both) / 1e12:.3f} TFLOPS), "
          f"peak {peak:.1f} MiB (torch {torch.__version__})")
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gap")
    g.add_argument("ref")
    g.add_argument("got")
    g.add_argument("limit", type=float)
    r = sub.add_parser("rate")
    r.add_argument("metrics")
    r.add_argument("skip", type=int, nargs="?", default=2)
    c = sub.add_parser("compile")
    c.add_argument("metrics")
    k = sub.add_parser("kernels")
    k.add_argument("log")
    k.add_argument("skip", type=int, nargs="?", default=2)
    k.add_argument("--top", type=int, default=15)
    s = sub.add_parser("sdpa")
    s.add_argument("--seq", type=int, required=True)
    s.add_argument("--heads", type=int, default=16)
    s.add_argument("--head-dim", type=int, default=128)
    s.add_argument("--batch", type=int, default=1)
    s.add_argument("--dtype", choices=["fp32", "bf16", "f16"], default="bf16")
    s.add_argument("--no-causal", dest="causal", action="store_false")
    s.add_argument("--alibi", action="store_true")
    s.add_argument("--iters", type=int, default=3)
    a = p.parse_args()
    return {"gap": gap, "rate": rate, "compile": compile_time, "kernels": kernels,
            "sdpa": sdpa}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
