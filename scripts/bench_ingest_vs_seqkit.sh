#!/usr/bin/env bash
# genslm tokenize beside `seqkit seq -u -j 2` (parse, upper-case, rewrite) on the same FASTA,
# interleaved, RUNS times each; prints every run, then the median and best of each.
#   scripts/bench_ingest_vs_seqkit.sh FILE.fa [RUNS] [GENSLM_BINARY]
# TOKENIZE_ARGS adds flags to genslm tokenize (e.g. "--digest md5"); GENSLM_SIMD=avx2 forces
# genslm's AVX2 tier (src/isa.rs).
# seqkit: `apt-get install seqkit` (Debian) or https://bioinf.shenwei.me/seqkit/.
set -euo pipefail
fasta=${1:?usage: $0 FILE.fa [RUNS] [GENSLM_BINARY]}
runs=${2:-5}
genslm=${3:-target/release/genslm}
command -v seqkit >/dev/null || { echo "seqkit is not installed (apt-get install seqkit)" >&2; exit 1; }
[ -x "$genslm" ] || { echo "$genslm not found: cargo build --release first" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cat "$fasta" > /dev/null # both start from a warm page cache
secs() { /usr/bin/time -f %e "$@" 2>&1 >/dev/null | tail -1; }
for i in $(seq "$runs"); do
  # shellcheck disable=SC2086
  g=$(secs "$genslm" tokenize --quiet --fasta "$fasta" --out "$tmp/t.parquet" ${TOKENIZE_ARGS:-})
  s=$(secs seqkit seq -u -j 2 "$fasta" -o "$tmp/s.fa")
  echo "run $i  genslm $g s  seqkit $s s"
  echo "$g" >> "$tmp/g"; echo "$s" >> "$tmp/s"
done
stats() { sort -n "$1" | awk '{a[NR]=$1} END {printf "median %.2f s  best %.2f s", a[int((NR+1)/2)], a[1]}'; }
mb=$(stat -c %s "$fasta" | awk '{printf "%.0f", $1/1e6}')
echo "genslm tokenize       $(stats "$tmp/g")   ($mb MB)"
echo "seqkit seq -u -j 2    $(stats "$tmp/s")"
