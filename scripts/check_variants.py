#!/usr/bin/env python3
"""`genslm variants` against a brute-force REF/ALT scoring in Hugging Face transformers.

  make-vcf FASTA CDS_START CDS_END W OUT.vcf
      Writes a VCF of SNVs, MNVs and indels on the first record of FASTA, inside the CDS
      CDS_START..CDS_END (1-based, inclusive), placed where windows of W codons clip: the
      CDS's first and last codons, the codons where the centred window starts to move, the
      middle; an MNV across a codon boundary; 1- and 3-base insertions and deletions; a
      deletion of the CDS's last bases; a multi-allelic line; and one variant before the CDS.

  check MODEL_DIR FASTA VCF CDS_START CDS_END W TABLE.tsv
      Re-derives every variant's REF and ALT windows from the rule genslm documents
      (src/infer/variants/delta.rs), written here independently: trim the alleles' shared
      bases, window of W codons centred on the first changed codon and clipped at the CDS
      ends, ALT = the same reference bases with the edit applied, whole codons only. Scores
      both windows with transformers (each from its first codon, in float64) and compares
      delta_ll, delta_mean_ll and the per-codon deltas of TABLE.tsv (written by `genslm variants`) within 1e-4.
"""
import csv
import math
import pathlib
import sys

import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from check_hf_roundtrip import read_fasta  # noqa: E402
from check_hf_positions import resolve_model_dir  # noqa: E402

TOL = 1e-4
OTHER = {"A": "C", "C": "G", "G": "T", "T": "A"}


def fail(msg):
    sys.exit(f"check_variants: FAILED: {msg}")


