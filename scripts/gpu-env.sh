# Sourced on the GPU machine before running the carried genslm (docs/GPU.md):
#   . scripts/gpu-env.sh [llvm|nvrtc]
# 1. finds what the CUDA build loads at run time: libcuda.so.1 (the driver), libnccl.so.*,
#    libnvrtc.so.*, libdevice.10.bc and the toolkit's headers — in CUDA_PATH, /usr/local/cuda*,
#    /opt/cuda, the system library directories, and Python's nvidia-*/triton wheels (the GPU
#    machine's PyTorch venv at /opt/torch/.venv, or python3's site-packages);
# 2. makes the unversioned links cudarc dlopens (libnccl.so, libnvrtc.so: cudarc 0.19 tries
#    .so, .so.12, .so.11..., never CUDA 13's .so.2/.so.13) in a private directory, and a
#    toolkit-shaped CUDA_PATH when libdevice only exists inside a wheel;
# 3. sets LD_LIBRARY_PATH with that directory first and without stubs/ or compat/ directories
#    (a stub libcuda gives CUDA_ERROR_STUB_LIBRARY);
# 4. unpacks target/gpu-bundle/genslm-VARIANT.xz (scripts/gpu-bundle.sh), checks its SHA-256,
#    and exports GENSLM_BIN;
# 5. prints one line per thing it found or missed.
# Returns non-zero only when the binary cannot be unpacked; missing libraries are reported and
# left to `genslm --backend cuda` (which names them) and scripts/gpu-probe.sh.
# Settings: GENSLM_VARIANT (llvm), BUNDLE_DIR (target/gpu-bundle), GENSLM_GPU_DIR (where links
# and the unpacked binary go; target/gpu-env), GPU_ENV_ROOT (a prefix for every searched path:
# the test's fake machine; the loader cache is not read then).

