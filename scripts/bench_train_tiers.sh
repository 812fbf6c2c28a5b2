#!/usr/bin/env bash
# genslm training beside PyTorch at the CPU's best instruction-set tier and with AVX2 forced on
# both sides, interleaved, so an AVX-512 machine also measures what an AVX2-only one runs:
# - genslm best:  target/release/genslm (gemm's AVX-512 kernels, GENSLM_SIMD unset)
# - genslm avx2:  an AVX2-only build (cargo build --release --no-default-features --target-dir
#                 target/avx2) with GENSLM_SIMD=avx2 (src/isa.rs)
# - torch best:   scripts/bench_torch_train.py as installed
# - torch avx2:   the same with ATEN_CPU_CAPABILITY=avx2 DNNL_MAX_CPU_ISA=AVX2
#                 MKL_ENABLE_INSTRUCTIONS=AVX2
# Usage: scripts/bench_train_tiers.sh SEQ_LEN [ROUNDS] [STEPS] [CONFIG]
set -euo pipefail
cd "$(dirname "$0")/.."
seq=${1:?usage: $0 SEQ_LEN [ROUNDS] [STEPS] [CONFIG]}
rounds=${2:-2}
steps=${3:-3}
config=${4:-configs/genslm-25m.toml}
best=target/release/genslm
avx2=target/avx2/release/genslm
for b in "$best" "$avx2"; do
  [ -x "$b" ] || { echo "$b not found (see the header of $0)" >&2; exit 1; }
done
threads=$(nproc)
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $threads threads, seq $seq, $(date -u +%F)"
tok() { grep -o '[0-9.]* tokens/s' | head -1; }
for r in $(seq "$rounds"); do
  g1=$("$best" bench train --config "$config" --seq-len "$seq" --steps "$steps" --quiet | tail -1)
  t1=$(python3 scripts/bench_torch_train.py "$config" "$seq" "$steps" "$threads")
  g2=$(GENSLM_SIMD=avx2 "$avx2" bench train --config "$config" --seq-len "$seq" --steps "$steps" --quiet | tail -1)
  t2=$(ATEN_CPU_CAPABILITY=avx2 DNNL_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
    python3 scripts/bench_torch_train.py "$config" "$seq" "$steps" "$threads")
  echo "round $r best: genslm $(echo "$g1" | tok) (${g1##*peak RSS }) | torch $t1"
  echo "round $r avx2: genslm $(echo "$g2" | tok) (${g2##*peak RSS }) | torch $t2"
done
