#!/usr/bin/env bash
# The test command: installs what the full suite needs on a fresh machine, then runs it.
# Usage: ./scripts/test.sh        (set CARGO_TARGET_DIR to keep build outputs elsewhere)
#
# One build serves the whole suite: every cargo command here uses the same features (the CPU
# backend plus wgpu, so the CubeCL kernels' tests and the whole model on lavapipe share it), and
# only the MPI and CUDA checks add features. A second feature set would rebuild burn (~12 min).
# The installs wait on the network while the first build uses the CPUs, so they run beside it.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS=0
stage() { printf '== [%dm%02ds] %s\n' $((SECONDS / 60)) $((SECONDS % 60)) "$*"; }
FEATURES=(--features wgpu)
# wgpu picks Mesa's lavapipe (software Vulkan) when no GPU is present; this makes it explicit.
export CUBECL_WGPU_DEFAULT_DEVICE="${CUBECL_WGPU_DEFAULT_DEVICE:-Cpu}"
LOGS=$(mktemp -d)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP" "$LOGS"' EXIT

stage "installing, in the background: OpenMPI and libclang (MPI build), lavapipe (wgpu tests)"
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
have_system() {
  command -v mpirun >/dev/null && ls /usr/lib/llvm-*/lib/libclang.so* >/dev/null 2>&1 \
    && ls /usr/share/vulkan/icd.d/lvp_icd*.json >/dev/null 2>&1
}
(
  if ! have_system; then
    $SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q \
      openmpi-bin libopenmpi-dev libclang-dev clang mesa-vulkan-drivers libvulkan1
    have_system
  fi
) >"$LOGS/apt.log" 2>&1 &
APT=$!
stage "installing, in the background: the python reference tools (pyarrow, pandas, tokenizers, torch, transformers; umap-learn and jupyter for the notebook)"
# They are the independent references of the suite: a failed install fails the run.
PY_IMPORTS="import pyarrow, pandas, tokenizers.models, torch, transformers, safetensors, umap, matplotlib, nbconvert, ipykernel, xxhash"
(
  if ! (cd /tmp && python3 -c "$PY_IMPORTS") 2>/dev/null; then
    python3 -m pip install --quiet --disable-pip-version-check \
      pyarrow pandas tokenizers torch transformers safetensors \
      umap-learn jupyter nbconvert ipykernel matplotlib xxhash
    (cd /tmp && python3 -c "$PY_IMPORTS")
  fi
) >"$LOGS/pip.log" 2>&1 &
PIP=$!
installed() { # PID WHAT LOG: wait for a background install; its failure fails the run
  if ! wait "$1"; then
    cat "$3" >&2
    echo "error: $2 could not be installed (log above)" >&2
    exit 1
  fi
}

stage "layers: no import cycle between files; ops import only ops/error; the model no parallel/train/plan/infer/cli/bench; the modules beside the layers none of them (and the check catches planted violations)"
python3 scripts/check_imports.py
python3 scripts/check_imports.py --self-test

stage "cargo build (tests of both crates, features ${FEATURES[*]})"
cargo test --locked --workspace "${FEATURES[@]}" --no-run
installed $APT "the system packages (apt-get: openmpi-bin libopenmpi-dev libclang-dev clang mesa-vulkan-drivers libvulkan1)" "$LOGS/apt.log"
installed $PIP "the python reference tools (pip)" "$LOGS/pip.log"
stage "cargo test: the model on the CPU, and the fused attention kernels on lavapipe (against an f64 reference and cubek-attention)"
cargo test --locked --workspace "${FEATURES[@]}" 2>&1 | grep -v "XDG_RUNTIME_DIR"

