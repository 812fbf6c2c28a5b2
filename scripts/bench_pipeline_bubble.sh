#!/usr/bin/env bash
# The measured pipeline bubble of each schedule against its theory (issue 40): tiny with 8
# layers, seq 1024, batch 1, `--pp 2 --grad-accum 8`, one process per stage bound to its own
# core (mpirun -np 2 --bind-to core; each stage computes on one thread). Schedules interleaved
# round by round; prints, per run, pp_bubble over steps 2-6 and the mean tokens/s.
# Usage: [HIDDEN=64] [SEQ=1024] scripts/bench_pipeline_bubble.sh PATH/TO/genslm [ROUNDS] (built
# with --features mpi, release; HIDDEN sets the width, the MLP 4x it). Needs mpirun and two cores.
# At tiny's width attention outweighs the linear layers, whose weight products are what ZB's W
# passes move into the bubbles; HIDDEN=256 SEQ=256 is a model where the linear layers dominate.
set -euo pipefail
BIN=$1
ROUNDS=${2:-2}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
HIDDEN=${HIDDEN:-64}
SEQ=${SEQ:-1024}
sed -e 's/^num_layers = .*/num_layers = 8/' -e "s/^hidden_size = .*/hidden_size = $HIDDEN/" \
  -e "s/^intermediate_size = .*/intermediate_size = $((4 * HIDDEN))/" configs/tiny.toml > "$TMP/tiny8.toml"
echo "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores, $(date -u +%F); hidden $HIDDEN, seq $SEQ"
for round in $(seq "$ROUNDS"); do
  for sched in 1f1b zb interleaved gpipe; do
    extra=()
    [ "$sched" = interleaved ] && extra=(--pp-virtual 2)
    out="$TMP/$sched-$round"
    mpirun --bind-to core -np 2 "$BIN" train --fasta data/ --config "$TMP/tiny8.toml" --out "$out" \
      --steps 6 --seq-len "$SEQ" --batch-size 1 --grad-accum 8 --val-every 1000 --pp 2 \
      --pp-schedule "$sched" "${extra[@]}" --quiet
    python3 - "$out/metrics.jsonl" "$sched" "$round" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
rows = [r for r in rows if "pp_bubble" in r and r.get("pp_bubble") is not None and r["step"] >= 2]
b = [r["pp_bubble"] for r in rows]
tps = sum(r["tokens_per_s"] for r in rows) / len(rows)
print(f"round {sys.argv[3]} {sys.argv[2]:12s} pp_bubble {min(b):.3f}-{max(b):.3f}  {tps:,.0f} tokens/s")
EOF
  done
done
