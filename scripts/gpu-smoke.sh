#!/usr/bin/env bash
# The GPU check: needs only a genslm binary built with the `cuda` feature
# (scripts/build-cuda.sh), an NVIDIA GPU with its driver, nvidia-smi and python3 — no Rust.
# Usage: scripts/gpu-smoke.sh BINARY [WORK_DIR]
# Prints one markdown table:
#   (1) tiny and genslm-25m, 20 steps on cuda (bf16) vs cpu (fp32): worst per-step loss gap;
#   (2) tokens/s, TFLOPS, MFU and peak GPU memory of genslm-25m and genslm-250m training at
#       seq 2K, 8K and the longest power of two that fits (batch 1);
#   (3) embed and generate on cuda;
#   (4) with 2+ GPUs: --sp 2 (under mpirun when present: NCCL on device buffers; else two
#       thread ranks) vs --sp 1, losses.
# PEAK_TFLOPS (default 989, H100/H200 SXM dense bf16) sets the MFU denominator.
set -uo pipefail
BIN=$(realpath "$1")
cd "$(dirname "$0")/.."
WORK=${2:-$(mktemp -d)}
mkdir -p "$WORK"
PEAK=${PEAK_TFLOPS:-989}
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
TABLE="$WORK/table.md"
GPU=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1)
{ echo "GPU: $GPU ($NGPU visible); $(date -u +%F); binary $(basename "$BIN")"; echo
  echo "| check | result | figures |"; echo "|---|---|---|"; } > "$TABLE"
row() { echo "| $1 | $2 | $3 |" >> "$TABLE"; }

# Runs "$@" while sampling GPU memory; leaves the peak (MiB) in $WORK/peak.
with_gpu_mem() {
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > "$WORK/mem.log" &
  local mon=$! rc
  "$@"; rc=$?
  kill $mon; wait $mon 2>/dev/null
  sort -n "$WORK/mem.log" | tail -1 > "$WORK/peak"
  return $rc
}

# Mean tokens/s and TFLOPS over the steps after the first two (warm-up, kernel compilation).
rate() { python3 - "$1" <<'PY'
import json, sys
m = [json.loads(l) for l in open(sys.argv[1])]
m = [x for x in m if x.get("tokens_per_s")][2:] or m
print("%.0f %.2f" % (sum(x["tokens_per_s"] for x in m) / len(m), sum(x["tflops"] for x in m) / len(m)))
PY
}

# Worst per-step relative loss gap between two runs' metrics.
gap() { python3 - "$1" "$2" <<'PY'
import json, sys
a, b = ([json.loads(l)["loss"] for l in open(p)] for p in sys.argv[1:3])
print("%.2e" % max(abs(x - y) / abs(x) for x, y in zip(a, b)))
PY
}

SMALL=(train --fasta data/ --steps 20 --seq-len 64 --batch-size 4 --lr 3e-3 --val-every 0 --quiet)
for cfg in tiny genslm-25m; do
  "$BIN" "${SMALL[@]}" --config "configs/$cfg.toml" --out "$WORK/$cfg-cpu" --backend cpu --overwrite
  if with_gpu_mem "$BIN" "${SMALL[@]}" --config "configs/$cfg.toml" --out "$WORK/$cfg-cuda" \
       --backend cuda --overwrite; then
    g=$(gap "$WORK/$cfg-cpu/metrics.jsonl" "$WORK/$cfg-cuda/metrics.jsonl")
    ok=$(python3 -c "print('pass' if $g <= 0.02 else 'FAIL')")
    row "(1) $cfg 20 steps cuda bf16 vs cpu fp32" "$ok" "worst step loss gap $g (limit 2e-2)"
  else
    row "(1) $cfg 20 steps cuda bf16 vs cpu fp32" "FAIL" "cuda run failed (see stderr)"
  fi
done

# Long records for the throughput runs: random codons, 40 records of 2^17 codons.
python3 - "$WORK/long.fa" <<'PY'
import random, sys
random.seed(0)
with open(sys.argv[1], "w") as f:
    for i in range(40):
        s = "".join(random.choice("ACGT") for _ in range(3 * 131072))
        f.write(f">r{i}\n" + "\n".join(s[j:j + 80] for j in range(0, len(s), 80)) + "\n")
PY
perf() { # config seq -> appends a row; returns the run's status
  local cfg=$1 seq=$2 out="$WORK/perf-$1-$2"
  if with_gpu_mem timeout 600 "$BIN" train --fasta "$WORK/long.fa" --config "configs/$cfg.toml" \
       --out "$out" --steps 6 --seq-len "$seq" --batch-size 1 --val-every 0 --warmup 1 \
       --overwrite --quiet --backend cuda; then
    read -r tps tfl < <(rate "$out/metrics.jsonl")
    mfu=$(python3 -c "print('%.1f%%' % (100 * $tfl / $PEAK))")
    row "(2) $cfg seq $seq" "ran" "$tps tokens/s, $tfl TFLOPS, MFU $mfu, peak GPU $(cat "$WORK/peak") MiB"
    return 0
  fi
  row "(2) $cfg seq $seq" "did not fit/failed" "peak GPU $(cat "$WORK/peak") MiB before it stopped"
  return 1
}
for cfg in genslm-25m genslm-250m; do
  perf "$cfg" 2048; perf "$cfg" 8192
  seq=16384
  while [ $seq -le 131072 ] && perf "$cfg" $seq; do seq=$((seq * 2)); done
done

if with_gpu_mem "$BIN" embed --model "$WORK/genslm-25m-cuda" --fasta data/ --out "$WORK/emb.parquet" \
     --backend cuda --quiet; then
  row "(3) embed on cuda" "pass" "peak GPU $(cat "$WORK/peak") MiB"
else row "(3) embed on cuda" "FAIL" "see stderr"; fi
if "$BIN" generate --model "$WORK/genslm-25m-cuda" --num 4 --max-codons 256 --backend cuda \
     --out "$WORK/gen.fa" --quiet && [ "$(grep -c '>' "$WORK/gen.fa")" = 4 ]; then
  row "(3) generate on cuda" "pass" "4 samples of 256 codons"
else row "(3) generate on cuda" "FAIL" "see stderr"; fi

if [ "$NGPU" -ge 2 ]; then
  "$BIN" "${SMALL[@]}" --config configs/genslm-25m.toml --out "$WORK/sp1" --backend cuda --overwrite
  # Under mpirun (a binary built with mpi) the exchange runs over NCCL on device buffers;
  # without it the two ranks are threads of one process talking through host memory.
  if command -v mpirun >/dev/null; then
    how="mpirun -np 2, NCCL"
    LAUNCH=(mpirun --allow-run-as-root -np 2 -x OMPI_ALLOW_RUN_AS_ROOT=1 "$BIN")
  else
    how="threads, host exchange"; LAUNCH=("$BIN")
  fi
  if "${LAUNCH[@]}" "${SMALL[@]}" --config configs/genslm-25m.toml --out "$WORK/sp2" \
       --backend cuda --sp 2 --overwrite; then
    row "(4) --sp 2 ($how) vs --sp 1 on cuda" "ran" \
      "worst step loss gap $(gap "$WORK/sp1/metrics.jsonl" "$WORK/sp2/metrics.jsonl")"
  else row "(4) --sp 2 ($how) on cuda" "FAIL" "see stderr"; fi
else
  row "(4) --sp 2 vs --sp 1" "skipped" "one GPU visible"
fi
cat "$TABLE"
