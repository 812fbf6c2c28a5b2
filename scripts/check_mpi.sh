#!/usr/bin/env bash
# Sequence/data parallelism under mpirun give the single-process losses, and a failing rank
# ends the job quickly with a message. Usage: scripts/check_mpi.sh PATH/TO/genslm (built with
# --features mpi). Needs mpirun (OpenMPI or MPICH).
set -euo pipefail
BIN=$1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
ARGS=(train --fasta data/ --config configs/tiny.toml --steps 4 --seq-len 64 --batch-size 4 --lr 3e-3 --val-every 2 --quiet)
MPIRUN=(mpirun --oversubscribe)
"$BIN" "${ARGS[@]}" --out "$TMP/one"
"${MPIRUN[@]}" -np 2 "$BIN" "${ARGS[@]}" --out "$TMP/np2sp2" --sp 2
"${MPIRUN[@]}" -np 4 "$BIN" "${ARGS[@]}" --out "$TMP/np4sp2" --sp 2
"${MPIRUN[@]}" -np 4 "$BIN" "${ARGS[@]}" --out "$TMP/np4sp4" --sp 4
"${MPIRUN[@]}" -np 2 "$BIN" "${ARGS[@]}" --out "$TMP/np2dp2"
python3 - "$TMP" <<'PY'
import json, sys
root = sys.argv[1]
def losses(d):
    return [(m["loss"], m.get("val_loss")) for m in map(json.loads, open(f"{root}/{d}/metrics.jsonl"))]
ref = losses("one")
for d in ["np2sp2", "np4sp2", "np4sp4", "np2dp2"]:
    got = losses(d)
    assert len(got) == len(ref), (d, len(got))
    for (a, va), (b, vb) in zip(got, ref):
        assert abs(a - b) / b <= 1e-5, (d, a, b)
        assert (va is None) == (vb is None) and (va is None or abs(va - vb) / vb <= 1e-5), (d, va, vb)
    print(f"check_mpi: {d} matches the single-process losses ({len(got)} steps)")
PY
# Fault: rank 1 fails at step 2; the job must end non-zero within a minute, saying why.
start=$(date +%s)
if timeout 60 "${MPIRUN[@]}" -np 2 env GENSLM_FAULT_RANK=1:2 "$BIN" "${ARGS[@]}" --out "$TMP/fault" --sp 2 > "$TMP/fault.log" 2>&1; then
  echo "check_mpi: the faulty job succeeded" >&2; exit 1
fi
took=$(( $(date +%s) - start ))
grep -q "injected fault" "$TMP/fault.log" || { cat "$TMP/fault.log" >&2; echo "check_mpi: no message from the failing rank" >&2; exit 1; }
[ "$took" -lt 60 ] || { echo "check_mpi: took ${took}s" >&2; exit 1; }
echo "check_mpi: a failing rank ended the job in ${took}s with its message"
