#!/usr/bin/env bash
# The GPU check after scripts/gpu-probe.sh passes (docs/GPU.md): parts chosen with PARTS, each
# at most about 8 minutes (one device command may run 10), rows printed and appended to
# $OUT/smoke-VARIANT.md as they are measured, so a timeout keeps what ran; the runs' logs go
# to $OUT/smoke-logs-VARIANT.tar.xz (the device tool brings back 8 files at most).
# Usage: PARTS=correctness,throughput bash scripts/gpu-smoke.sh [llvm|nvrtc]
#   correctness  tiny and genslm-25m, 20 steps, cuda fp32 (<= 1e-3 relative per step) and bf16
#                (<= 2e-2) against the CPU fp32 curve (REF_DIR, else made here first), and cuda
#                bf16 against the CPU's bf16 curve (the same mixed-precision layout), when carried
#   throughput   genslm-25m and genslm-250m (THROUGHPUT_CONFIGS) at seq 2K, 8K, then doubling
#                while it fits, up to PERF_MAX_SEQ (131072):
#                tokens/s, TFLOPS, MFU (PEAK_TFLOPS, default 989: H100/H200 SXM dense bf16),
#                peak GPU memory (nvidia-smi, sampled every 100 ms)
#   infer        score, embed and generate on cuda with a model trained here for 5 steps
#   peer         Hugging Face GPT-NeoX in PyTorch (bf16 autocast, scripts/bench_torch_train.py
#                with DEVICE=cuda) then genslm, shape by shape (PEER_SHAPES, default
#                genslm-25m:2048,genslm-25m:8192,genslm-250m:2048,genslm-250m:8192): tokens/s
#                of each and genslm / PyTorch
#   attention    the op alone, bf16, causal: genslm's kernels vs cubek vs PyTorch SDPA at
#                ATTN_SEQS (1024,4096,16384,32768) × d 64/128, and ALiBi (ours vs SDPA)
#   profile      where a training step's GPU time goes (PROFILE_SHAPES, default
#                genslm-25m:2048,genslm-250m:2048): cubecl's per-kernel timings of steps 3-6
#                (CUBECL_DEBUG_OPTION=profile; every launch waits for its kernel, so only the
#                kernel times count, not the step time), beside the unprofiled step time with
#                and without the trainer's device-memory samples (PROFILE_MODES, default
#                samples,no-samples,profiled), to $OUT/profile-VARIANT.md
#   sp           with 2+ GPUs: --sp 2 against --sp 1
# The CPU curves take seconds; make them on the dev machine and carry them to save GPU time:
#   PARTS=ref BIN=target/release/genslm bash scripts/gpu-smoke.sh   (writes REF_DIR)
set -uo pipefail
cd "$(dirname "$0")/.."
VARIANT=${1:-llvm}
PARTS=",${PARTS:-correctness,throughput,infer,attention,sp},"
OUTDIR=${OUT:-target/gpu-smoke}
REF_DIR=${REF_DIR:-target/gpu-bundle/ref}
PEAK=${PEAK_TFLOPS:-989}
PART_S=${PART_S:-450}
mkdir -p "$OUTDIR" "$REF_DIR"
ROWS="$OUTDIR/smoke-$VARIANT.md"
WORK=${WORK:-$(mktemp -d)}
mkdir -p "$WORK"
trap 'tar -cJf "$OUTDIR/smoke-logs-$VARIANT.tar.xz" -C "$WORK" $(cd "$WORK" && ls *.log 2>/dev/null) 2>/dev/null' EXIT
row() { printf '| %s | %s | %s |\n' "$1" "$2" "$3" | tee -a "$ROWS"; }
part() { [[ $PARTS == *",$1,"* ]]; }
# Seconds left in the current part (set PART_START before the part).
left() { echo $(( PART_S - ($(date +%s) - PART_START) )); }
tail2() { grep -v '^$' "$1" | tail -2 | tr '\n|' ' /' | cut -c1-300; }

SMALL=(--fasta data/ --steps 20 --seq-len 64 --batch-size 4 --lr 3e-3 --seed 7 --val-every 0
       --quiet --overwrite)
