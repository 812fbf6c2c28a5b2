#!/usr/bin/env bash
# The test command: installs what the full suite needs on a fresh machine, then runs it.
# Usage: ./scripts/test.sh        (set CARGO_TARGET_DIR to keep build outputs elsewhere)
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== system packages for the MPI build (OpenMPI, libclang for bindgen)"
if ! command -v mpirun >/dev/null || ! ls /usr/lib/llvm-*/lib/libclang.so* >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q \
    openmpi-bin libopenmpi-dev libclang-dev clang
fi

echo "== python reference tools (pyarrow, pandas, tokenizers, torch, transformers)"
# They are the independent references of the suite: a failed install fails the run.
if ! (cd /tmp && python3 -c "import pyarrow, pandas, tokenizers.models, torch, transformers, safetensors") 2>/dev/null; then
  python3 -m pip install --quiet --disable-pip-version-check \
    pyarrow pandas tokenizers torch transformers safetensors
  (cd /tmp && python3 -c "import pyarrow, pandas, tokenizers.models, torch, transformers, safetensors") || {
    echo "error: the python reference tools could not be installed" >&2; exit 1; }
fi

echo "== no new import cycles between files; the model imports no parallel/train code"
python3 scripts/check_imports.py

echo "== cargo test"
cargo test --locked

echo "== tokenizer fixture is reproducible with Hugging Face tokenizers"
cp tests/fixtures/tokenizer_hf.json /tmp/genslm_fixture_before.json
python3 scripts/make_tokenizer_fixture.py
if ! cmp -s tests/fixtures/tokenizer_hf.json /tmp/genslm_fixture_before.json; then
  echo "tokenizer fixture differs from what HF tokenizers produces now" >&2; exit 1
fi

echo "== tokenize the bundled genomes; check the parquet with pyarrow/pandas"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
cargo run --locked --quiet -- tokenize --fasta data/ --out "$TMP/data.parquet"
python3 scripts/check_dataset.py "$TMP/data.parquet" data

echo "== train on the bundled genomes; the checkpoint loads in transformers with the same loss"
cargo run --locked --quiet -- train --fasta data/ --config configs/tiny.toml --out "$TMP/run" \
  --steps 20 --seq-len 64 --batch-size 4 --lr 3e-3 --quiet
cargo run --locked --quiet -- score --model "$TMP/run" --fasta data/lambda_virus.fa data/dwv.fasta.gz \
  --seq-len 64 > "$TMP/scores.tsv"
for f in data/lambda_virus.fa data/dwv.fasta.gz; do
  python3 scripts/check_hf_roundtrip.py "$TMP/run/checkpoints/step-20" "$f" 64 "$TMP/scores.tsv"
done

echo "== learned/ALiBi checkpoints: transformers runs them faithfully with trust_remote_code, refuses them without"
for pos in learned alibi; do
  sed "s/^position = .*/position = \"$pos\"/" configs/tiny.toml > "$TMP/tiny-$pos.toml"
  cargo run --locked --quiet -- train --fasta data/ --config "$TMP/tiny-$pos.toml" --out "$TMP/run-$pos" \
    --steps 20 --seq-len 64 --batch-size 4 --lr 3e-3 --quiet
  cargo run --locked --quiet -- score --model "$TMP/run-$pos" --fasta data/lambda_virus.fa \
    --seq-len 64 > "$TMP/scores-$pos.tsv"
  python3 scripts/check_hf_positions.py check "$TMP/run-$pos" data/lambda_virus.fa 64 "$TMP/scores-$pos.tsv"
done
echo "== and the other way: models written by transformers (all three positions) score the same in genslm"
for pos in rotary learned alibi; do
  python3 scripts/check_hf_positions.py make $pos "$TMP/hf-$pos"
  cargo run --locked --quiet -- score --model "$TMP/hf-$pos" --fasta data/lambda_virus.fa \
    --seq-len 64 > "$TMP/hf-scores-$pos.tsv"
  python3 scripts/check_hf_positions.py check "$TMP/hf-$pos" data/lambda_virus.fa 64 "$TMP/hf-scores-$pos.tsv"
done

echo "== genslm convert: GenSLM's released checkpoint layout (torch-written) gives PyTorch's loss"
cargo build --locked --quiet
python3 scripts/check_convert.py "${CARGO_TARGET_DIR:-target}/debug/genslm" data/dwv.fasta.gz

echo "== the same run with bf16 compute (fp32 master weights): its checkpoint loads in transformers"
cargo run --locked --quiet -- train --fasta data/ --config configs/tiny.toml --out "$TMP/run16" \
  --steps 20 --seq-len 64 --batch-size 4 --lr 3e-3 --quiet --precision bf16
cargo run --locked --quiet -- score --model "$TMP/run16" --fasta data/lambda_virus.fa \
  --seq-len 64 > "$TMP/scores16.tsv"
python3 scripts/check_hf_roundtrip.py "$TMP/run16/checkpoints/step-20" data/lambda_virus.fa 64 "$TMP/scores16.tsv"

echo "== a ZeRO-3 run over 4 thread ranks (DP 2 × SP 2): its gathered checkpoint loads in transformers"
cargo run --locked --quiet -- train --fasta data/ --config configs/tiny.toml --out "$TMP/runz3" \
  --steps 20 --seq-len 64 --batch-size 4 --lr 3e-3 --quiet --dp 2 --sp 2 --zero 3 --checkpoint-activations
cargo run --locked --quiet -- score --model "$TMP/runz3" --fasta data/lambda_virus.fa \
  --seq-len 64 > "$TMP/scoresz3.tsv"
python3 scripts/check_hf_roundtrip.py "$TMP/runz3/checkpoints/step-20" data/lambda_virus.fa 64 "$TMP/scoresz3.tsv"

echo "== embed the bundled genomes: parquet checked with pyarrow, PCA plot, UMAP notebook (headless)"
cargo run --locked --quiet -- embed --model "$TMP/run" --fasta data/ --out "$TMP/emb.parquet" \
  --plot "$TMP/latent.png" --quiet
test -s "$TMP/latent.png"
python3 scripts/check_embeddings.py "$TMP/emb.parquet" 29 64
./scripts/run_notebook.sh "$TMP/emb.parquet" "$TMP/notebook"

echo "== NCCL communicator compiles (cudarc; no GPU here, so it is not run)"
cargo check --locked --features nccl

echo "== the CUDA build (burn-cuda, NCCL on device buffers) type-checks offline"
./scripts/check-cuda.sh

echo "== the GPU machine's environment script against a fake machine; the probe stops cleanly here"
./tests/gpu_env.sh
if PROBE=$(bash scripts/gpu-probe.sh 2>&1); then
  echo "error: gpu-probe.sh succeeded on a machine without a GPU" >&2; exit 1
fi
grep -q "no NVIDIA driver" <<<"$PROBE" || { echo "$PROBE"; echo "error: gpu-probe.sh did not say 'no NVIDIA driver'" >&2; exit 1; }

echo "== fused attention kernels and --backend wgpu on lavapipe (software Vulkan)"
./scripts/test-kernels.sh

echo "== sequence/data parallelism under mpirun -np 2 and -np 4 match one process; fault test"
cargo build --locked --features mpi
./scripts/check_mpi.sh "${CARGO_TARGET_DIR:-target}/debug/genslm"

echo "== all tests passed"
