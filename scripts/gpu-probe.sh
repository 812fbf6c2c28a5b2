#!/usr/bin/env bash
# The first call on a GPU machine (docs/GPU.md): about 3 minutes, one command. Each row is
# printed as soon as it is known, so a timeout still returns what ran.
# Usage: bash scripts/gpu-probe.sh [llvm|nvrtc]
#   Needs the carried bundle (target/gpu-bundle, scripts/build-cuda.sh --bundle) and, for the
#   PyTorch row, the machine's python3 with torch. Writes three files to $OUT (the device
#   tool's output folder, else target/gpu-probe; it brings back 8 files at most): the rows
#   (probe-VARIANT.md), the runs' logs (probe-logs-VARIANT.tar.xz) and, when a kernel fails,
#   the PTX cubecl compiled (ptx-VARIANT.tar.xz, from CUBECL_CUDA_DUMP_PTX).
# Rows: GPU, driver and toolkit; the binary's NEEDED and missing libraries; tiny config 5 steps
# --backend cuda in fp32 against the CPU curve (<= 1e-3 relative per step) and in bf16 (<= 2e-2);
# kernel compilation time; attention at one shape: genslm's kernels, cubek, PyTorch SDPA.
set -uo pipefail
cd "$(dirname "$0")/.."
VARIANT=${1:-llvm}
OUTDIR=${OUT:-target/gpu-probe}
mkdir -p "$OUTDIR"
ROWS="$OUTDIR/probe-$VARIANT.md"
WORK=$(mktemp -d)
# Logs travel back as one archive, whatever ended the script.
trap 'tar -cJf "$OUTDIR/probe-logs-$VARIANT.tar.xz" -C "$WORK" $(cd "$WORK" && ls *.log 2>/dev/null) 2>/dev/null; rm -rf "$WORK"' EXIT
row() { printf '| %s | %s | %s |\n' "$1" "$2" "$3" | tee -a "$ROWS"; }
T0=$(date +%s)
since() { echo "$(( $(date +%s) - T0 )) s"; }

echo "== gpu-env.sh ($VARIANT)"
. scripts/gpu-env.sh "$VARIANT"; ENV_RC=$?

# No driver, no point: say so plainly and stop (this is what a machine without a GPU sees).
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-probe: no NVIDIA driver on this machine (nvidia-smi $(command -v nvidia-smi >/dev/null && echo 'finds no GPU' || echo 'is not installed')); nothing to probe" >&2
  exit 1
fi
{ echo; echo "GPU probe, $VARIANT variant, $(date -u +%FT%TZ)"; echo
  echo "| check | result | figures |"; echo "|---|---|---|"; } | tee -a "$ROWS"
row "GPU" "$(nvidia-smi --query-gpu=name,memory.total,compute_cap --format=csv,noheader | head -1)" \
  "driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1); nvcc $(nvcc --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\).*/\1/p' || echo none)"
if (( ENV_RC != 0 )); then
  row "binary" "FAIL" "gpu-env.sh could not unpack target/gpu-bundle/genslm-$VARIANT.xz (see above)"
  exit 1
fi
BIN=$GENSLM_BIN
cat "${BUNDLE_DIR:-target/gpu-bundle}/BUNDLE-$VARIANT.txt" 2>/dev/null | sed 's/^/   /'
MISSING=$(ldd "$BIN" 2>&1 | awk '/not found/ {print $1}' | tr '\n' ' ')
row "NEEDED libraries" "$([[ -z "$MISSING" ]] && echo pass || echo FAIL)" \
  "$(readelf -d "$BIN" 2>/dev/null | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | tr '\n' ' ')${MISSING:+; missing: $MISSING}"

# The CPU curve, made here with the same binary (tiny, 5 steps: about a second).
TRAIN=(train --fasta data/ --config configs/tiny.toml --steps 5 --seq-len 64 --batch-size 2
       --lr 3e-3 --seed 7 --val-every 0 --quiet --overwrite)
REF="$WORK/cpu/metrics.jsonl"
timeout 60 "$BIN" "${TRAIN[@]}" --out "$WORK/cpu" --backend cpu > "$WORK/tiny-cpu.log" 2>&1 ||
  row "tiny 5 steps cpu (the reference)" FAIL "$(grep -v '^$' "$WORK/tiny-cpu.log" | tail -2 | tr '\n|' ' /')"
export CUBECL_CUDA_DUMP_PTX="$WORK/ptx"
for prec in fp32 bf16; do
  limit=$([[ $prec == fp32 ]] && echo 1e-3 || echo 2e-2)
  log="$WORK/tiny-cuda-$prec.log"
  t=$(date +%s)
  if timeout 75 "$BIN" "${TRAIN[@]}" --out "$WORK/cuda-$prec" --backend cuda --precision "$prec" > "$log" 2>&1; then
    res=$(python3 scripts/gpu_tables.py gap "$REF" "$WORK/cuda-$prec/metrics.jsonl" "$limit")
    row "tiny 5 steps cuda $prec vs cpu" "${res%%:*}" "${res#*: }; $(( $(date +%s) - t )) s in all"
    [[ $prec == fp32 ]] && row "kernel compilation (first step)" "-" \
      "$(python3 scripts/gpu_tables.py compile "$WORK/cuda-$prec/metrics.jsonl")"
  else
    rc=$?
    row "tiny 5 steps cuda $prec vs cpu" "FAIL" "exit $rc$([[ $rc == 124 ]] && echo ' (timeout 75 s)'): $(grep -v '^$' "$log" | tail -2 | tr '\n|' ' /' | cut -c1-300)"
    grep -v '^$' "$log" | tail -15 | sed 's/^/   /'
    # Keep what cubecl compiled, for docs/GPU.md's failure table.
    [[ -d "$WORK/ptx" ]] && tar -cJf "$OUTDIR/ptx-$VARIANT.tar.xz" -C "$WORK" ptx
  fi
done
unset CUBECL_CUDA_DUMP_PTX
echo "   ($(since) so far)"

# Attention at one shape, bf16 inputs, causal: ours, cubek (forward only in bf16), PyTorch.
SHAPE=(--seq 4096 --heads 16 --head-dim 128 --batch 1 --iters 3)
for imp in genslm cubek; do
  line=$(timeout 45 "$BIN" bench attention "${SHAPE[@]}" --dtype bf16 --impl "$imp" --backend cuda 2>&1 | tail -1)
  row "attention $imp s 4096 d 128 bf16 causal" "$([[ $line == attention* ]] && echo ran || echo FAIL)" "$(tr '|' '/' <<<"$line" | cut -c1-300)"
done
line=$(timeout 45 python3 scripts/gpu_tables.py sdpa "${SHAPE[@]}" --dtype bf16 2>&1 | tail -1)
row "attention torch SDPA s 4096 d 128 bf16 causal" "$([[ $line == sdpa* ]] && echo ran || echo FAIL)" "$(tr '|' '/' <<<"$line" | cut -c1-300)"
echo "== gpu-probe done in $(since); rows in $ROWS"
