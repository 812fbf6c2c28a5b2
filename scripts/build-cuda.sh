#!/usr/bin/env bash
# Builds a runnable CUDA binary and, with --bundle, the compressed package carried to a GPU
# machine (docs/GPU.md).
# Usage: scripts/build-cuda.sh [--offline-llvm] [--nvrtc] [--bundle]
#   default     features cuda,nccl: one process, ranks as threads, no libmpi needed where it
#               runs; kernels compiled at run time through LLVM to PTX (needs libdevice.10.bc).
#   --nvrtc     adds cuda-nvrtc: kernels compiled from CUDA C++ by NVRTC instead (the fallback
#               when the LLVM route fails on a GPU; needs libnvrtc and the toolkit's headers).
#   --bundle    strips and xz-compresses the binary into target/gpu-bundle/ with its NEEDED
#               list, SHA256SUMS and any library a CUDA machine would lack; fails when the
#               bundle passes 60 MiB or needs a newer glibc than GLIBC_MAX (2.39: Ubuntu 24.04).
#               Run once plain and once with --nvrtc: both variants share the bundle directory.
# FEATURES=cuda,nccl,mpi builds for clusters (one process per GPU under mpirun/srun); such a
# binary needs libmpi where it runs, which the GPU machine here does not have.
# burn-cuda -> cubecl-llvm -> tracel-llvm-bundler, whose build script downloads an LLVM 23.1
# bundle from GitHub. Where GitHub is out of reach (or with --offline-llvm), Debian's LLVM 22
# stands in for that bundle: the bundler only checks for a marker file, then runs llvm-config.
set -euo pipefail
cd "$(dirname "$0")/.."

OFFLINE=0 NVRTC=0 BUNDLE=0
for arg in "$@"; do
  case "$arg" in
    --offline-llvm) OFFLINE=1 ;; --nvrtc) NVRTC=1 ;; --bundle) BUNDLE=1 ;;
    *) echo "usage: $0 [--offline-llvm] [--nvrtc] [--bundle]" >&2; exit 2 ;;
  esac
done
START=$(date +%s)

# Cargo.toml pins cudarc's `cuda-12080` bindings; they load libcuda/libnccl/libnvrtc with dlopen
# at run time, so no toolkit is needed here. cudarc's build script gives CUDARC_CUDA_VERSION
# priority and adds that version's cfg on top of cuda-12080: any other value defines its
# bindings twice and fails to compile, so stop now rather than deep into the build.
if [[ -n "${CUDARC_CUDA_VERSION:-}" && "$CUDARC_CUDA_VERSION" != 12080 ]]; then
  echo "error: CUDARC_CUDA_VERSION=$CUDARC_CUDA_VERSION conflicts with cudarc's cuda-12080" \
    "feature in Cargo.toml; change that feature instead" >&2; exit 2
fi

# Never the CPU build's dir: burn with other features would rebuild there each time.
CUDA_TARGET_DIR="${CUDA_TARGET_DIR:-${CARGO_TARGET_DIR:-$PWD/target}/cuda}"
export CARGO_TARGET_DIR="$CUDA_TARGET_DIR"