if part ref; then
  BIN=${BIN:?PARTS=ref needs BIN=path/to/genslm}
  for cfg in tiny genslm-25m; do
    "$BIN" train "${SMALL[@]}" --config "configs/$cfg.toml" --out "$WORK/ref-$cfg" --backend cpu \
      && cp "$WORK/ref-$cfg/metrics.jsonl" "$REF_DIR/$cfg-cpu-20.jsonl" || exit 1
    "$BIN" train "${SMALL[@]}" --config "configs/$cfg.toml" --out "$WORK/ref-$cfg-bf16" --backend cpu \
      --precision bf16 && cp "$WORK/ref-$cfg-bf16/metrics.jsonl" "$REF_DIR/$cfg-cpu-bf16-20.jsonl" || exit 1
  done
  echo "== CPU curves in $REF_DIR: carry it with the bundle"; ls -l "$REF_DIR"
  [[ $PARTS == ",ref," ]] && exit 0
fi

. scripts/gpu-env.sh "$VARIANT" || exit 1
BIN=$GENSLM_BIN
if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-smoke: no NVIDIA driver on this machine (nvidia-smi); run scripts/gpu-probe.sh first" >&2
  exit 1
fi
NGPU=$(nvidia-smi -L | wc -l)
{ echo; echo "GPU smoke ($VARIANT, parts ${PARTS//,/ }): $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1) × $NGPU; $(date -u +%FT%TZ)"
  echo; echo "| check | result | figures |"; echo "|---|---|---|"; } | tee -a "$ROWS"

# Runs "$@" while sampling GPU memory; the peak (MiB) lands in $WORK/peak.
with_gpu_mem() {
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > "$WORK/mem.log" &
  local mon=$! rc
  "$@"; rc=$?
  kill $mon 2>/dev/null; wait $mon 2>/dev/null
  sort -n "$WORK/mem.log" | tail -1 > "$WORK/peak"
  return $rc
}

if part correctness; then
  PART_START=$(date +%s)
  # A run given less than its time is skipped by name rather than cut off mid-curve.
  for cfg in tiny genslm-25m; do
    ref="$REF_DIR/$cfg-cpu-20.jsonl"
    if [[ ! -s "$ref" ]]; then
      timeout 120 "$BIN" train "${SMALL[@]}" --config "configs/$cfg.toml" --out "$WORK/cpu-$cfg" --backend cpu \
        && ref="$WORK/cpu-$cfg/metrics.jsonl" || { row "$cfg CPU curve" FAIL "$(date)"; continue; }
    fi
    for prec in fp32 bf16; do
      limit=$([[ $prec == fp32 ]] && echo 1e-3 || echo 2e-2)
      log="$WORK/$cfg-cuda-$prec.log"
      if (( $(left) < 40 )); then row "$cfg 20 steps cuda $prec vs cpu fp32" skipped "part time (PART_S=$PART_S) spent"; continue; fi
      if with_gpu_mem timeout $(( $(left) < 100 ? $(left) : 100 )) "$BIN" train "${SMALL[@]}" --config "configs/$cfg.toml" \
           --out "$WORK/cuda-$cfg-$prec" --backend cuda --precision "$prec" > "$log" 2>&1; then
        res=$(python3 scripts/gpu_tables.py gap "$ref" "$WORK/cuda-$cfg-$prec/metrics.jsonl" "$limit")
        row "$cfg 20 steps cuda $prec vs cpu fp32" "${res%%:*}" "${res#*: }; peak GPU $(cat "$WORK/peak") MiB"
        ref16="$REF_DIR/$cfg-cpu-bf16-20.jsonl"
        if [[ $prec == bf16 && -s $ref16 ]]; then
          res=$(python3 scripts/gpu_tables.py gap "$ref16" "$WORK/cuda-$cfg-$prec/metrics.jsonl" "$limit")
          row "$cfg 20 steps cuda bf16 vs cpu bf16" "${res%%:*}" "${res#*: }"
        fi
      else
        row "$cfg 20 steps cuda $prec vs cpu fp32" FAIL "exit $?: $(tail2 "$log")"
      fi
    done
  done
fi

