#!/usr/bin/env bash
# The fused FlashAttention kernels (kernels/) on Mesa's lavapipe, a software Vulkan driver, so
# they are proven on machines without a GPU:
#  1. installs Debian's mesa-vulkan-drivers + libvulkan1 when lavapipe is missing;
#  2. runs the kernel tests (forward and backward against an f64 reference, and plain/causal
#     attention against cubek-attention, burn's own CubeCL attention);
#  3. trains configs/tiny.toml 5 steps with --backend wgpu and --backend cpu, same seed, and
#     compares the losses (≤ 1e-3 relative);
#  4. measures the device memory of the fused forward+backward at seq 1024 and 4096 (each in
#     its own process): it must grow linearly (ratio ≤ 4.5), not with seq² (16);
#  5. --offload optimizer|activations|all against no offload (losses within 1e-6, the moments'
#     bytes off the device), and runs too large for the device refused before any work.
# Builds go to ${CARGO_TARGET_DIR:-target}-wgpu so the CPU build's outputs stay untouched.
# On a machine with a real GPU, GENSLM_KERNELS_DEVICE=default runs the tests there instead.
# --model-only: steps 3 and 4 only, in CARGO_TARGET_DIR as it is. scripts/test.sh runs the
# kernel tests inside its one `cargo test --workspace --features wgpu` and calls it so.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL_ONLY=0
case "${1:-}" in
  --model-only) MODEL_ONLY=1 ;;
  "") ;;
  *) echo "usage: $0 [--model-only]" >&2; exit 2 ;;
esac

echo "== lavapipe (Mesa's software Vulkan driver)"
if ! ls /usr/share/vulkan/icd.d/lvp_icd*.json >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q \
    mesa-vulkan-drivers libvulkan1
  ls /usr/share/vulkan/icd.d/lvp_icd*.json >/dev/null 2>&1 || {
    echo "error: lavapipe did not install (mesa-vulkan-drivers)" >&2; exit 1; }
fi
# wgpu picks lavapipe when no GPU is present; this makes it explicit for the whole-model check.
export CUBECL_WGPU_DEFAULT_DEVICE="${CUBECL_WGPU_DEFAULT_DEVICE:-Cpu}"
if [ $MODEL_ONLY = 0 ]; then
  export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}-wgpu"
  echo "== kernel tests on lavapipe (against an f64 reference and against cubek-attention)"
  cargo test --locked -p genslm-kernels --features wgpu -- --nocapture 2>&1 \
    | grep -v "XDG_RUNTIME_DIR"
fi
BUILT="${CARGO_TARGET_DIR:-$PWD/target}"

echo "== tiny config, 5 steps: --backend wgpu vs --backend cpu (losses within 1e-3)"
cargo build --locked --features wgpu
BIN="$BUILT/debug/genslm"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
for b in cpu wgpu; do
  "$BIN" train --fasta data/ --config configs/tiny.toml --out "$TMP/$b" --steps 5 --seq-len 64 \
    --batch-size 2 --lr 3e-3 --seed 7 --quiet --backend "$b" 2>&1 | grep -v "XDG_RUNTIME_DIR" || true
  test -s "$TMP/$b/metrics.jsonl" || { echo "error: the $b run wrote no metrics" >&2; exit 1; }
done
python3 - "$TMP/cpu/metrics.jsonl" "$TMP/wgpu/metrics.jsonl" <<'PY'
import json, sys
def losses(p):
    return [r["loss"] for r in map(json.loads, open(p)) if "loss" in r and "step" in r]
cpu, gpu = losses(sys.argv[1]), losses(sys.argv[2])
assert len(cpu) == 5 and len(gpu) == 5, (cpu, gpu)
for i, (a, b) in enumerate(zip(cpu, gpu), 1):
    rel = abs(a - b) / abs(a)
    print(f"step {i}: cpu {a:.6f} wgpu {b:.6f} rel {rel:.1e}")
    assert rel <= 1e-3, f"step {i}: wgpu loss {b} vs cpu {a} ({rel:.1e} > 1e-3)"
