#!/usr/bin/env python3
"""Checks an embeddings parquet written by `genslm embed` with pyarrow and pandas.

Usage: check_embeddings.py FILE N_ROWS DIM
Exits non-zero (with the reason) unless the file has the documented columns and types,
N_ROWS rows, and an `embedding` column of DIM finite float32 values per row. The digest column is
`md5` (FASTA input) or the input dataset's own (`xxh3` by default), 32 hex digits either way.
"""
import math
import sys

import pyarrow as pa
import pyarrow.parquet as pq


def main() -> None:
    path, n_rows, dim = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    table = pq.read_table(path)
    digest = "xxh3" if "xxh3" in table.column_names else "md5"
    want = {
        "id": pa.string(),
        "description": pa.string(),
        "source": pa.string(),
        digest: pa.string(),
        "length": pa.int64(),
        "gc_content": pa.float64(),
        "n_tokens": pa.int64(),
        "layer": pa.int32(),
    }
    for name, typ in want.items():
        got = table.schema.field(name).type
        assert got == typ, f"column {name}: {got}, expected {typ}"
    emb_type = table.schema.field("embedding").type
    assert pa.types.is_fixed_size_list(emb_type), f"embedding is {emb_type}"
    assert emb_type.list_size == dim, f"embedding size {emb_type.list_size}, expected {dim}"
    assert emb_type.value_type == pa.float32(), f"embedding values are {emb_type.value_type}"
    assert table.num_rows == n_rows, f"{table.num_rows} rows, expected {n_rows}"
    df = table.to_pandas()
    flat = table.column("embedding").combine_chunks().flatten().to_numpy()
    matrix = flat.reshape(table.num_rows, dim)
    assert matrix.shape == (n_rows, dim)
    assert all(math.isfinite(x) for x in flat), "non-finite embedding values"
    assert (df["n_tokens"] > 0).all() and df["gc_content"].between(0, 1).all()
    assert df[digest].str.len().eq(32).all()
    print(f"{path}: {matrix.shape[0]} x {matrix.shape[1]} embeddings, columns {list(df.columns)}")


if __name__ == "__main__":
    main()