stage "every SIMD tier of the vector loops (fused ops, FlashAttention tiles, AdamW, FASTA cleaning, codons) against the same references, forced with GENSLM_SIMD"
# The default run above took the CPU's best tier; each lower tier this CPU can run goes again.
for tier in avx2 scalar; do
  if [ "$tier" = avx2 ] && ! { grep -qw avx2 /proc/cpuinfo && grep -qw fma /proc/cpuinfo && grep -qw ssse3 /proc/cpuinfo; }; then
    echo "GENSLM_SIMD=avx2: this CPU lacks AVX2, FMA or SSSE3, so the avx2 tier cannot run here (the scalar tier does)"
    continue
  fi
  echo "-- GENSLM_SIMD=$tier"
  GENSLM_SIMD=$tier cargo test --locked "${FEATURES[@]}" --lib -- ops:: data::clean tokenizer train::optim isa:: > "$LOGS/tier-$tier.log" 2>&1 \
    || { cat "$LOGS/tier-$tier.log"; exit 1; }
  GENSLM_SIMD=$tier cargo test --locked "${FEATURES[@]}" --test ops_flash_attention --test tokenizer >> "$LOGS/tier-$tier.log" 2>&1 \
    || { cat "$LOGS/tier-$tier.log"; exit 1; }
  grep -E "^test result" "$LOGS/tier-$tier.log"
done

stage "tokenizer fixture is reproducible with Hugging Face tokenizers"
cp tests/fixtures/tokenizer_hf.json /tmp/genslm_fixture_before.json
python3 scripts/make_tokenizer_fixture.py
if ! cmp -s tests/fixtures/tokenizer_hf.json /tmp/genslm_fixture_before.json; then
  echo "tokenizer fixture differs from what HF tokenizers produces now" >&2; exit 1
fi

stage "tokenize the bundled genomes; check the parquet with pyarrow/pandas"
cargo run --locked --quiet "${FEATURES[@]}" -- tokenize --fasta data/ --out "$TMP/data.parquet"
python3 scripts/check_dataset.py "$TMP/data.parquet" data
cargo run --locked --quiet "${FEATURES[@]}" -- tokenize --fasta data/ --out "$TMP/data-md5.parquet" --digest md5
python3 scripts/check_dataset.py "$TMP/data-md5.parquet" data

stage "train on the bundled genomes; the checkpoint loads in transformers with the same loss"
cargo run --locked --quiet "${FEATURES[@]}" -- train --fasta data/ --config configs/tiny.toml --out "$TMP/run" \
  --steps 20 --seq-len 64 --batch-size 4 --lr 3e-3 --quiet
cargo run --locked --quiet "${FEATURES[@]}" -- score --model "$TMP/run" --fasta data/lambda_virus.fa data/dwv.fasta.gz \
  --seq-len 64 > "$TMP/scores.tsv"
for f in data/lambda_virus.fa data/dwv.fasta.gz; do
  python3 scripts/check_hf_roundtrip.py "$TMP/run/checkpoints/step-20" "$f" 64 "$TMP/scores.tsv"
done

stage "learned/ALiBi checkpoints: transformers runs them faithfully with trust_remote_code, refuses them without"
for pos in learned alibi; do
  sed "s/^position = .*/position = \"$pos\"/" configs/tiny.toml > "$TMP/tiny-$pos.toml"
  cargo run --locked --quiet "${FEATURES[@]}" -- train --fasta data/ --config "$TMP/tiny-$pos.toml" --out "$TMP/run-$pos" \
    --steps 20 --seq-len 64 --batch-size 4 --lr 3e-3 --quiet
  cargo run --locked --quiet "${FEATURES[@]}" -- score --model "$TMP/run-$pos" --fasta data/lambda_virus.fa \
    --seq-len 64 > "$TMP/scores-$pos.tsv"
  python3 scripts/check_hf_positions.py check "$TMP/run-$pos" data/lambda_virus.fa 64 "$TMP/scores-$pos.tsv"
done
stage "and the other way: models written by transformers (all three positions) score the same in genslm"
for pos in rotary learned alibi; do
  python3 scripts/check_hf_positions.py make $pos "$TMP/hf-$pos"
  cargo run --locked --quiet "${FEATURES[@]}" -- score --model "$TMP/hf-$pos" --fasta data/lambda_virus.fa \
    --seq-len 64 > "$TMP/hf-scores-$pos.tsv"
  python3 scripts/check_hf_positions.py check "$TMP/hf-$pos" data/lambda_virus.fa 64 "$TMP/hf-scores-$pos.tsv"
