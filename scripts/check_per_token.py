#!/usr/bin/env python3
"""`genslm score --per-token` agrees with Hugging Face transformers token by token.

Loads MODEL_DIR (a model directory or a genslm run directory; learned/ALiBi checkpoints through
their exported modeling file, trust_remote_code=True), tokenizes every FASTA record with Hugging
Face `tokenizers`, and scores it with Hugging Face's perplexity recipe for a window W and stride
S ("Perplexity of fixed-length models" in the transformers docs): windows start every S tokens,
each is at most W long, and each scores only the tokens past the previous window's end (a
token's left context is the rest of its window). Compares every row of PER_TOKEN.parquet:
the token, its position and context, log-probability, entropy, rank, the top-k list, and the
full distribution when present (tolerance 1e-4 in log-probability; ranks and top-k orders
only where the probabilities involved are more than 1e-4 apart).

Usage: python3 scripts/check_per_token.py MODEL_DIR FASTA[,FASTA...] W S PER_TOKEN.parquet
(several FASTA files in the order genslm read them: records of several files are scored in
shared batches, so this checks the grouped path too)
"""
import pathlib
import sys

import pyarrow.parquet as pq
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from check_hf_roundtrip import encode, read_fasta  # noqa: E402
from check_hf_positions import resolve_model_dir  # noqa: E402

TOL = 1e-4


def fail(msg):
    sys.exit(f"check_per_token: FAILED: {msg}")


def hf_recipe(model, ids, w, s):
    """Per scored token: (index, context, log-probs over the vocabulary), in float64."""
    out, prev_end, n = [], 0, len(ids)
    for begin in range(0, n, s):
        end = min(begin + w, n)
        x = torch.tensor([ids[begin:end]])
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=x).logits[0].double(), -1)
        for i in range(max(begin + 1, prev_end), end):
            out.append((i, i - begin, lp[i - begin - 1]))
        prev_end = end
        if end == n:
            break
    return out


def main():
    model_dir = resolve_model_dir(pathlib.Path(sys.argv[1]))
    fastas = [pathlib.Path(f) for f in sys.argv[2].split(",")]
    w, s, path = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, trust_remote_code=True, attn_implementation="eager"
    ).eval()
    table = pq.read_table(path)
    meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
    vocab = meta.get("genslm.vocab", "genslm69")
    tok = Tokenizer.from_file(str(ROOT / "tokenizers" / f"{vocab}.json"))
    text = {i: t for t, i in tok.get_vocab().items()}
    bos = 1 if "[BOS]" in tok.get_vocab() else 0
    rows = table.to_pylist()
    file_order = list(dict.fromkeys(r["id"] for r in rows))
    by_record = {}
    for r in rows:
        by_record.setdefault(r["id"], []).append(r)
    worst, checked, tied = 0.0, 0, 0
    records = [rec for f in fastas for rec in read_fasta(f)]
    for rid, seq in records:
        ids = encode(tok, seq)
        ref = hf_recipe(model, ids, w, s)
        ours = by_record.pop(rid, [])
        if len(ours) != len(ref):
            fail(f"{rid}: {len(ours)} rows, the recipe scores {len(ref)} tokens")
        for r, (i, ctx, lp) in zip(ours, ref):
            where = f"{rid} token {i}"
            want = (i, i - bos, 3 * (i - bos), text[ids[i]], ctx)
            got = (r["token_index"], r["codon_index"], r["base_offset"], r["codon"], r["context"])
            if got != want:
                fail(f"{where}: (token_index, codon_index, base_offset, codon, context) {got}, expected {want}")
            t = lp[ids[i]].item()
            p = lp.exp()
            entropy = -(p * lp).sum().item()
            err = max(abs(r["log_prob"] - t), abs(r["entropy"] - entropy))
            worst = max(worst, err)
            if err > TOL:
                fail(f"{where}: log_prob {r['log_prob']:.6f} vs {t:.6f}, entropy {r['entropy']:.6f} vs {entropy:.6f}")
            # Rank: tokens clearly more likely than the target, and those within the tolerance.
            above = int((lp > t + TOL).sum())
            near = int(((lp - t).abs() <= TOL).sum())
            if not above + 1 <= r["rank"] <= above + near:
                fail(f"{where}: rank {r['rank']}, expected {above + 1}..{above + near}")
            k = len(r["top_codons"])
            order = torch.sort(p, descending=True).values
            for j, (c, q) in enumerate(zip(r["top_codons"], r["top_probs"])):
                want = order[j].item()
                if abs(q - want) > TOL:
                    fail(f"{where}: top {j} probability {q} vs {want}")
                # The codon must be one whose probability is that value (ties may order either way).
                close = torch.nonzero((p - want).abs() <= TOL).flatten().tolist()
                cands = {text.get(v, f"<id {v}>") for v in close}
                if c not in cands:
                    fail(f"{where}: top {j} is {c}, expected one of {sorted(cands)}")
                tied += len(cands) > 1
            if "log_probs" in r:
                diff = (torch.tensor(r["log_probs"], dtype=torch.float64) - lp).abs().max().item()
                if diff > TOL:
                    fail(f"{where}: full distribution off by {diff}")
            checked += 1
        print(f"{rid}: {len(ours)} tokens match (window {w}, stride {s}, top-{k})")
    if file_order != [rid for rid, _ in records]:
        fail(f"records in the file in the order {file_order}, read in {[rid for rid, _ in records]}")
    if by_record:
        fail(f"rows for records not in {sys.argv[2]}: {sorted(by_record)}")
    print(f"check_per_token: {checked} tokens of {model_dir} equal transformers' "
          f"(worst |diff| {worst:.1e}; {tied} top-k slots with near-ties)")


if __name__ == "__main__":
    main()
