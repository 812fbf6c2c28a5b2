#!/usr/bin/env bash
# The 8-step loss curves of one rank, SP 2, CP 2, TP 2 and ZeRO-3 (DP 2) on configs/tiny.toml,
# printed with every digit metrics.jsonl holds: a refactor that claims "behaviour unchanged" runs
# this before and after and diffs the two outputs (they must be bit-identical).
# Usage: scripts/loss_curves.sh [GENSLM_BINARY]   (default: target/release/genslm)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-target/release/genslm}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
"$BIN" tokenize --fasta data/ --out "$TMP/data.parquet" --quiet >/dev/null
for layout in "one-rank:" "sp2:--sp 2" "cp2:--cp 2" "tp2:--tp 2" "zero3-dp2:--dp 2 --zero 3"; do
  name=${layout%%:*}
  # shellcheck disable=SC2086
  "$BIN" train --data "$TMP/data.parquet" --config configs/tiny.toml --out "$TMP/$name" \
    --steps 8 --seq-len 128 --batch-size 2 --threads 2 --quiet --val-every 0 ${layout#*:}
  python3 - "$name" "$TMP/$name/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[2]) if l.strip()]
loss = [r["loss"] for r in rows if "step" in r and "loss" in r]
print(sys.argv[1].ljust(10), " ".join(repr(x) for x in loss))
PY
done
