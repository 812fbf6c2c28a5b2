#!/usr/bin/env python3
"""Longest trainable sequence of genslm-25m within 16 GiB per rank: one rank vs 4 ranks of
Ulysses (--sp 4), of context parallelism (--cp 4) and of both (--sp 2 --cp 2).

Each layout trains one step (batch 1, no activation checkpointing: activations then grow by
about 0.3 MiB per token, which three short runs can measure; with checkpointing the slope is
~20 times smaller and lost in the noise of runs this short) at three per-rank token counts
under mpirun (one process per rank, so a process's peak RSS is one rank's) and reads rank 0's
peak from metrics.jsonl. Per-rank peak is linear in the tokens a rank holds (FlashAttention and
the ring keep nothing of size s²), so a least-squares line through the three points, solved for
16 GiB, gives the longest per-rank share; times the ranks that share a sequence, the longest
sequence. The 16 GiB points are extrapolations from measured ones (this machine has 24 GiB in
all); the table says so. Fails unless CP reaches at least 3.5 times the one-rank length.

Usage: python3 scripts/cp_memory_table.py target/release/genslm   (built with --features mpi)
"""
import json
import os
import subprocess
import sys
import tempfile

BIN = sys.argv[1]
CONFIG = "configs/genslm-25m.toml"
LOCAL = (512, 1024, 2048)
BUDGET_MIB = 16 * 1024
LAYOUTS = [("one rank", 1, []), ("SP 4", 4, ["--sp", "4"]), ("CP 4", 4, ["--cp", "4"]),
           ("SP 2 × CP 2", 4, ["--sp", "2", "--cp", "2"])]
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


def peak(tmp, name, ranks, flags, local):
    out = f"{tmp}/{name.replace(' ', '')}-{local}"
    cmd = [BIN, "train", "--fasta", "data/", "--config", CONFIG, "--out", out, "--steps", "1",
           "--seq-len", str(local * ranks), "--batch-size", "1", "--val-every", "0", "--quiet",
           "--skip-memory-check", "--threads", "1"] + flags
    if ranks > 1:
        # One compute thread per rank everywhere: per-thread buffers grow with the tokens too,
        # so the one-rank baseline runs with the same thread count as each rank.
        cmd = ["mpirun", "--oversubscribe", "-np", str(ranks)] + cmd
    subprocess.run(cmd, check=True, env=ENV)
    return [json.loads(l) for l in open(f"{out}/metrics.jsonl")][-1]["peak_rss_mib"]


def fit(xs, ys):
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


rows, longest = [], {}
with tempfile.TemporaryDirectory() as tmp:
    for name, ranks, flags in LAYOUTS:
        peaks = [peak(tmp, name, ranks, flags, l) for l in LOCAL]
        a, b = fit(LOCAL, peaks)
        longest[name] = int((BUDGET_MIB - a) / b) * ranks
        cells = " | ".join(f"{l * ranks}: {p:.0f}" for l, p in zip(LOCAL, peaks))
        rows.append((name, cells, a, b, longest[name]))
one = longest["one rank"]
print(f"{CONFIG}, batch 1, no activation checkpointing, one process per rank (mpirun), "
      "rank 0's peak RSS, --threads 1 per rank")
print("| layout | measured: sequence → peak MiB per rank | fit: MiB + MiB/token (per-rank "
      "tokens) | longest sequence within 16 GiB per rank (extrapolated) | vs one rank |")
print("|---|---|---|---|---|")
for name, cells, a, b, n in rows:
    print(f"| {name} | {cells} | {a:.0f} + {b:.3f}·t | {n:,} | {n / one:.2f}× |")
ratio = longest["CP 4"] / one
assert ratio >= 3.5, f"CP 4 reaches only {ratio:.2f}× the one-rank length"
