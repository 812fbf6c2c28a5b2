#!/usr/bin/env python3
"""Token-id fixture from Hugging Face `tokenizers`, the library GenSLM itself uses.

Loads tokenizers/genslm69.json and genslm71.json (GenSLM's vocabularies) with
`tokenizers.Tokenizer.from_file` and tokenizes sequences the way GenSLM's data pipeline does:
upper-case, then split into non-overlapping 3-mers joined by spaces (a trailing 1-2 bases stay
as a short word, which the WordLevel model maps to [UNK]). Writes
tests/fixtures/tokenizer_hf.json: [{"vocab", "seq", "ids"}, ...].

Usage: python3 scripts/make_tokenizer_fixture.py   (needs `pip install tokenizers`)
"""
import json
import pathlib
import random

from tokenizers import Tokenizer

ROOT = pathlib.Path(__file__).resolve().parent.parent


def genslm_words(seq: str) -> str:
    seq = seq.upper()
    return " ".join(seq[i : i + 3] for i in range(0, len(seq), 3))


def sequences():
    rng = random.Random(7)
    seqs = ["ATG", "atggcgtaa", "ATGNNNTAG", "ACGTA", "AC", "A", "RYSWKMBDHVNU", "aTgCcGtAg"]
    # Every codon once, in a fixed shuffled order.
    codons = [a + b + c for a in "ACGT" for b in "ACGT" for c in "ACGT"]
    rng.shuffle(codons)
    seqs.append("".join(codons))
    for n in [7, 30, 301, 1000]:
        alphabet = "ACGTACGTACGTacgtN"
        seqs.append("".join(rng.choice(alphabet) for _ in range(n)))
    return seqs


def main():
    out = []
    for vocab in ["genslm69", "genslm71"]:
        tok = Tokenizer.from_file(str(ROOT / "tokenizers" / f"{vocab}.json"))
        for seq in sequences():
            ids = tok.encode(genslm_words(seq)).ids
            out.append({"vocab": vocab, "seq": seq, "ids": ids})
    path = ROOT / "tests" / "fixtures" / "tokenizer_hf.json"
    path.write_text(json.dumps(out, indent=0) + "\n")
    print(f"wrote {len(out)} cases to {path}")


if __name__ == "__main__":
    main()