# Long records for the long sequences: random codons, 40 records of 2^17 codons.
long_fasta() {
  [[ -s "$WORK/long.fa" ]] && return
  python3 - "$WORK/long.fa" <<'PY'
import random, sys
random.seed(0)
with open(sys.argv[1], "w") as f:
    for i in range(40):
        s = "".join(random.choices("ACGT", k=3 * 131072))
        f.write(f">r{i}\n" + "\n".join(s[j:j + 80] for j in range(0, len(s), 80)) + "\n")
PY
}

if part throughput; then
  PART_START=$(date +%s)
  long_fasta
  perf() {  # config seq -> a row; fails when the run did not fit or failed
    local cfg=$1 seq=$2 out="$WORK/perf-$1-$2" budget
    budget=$(left)
    if (( budget < 30 )); then row "$cfg seq $seq" skipped "part time (PART_S=$PART_S) spent"; return 1; fi
    (( budget > 120 )) && budget=120
    local rc=0
    with_gpu_mem timeout "$budget" "$BIN" train --fasta "$WORK/long.fa" --config "configs/$cfg.toml" \
      --out "$out" --steps 6 --seq-len "$seq" --batch-size 1 --val-every 0 --warmup 1 \
      --overwrite --quiet --backend cuda > "$WORK/perf-$cfg-$seq.log" 2>&1 || rc=$?
    if (( rc == 0 )); then
      read -r tps tfl < <(python3 scripts/gpu_tables.py rate "$out/metrics.jsonl")
      row "$cfg seq $seq bf16, batch 1" ran "$tps tokens/s, $tfl TFLOPS, MFU $(python3 -c "print('%.1f%%' % (100 * $tfl / $PEAK))"), peak GPU $(cat "$WORK/peak") MiB; first step: $(python3 scripts/gpu_tables.py compile "$out/metrics.jsonl")"
      return 0
    fi
    row "$cfg seq $seq bf16, batch 1" "did not fit / failed" "exit $rc$( (( rc == 124 )) && echo " (timeout ${budget} s)"); peak GPU $(cat "$WORK/peak") MiB: $(tail2 "$WORK/perf-$cfg-$seq.log")"
    return 1
  }
  IFS=, read -r -a CFGS <<<"${THROUGHPUT_CONFIGS:-genslm-25m,genslm-250m}"
  for cfg in "${CFGS[@]}"; do
    perf "$cfg" 2048 && perf "$cfg" 8192 || continue
    seq=16384
    while (( seq <= ${PERF_MAX_SEQ:-131072} )) && perf "$cfg" $seq; do seq=$((seq * 2)); done
  done
fi