PY
echo "== --offload on wgpu: the same losses; the moments leave the device"
# tiny, 4 steps, checkpointed: no offload, the optimizer's state on the host (the fused CPU
# AdamW instead of the composed device update: within 1e-6), the kept layer inputs on the host
# (the same arithmetic: within 1e-6, lavapipe's reductions are not bit-reproducible run to run)
# and both. The device memory in use after a step falls by the two moments (8 bytes/param).
for o in none optimizer activations all; do
  "$BIN" train --fasta data/ --config configs/tiny.toml --out "$TMP/off-$o" --steps 4 --seq-len 64 \
    --batch-size 2 --lr 3e-3 --seed 7 --quiet --backend wgpu --checkpoint-activations \
    --offload "$o" 2>&1 | grep -v "XDG_RUNTIME_DIR" || true
  test -s "$TMP/off-$o/metrics.jsonl" || { echo "error: --offload $o wrote no metrics" >&2; exit 1; }
done
python3 - "$TMP" <<'PY'
import json, sys
def rows(o):
    return [r for r in map(json.loads, open(f"{sys.argv[1]}/off-{o}/metrics.jsonl")) if "step" in r]
base = rows("none")
assert len(base) == 4, base
for o in ["optimizer", "activations", "all"]:
    got = rows(o)
    for a, b in zip(base, got):
        rel = abs(a["loss"] - b["loss"]) / abs(a["loss"])
        assert rel <= 1e-6, f"--offload {o}, step {a['step']}: loss {b['loss']} vs {a['loss']} ({rel:.1e})"
    moved = base[-1]["device_in_use_mib"] - got[-1]["device_in_use_mib"]
    moments = 2 * base[-1]["memory"]["params_bytes"] / 2**20
    print(f"--offload {o}: losses within 1e-6 of no offload; device in use "
          f"{got[-1]['device_in_use_mib']:.3f} MiB vs {base[-1]['device_in_use_mib']:.3f} MiB "
          f"(moments {moments:.3f} MiB)")
    if o == "activations":
        assert abs(moved) <= 0.05 * moments, f"--offload activations moved {moved:.3f} MiB between steps"
    else:
        assert abs(moved - moments) <= 0.05 * moments, \
            f"--offload {o}: {moved:.3f} MiB left the device, the moments are {moments:.3f} MiB"
PY
echo "== wgpu runs that cannot fit are refused before any work, naming the figures"
# One activation above lavapipe's largest buffer (128 MiB), then a model above its memory (host
# memory: lavapipe has no card). Exit 1 with the message; no run directory.
refused() {
  local want=$1; shift
  set +e
  "$BIN" train --fasta data/ --out "$TMP/refused" --batch-size 1 --steps 1 --backend wgpu --quiet "$@" \
    > "$TMP/refused.log" 2>&1
  local rc=$?
  set -e
  grep -v XDG_RUNTIME_DIR "$TMP/refused.log" >&2 || true
  [ "$rc" = 1 ] || { echo "error: exit $rc, not 1, for $*" >&2; exit 1; }
  grep -q "$want" "$TMP/refused.log" || { echo "error: no '$want' for $*" >&2; exit 1; }
  [ ! -e "$TMP/refused" ] || { echo "error: a refused run wrote $TMP/refused" >&2; exit 1; }
}
refused "largest buffer the device" --config configs/genslm-25m.toml --seq-len 1000000
refused "predicted peak device memory is .* GiB (fp32), but the device .* host memory" \
  --config configs/genslm-25b.toml --seq-len 512
echo "== wgpu attention forward+backward: device memory at seq 1024 vs 4096 (linear: ratio <= 4.5)"
# The bench line goes to stderr for the log (not through `tee /dev/stderr`, which overwrites
# a log file that stderr is redirected to) and its peak to stdout.
peak() {
  local out
  out=$("$BIN" bench attention --backend wgpu --seq "$1" --heads 3 --head-dim 64 --iters 1 2>/dev/null)
  echo "$out" >&2
  sed -n 's/.*peak \([0-9.]*\) MiB (device memory pools).*/\1/p' <<<"$out"
}
P1=$(peak 1024); P4=$(peak 4096)
python3 -c "
p1, p4 = float('$P1'), float('$P4')
r = p4 / p1
print(f'peak device memory: seq 1024 {p1:.1f} MiB, seq 4096 {p4:.1f} MiB, ratio {r:.2f}')
assert r <= 4.5, f'attention memory grows faster than linearly: ratio {r:.2f} > 4.5'
"
echo "== kernel tests passed"