# The bundler's llvm_path(): dirs::data_local_dir() = $XDG_DATA_HOME if absolute, else ~/.local/share.
DATA_DIR="${XDG_DATA_HOME:-}"
[[ "$DATA_DIR" == /* ]] || DATA_DIR="${HOME:-$(getent passwd "$(id -u)" | cut -d: -f6)}/.local/share"
LLVM_DIR="$DATA_DIR/tracel/tracel-llvm-23.1.0-4"
MARKER="$LLVM_DIR/.tracel-llvm-installed"
case "$(uname -m)" in aarch64) ASSET=linux-AArch64 ;; *) ASSET=linux-x64 ;; esac
URL="https://github.com/tracel-ai/tracel-llvm/releases/download/v23.1.0-4/$ASSET.tar.xz"
# The bundler fetches this small sidecar first, with a plain GET: probe the same way.
PROBE="${URL%.tar.xz}.checksums.json"

FEATURES="${FEATURES:-cuda,nccl}"
VARIANT=llvm
if (( NVRTC )); then FEATURES="$FEATURES,cuda-nvrtc"; VARIANT=nvrtc; fi
build() { cargo build --release --locked --features "$FEATURES"; }

ensure_pkgs() {  # dpkg -s alone also passes for removed-but-not-purged packages
  [[ "$(dpkg-query -W -f='${db:Status-Abbrev}\n' "$@" 2>/dev/null | grep -c '^ii')" == "$#" ]] && return
  local SUDO=""; [[ "$(id -u)" = 0 ]] || SUDO="sudo"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "$@"
}
# The mpi feature: rsmpi's build script runs bindgen (libclang) over OpenMPI's headers.
[[ ",$FEATURES," != *,mpi,* ]] || ensure_pkgs libopenmpi-dev libclang-dev clang

debian_llvm() {
  # libpolly: --libs names Polly/PollyISL; libzstd-dev: -lzstd needs the unversioned libzstd.so,
  # which llvm-22-dev does not pull in (z3 and xml2 dev packages it does).
  ensure_pkgs llvm-22-dev libpolly-22-dev libzstd-dev zlib1g-dev
  local src=/usr/lib/llvm-22
  # Anything but our own layout (a half-extracted bundle, links straight into /usr) goes.
  if [[ -e "$LLVM_DIR" ]] && ! [[ -d "$LLVM_DIR/bin" && ! -L "$LLVM_DIR/bin" \
        && -d "$LLVM_DIR/lib" && ! -L "$LLVM_DIR/lib" && -L "$LLVM_DIR/include" ]]; then
    rm -rf "$LLVM_DIR"
  fi
  mkdir -p "$LLVM_DIR/bin" "$LLVM_DIR/lib"
  # A copy, not a link: llvm-config derives --libdir from its resolved path, and libdir must
  # be our lib/ (the bundler's only link search path) so the z3 link below is found there.
  cmp -s "$src/bin/llvm-config" "$LLVM_DIR/bin/llvm-config" ||
    install -m 755 "$src/bin/llvm-config" "$LLVM_DIR/bin/llvm-config"
  ln -sfn "$src/include" "$LLVM_DIR/include"
  find "$LLVM_DIR/lib" -xtype l -delete   # archives a Debian update dropped
  ln -sf "$src"/lib/*.a "$LLVM_DIR/lib/"  # includes libPolly*.a, which --libs names
  # --system-libs gives z3 as an absolute path; the bundler keeps only its file stem ("libz3")
  # and emits dylib=libz3, i.e. -llibz3, so the linker needs a liblibz3.so.
  local tok base syslibs
  syslibs="$("$LLVM_DIR/bin/llvm-config" --link-static --system-libs)"
  for tok in $syslibs; do
    [[ "$tok" == /* ]] || continue
    base="$(basename "$tok")"
    ln -sf "$tok" "$LLVM_DIR/lib/lib${base%.*}.so"
  done
  # Only when missing: the bundler reruns (and cubecl-llvm relinks) whenever it changes.
  [[ -e "$MARKER" ]] || : > "$MARKER"
  echo "== LLVM: Debian $("$LLVM_DIR/bin/llvm-config" --version) standing in at $LLVM_DIR"
}

if [[ -e "$MARKER" && "$("$LLVM_DIR/bin/llvm-config" --version 2>/dev/null)" == 23.* ]]; then
  echo "== LLVM: the real 23.1 bundle is already installed at $LLVM_DIR"
  build
elif (( ! OFFLINE )) && curl -fsL --max-time 8 -o /dev/null "$PROBE"; then
  echo "== LLVM: $PROBE is reachable; plain online build (target $CARGO_TARGET_DIR)"
  # Drop a Debian stand-in, else its marker would stop the bundler from fetching 23.1.
  [[ -e "$MARKER" ]] && rm -rf "$LLVM_DIR"
  # No marker after a failure means the download itself failed: fall back to Debian LLVM.
  build || { [[ ! -e "$MARKER" ]] || exit 1; echo "== bundle download failed; Debian LLVM 22"
             debian_llvm; build; }
else
  echo "== LLVM: offline route, Debian LLVM 22 (target $CARGO_TARGET_DIR)"
  debian_llvm
  build
fi

BIN="$CARGO_TARGET_DIR/release/genslm"
SIZE=$(stat -c %s "$BIN")
echo "== built $BIN ($FEATURES): $SIZE bytes ($(awk -v s="$SIZE" 'BEGIN{printf "%.1f", s/1048576}') MiB)" \
  "in $(( $(date +%s) - START )) s"
(( BUNDLE )) || exit 0
exec scripts/gpu-bundle.sh "$BIN" "$VARIANT" "$FEATURES"