_genslm_gpu_env() {
  local R=${GPU_ENV_ROOT:-} variant=${1:-${GENSLM_VARIANT:-llvm}}
  local bundle=${BUNDLE_DIR:-target/gpu-bundle} priv=${GENSLM_GPU_DIR:-$PWD/target/gpu-env}
  # Sourced into the caller's shell: its errexit/pipefail must not end it on a search that
  # finds nothing (`local -` restores the options when this returns).
  local -
  set +e +o pipefail
  local d f t sp
  _ge_say() { printf 'gpu-env: %-16s %s\n' "$1" "$2"; }
  # First existing path among the arguments (globs already expanded), skipping stub/compat dirs.
  _ge_first() { for f in "$@"; do [[ -e "$f" && "$f" != */stubs/* && "$f" != */compat/* ]] && { echo "$f"; return 0; }; done; return 1; }
  # NAME.so.* in the first of the given directories that has one (their order is the
  # priority), the highest version there.
  _ge_lib_in() {
    local name=$1 dir hit; shift
    for dir in "$@"; do
      [[ -d "$dir" && "$dir" != */stubs* && "$dir" != */compat* ]] || continue
      hit=$(find "$dir" -maxdepth 1 \( -name "$name.so.[0-9]*" -o -name "$name.so" \) 2>/dev/null | sort -V | tail -1)
      [[ -n "$hit" ]] && { echo "$hit"; return 0; }
    done
    return 1
  }

  # Toolkits: CUDA_PATH first, then the usual places (newest versioned directory last wins ties).
  local toolkits=()
  # (A CUDA_PATH this script made earlier in the same shell is rebuilt, not searched.)
  [[ -n "${CUDA_PATH:-}" && "$CUDA_PATH" != "$priv"/* ]] && toolkits+=("$CUDA_PATH")
  for d in "$R/usr/local/cuda" $(ls -d "$R"/usr/local/cuda-* 2>/dev/null | sort -Vr) "$R/opt/cuda" "$R/usr/lib/cuda"; do
    [[ -d "$d" ]] && toolkits+=("$d")
  done
  # Python site-packages: the device's PyTorch venv, then python3's own.
  local sites=()
  for d in "$R"/opt/torch/.venv/lib/python3*/site-packages; do [[ -d "$d" ]] && sites+=("$d"); done
  if [[ -z "$R" ]] && command -v python3 >/dev/null; then
    for d in $(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null); do
      [[ -d "$d" ]] && sites+=("$d")
    done
  fi
  local libdirs=()
  for t in "${toolkits[@]}"; do libdirs+=("$t/lib64" "$t/lib" "$t/targets/x86_64-linux/lib"); done
  libdirs+=("$R/usr/lib/x86_64-linux-gnu" "$R/usr/lib64" "$R/usr/local/nvidia/lib64" "$R/usr/lib")
  for sp in "${sites[@]}"; do
    for d in "$sp"/nvidia/*/lib "$sp"/nvidia/*/*/lib; do [[ -d "$d" ]] && libdirs+=("$d"); done
  done

  local cuda="" nccl nvrtc libdevice="" include=""
  if [[ -z "$R" ]]; then
    cuda=$(ldconfig -p 2>/dev/null | awk '$1 == "libcuda.so.1" {print $NF}' | grep -v -e /stubs/ -e /compat/ | head -1)
  fi
  [[ -n "$cuda" ]] || cuda=$(_ge_lib_in libcuda "$R/usr/lib/x86_64-linux-gnu" "$R/usr/lib64" "$R/usr/local/nvidia/lib64" "$R/usr/lib/wsl/lib")
  nccl=$(_ge_lib_in libnccl "${libdirs[@]}")
  nvrtc=$(_ge_lib_in libnvrtc "${libdirs[@]}")
  for t in "${toolkits[@]}"; do
    [[ -z "$libdevice" && -f "$t/nvvm/libdevice/libdevice.10.bc" ]] && libdevice="$t/nvvm/libdevice/libdevice.10.bc"
    [[ -z "$include" && -f "$t/include/cuda.h" ]] && include="$t/include"
  done
  for sp in "${sites[@]}"; do
    [[ -n "$libdevice" ]] || libdevice=$(_ge_first "$sp"/nvidia/*/nvvm/libdevice/libdevice.10.bc \
      "$sp"/nvidia/*/*/nvvm/libdevice/libdevice.10.bc "$sp"/triton/backends/nvidia/lib/libdevice.10.bc) || libdevice=""
    [[ -n "$include" ]] || include=$(dirname "$(_ge_first "$sp"/nvidia/*/include/cuda.h "$sp"/nvidia/*/*/include/cuda.h)" 2>/dev/null) || include=""
    [[ "$include" == "." ]] && include=""
  done

  # Real files, not links into the private directory about to be rebuilt.
  [[ -n "$libdevice" ]] && libdevice=$(readlink -f "$libdevice")
  [[ -n "$include" ]] && include=$(readlink -f "$include")
  mkdir -p "$priv/lib" "$priv/bin" || return 1
  # Links from an earlier source on another layout go first.
  rm -rf "$priv/lib/libnccl.so" "$priv/lib/libnvrtc.so" "$priv/cuda"
  # cudarc's names: an unversioned link to whatever version is there.
  [[ -n "$nccl" ]] && ln -sfn "$nccl" "$priv/lib/libnccl.so"
  [[ -n "$nvrtc" ]] && ln -sfn "$nvrtc" "$priv/lib/libnvrtc.so"
  # cubecl reads $CUDA_PATH/nvvm/libdevice/libdevice.10.bc and $CUDA_PATH/include: a real
  # toolkit when it has both, else a private tree shaped like one.
  local tk=""
  for t in "${toolkits[@]}"; do
    if [[ -f "$t/nvvm/libdevice/libdevice.10.bc" && -d "$t/include" ]]; then tk=$t; break; fi
  done
  if [[ -z "$tk" && -n "$libdevice" ]]; then
    tk="$priv/cuda"
    mkdir -p "$tk/nvvm/libdevice"
    ln -sfn "$libdevice" "$tk/nvvm/libdevice/libdevice.10.bc"
    [[ -n "$include" ]] && ln -sfn "$include" "$tk/include"
  fi
  [[ -n "$tk" ]] && export CUDA_PATH="$tk"

  # The loader path: our links, the real libraries' directories (NVRTC loads its builtins
  # library from beside itself), the bundle's libraries, then the old path minus stubs/compat.
  local path="$priv/lib" old
  for f in "$nccl" "$nvrtc" "$cuda"; do [[ -n "$f" ]] && path="$path:$(dirname "$f")"; done
  [[ -d "$bundle/lib" ]] && path="$path:$(cd "$bundle/lib" && pwd)"
  local IFS=:
  for old in ${LD_LIBRARY_PATH:-}; do
    [[ -z "$old" || "$old" == */stubs* || "$old" == */compat* ]] && continue
    path="$path:$old"
  done
  unset IFS
  export LD_LIBRARY_PATH="$path"

  _ge_say libcuda.so.1 "${cuda:-MISSING (no NVIDIA driver library: is this a GPU machine?)}"
  _ge_say libnccl "${nccl:-MISSING (needed only for several GPUs)}"
  _ge_say libnvrtc "${nvrtc:-MISSING (needed by the nvrtc variant)}"
  _ge_say libdevice.10.bc "${libdevice:-MISSING (needed by the llvm variant for exp/log/tanh)}"
  _ge_say include "${include:-MISSING (needed by the nvrtc variant)}"
  _ge_say CUDA_PATH "${CUDA_PATH:-unset}"
  _ge_say LD_LIBRARY_PATH "$LD_LIBRARY_PATH"

  # The binary: unpacked once, checked against the checksum of the stripped build.
  local xzf="$bundle/genslm-$variant.xz" sumf="$bundle/genslm-$variant.sha256" bin="$priv/bin/genslm-$variant"
  if [[ ! -f "$xzf" || ! -f "$sumf" ]]; then
    _ge_say binary "MISSING: no $xzf (+ .sha256); build it with scripts/build-cuda.sh --bundle and carry target/gpu-bundle"
    return 1
  fi
  local want have
  want=$(awk '{print $1}' "$sumf")
  have=$( [[ -f "$bin" ]] && sha256sum "$bin" | awk '{print $1}')
  if [[ "$have" != "$want" ]]; then
    rm -f "$bin.tmp"
    if command -v xz >/dev/null; then
      xz -dc "$xzf" > "$bin.tmp"
    else
      python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$xzf" "$bin.tmp"
    fi || { rm -f "$bin.tmp"; _ge_say binary "CORRUPT: $xzf does not decompress"; return 1; }
    have=$(sha256sum "$bin.tmp" | awk '{print $1}')
    if [[ "$have" != "$want" ]]; then
      rm -f "$bin.tmp"; _ge_say binary "CORRUPT: $xzf unpacks to sha256 $have, expected $want"; return 1
    fi
    chmod +x "$bin.tmp" && mv "$bin.tmp" "$bin"
  fi
  export GENSLM_BIN="$bin"
  _ge_say binary "$bin ($variant; sha256 ${want:0:16}…)"
}
_genslm_gpu_env "$@"
_ge_rc=$?
unset -f _genslm_gpu_env _ge_say _ge_first _ge_lib_in
return $_ge_rc 2>/dev/null || exit $_ge_rc
