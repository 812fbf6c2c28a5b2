#!/usr/bin/env bash
# scripts/gpu-env.sh against a fake GPU machine: a directory tree shaped like the device's
# (driver library, a stub libcuda, CUDA 13's versioned NCCL/NVRTC inside PyTorch's nvidia
# wheels, libdevice in the toolkit or only in triton's wheel) and a fake bundle whose binary is
# a shell script. Run by scripts/test.sh; needs bash, xz and sha256sum only.
set -euo pipefail
cd "$(dirname "$0")/.."
T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
touchf() { mkdir -p "$(dirname "$1")"; echo x > "$1"; }

M=$T/machine
SP=$M/opt/torch/.venv/lib/python3.12/site-packages
touchf "$M/usr/lib/x86_64-linux-gnu/libcuda.so.1"
touchf "$M/usr/local/cuda-13.0/lib64/stubs/libcuda.so"
touchf "$M/usr/local/cuda-13.0/nvvm/libdevice/libdevice.10.bc"
touchf "$M/usr/local/cuda-13.0/include/cuda.h"
touchf "$M/usr/local/cuda-13.0/lib64/libnvrtc.so.13"
touchf "$SP/nvidia/nccl/lib/libnccl.so.2"
touchf "$SP/nvidia/cu13/lib/libnvrtc.so.13"
touchf "$SP/nvidia/cu13/lib/libnvrtc-builtins.so.13.0"
touchf "$SP/triton/backends/nvidia/lib/libdevice.10.bc"

B=$T/bundle
mkdir -p "$B/raw"
printf '#!/bin/sh\necho "fake genslm $*"\n' > "$B/raw/genslm-llvm"
(cd "$B/raw" && sha256sum genslm-llvm) > "$B/genslm-llvm.sha256"
xz -c "$B/raw/genslm-llvm" > "$B/genslm-llvm.xz"

# Runs gpu-env.sh in a clean shell and prints the variables it exports.
run() {
  env -i PATH="$PATH" HOME="$T" GPU_ENV_ROOT="$M" BUNDLE_DIR="$B" GENSLM_GPU_DIR="$T/priv" \
    LD_LIBRARY_PATH="$M/usr/local/cuda-13.0/lib64/stubs:/usr/local/cuda/compat:/keep/me" "$@" \
    bash -c '. scripts/gpu-env.sh llvm; rc=$?; echo "RC=$rc"; echo "CUDA_PATH=${CUDA_PATH:-}";
             echo "LD=$LD_LIBRARY_PATH"; echo "BIN=${GENSLM_BIN:-}"'
}
get() { sed -n "s/^$1=//p" <<<"$OUT"; }

echo "== a machine like the device: toolkit with libdevice, CUDA 13 libraries in the wheels"
OUT=$(run); echo "$OUT"
[[ $(get RC) == 0 ]] || fail "gpu-env.sh returned $(get RC)"
[[ $(readlink "$T/priv/lib/libnccl.so") == "$SP/nvidia/nccl/lib/libnccl.so.2" ]] || fail "libnccl.so link: $(readlink "$T/priv/lib/libnccl.so")"
readlink "$T/priv/lib/libnvrtc.so" | grep -q 'libnvrtc.so.13$' || fail "libnvrtc.so link"
[[ $(get CUDA_PATH) == "$M/usr/local/cuda-13.0" ]] || fail "CUDA_PATH $(get CUDA_PATH)"
LD=$(get LD)
[[ $LD == "$T/priv/lib:"* ]] || fail "private links are not first on LD_LIBRARY_PATH: $LD"
[[ $LD != *stubs* && $LD != *compat* ]] || fail "stubs/compat left on LD_LIBRARY_PATH: $LD"
[[ $LD == *:/keep/me ]] || fail "an ordinary LD_LIBRARY_PATH entry was dropped: $LD"
[[ $LD == *"$SP/nvidia/nccl/lib"* ]] || fail "NCCL's own directory is not on the path"
grep -q "libcuda.so.1 *$M/usr/lib/x86_64-linux-gnu/libcuda.so.1" <<<"$OUT" || fail "driver library not reported"
[[ $("$(get BIN)" train) == "fake genslm train" ]] || fail "unpacked binary does not run"
# A second source reuses the unpacked binary (same checksum) and still succeeds.
OUT=$(run); [[ $(get RC) == 0 ]] || fail "second run"

