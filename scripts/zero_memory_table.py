#!/usr/bin/env python3
"""Per-rank ZeRO memory of genslm-100m against `genslm plan`'s prediction.

For 1, 2 and 4 ranks (threads, DP only) and ZeRO 1, 2, 3 (with --checkpoint-activations),
trains 2 steps at seq 256 and reads rank 0's accounting from metrics.jsonl (`memory`: bytes of
weights, gradients and Adam moments the rank holds at the update, and the process's peak), then
asks `genslm plan --device cpu --json` for the same layout. Prints a Markdown table and fails
if a predicted weights/gradients/optimizer figure is more than 15% off the measurement.

Usage: python3 scripts/zero_memory_table.py target/release/genslm [CONFIG]
"""
import json
import subprocess
import sys
import tempfile

BIN = sys.argv[1]
CONFIG = sys.argv[2] if len(sys.argv) > 2 else "configs/genslm-100m.toml"
SEQ = 256
MIB = 1 << 20


def measure(tmp, ranks, zero):
    out = f"{tmp}/r{ranks}z{zero}"
    subprocess.run(
        [BIN, "train", "--fasta", "data/", "--config", CONFIG, "--out", out, "--steps", "2",
         "--seq-len", str(SEQ), "--batch-size", str(ranks), "--dp", str(ranks),
         "--zero", str(zero), "--checkpoint-activations", "--val-every", "0", "--quiet",
         "--skip-memory-check"],
        check=True)
    last = [json.loads(l) for l in open(f"{out}/metrics.jsonl")][-1]
    return last["memory"], last["peak_rss_mib"]


def predict(ranks, zero):
    r = subprocess.run(
        [BIN, "plan", "--device", "cpu", "--config", CONFIG, "--gpus", str(ranks),
         "--dp", str(ranks), "--sp", "1", "--zero", str(zero), "--gpu-mem-gib", "16",
         "--seq-len", str(SEQ), "--checkpoint-activations", "--json"],
        check=True, capture_output=True, text=True)
    return json.loads(r.stdout)["rank_states_at_seq_len"]


rows, worst = [], 0.0
with tempfile.TemporaryDirectory() as tmp:
    for ranks in (1, 2, 4):
        for zero in (1, 2, 3):
            mem, peak = measure(tmp, ranks, zero)
            pred = predict(ranks, zero)
            cells = []
            for key, pkey in [("params_bytes", "parameters"), ("grads_bytes", "gradients"),
                              ("optimizer_bytes", "optimizer_states")]:
                got, want = mem[key], pred[pkey]
                err = abs(want - got) / got
                worst = max(worst, err)
                cells.append(f"{got / MIB:.0f} / {want / MIB:.0f}")
            total = (mem["params_bytes"] + mem["grads_bytes"] + mem["optimizer_bytes"]) / MIB
            rows.append(f"| {ranks} | {zero} | " + " | ".join(cells)
                        + f" | {total:.0f} | {peak:.0f} |")
print(f"{CONFIG}, seq {SEQ}, batch 1 per rank, --checkpoint-activations, ranks as threads")
print("| ranks | ZeRO | weights MiB (measured / planned) | gradients | Adam moments | "
      "sum per rank | process peak RSS MiB |")
print("|---|---|---|---|---|---|---|")
print("\n".join(rows))
print(f"largest planner error on the three states: {100 * worst:.2f}%")
if worst > 0.15:
    sys.exit("zero_memory_table: the planner is more than 15% off")