done

stage "score --per-token and --stride: every codon's log-probability, entropy, rank and top-k equal transformers' on a real genome"
cargo run --locked --quiet "${FEATURES[@]}" -- score --model "$TMP/run" --fasta data/lambda_virus.fa \
  --seq-len 64 --per-token "$TMP/tok-run.parquet" > /dev/null
python3 scripts/check_per_token.py "$TMP/run" data/lambda_virus.fa 64 64 "$TMP/tok-run.parquet"
for pos in rotary learned alibi; do
  cargo run --locked --quiet "${FEATURES[@]}" -- score --model "$TMP/hf-$pos" --fasta data/lambda_virus.fa \
    data/dwv.fasta.gz --seq-len 64 --stride 24 --per-token "$TMP/tok-$pos.parquet" --full-distribution > /dev/null
  python3 scripts/check_per_token.py "$TMP/hf-$pos" data/lambda_virus.fa,data/dwv.fasta.gz 64 24 \
    "$TMP/tok-$pos.parquet"
done

stage "embed --pool none --layers --stride: every codon's hidden states equal transformers' output_hidden_states"
for pos in rotary alibi; do
  cargo run --locked --quiet "${FEATURES[@]}" -- embed --model "$TMP/hf-$pos" --fasta data/dwv.fasta.gz \
    --seq-len 64 --stride 40 --pool none --layers 0,1,-1 --out "$TMP/states-$pos.parquet" --quiet
  python3 scripts/check_token_states.py "$TMP/hf-$pos" data/dwv.fasta.gz 64 40 0,1,-1 "$TMP/states-$pos.parquet"
done

stage "variants: Δ log-likelihood equals transformers' brute-force REF/ALT scoring (SNVs, MNVs, indels; window edges, CDS ends)"
# Lambda's cro gene (NC_001416.1 38041..38241, 67 codons) with windows of 16 codons.
python3 scripts/check_variants.py make-vcf data/lambda_virus.fa 38041 38241 16 "$TMP/cro.vcf"
for pos in rotary learned alibi; do
  cargo run --locked --quiet "${FEATURES[@]}" -- variants --model "$TMP/hf-$pos" --fasta data/lambda_virus.fa \
    --vcf "$TMP/cro.vcf" --cds 38041..38241 --window 16 --out "$TMP/variants-$pos.tsv" --quiet
  python3 scripts/check_variants.py check "$TMP/hf-$pos" data/lambda_virus.fa "$TMP/cro.vcf" 38041 38241 16 \
    "$TMP/variants-$pos.tsv"
done
# The record itself as the CDS (no --cds): variants at the record's first and last bases.
python3 -c "import sys; sys.path.insert(0, 'scripts'); from check_hf_roundtrip import read_fasta; \
s = read_fasta(__import__('pathlib').Path('data/lambda_virus.fa'))[0][1]; print('>cro\n' + s[38040:38241])" > "$TMP/cro.fa"
python3 scripts/check_variants.py make-vcf "$TMP/cro.fa" 1 201 16 "$TMP/cro-record.vcf"
cargo run --locked --quiet "${FEATURES[@]}" -- variants --model "$TMP/hf-rotary" --fasta "$TMP/cro.fa" \
  --vcf "$TMP/cro-record.vcf" --window 16 --out "$TMP/variants-record.tsv" --quiet
python3 scripts/check_variants.py check "$TMP/hf-rotary" "$TMP/cro.fa" "$TMP/cro-record.vcf" 1 201 16 \
  "$TMP/variants-record.tsv"

stage "genslm convert: GenSLM's released checkpoint layout (torch-written) gives PyTorch's loss"
cargo build --locked --quiet "${FEATURES[@]}"
python3 scripts/check_convert.py "${CARGO_TARGET_DIR:-target}/debug/genslm" data/dwv.fasta.gz

