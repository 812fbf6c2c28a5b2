#!/usr/bin/env bash
# Type-checks (and lints) the CUDA build (features cuda + nccl, with and without mpi, and the
# NVRTC variant) on a machine with no GPU and no internet. burn-cuda pulls cubecl-llvm, whose
# build script downloads an LLVM bundle; it skips the download when DOCS_RS is set (the docs.rs
# path), which only type-checks — so this proves the GPU code compiles, not that it links or
# runs (scripts/build-cuda.sh does).
# Its own target dir: sharing the CPU build's would rebuild burn with other features each time.
set -euo pipefail
cd "$(dirname "$0")/.."
# Beside the CPU build when CARGO_TARGET_DIR is set (CI), else inside ./target (ignored).
if [ -n "${CARGO_TARGET_DIR:-}" ]; then DEFAULT="$CARGO_TARGET_DIR-cuda-check"; else DEFAULT="$PWD/target/cuda-check"; fi
export CARGO_TARGET_DIR="${CUDA_CHECK_TARGET_DIR:-$DEFAULT}"
export DOCS_RS=1
echo "== cargo clippy --features cuda,nccl (DOCS_RS=1, target $CARGO_TARGET_DIR)"
cargo clippy --locked --features cuda,nccl --all-targets -- -D warnings
# The other combinations differ from the first in src/ only (cfg), so their tests are not
# linted again: each is a re-check of genslm alone (and of burn's crates for plain nccl).
echo "== cargo clippy --features cuda,nccl,mpi"
cargo clippy --locked --features cuda,nccl,mpi -- -D warnings
echo "== cargo clippy --features cuda-nvrtc,nccl (kernels compiled by NVRTC: the fallback bundle)"
cargo clippy --locked --features cuda-nvrtc,nccl -- -D warnings
echo "== cargo clippy --features nccl (the NCCL communicator without burn-cuda)"
cargo clippy --locked --features nccl -- -D warnings
# scripts/test.sh builds everything with wgpu on; the README's `cargo run` has no features.
echo "== cargo clippy (default features: what the README's cargo run compiles)"
cargo clippy --locked -- -D warnings
echo "== the CUDA build type-checks"