if part peer; then
  PART_START=$(date +%s)
  python3 -c "import random; random.seed(0); open('$WORK/peer.fa', 'w').write(''.join('>r%d\n%s\n' % (i, ''.join(random.choices('ACGT', k=120000))) for i in range(8)))"
  IFS=, read -r -a SHAPES <<<"${PEER_SHAPES:-genslm-25m:2048,genslm-25m:8192,genslm-250m:2048,genslm-250m:8192}"
  for shape in "${SHAPES[@]}"; do
    cfg=${shape%%:*} seq=${shape##*:}
    if (( $(left) < 40 )); then row "peer $cfg seq $seq" skipped "part time spent"; continue; fi
    torch=$(DEVICE=cuda timeout 60 python3 scripts/bench_torch_train.py "configs/$cfg.toml" "$seq" 5 2>&1 | tail -1)
    out="$WORK/peer-$cfg-$seq"
    if timeout $(( $(left) < 90 ? $(left) : 90 )) "$BIN" train --fasta "$WORK/peer.fa" --config "configs/$cfg.toml" --out "$out" \
         --steps 6 --seq-len "$seq" --batch-size 1 --val-every 0 --warmup 1 --overwrite --quiet --backend cuda \
         > "$WORK/peer-$cfg-$seq.log" 2>&1; then
      read -r tps _ < <(python3 scripts/gpu_tables.py rate "$out/metrics.jsonl")
      pt=$(sed -n 's/.*: \([0-9.]*\) tokens\/s.*/\1/p' <<<"$torch")
      ratio=$(python3 -c "print('%.3f' % ($tps / $pt))" 2>/dev/null || echo "n/a")
      row "peer $cfg seq $seq bf16" ran "genslm $tps tokens/s; PyTorch ${pt:-n/a} tokens/s; genslm / PyTorch $ratio ($(tr '|' '/' <<<"$torch" | cut -c1-160))"
    else
      row "peer $cfg seq $seq" FAIL "genslm: $(tail2 "$WORK/peer-$cfg-$seq.log"); PyTorch: $(tr '|' '/' <<<"$torch" | cut -c1-160)"
    fi
  done
fi

if part infer; then
  M="$WORK/infer-model"
  if timeout 100 "$BIN" train --fasta data/ --config configs/tiny.toml --out "$M" --steps 5 --seq-len 64 \
       --batch-size 2 --val-every 0 --quiet --overwrite --backend cuda > "$WORK/infer-train.log" 2>&1; then
    timeout 60 "$BIN" score --model "$M" --fasta data/lambda_virus.fa --seq-len 64 --backend cuda > "$WORK/gpu.tsv" 2> "$WORK/score.log" \
      && timeout 60 "$BIN" score --model "$M" --fasta data/lambda_virus.fa --seq-len 64 --backend cpu > "$WORK/cpu.tsv" 2>/dev/null \
      && res=$(python3 - "$WORK/cpu.tsv" "$WORK/gpu.tsv" <<'PY'
import sys
def rows(p):
    out = []
    for line in open(p):
        f = line.rstrip("\n").split("\t")
        try:
            out.append([float(x) for x in f[1:] if x])
        except ValueError:
            pass
    return out
a, b = rows(sys.argv[1]), rows(sys.argv[2])
gap = max((abs(x - y) / max(abs(x), 1e-9) for r, s in zip(a, b) for x, y in zip(r, s)), default=float("nan"))
print(("pass" if len(a) == len(b) and gap <= 2e-2 else "FAIL") + f" | {len(b)} rows, worst relative gap {gap:.1e} (bf16 on cuda, limit 2e-2)")
PY
) && row "score on cuda vs cpu" "${res%% | *}" "${res#* | }" || row "score on cuda" FAIL "$(tail2 "$WORK/score.log")"
    with_gpu_mem timeout 60 "$BIN" embed --model "$M" --fasta data/ --out "$WORK/emb.parquet" --backend cuda --quiet \
      > "$WORK/embed.log" 2>&1 && row "embed on cuda" pass "peak GPU $(cat "$WORK/peak") MiB" \
      || row "embed on cuda" FAIL "$(tail2 "$WORK/embed.log")"
    timeout 60 "$BIN" generate --model "$M" --num 4 --max-codons 256 --backend cuda --out "$WORK/gen.fa" --quiet \
      > "$WORK/gen.log" 2>&1 && [[ $(grep -c '>' "$WORK/gen.fa") == 4 ]] \
      && row "generate on cuda" pass "4 samples of up to 256 codons" || row "generate on cuda" FAIL "$(tail2 "$WORK/gen.log")"
  else
    row "infer: 5 training steps on cuda" FAIL "$(tail2 "$WORK/infer-train.log")"
  fi
fi

if part attention; then
  PART_START=$(date +%s)
  IFS=, read -r -a SEQS <<<"${ATTN_SEQS:-1024,4096,16384,32768}"
  for d in 64 128; do
    for s in "${SEQS[@]}"; do
      for imp in genslm cubek sdpa genslm-alibi sdpa-alibi; do
        [[ $imp == *alibi && $d != 128 ]] && continue
        if (( $(left) < 20 )); then row "attention $imp s $s d $d" skipped "part time spent"; continue; fi
        args=(--seq "$s" --heads 16 --head-dim "$d" --batch 1 --iters 3 --dtype bf16)
        [[ $imp == *alibi ]] && args+=(--alibi)
        case $imp in
          sdpa*) line=$(timeout 40 python3 scripts/gpu_tables.py sdpa "${args[@]}" 2>&1 | tail -1) ;;
          *) line=$(timeout 40 "$BIN" bench attention "${args[@]}" --impl "${imp%-alibi}" --backend cuda 2>&1 | tail -1) ;;
        esac
        ok=$([[ $line == attention* || $line == sdpa* ]] && echo ran || echo FAIL)
        row "attention $imp bf16 causal s $s d $d" "$ok" "$(tr '|' '/' <<<"$line" | cut -c1-260)"
      done
    done
  done
