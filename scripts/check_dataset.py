#!/usr/bin/env python3
"""Independent check of a dataset written by `genslm tokenize --fasta data/ --out FILE`.

Opens FILE with pyarrow and pandas, checks the columns and their types, and recomputes
length, GC content and the digest — xxh3 (the `xxhash` package's XXH3-128) or md5 (hashlib),
whichever column the file has — from a plain-Python reading of the FASTA files.

Usage: python3 scripts/check_dataset.py FILE.parquet DATA_DIR
"""
import gzip
import hashlib
import pathlib
import sys

import pandas as pd
import xxhash
import pyarrow.parquet as pq

DIGESTS = {"xxh3": xxhash.xxh3_128_hexdigest, "md5": lambda b: hashlib.md5(b).hexdigest()}


def expected(names):
    kind = "xxh3" if "xxh3" in names else "md5"
    return kind, ["id", "description", "source", "length", "gc_content", kind, "tokens"]


def read_fasta(path):
    opener = gzip.open if path.suffix == ".gz" else open
    records = []
    with opener(path, "rt") as f:
        for line in f:
            line = line.rstrip("\r\n")
            if line.startswith(">"):
                records.append([line[1:], []])
            else:
                records[-1][1].append(line.upper())
    return [(h, "".join(parts)) for h, parts in records]


def main():
    parquet, data_dir = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    table = pq.read_table(parquet)
    kind, cols = expected(table.column_names)
    assert table.column_names[: len(cols)] == cols, table.column_names
    digest = DIGESTS[kind]
    assert str(table.schema.field("tokens").type).startswith("list<"), table.schema
    df = pd.read_parquet(parquet)
    by_key = {(r.source, r.id): r for r in df.itertuples()}
    n = 0
    for path in sorted(p for p in data_dir.rglob("*") if p.name.endswith((".fa", ".fasta", ".fna", ".fa.gz", ".fasta.gz", ".fna.gz"))):
        for header, seq in read_fasta(path):
            rid = header.split()[0]
            row = by_key.get((str(path), rid))
            if row is None:
                sys.exit(f"check_dataset: record {rid} of {path} is not in {parquet}: give the "
                         f"directory the dataset was tokenized from (its `source` column names "
                         f"the files: {sorted({r.source for r in df.itertuples()})[:3]}...)")
            assert row.length == len(seq), (rid, row.length, len(seq))
            gc = (seq.count("G") + seq.count("C")) / len(seq)
            assert abs(row.gc_content - gc) < 1e-12, (rid, row.gc_content, gc)
            assert getattr(row, kind) == digest(seq.encode()), (rid, kind)
            assert len(row.tokens) == (len(seq) + 2) // 3, rid
            n += 1
    assert n == len(df), (n, len(df))
    print(f"check_dataset: {n} records match, digest {kind} (pyarrow {pq.__name__}, pandas {pd.__version__})")


if __name__ == "__main__":
    main()