echo "== sourced twice in one shell under set -euo pipefail (llvm, then nvrtc): the shell lives on"
printf '#!/bin/sh\necho nvrtc\n' > "$B/raw/genslm-nvrtc"
(cd "$B/raw" && sha256sum genslm-nvrtc) > "$B/genslm-nvrtc.sha256"
xz -c "$B/raw/genslm-nvrtc" > "$B/genslm-nvrtc.xz"
rm -rf "$M/usr/local/cuda-13.0/nvvm"   # libdevice only in triton's wheel: a private CUDA_PATH
OUT=$(env -i PATH="$PATH" HOME="$T" GPU_ENV_ROOT="$M" BUNDLE_DIR="$B" GENSLM_GPU_DIR="$T/priv2" \
  bash -c 'set -euo pipefail; . scripts/gpu-env.sh llvm >/dev/null; . scripts/gpu-env.sh nvrtc >/dev/null
           echo "BIN=$GENSLM_BIN"; echo "LIBDEVICE=$(readlink -f "$CUDA_PATH/nvvm/libdevice/libdevice.10.bc")"')
echo "$OUT"
[[ $(get BIN) == "$T/priv2/bin/genslm-nvrtc" ]] || fail "second source in one set -e shell"
[[ $(get LIBDEVICE) == "$SP/triton/backends/nvidia/lib/libdevice.10.bc" ]] || fail "libdevice link after a second source: $(get LIBDEVICE)"

echo "== the newest library of the first place that has one: the toolkit's, then the system's, then the wheels'"
touchf "$M/usr/lib/x86_64-linux-gnu/libnccl.so.2.18.1"
touchf "$SP/nvidia/nccl/lib/libnccl.so.2.27.3"
OUT=$(run)
[[ $(readlink "$T/priv/lib/libnccl.so") == "$M/usr/lib/x86_64-linux-gnu/libnccl.so.2.18.1" ]] || fail "library priority: $(readlink "$T/priv/lib/libnccl.so")"
rm "$M/usr/lib/x86_64-linux-gnu/libnccl.so.2.18.1"
OUT=$(run)
[[ $(readlink "$T/priv/lib/libnccl.so") == "$SP/nvidia/nccl/lib/libnccl.so.2.27.3" ]] || fail "highest version in a directory: $(readlink "$T/priv/lib/libnccl.so")"
rm "$SP/nvidia/nccl/lib/libnccl.so.2.27.3"

echo "== no toolkit libdevice: triton's copy behind a private toolkit-shaped CUDA_PATH"
rm -rf "$M/usr/local/cuda-13.0"
OUT=$(run); echo "$OUT"
[[ $(get CUDA_PATH) == "$T/priv/cuda" ]] || fail "CUDA_PATH $(get CUDA_PATH)"
[[ $(readlink "$T/priv/cuda/nvvm/libdevice/libdevice.10.bc") == "$SP/triton/backends/nvidia/lib/libdevice.10.bc" ]] \
  || fail "libdevice link"
readlink "$T/priv/lib/libnvrtc.so" | grep -q "$SP/nvidia/cu13/lib/libnvrtc.so.13" || fail "wheel NVRTC not linked"
grep -q 'include *MISSING' <<<"$OUT" || fail "missing headers not reported"

echo "== no xz on the machine: python3's lzma unpacks the binary"
NOXZ=$T/noxz; mkdir -p "$NOXZ"
for f in /usr/local/bin/* /usr/bin/* /bin/*; do
  case "${f##*/}" in xz|unxz|xzcat|lzma|unlzma) ;; *) ln -sf "$f" "$NOXZ/${f##*/}" ;; esac
done
rm -rf "$T/priv"
OUT=$(PATH="$NOXZ" run); echo "$OUT" | tail -1
[[ $(get RC) == 0 && $("$(get BIN)" x) == "fake genslm x" ]] || fail "unpacking without xz"

echo "== nothing at all: every missing piece is named, and no stale link is left"
rm -rf "$M/usr" "$M/opt"
OUT=$(run); echo "$OUT"
[[ ! -e "$T/priv/lib/libnccl.so" && ! -L "$T/priv/lib/libnccl.so" ]] || fail "stale libnccl.so link"
for what in libcuda.so.1 libnccl libnvrtc libdevice.10.bc; do
  grep -q "$what *MISSING" <<<"$OUT" || fail "$what not reported missing"
done

echo "== a corrupt bundle is refused"
rm -rf "$T/priv"
printf 'not xz' > "$B/genslm-llvm.xz"
OUT=$(run); echo "$OUT"
[[ $(get RC) == 1 && -z $(get BIN) ]] || fail "a corrupt bundle was accepted"
grep -q CORRUPT <<<"$OUT" || fail "no CORRUPT message"
xz -c "$B/raw/genslm-llvm" | head -c 40 > "$B/genslm-llvm.xz"   # truncated
OUT=$(run); [[ $(get RC) == 1 ]] || fail "a truncated bundle was accepted"
printf '#!/bin/sh\necho evil\n' | xz -c > "$B/genslm-llvm.xz"      # valid xz, wrong binary
OUT=$(run); [[ $(get RC) == 1 ]] && grep -q 'expected' <<<"$OUT" || fail "a checksum mismatch was accepted"
[[ ! -e "$T/priv/bin/genslm-llvm" ]] || fail "a rejected binary was left in place"
echo "== gpu-env.sh passed"