stage "the same run with bf16 compute (fp32 master weights): its checkpoint loads in transformers"
cargo run --locked --quiet "${FEATURES[@]}" -- train --fasta data/ --config configs/tiny.toml --out "$TMP/run16" \
  --steps 20 --seq-len 64 --batch-size 4 --lr 3e-3 --quiet --precision bf16
cargo run --locked --quiet "${FEATURES[@]}" -- score --model "$TMP/run16" --fasta data/lambda_virus.fa \
  --seq-len 64 > "$TMP/scores16.tsv"
python3 scripts/check_hf_roundtrip.py "$TMP/run16/checkpoints/step-20" data/lambda_virus.fa 64 "$TMP/scores16.tsv"

stage "a ZeRO-3 run over 4 thread ranks (DP 2 × SP 2): its gathered checkpoint loads in transformers"
cargo run --locked --quiet "${FEATURES[@]}" -- train --fasta data/ --config configs/tiny.toml --out "$TMP/runz3" \
  --steps 20 --seq-len 64 --batch-size 4 --lr 3e-3 --quiet --dp 2 --sp 2 --zero 3 --checkpoint-activations
cargo run --locked --quiet "${FEATURES[@]}" -- score --model "$TMP/runz3" --fasta data/lambda_virus.fa \
  --seq-len 64 > "$TMP/scoresz3.tsv"
python3 scripts/check_hf_roundtrip.py "$TMP/runz3/checkpoints/step-20" data/lambda_virus.fa 64 "$TMP/scoresz3.tsv"

stage "embed the bundled genomes: parquet checked with pyarrow, PCA plot, UMAP notebook (headless)"
cargo run --locked --quiet "${FEATURES[@]}" -- embed --model "$TMP/run" --fasta data/ --out "$TMP/emb.parquet" \
  --plot "$TMP/latent.png" --quiet
test -s "$TMP/latent.png"
python3 scripts/check_embeddings.py "$TMP/emb.parquet" 29 64
# From the tokenized dataset (xxh3 digests): the digest column is the dataset's.
cargo run --locked --quiet "${FEATURES[@]}" -- embed --model "$TMP/run" --data "$TMP/data.parquet" --out "$TMP/emb-data.parquet" --quiet
python3 scripts/check_embeddings.py "$TMP/emb-data.parquet" 29 64
python3 -c "import pyarrow.parquet as pq, sys; assert 'xxh3' in pq.read_schema(sys.argv[1]).names" "$TMP/emb-data.parquet"
./scripts/run_notebook.sh "$TMP/emb.parquet" "$TMP/notebook"

stage "the CUDA build (burn-cuda, NCCL on device buffers) and the NCCL communicator type-check offline"
./scripts/check-cuda.sh

stage "the GPU machine's environment script against a fake machine; the probe stops cleanly here"
./tests/gpu_env.sh
if PROBE=$(bash scripts/gpu-probe.sh 2>&1); then
  echo "error: gpu-probe.sh succeeded on a machine without a GPU" >&2; exit 1
fi
grep -q "no NVIDIA driver" <<<"$PROBE" || { echo "$PROBE"; echo "error: gpu-probe.sh did not say 'no NVIDIA driver'" >&2; exit 1; }

stage "the whole model with --backend wgpu on lavapipe: losses as on the CPU, attention memory linear in seq"
./scripts/test-kernels.sh --model-only

stage "sequence/data parallelism under mpirun -np 2 and -np 4 match one process; fault test; point-to-point calls"
cargo build --locked --features wgpu,mpi --bin genslm --example mpi_point_to_point
./scripts/check_mpi.sh "${CARGO_TARGET_DIR:-target}/debug/genslm"
P2P="${CARGO_TARGET_DIR:-target}/debug/examples/mpi_point_to_point"
OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun --oversubscribe -np 4 "$P2P"
# Every call cut into pieces of at most 3 elements (messages of 5, 7 and 9).
GENSLM_MPI_MAX_COUNT=3 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun --oversubscribe -np 3 "$P2P"

stage "all tests passed"
