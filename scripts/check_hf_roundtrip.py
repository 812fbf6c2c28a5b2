#!/usr/bin/env python3
"""A checkpoint written by genslm loads in Hugging Face transformers unchanged and gives the
same loss.

Loads CHECKPOINT_DIR with GPTNeoXForCausalLM.from_pretrained, tokenizes each record of FASTA
with Hugging Face `tokenizers` and GenSLM's vocabulary, cuts the tokens into non-overlapping
windows of SEQ_LEN, and computes the mean next-token NLL per record. Compares it with the TSV
printed by `genslm score --model CHECKPOINT_DIR --fasta FASTA --seq-len SEQ_LEN`.

Usage: python3 scripts/check_hf_roundtrip.py CHECKPOINT_DIR FASTA SEQ_LEN SCORES.tsv
"""
import csv
import gzip
import math
import pathlib
import sys

import torch
from tokenizers import Tokenizer
from transformers import GPTNeoXForCausalLM

ROOT = pathlib.Path(__file__).resolve().parent.parent


def read_fasta(path):
    opener = gzip.open if path.suffix == ".gz" else open
    recs = []
    with opener(path, "rt") as f:
        for line in f:
            line = line.strip()
            if line.startswith(">"):
                recs.append([line[1:].split()[0], []])
            elif line:
                recs[-1][1].append(line.upper())
    return [(i, "".join(p)) for i, p in recs]


def encode(tok, seq):
    """GenSLM's tokenization: space-separated codons through the vocabulary's tokenizers file."""
    return tok.encode(" ".join(seq[i : i + 3] for i in range(0, len(seq), 3))).ids


def windows(ids, seq_len):
    """genslm score's windows: consecutive, non-overlapping, each predicting from its own start."""
    for start in range(0, len(ids), seq_len):
        w = ids[start : start + seq_len]
        if len(w) >= 2:
            yield torch.tensor([w])


def window_nll(model, x):
    """Sum of -log p(next token) over one window, in float64, and the window's logits."""
    with torch.no_grad():
        logits = model(input_ids=x).logits[0]
    lp = torch.log_softmax(logits[:-1].double(), -1)
    return -lp.gather(1, x[0, 1:, None]).sum().item(), logits


def record_nll(model, tok, seq, seq_len):
    """Summed next-token NLL of one record over genslm score's windows, and the tokens predicted."""
    total, n = 0.0, 0
    for x in windows(encode(tok, seq), seq_len):
        total += window_nll(model, x)[0]
        n += x.shape[1] - 1
    return total, n


def main():
    ckpt, fasta, seq_len, tsv = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    # Master weights: every tensor of the checkpoint is fp32, whatever precision trained it.
    from safetensors import safe_open
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        for k in f.keys():
            assert f.get_tensor(k).dtype == torch.float32, (k, f.get_tensor(k).dtype)
    model = GPTNeoXForCausalLM.from_pretrained(ckpt, attn_implementation="eager").eval()
    tok = Tokenizer.from_file(str(ROOT / "tokenizers" / "genslm69.json"))
    ours = {r["id"]: r for r in csv.DictReader(open(tsv), delimiter="\t")}
    worst = 0.0
    for rid, seq in read_fasta(fasta):
        total, n = record_nll(model, tok, seq, seq_len)
        mine = float(ours[rid]["mean_nll"])
        assert int(ours[rid]["n_tokens"]) == n, (rid, ours[rid]["n_tokens"], n)
        rel = abs(mine - total / n) / (total / n)
        worst = max(worst, rel)
        print(f"{rid}\ttransformers {total / n:.6f}\tgenslm {mine:.6f}\trel {rel:.2e}")
    assert worst <= 1e-4, f"relative difference {worst} > 1e-4"
    print(f"check_hf_roundtrip: transformers reproduces genslm's loss (worst rel. diff {worst:.1e})")


if __name__ == "__main__":
    main()