def make_vcf(fasta, s, e, w, out):
    rid, seq = read_fasta(fasta)[0]
    n = (e - s + 1) // 3
    lines = []

    def add(pos, ref_len, alt_fn, vid):
        ref = seq[pos - 1:pos - 1 + ref_len]
        lines.append(f"{rid}\t{pos}\t{vid}\t{ref}\t{alt_fn(ref)}")

    snv = lambda r: OTHER[r]  # noqa: E731
    for c in sorted({0, 1, w // 2 - 1, w // 2, w // 2 + 1, n // 2, n - w // 2 - 1, n - w // 2, n - 2, n - 1}):
        for k in range(3):
            add(s + 3 * c + k, 1, snv, f"snv_c{c + 1}_{k}")
    add(s + 3 * (n // 2) + 2, 2, lambda r: OTHER[r[0]] + OTHER[r[1]], "mnv_boundary")
    add(s + 3 * 5, 3, lambda r: "".join(OTHER[x] for x in r), "mnv_codon")
    for c in (1, n // 2, n - 2):
        p = s + 3 * c
        add(p, 1, lambda r: r + "T", f"ins1_c{c + 1}")
        add(p, 1, lambda r: r + "GCA", f"ins3_c{c + 1}")
        add(p, 2, lambda r: r[0], f"del1_c{c + 1}")
        add(p, 4, lambda r: r[0], f"del3_c{c + 1}")
    add(e - 2, 3, lambda r: r[0], "del_cds_end")
    # Changes longer than the half window after them: the window stretches to hold them.
    add(s + 3 * (n // 2), 31, lambda r: r[0], "del30_past_window")
    add(s, 50, lambda r: r[0], "del49_from_start")
    add(s + 3 * (n // 2) + 1, 3 * w, lambda r: "".join(OTHER[x] for x in r), "mnv_past_window")
    add(e - 3 * w, 3 * w, lambda r: r[0], "del_to_cds_end")
    if s > 1:
        # A deletion of the start codon anchored on the base before the CDS: inside.
        add(s - 1, 4, lambda r: r[0], "del_start_codon_anchored")
    ref = seq[s + 29]
    lines.append(f"{rid}\t{s + 30}\tmulti\t{ref}\t{OTHER[ref]},{OTHER[OTHER[ref]]},{ref}AA")
    if s > 1:
        add(s - 1, 1, snv, "before_cds")
    pathlib.Path(out).write_text("##fileformat=VCFv4.2\n#CHROM\tPOS\tID\tREF\tALT\n" + "\n".join(lines) + "\n")
    print(f"make-vcf: {len(lines)} lines on {rid} ({out})")


def trim(at, ref, alt):
    """Drops the alleles' shared prefix and suffix (a VCF indel's anchor base)."""
    p = 0
    while p < min(len(ref), len(alt)) and ref[p] == alt[p]:
        p += 1
    ref, alt, at = ref[p:], alt[p:], at + p
    q = 0
    while q < min(len(ref), len(alt)) and ref[-1 - q] == alt[-1 - q]:
        q += 1
    return at, ref[:len(ref) - q], alt[:len(alt) - q]


def windows(cds, at, ref, alt, w, whole_record):
    """REF and ALT codon strings of genslm's windows (None when not scored), the window's first
    codon and the reported codons. Written from the documented rule, not from the Rust code's
    arithmetic: the window is cut from the reference first and the change made inside it. On a
    record that is the CDS (`whole_record`), a window reaching its last whole codon runs to the
    record's end as training tokenized it: a partial last codon stays (the tokenizer makes it
    [UNK]), and genslm71's [EOS] would follow (this check's vocabulary, genslm69, has none)."""
    n = len(cds) // 3
    c = at // 3
    if c >= n or at + len(ref) > 3 * n:
        return None
    a = min(max(c - w // 2, 0), max(n - w, 0))
    # W codons from a, stretched to hold the whole change, within the CDS's whole codons.
    end_c = min(n, max(a + min(w, n - a), -(-(at + len(ref)) // 3)))
    to_end = whole_record and end_c == n
    ref_win = cds[3 * a:] if to_end else cds[3 * a:3 * end_c]
    k = at - 3 * a
    alt_win = ref_win[:k] + alt + ref_win[k + len(ref):]
    if not to_end:
        alt_win = alt_win[:len(alt_win) - len(alt_win) % 3]
    if -(-len(ref_win) // 3) < 2 or -(-len(alt_win) // 3) < 2:
        return None
    if len(ref) == len(alt):
        last = (at + len(ref) - 1) // 3
        codons = [x - a for x in range(c, last + 1) if x < end_c]
    else:
        codons = [c - a]
    return ref_win, alt_win, a, codons


def log_probs(model, tok, bases):
    ids = tok.encode(" ".join(bases[i:i + 3] for i in range(0, len(bases), 3))).ids
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), -1)
    return [math.nan] + [lp[t - 1, ids[t]].item() for t in range(1, len(ids))]


def check(model_dir, fasta, vcf, s, e, w, table):
    model = AutoModelForCausalLM.from_pretrained(
        resolve_model_dir(model_dir), trust_remote_code=True, attn_implementation="eager").eval()
    tok = Tokenizer.from_file(str(ROOT / "tokenizers" / "genslm69.json"))
    seqs = dict(read_fasta(fasta))
    rows = list(csv.DictReader(open(table), delimiter="\t"))
    alleles = []
    for line in open(vcf):
        if line.startswith("#") or not line.strip():
            continue
        chrom, pos, vid, ref, alts = line.rstrip("\n").split("\t")[:5]
        alleles += [(chrom, int(pos), vid, ref, a) for a in alts.split(",")]
    if len(rows) != len(alleles):
        fail(f"{len(rows)} rows for {len(alleles)} alleles")
    worst, scored = 0.0, 0
    for r, (chrom, pos, vid, ref, alt) in zip(rows, alleles):
        if (r["id"], int(r["pos"]), r["ref"], r["alt"]) != (vid, pos, ref, alt):
            fail(f"row {r} is not allele {vid} {pos} {ref}>{alt}")
        at, tref, talt = trim(pos - 1, ref, alt)  # 0-based, on the record
        inside = (s - 1 < at < e) if not tref else (s - 1 <= at and at + len(tref) <= e)
        if not inside:
            if r["consequence"] != "outside_cds" or r["delta_ll"] != "NA":
                fail(f"{vid}: outside the CDS, got {r['consequence']} {r['delta_ll']}")
            continue
        cds = seqs[chrom][s - 1:e]
        win = windows(cds, at - (s - 1), tref, talt, w, s == 1 and e == len(seqs[chrom]))
        if win is None:
            if r["delta_ll"] != "NA":
                fail(f"{vid}: not scorable (incomplete codon or an empty window), got {r['delta_ll']}")
            continue
        rb, ab, a, codons = win
        lr, la = log_probs(model, tok, rb), log_probs(model, tok, ab)
        delta = sum(la[1:]) - sum(lr[1:])
        delta_mean = sum(la[1:]) / (len(la) - 1) - sum(lr[1:]) / (len(lr) - 1)
        per = [la[i] - lr[i] if 0 < i < min(len(la), len(lr)) else math.nan for i in codons]
        got = float(r["delta_ll"])
        got_per = [math.nan if x == "NA" else float(x) for x in r["codon_deltas"].split(",")]
        if int(r["window_start"]) != a + 1 or int(r["ref_tokens"]) != len(lr) or int(r["alt_tokens"]) != len(la):
            fail(f"{vid}: window {r['window_start']} ({r['ref_tokens']}/{r['alt_tokens']} tokens), expected {a + 1} ({len(lr)}/{len(la)})")
        if len(got_per) != len(per) or any(
                (math.isnan(x) != math.isnan(y)) or (not math.isnan(x) and abs(x - y) > TOL) for x, y in zip(got_per, per)):
            fail(f"{vid}: codon deltas {got_per}, transformers {per}")
        err = max(abs(got - delta), abs(float(r["delta_mean_ll"]) - delta_mean))
        worst = max(worst, err)
        if err > TOL:
            fail(f"{vid} {pos} {ref}>{alt}: delta_ll {got:.6f} (mean {r['delta_mean_ll']}), "
                 f"transformers {delta:.6f} (mean {delta_mean:.6f})")
        scored += 1
    print(f"check_variants: {scored} variants' delta_ll equal transformers' brute-force REF/ALT "
          f"scoring (worst |diff| {worst:.1e}; window {w})")


if __name__ == "__main__":
    if sys.argv[1] == "make-vcf":
        make_vcf(pathlib.Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    elif sys.argv[1] == "check":
        check(pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3]), sys.argv[4], int(sys.argv[5]),
              int(sys.argv[6]), int(sys.argv[7]), sys.argv[8])
    else:
        sys.exit(__doc__)
