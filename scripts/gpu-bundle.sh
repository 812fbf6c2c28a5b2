#!/usr/bin/env bash
# Packs a CUDA build of genslm for the GPU machine (docs/GPU.md): at most 64 MiB travels
# there, it has no Rust and no package registry, and its glibc is a current Ubuntu's.
# Usage: scripts/gpu-bundle.sh BINARY VARIANT [FEATURES]   (scripts/build-cuda.sh --bundle calls it)
#   VARIANT: llvm or nvrtc (the kernel compiler the binary was built with).
# Writes into ${BUNDLE_DIR:-target/gpu-bundle}/:
#   genslm-VARIANT.xz        the stripped binary, xz -9e (python3's lzma unpacks it anywhere)
#   genslm-VARIANT.sha256    checksum of the unpacked binary (scripts/gpu-env.sh checks it)
#   NEEDED-VARIANT.txt       each NEEDED library: "system" (any CUDA machine has it) or "bundled"
#   lib/                     the bundled ones (and what they need), if any
#   BUNDLE-VARIANT.txt       features, commit, date, sizes, highest GLIBC_ symbol
#   SHA256SUMS               every file above
# Fails when the directory passes BUNDLE_MAX_MIB (60) or anything needs a glibc newer than
# GLIBC_MAX (2.39, Ubuntu 24.04 LTS).
set -euo pipefail
cd "$(dirname "$0")/.."
[[ $# -ge 2 ]] || { echo "usage: $0 BINARY llvm|nvrtc [FEATURES]" >&2; exit 2; }
BIN=$1 VARIANT=$2 FEATURES=${3:-unknown}
[[ "$VARIANT" == llvm || "$VARIANT" == nvrtc ]] || { echo "error: variant '$VARIANT' is not llvm or nvrtc" >&2; exit 2; }
[[ -x "$BIN" ]] || { echo "error: $BIN is not an executable" >&2; exit 2; }
OUT=${BUNDLE_DIR:-target/gpu-bundle}
MAX_MIB=${BUNDLE_MAX_MIB:-60}
GLIBC_MAX=${GLIBC_MAX:-2.39}
mkdir -p "$OUT/lib"
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT

# Libraries every Linux machine with the NVIDIA driver has (glibc's, the GCC runtime, zlib) or
# that the driver itself provides. Anything else NEEDED is copied into lib/.
SYSTEM_RE='^(libc|libm|libpthread|libdl|librt|libutil|libresolv|ld-linux-x86-64|ld-linux-aarch64|libgcc_s|libstdc\+\+|libz|libcuda|libnvidia-ml)\.so'

needed() { readelf -d "$1" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'; }
# Highest GLIBC_x.y a file's dynamic symbols ask for.
glibc_of() { objdump -T "$1" 2>/dev/null | grep -o 'GLIBC_[0-9.]*' | sed 's/GLIBC_//' | sort -V | tail -1; }
newer() { [[ "$(printf '%s\n%s\n' "$1" "$2" | sort -V | tail -1)" != "$2" ]]; }  # $1 > $2

cp "$BIN" "$TMP/genslm-$VARIANT"
strip --strip-all "$TMP/genslm-$VARIANT"
RAW=$(stat -c %s "$TMP/genslm-$VARIANT")

# NEEDED, bundling what a CUDA machine would lack (and, transitively, what that needs).
: > "$OUT/NEEDED-$VARIANT.txt"
GLIBC=$(glibc_of "$TMP/genslm-$VARIANT")
queue=("$TMP/genslm-$VARIANT")
while ((${#queue[@]})); do
  file=${queue[0]}; queue=("${queue[@]:1}")
  for lib in $(needed "$file"); do
    if [[ "$lib" =~ $SYSTEM_RE ]]; then
      [[ "$file" == "$TMP/genslm-$VARIANT" ]] && echo "$lib system" >> "$OUT/NEEDED-$VARIANT.txt"
      continue
    fi
    [[ "$file" == "$TMP/genslm-$VARIANT" ]] && echo "$lib bundled" >> "$OUT/NEEDED-$VARIANT.txt"
    [[ -e "$OUT/lib/$lib" ]] && continue
    path=$(ldd "$BIN" | awk -v l="$lib" '$1 == l && $3 ~ /^\// {print $3}')
    [[ -n "$path" ]] || { echo "error: NEEDED $lib is not found on this machine" >&2; exit 1; }
    cp -L "$path" "$OUT/lib/$lib"
    g=$(glibc_of "$OUT/lib/$lib"); [[ -z "$g" ]] || ! newer "$g" "$GLIBC" || GLIBC=$g
    queue+=("$OUT/lib/$lib")
  done
done
echo "== NEEDED ($VARIANT):"; sed 's/^/   /' "$OUT/NEEDED-$VARIANT.txt"
echo "== highest GLIBC_ symbol needed: $GLIBC (limit $GLIBC_MAX)"
if newer "$GLIBC" "$GLIBC_MAX"; then
  echo "error: the binary needs glibc $GLIBC, newer than $GLIBC_MAX; build on an older system" >&2
  exit 1
fi

(cd "$TMP" && sha256sum "genslm-$VARIANT") > "$OUT/genslm-$VARIANT.sha256"
echo "== xz -9e (about two minutes)"
xz -9e -T1 -c "$TMP/genslm-$VARIANT" > "$OUT/genslm-$VARIANT.xz.tmp"
mv "$OUT/genslm-$VARIANT.xz.tmp" "$OUT/genslm-$VARIANT.xz"
PACKED=$(stat -c %s "$OUT/genslm-$VARIANT.xz")
mib() { awk -v s="$1" 'BEGIN{printf "%.1f", s/1048576}'; }
{
  echo "variant: $VARIANT (kernels compiled by $([[ $VARIANT == llvm ]] && echo 'LLVM to PTX' || echo NVRTC))"
  echo "features: $FEATURES"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (uncommitted changes)')"
  echo "built: $(date -u +%FT%TZ) on $(uname -m), $(ldd --version | head -1)"
  echo "stripped: $RAW bytes ($(mib "$RAW") MiB); xz: $PACKED bytes ($(mib "$PACKED") MiB)"
  echo "glibc needed: $GLIBC"
} > "$OUT/BUNDLE-$VARIANT.txt"
rmdir "$OUT/lib" 2>/dev/null || true
(cd "$OUT" && find . -type f ! -name SHA256SUMS | sed 's|^\./||' | sort | xargs sha256sum > SHA256SUMS)
TOTAL=$(du -sb "$OUT" | cut -f1)
cat "$OUT/BUNDLE-$VARIANT.txt" | sed 's/^/   /'
echo "== bundle $OUT: $(mib "$TOTAL") MiB in all (limit $MAX_MIB MiB): $(cd "$OUT" && ls | tr '\n' ' ')"
if (( TOTAL > MAX_MIB * 1048576 )); then
  echo "error: the bundle is $(mib "$TOTAL") MiB, over $MAX_MIB MiB: it will not travel to the GPU machine" >&2
  exit 1
fi
