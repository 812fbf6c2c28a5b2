#!/usr/bin/env python3
"""README's two tables of genslm's own layouts for the 25B/33B presets on 32-512 A100-40GB
(`genslm plan` predictions), regenerated from the binary so they follow the planner:
  1. Ulysses only, CP (with anything), the best layout, and the same with activation
     checkpointing (`plan --sweep [--checkpoint-activations] --json`);
  2. with pipeline stages (checkpointing on): the best without PP, the best with ZeRO <= 1 and
     no PP (`--pp 1 --zero 0|1`), the best with PP and its layout (`--pp P` for every P);
  3. with `--offload optimizer|activations|all` (checkpointing on): the longest sequence, its
     layout and the host memory per rank it needs (`--only-offload` prints this one alone).
Usage: python3 scripts/plan_tables.py [BIN [PLAN FLAGS...]]   (default target/release/genslm;
flags such as --no-megatron-sp are added to every plan). K = 1024 tokens.
"""
import json
import pathlib
import subprocess
import sys

ONLY_OFFLOAD = "--only-offload" in sys.argv
ARGS = [a for a in sys.argv[1:] if a != "--only-offload"]
BIN = ARGS[0] if ARGS else "target/release/genslm"
EXTRA = ARGS[1:]
GPUS = [16, 32, 64, 128, 256, 512]
if not pathlib.Path(BIN).is_file():
    sys.exit(f"plan_tables: {BIN} is not built: run `cargo build --release` first, or pass the "
             f"binary as the first argument")


def plan(model, gpus, *flags):
    out = subprocess.run([BIN, "plan", "--config", f"configs/genslm-{model}.toml", "--gpus", str(gpus),
                          "--gpu-mem-gib", "40", "--json", *flags, *EXTRA], capture_output=True, text=True)
    return json.loads(out.stdout) if out.returncode == 0 else None


def name(l):
    parts = []
    if l["tp"] > 1:
        parts.append(f"TP {l['tp']}")
    if l["sp"] > 1:
        parts.append(f"SP {l['sp']}")
    if l["cp"] > 1:
        parts.append(f"CP {l['cp']}")
    if l["pp"] > 1:
        parts.append(f"PP {l['pp']}")
    if l["dp"] > 1:
        parts.append(f"DP {l['dp']}")
    return " × ".join(parts or ["DP 1"]) + (f", ZeRO-{l['zero']}" if l["pp"] > 1 else "")


def k(n):
    return f"{n // 1024:,}" if n else "–"


def offload_table():
    print("| model | GPUs | no offload | `--offload optimizer` | `--offload activations` | "
          "`--offload all` | its layout | host memory per rank |")
    print("|---|---|---|---|---|---|---|---|")
    for model in ["25b", "33b"]:
        for g in GPUS[1:]:
            cells = []
            for o in ["none", "optimizer", "activations", "all"]:
                d = plan(model, g, "--checkpoint-activations", "--offload", o)
                cells.append(d)
            last = cells[-1]
            host = last["at_max_seq_len"]["host_bytes"] / 2**30 if last else 0
            print(f"| {model.upper()} | {g} | " + " | ".join(k(d["max_seq_len"] if d else 0) for d in cells)
                  + f" | {name(last['layout']) if last else '–'} | {host:,.0f} GiB |")


def main():
    if ONLY_OFFLOAD:
        offload_table()
        return
    print("| model | GPUs | Ulysses SP only | CP (with anything) | best layout | with `--checkpoint-activations` | best layout (ckpt) |")
    print("|---|---|---|---|---|---|---|")
    sweeps = {}
    for model in ["25b", "33b"]:
        plain = {r["gpus"]: r for r in plan(model, 512, "--sweep")["rows"]}
        ckpt = {r["gpus"]: r for r in plan(model, 512, "--sweep", "--checkpoint-activations")["rows"]}
        sweeps[model] = ckpt
        for g in GPUS[1:]:
            p, c = plain[g], ckpt[g]
            print(f"| {model.upper()} | {g} | {k(p['ulysses'])} | {k(p['context'])} | "
                  f"{name(p['best']['strategy']['layout'])} | {k(c['best']['max_seq_len'])} | "
                  f"{name(c['best']['strategy']['layout'])} |")
    print()
    print("| model | GPUs | best without PP | ZeRO ≤ 1 without PP | best with PP | its layout |")
    print("|---|---|---|---|---|---|")
    for model in ["25b", "33b"]:
        for g in GPUS:
            row = sweeps[model][g] if g in sweeps[model] else None
            z1 = max((d["max_seq_len"] for z in ("0", "1")
                      if (d := plan(model, g, "--checkpoint-activations", "--pp", "1", "--zero", z))), default=0)
            best_pp = None
            p = 2
            while p <= g:
                if g % p == 0:
                    d = plan(model, g, "--checkpoint-activations", "--pp", str(p))
                    if d and d["max_seq_len"] > 0 and (best_pp is None or d["max_seq_len"] > best_pp["max_seq_len"]):
                        best_pp = d
                p *= 2
            print(f"| {model.upper()} | {g} | {k(row['no_pipeline'] if row else 0)} | {k(z1)} | "
                  f"{k(best_pp['max_seq_len'] if best_pp else 0)} | "
                  f"{name(best_pp['layout']) if best_pp else 'none fits'} |")
    print()
    offload_table()


if __name__ == "__main__":
    main()
