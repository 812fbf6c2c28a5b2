#!/usr/bin/env bash
# Re-measures the peaks that tests/plan_calibration.rs holds (MEASURED and MEASURED_CKPT, as
# "(config, run, sp, attention, seq_len, peak MiB)" rows; MEASURED_ZERO, as "(config, dp, sp,
# zero, checkpointing, seq_len, peak MiB)" rows) to paste there. Run after any change to
# what the model keeps alive, with release builds:
#   scripts/measure_plan_calibration.sh target/release/genslm [GENSLM_WITH_MPI]
# The second binary (built with --features mpi) adds the mpirun rows; without it they are skipped
# and said so.
set -euo pipefail
BIN=${1:?usage: $0 GENSLM [GENSLM_WITH_MPI]}
MPIBIN=${2:-}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
row() { printf '    ("%s", "%s", %s, AttentionKind::%s, %s, %s),\n' "$@"; }
peak() { python3 -c "import json,sys; print(max(json.loads(l)['peak_rss_mib'] for l in open(sys.argv[1]) if 'peak_rss_mib' in l))" "$1/metrics.jsonl"; }
train() { # config seq_len extra-args...
  local cfg=$1 s=$2; shift 2
  rm -rf "$TMP/run"
  "$BIN" train --fasta data/lambda_virus.fa --config "configs/$cfg.toml" --out "$TMP/run" --steps 1 \
    --seq-len "$s" --batch-size 1 --val-fraction 0 --warmup 0 --quiet "$@"
  peak "$TMP/run"
}
# One step per case, each in its own process: "seq_len attention step_s tokens/s peak_MiB".
"$BIN" bench attention --config configs/tiny.toml --seq-lens 2048,4096,8192,16384 --naive-max 8192 \
  --checkpoint-activations --quiet | awk '$1 ~ /^[0-9]+$/' > "$TMP/bench.txt"
cat "$TMP/bench.txt" >&2
bench_peak() { awk -v s=$1 -v a=$2 '$1==s && $2==a {print $5}' "$TMP/bench.txt"; }
echo "// MEASURED"
for s in 2048 4096 8192 16384; do row tiny bench 1 Flash $s "$(bench_peak $s flash)"; done
for s in 2048 4096 8192; do row tiny bench 1 Naive $s "$(bench_peak $s naive)"; done
for s in 2048 4096 8192 16384; do row tiny train 1 Flash $s "$(train tiny $s)"; done
for s in 1024 2048 4096 9968; do row genslm-25m train 1 Flash $s "$(train genslm-25m $s)"; done
if [ -n "$MPIBIN" ]; then
  for p in 2 4; do for s in 1024 2048 4096 8192; do
    rm -rf "$TMP/run"
    mpirun --oversubscribe -np $p "$MPIBIN" train --fasta data/lambda_virus.fa --config configs/genslm-25m.toml \
      --out "$TMP/run" --steps 1 --seq-len $s --batch-size 1 --val-fraction 0 --warmup 0 --quiet --sp $p
    row genslm-25m mpi $p Flash $s "$(peak "$TMP/run")"
  done; done
else
  echo "    // mpirun rows not measured: pass a --features mpi binary" >&2
fi
echo "// MEASURED_CKPT"
for s in 2048 4096 8192 16384; do row tiny bench 1 Flash $s "$(bench_peak $s flash+ckpt)"; done
for s in 1024 4096 9968; do row genslm-25m train 1 Flash $s "$(train genslm-25m $s --checkpoint-activations)"; done
if [ -n "$MPIBIN" ]; then
  echo "// MEASURED_ZERO (2 steps: the second step's optimizer buffers meet the first's leftovers)"
  zrow() { printf '    ("%s", %s, %s, %s, %s, %s, %s),\n' "$@"; }
  zero() { # dp sp zero ckpt(true/false) seq_len
    local dp=$1 sp=$2 z=$3 c=$4 s=$5 extra=()
    [ "$c" = true ] && extra=(--checkpoint-activations)
    rm -rf "$TMP/run"
    mpirun --oversubscribe -np $((dp * sp)) "$MPIBIN" train --fasta data/lambda_virus.fa \
      --config configs/genslm-25m.toml --out "$TMP/run" --steps 2 --seq-len "$s" --batch-size "$dp" \
      --dp "$dp" --sp "$sp" --zero "$z" --val-fraction 0 --warmup 0 --quiet --skip-memory-check \
      "${extra[@]}"
    zrow genslm-25m "$dp" "$sp" "$z" "$c" "$s" "$(peak "$TMP/run")"
  }
  for s in 2048 4096; do for dp in 2 4; do for z in 1 2 3; do for c in false true; do
    zero $dp 1 $z $c $s
  done; done; done; done
  for c in false true; do zero 2 2 3 $c 4096; done
fi
