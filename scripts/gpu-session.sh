#!/usr/bin/env bash
# The whole GPU playbook in one device call, for a short lease (docs/GPU.md: 15 minutes of
# device time in all, the machine's start included). Runs the probe, then the smoke parts in
# order of value (correctness, infer, peer, throughput, attention) while DEADLINE_S allows, each part
# given only the seconds left. Stops early when nothing after a step could mean anything, so
# the lease keeps time for a fix and a second call:
#   - after the probe, when neither kernel compiler (llvm, then nvrtc if carried) trains tiny;
#   - after correctness, when no fp32 curve matches the CPU's (speed of wrong numbers is noise).
# Usage (the device call):  DEADLINE_S=480 bash scripts/gpu-session.sh
#   SESSION_PARTS (correctness,infer,peer,throughput,attention; profile is another),
#   THROUGHPUT_CONFIGS (genslm-25m,genslm-250m), PERF_MAX_SEQ (32768), ATTN_SEQS (4096,16384)
# Rows go to $OUT as the probe and smoke scripts write them (8 files at most come back).
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
DEADLINE_S=${DEADLINE_S:-480}
export OUT=${OUT:-target/gpu-session}
mkdir -p "$OUT"
left() { echo $(( DEADLINE_S - ($(date +%s) - T0) )); }
passed() { grep -q "^| $2 | pass" "$1" 2>/dev/null; }

variant=llvm
timeout "$(left)" bash scripts/gpu-probe.sh llvm
if ! passed "$OUT/probe-llvm.md" "tiny 5 steps cuda fp32 vs cpu"; then
  if [[ -f target/gpu-bundle/genslm-nvrtc.xz ]] && (( $(left) > 60 )); then
    variant=nvrtc
    timeout "$(left)" bash scripts/gpu-probe.sh nvrtc
    passed "$OUT/probe-nvrtc.md" "tiny 5 steps cuda fp32 vs cpu" ||
      { echo "== gpu-session: neither compiler trains tiny on cuda; stopping after $(( $(date +%s) - T0 )) s"; exit 1; }
  else
    echo "== gpu-session: the llvm variant does not train tiny on cuda; stopping after $(( $(date +%s) - T0 )) s"
    exit 1
  fi
fi

# One log folder for every part, so the last part's archive holds them all.
export WORK=${WORK:-$(mktemp -d)}
export PERF_MAX_SEQ=${PERF_MAX_SEQ:-32768} ATTN_SEQS=${ATTN_SEQS:-4096,16384}
export THROUGHPUT_CONFIGS=${THROUGHPUT_CONFIGS:-genslm-25m,genslm-250m}
IFS=, read -r -a SESSION_PARTS <<<"${SESSION_PARTS:-correctness,infer,peer,throughput,attention}"
for p in "${SESSION_PARTS[@]}"; do
  l=$(left)
  if (( l < 45 )); then echo "== gpu-session: no time left for $p"; continue; fi
  echo "== gpu-session: $p ($l s left)"
  PART_S=$(( l - 15 )) PARTS=$p timeout "$l" bash scripts/gpu-smoke.sh "$variant"
  if [[ $p == correctness ]] && ! grep -q '^| [^|]* cuda fp32 vs cpu fp32 | pass' "$OUT/smoke-$variant.md"; then
    echo "== gpu-session: no fp32 curve matches the CPU's; stopping after $(( $(date +%s) - T0 )) s"
    exit 1
  fi
done
echo "== gpu-session done in $(( $(date +%s) - T0 )) s ($variant)"