fi

if part profile; then
  PART_START=$(date +%s)
  long_fasta
  PROF="$OUTDIR/profile-$VARIANT.md"
  { echo; echo "Step profile ($VARIANT): $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); $(date -u +%FT%TZ)"; } | tee -a "$PROF"
  # cubecl reads cubecl.toml from the working directory; the runs start there, so its autotune
  # cache is warm (from the first, unprofiled run) before the profiled run, whose launches
  # would otherwise time autotune's candidates too.
  P="$WORK/profile"; mkdir -p "$P"
  printf '[profiling.logger]\nfile = "%s/kernels.log"\nappend = false\n' "$P" > "$P/cubecl.toml"
  ROOT=$PWD
  IFS=, read -r -a SHAPES <<<"${PROFILE_SHAPES:-genslm-25m:2048,genslm-250m:2048}"
  for shape in "${SHAPES[@]}"; do
    cfg=${shape%%:*} seq=${shape##*:} rates=()
    rm -f "$P/kernels.log"
    IFS=, read -r -a MODES <<<"${PROFILE_MODES:-samples,no-samples,profiled}"
    for mode in "${MODES[@]}"; do
      if (( $(left) < 30 )); then row "profile $cfg seq $seq $mode" skipped "part time spent"; continue 2; fi
      env=(); [[ $mode == no-samples ]] && env=(GENSLM_DEVICE_MEMORY_SAMPLES=0)
      [[ $mode == profiled ]] && env=(CUBECL_DEBUG_OPTION=profile)
      out="$P/$cfg-$seq-$mode" log="$WORK/profile-$cfg-$seq-$mode.log"
      if (cd "$P" && env "${env[@]}" timeout $(( $(left) < 120 ? $(left) : 120 )) "$BIN" train \
            --fasta "$WORK/long.fa" --config "$ROOT/configs/$cfg.toml" --out "$out" --steps 6 \
            --seq-len "$seq" --batch-size 1 --val-every 0 --warmup 1 --overwrite --quiet \
            --backend cuda) > "$log" 2>&1; then
        read -r tps _ < <(python3 scripts/gpu_tables.py rate "$out/metrics.jsonl")
        rates+=("$mode $tps tokens/s")
      else
        row "profile $cfg seq $seq $mode" FAIL "exit $?: $(tail2 "$log")"
      fi
    done
    row "profile $cfg seq $seq" ran "$(IFS=';'; echo "${rates[*]}")"
    { echo; echo "### $cfg, seq $seq, bf16, batch 1"; echo
      echo "Tokens/s, mean of steps 3-6 (samples: as trainers run; no-samples: GENSLM_DEVICE_MEMORY_SAMPLES=0; profiled: every launch waits for its kernel): ${rates[*]}"; echo
      python3 scripts/gpu_tables.py kernels "$P/kernels.log" 2 --top 20 2>&1 || true; } >> "$PROF"
    cp "$P/kernels.log" "$WORK/kernels-$cfg-$seq.log" 2>/dev/null
  done
  cat "$PROF"
fi

if part sp; then
  if (( NGPU >= 2 )); then
    "$BIN" train "${SMALL[@]}" --config configs/genslm-25m.toml --out "$WORK/sp1" --backend cuda > "$WORK/sp1.log" 2>&1
    if timeout 200 "$BIN" train "${SMALL[@]}" --config configs/genslm-25m.toml --out "$WORK/sp2" \
         --backend cuda --sp 2 > "$WORK/sp2.log" 2>&1; then
      res=$(python3 scripts/gpu_tables.py gap "$WORK/sp1/metrics.jsonl" "$WORK/sp2/metrics.jsonl" 2e-2)
      row "--sp 2 (thread ranks) vs --sp 1 on cuda" "${res%%:*}" "${res#*: }"
    else row "--sp 2 on cuda" FAIL "$(tail2 "$WORK/sp2.log")"; fi
  else
    row "--sp 2 vs --sp 1" skipped "one GPU visible"
  fi
fi
echo "== rows in $ROWS"
