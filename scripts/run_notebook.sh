#!/usr/bin/env bash
# Runs notebooks/latent_space.ipynb headless on an embeddings parquet from `genslm embed`.
# Usage: scripts/run_notebook.sh EMB.parquet OUT_DIR
# Writes OUT_DIR/latent_umap.png and the executed notebook. Installs umap-learn, jupyter,
# nbconvert, ipykernel and matplotlib with pip when missing; fails when they cannot be installed.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -ne 2 ]; then
  echo "usage: $0 EMB.parquet OUT_DIR" >&2; exit 2
fi
EMB=$(realpath "$1")
mkdir -p "$2"
OUT=$(realpath "$2")
have() { (cd /tmp && python3 -c "import umap, matplotlib, pyarrow, pandas, nbconvert, ipykernel") 2>/dev/null; }
if ! have; then
  if ! python3 -m pip install --quiet --disable-pip-version-check \
      umap-learn jupyter nbconvert ipykernel matplotlib pyarrow pandas || ! have; then
    echo "error: could not install the notebook's packages with pip (umap-learn, jupyter, ...)" >&2
    exit 1
  fi
fi
rm -f "$OUT/latent_umap.png"
GENSLM_EMBEDDINGS="$EMB" GENSLM_UMAP_PNG="$OUT/latent_umap.png" \
  python3 -m jupyter nbconvert --to notebook --execute notebooks/latent_space.ipynb \
  --ExecutePreprocessor.timeout=600 --output-dir "$OUT" --output latent_space.executed.ipynb
if [ ! -s "$OUT/latent_umap.png" ]; then
  echo "the notebook ran but wrote no $OUT/latent_umap.png" >&2; exit 1
fi
echo "latent-space notebook: $OUT/latent_umap.png"
