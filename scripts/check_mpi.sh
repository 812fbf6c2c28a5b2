#!/usr/bin/env bash
# Sequence/context/tensor/pipeline/data parallelism under mpirun give the single-process losses, and a failing rank
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
# ZeRO-2/3 over the DP×SP group for 8 optimizer steps: gradients reduce-scattered layer by layer,
# ZeRO-3 weights gathered per layer (with checkpointing: again for the recompute).
ARGS8=(train --fasta data/ --config configs/tiny.toml --steps 8 --seq-len 64 --batch-size 4 --lr 3e-3 --val-every 4 --quiet)
"$BIN" "${ARGS8[@]}" --out "$TMP/one8"
# bf16 in DeepSpeed's layout (issue 41; fp32 masters sharded with the moments) over 2 processes:
# the single process runs the same sequences as two micro-batches of two, so its bf16 rounding
# of the weight gradients is the data ranks' (tests/bf16_layout.rs).
ARGS8BF=(train --fasta data/ --config configs/tiny.toml --steps 8 --seq-len 64 --lr 3e-3 --val-every 4 --quiet --precision bf16)
"$BIN" "${ARGS8BF[@]}" --batch-size 2 --grad-accum 2 --out "$TMP/one8bf16"
"${MPIRUN[@]}" -np 2 "$BIN" "${ARGS8BF[@]}" --batch-size 4 --out "$TMP/np2z1bf16" --zero 1
"${MPIRUN[@]}" -np 2 "$BIN" "${ARGS8BF[@]}" --batch-size 4 --out "$TMP/np2z3bf16" --zero 3
"${MPIRUN[@]}" -np 2 "$BIN" "${ARGS8[@]}" --out "$TMP/np2z2" --zero 2
"${MPIRUN[@]}" -np 4 "$BIN" "${ARGS8[@]}" --out "$TMP/np4z3" --zero 3 2> "$TMP/np4z3.err"
"${MPIRUN[@]}" -np 4 "$BIN" "${ARGS8[@]}" --out "$TMP/np4sp2z3c" --sp 2 --zero 3 --checkpoint-activations
# Overlap (issue 42): the library granted MPI_THREAD_MULTIPLE (no note that overlap is off), and
# the same runs with blocking collectives (--no-overlap) give bit-identical curves (Ulysses: within
# 1e-6; checked below).
if grep -q "not overlapped" "$TMP/np4z3.err"; then cat "$TMP/np4z3.err" >&2; exit 1; fi
"${MPIRUN[@]}" -np 4 "$BIN" "${ARGS8[@]}" --out "$TMP/np4z3nov" --zero 3 --no-overlap
"${MPIRUN[@]}" -np 4 "$BIN" "${ARGS8[@]}" --out "$TMP/np4sp2z3cnov" --sp 2 --zero 3 --checkpoint-activations --no-overlap
# Quantized collectives (issue 41): ZeRO-3 with int8 weight gathers and int8 gradient
# reductions across processes, within 2% of the fp32 run with about 1/4 of its bytes (below).
"${MPIRUN[@]}" -np 4 "$BIN" "${ARGS8[@]}" --out "$TMP/np4z3q8" --zero 3 --quantize-weights int8 --quantize-grads int8
# Sharded optimizer state across processes: ZeRO-3 on 4 processes writes one shard per rank at
# step 4; 2 processes (ZeRO-1 over SP 2) and then 1 resume from it.
"${MPIRUN[@]}" -np 4 "$BIN" "${ARGS8[@]}" --out "$TMP/np4z3to2" --zero 3 --stop-after 4
test "$(ls "$TMP/np4z3to2/checkpoints/step-4/" | grep -c '^optimizer-rank')" = 4
"${MPIRUN[@]}" -np 2 "$BIN" "${ARGS8[@]}" --out "$TMP/np4z3to2" --sp 2 --zero 1 --resume --stop-after 2
"$BIN" "${ARGS8[@]}" --out "$TMP/np4z3to2" --resume
# Context parallelism: K/V blocks around the ring by MPI_Sendrecv (zigzag chunks), alone, with
# Ulysses inside (USP) and with DP + ZeRO-1 on top.
"${MPIRUN[@]}" -np 2 "$BIN" "${ARGS8[@]}" --out "$TMP/np2cp2" --cp 2
"${MPIRUN[@]}" -np 4 "$BIN" "${ARGS8[@]}" --out "$TMP/np4cp2sp2" --cp 2 --sp 2
"${MPIRUN[@]}" -np 4 "$BIN" "${ARGS8[@]}" --out "$TMP/np4dp2cp2z1" --cp 2 --zero 1
# CP 4: the forward's blocks travel both ways round the ring (two MPI_Sendrecv per exchange,
# one forward and one back), the last exchange one way.
"${MPIRUN[@]}" -np 4 "$BIN" "${ARGS8[@]}" --out "$TMP/np4cp4" --cp 4
# The ring's double-buffered passes and DP's all-reduces started during the backward, against
# the same runs with blocking collectives (bit-identical, checked below).
"${MPIRUN[@]}" -np 2 "$BIN" "${ARGS8[@]}" --out "$TMP/np2cp2nov" --cp 2 --no-overlap
"${MPIRUN[@]}" -np 4 "$BIN" "${ARGS8[@]}" --out "$TMP/np4dp2cp2z1nov" --cp 2 --zero 1 --no-overlap
"${MPIRUN[@]}" -np 4 "$BIN" "${ARGS8[@]}" --out "$TMP/np4cp4nov" --cp 4 --no-overlap
# Tensor parallelism: heads, MLP columns and the vocabulary split; two all-reduces per layer
# and pass (Megatron's f and g; with Megatron sequence parallelism, the default, an all-gather
# and a reduce-scatter instead), alone, without Megatron SP, with Ulysses, with DP + ZeRO-1, and
# with ZeRO-3 over DP (each TP rank's slices sharded over its data group).
"${MPIRUN[@]}" -np 2 "$BIN" "${ARGS8[@]}" --out "$TMP/np2tp2" --tp 2
"${MPIRUN[@]}" -np 2 "$BIN" "${ARGS8[@]}" --out "$TMP/np2tp2nosp" --tp 2 --no-megatron-sp
"${MPIRUN[@]}" -np 4 "$BIN" "${ARGS8[@]}" --out "$TMP/np4tp2sp2" --tp 2 --sp 2
"${MPIRUN[@]}" -np 4 "$BIN" "${ARGS8[@]}" --out "$TMP/np4dp2tp2z1" --tp 2 --zero 1
"${MPIRUN[@]}" -np 4 "$BIN" "${ARGS8[@]}" --out "$TMP/np4dp2tp2z3" --tp 2 --zero 3
# Pipeline stages (5 layers, uneven over 2 and 4 stages; 4 micro-batches): activations forward and
# gradients back by MPI_Isend/Recv, every schedule, composed with TP, SP, CP and DP + ZeRO-1; a
# PP 4 run stopped at step 4 resumes on PP 2 × TP 2.
sed 's/^num_layers = 2$/num_layers = 5/' configs/tiny.toml > "$TMP/tiny5.toml"
grep -q '^num_layers = 5$' "$TMP/tiny5.toml"
ARGSPP=(train --fasta data/ --config "$TMP/tiny5.toml" --steps 8 --seq-len 64 --batch-size 4 --grad-accum 4 --lr 3e-3 --val-every 4 --quiet)
"$BIN" "${ARGSPP[@]}" --out "$TMP/onepp"
"${MPIRUN[@]}" -np 2 "$BIN" "${ARGSPP[@]}" --out "$TMP/np2pp2" --pp 2
"${MPIRUN[@]}" -np 4 "$BIN" "${ARGSPP[@]}" --out "$TMP/np4pp4" --pp 4
"${MPIRUN[@]}" -np 4 "$BIN" "${ARGSPP[@]}" --out "$TMP/np4pp4gpipe" --pp 4 --pp-schedule gpipe
"${MPIRUN[@]}" -np 4 "$BIN" "${ARGSPP[@]}" --out "$TMP/np4pp4zbc" --pp 4 --pp-schedule zb --checkpoint-activations
"${MPIRUN[@]}" -np 2 "$BIN" "${ARGSPP[@]}" --out "$TMP/np2pp2v2" --pp 2 --pp-schedule interleaved --pp-virtual 2
"${MPIRUN[@]}" -np 4 "$BIN" "${ARGSPP[@]}" --out "$TMP/np4pp2tp2" --pp 2 --tp 2
"${MPIRUN[@]}" -np 4 "$BIN" "${ARGSPP[@]}" --out "$TMP/np4pp2sp2" --pp 2 --sp 2
"${MPIRUN[@]}" -np 4 "$BIN" "${ARGSPP[@]}" --out "$TMP/np4pp2cp2" --pp 2 --cp 2
"${MPIRUN[@]}" -np 4 "$BIN" "${ARGSPP[@]}" --out "$TMP/np4pp2dp2z1" --pp 2 --zero 1
"${MPIRUN[@]}" -np 4 "$BIN" "${ARGSPP[@]}" --out "$TMP/np4pp4to2" --pp 4 --stop-after 4
"${MPIRUN[@]}" -np 4 "$BIN" "${ARGSPP[@]}" --out "$TMP/np4pp4to2" --pp 2 --tp 2 --resume
# The same layouts with every MPI call cut into pieces of at most 1000 elements (the path that
# carries messages past MPI's 2^31 count limit): ring pass and Ulysses all-to-all, the TP
# all-reduce, ZeRO-3's all-gather and reduce-scatter, the pipeline's sends.
PIECES=(env GENSLM_MPI_MAX_COUNT=1000 "$BIN")
"${MPIRUN[@]}" -np 4 "${PIECES[@]}" "${ARGSPP[@]}" --out "$TMP/pieces_pp2sp2" --pp 2 --sp 2
"${MPIRUN[@]}" -np 4 "${PIECES[@]}" "${ARGS8[@]}" --out "$TMP/pieces_cp2sp2" --cp 2 --sp 2
"${MPIRUN[@]}" -np 4 "${PIECES[@]}" "${ARGS8[@]}" --out "$TMP/pieces_dp2tp2z1" --tp 2 --zero 1
"${MPIRUN[@]}" -np 4 "${PIECES[@]}" "${ARGS8[@]}" --out "$TMP/pieces_z3" --zero 3
# genslm-25m over 3 DP ranks (ZeRO-1): its parameter count does not divide by 3, so the shards
# are padded; buckets of 1,000,003 elements split large parameters and pack small ones.
ARGS25=(train --fasta data/ --config configs/genslm-25m.toml --steps 3 --seq-len 64 --batch-size 3 --lr 1e-3 --warmup 1 --val-every 0 --quiet --reduce-bucket-size 1000003)
"$BIN" "${ARGS25[@]}" --out "$TMP/one25"
"${MPIRUN[@]}" -np 3 "$BIN" "${ARGS25[@]}" --out "$TMP/np3dp3"
python3 - "$TMP" <<'PY'
import glob, json, sys
import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file
root = sys.argv[1]
def moments(d):
    """A checkpoint's Adam moments assembled from its per-rank shards (written here in numpy,
    independently of genslm's reader): each piece is a flat range of a rectangle of the full
    [rows, cols] parameter; every value must be covered exactly once."""
    out = {}
    files = sorted(glob.glob(f"{d}/optimizer-rank*.safetensors"))
    assert files, d
    for path in files:
        with safe_open(path, "np") as f:
            for name, p in json.loads(f.metadata()["genslm_moment_pieces"]).items():
                (rows, cols), (r0, c0, nr, nc) = p["shape"], p["rect"]
                for suffix in ("exp_avg", "exp_avg_sq"):
                    full = out.setdefault(f"{name}.{suffix}", np.full((rows, cols), np.nan, np.float32))
                    rect = np.full(nr * nc, np.nan, np.float32)
                    rect[p["start"]:p["start"] + p["len"]] = f.get_tensor(f"{name}.{suffix}")
                    rect = rect.reshape(nr, nc)
                    view, have = full[r0:r0 + nr, c0:c0 + nc], ~np.isnan(rect)
                    assert np.isnan(view[have]).all(), ("covered twice", path, name)
                    view[have] = rect[have]
    for k, v in out.items():
        assert not np.isnan(v).any(), ("not covered", d, k)
    return out
def losses(d):
    return [(m["loss"], m.get("val_loss")) for m in map(json.loads, open(f"{root}/{d}/metrics.jsonl"))]
for ref_dir, runs in [("one", ["np2sp2", "np4sp2", "np4sp4", "np2dp2"]), ("one8", ["np2z2", "np4z3", "np4sp2z3c", "np4z3to2", "np2cp2", "np4cp2sp2", "np4dp2cp2z1", "np4cp4", "np2tp2", "np2tp2nosp", "np4tp2sp2", "np4dp2tp2z1", "np4dp2tp2z3", "pieces_cp2sp2", "pieces_dp2tp2z1", "pieces_z3"]), ("one25", ["np3dp3"]), ("one8bf16", ["np2z1bf16", "np2z3bf16"]), ("onepp", ["np2pp2", "np4pp4", "np4pp4gpipe", "np4pp4zbc", "np2pp2v2", "np4pp2tp2", "np4pp2sp2", "np4pp2cp2", "np4pp2dp2z1", "np4pp4to2", "pieces_pp2sp2"])]:
    ref = losses(ref_dir)
    for d in runs:
        got = losses(d)
        assert len(got) == len(ref), (d, len(got))
        for (a, va), (b, vb) in zip(got, ref):
            assert abs(a - b) / b <= 1e-5, (d, a, b)
            assert (va is None) == (vb is None) and (va is None or abs(va - vb) / vb <= 1e-5), (d, va, vb)
        print(f"check_mpi: {d} matches the single-process losses ({len(got)} steps)")
def curve(d):
    return [(m["loss"], m.get("val_loss"), m["grad_norm"]) for m in map(json.loads, open(f"{root}/{d}/metrics.jsonl"))]
for on, off in [("np4z3", "np4z3nov")]:
    assert curve(on) == curve(off), (on, curve(on), off, curve(off))
    print(f"check_mpi: {on} is bit-identical with overlap on and off")
# Ulysses overlaps its exchanges with the MLP in two halves of the rows, the CP ring its passes
# with the MLP in CP + 1 parts; the parts' weight gradients add: within 1e-6 of the blocking
# run, not bit for bit (tests/parallel_overlap.rs).
for on, off in [("np4sp2z3c", "np4sp2z3cnov"), ("np2cp2", "np2cp2nov"), ("np4dp2cp2z1", "np4dp2cp2z1nov"), ("np4cp4", "np4cp4nov")]:
    for a, b in zip(curve(on), curve(off), strict=True):
        for x, y in zip(a, b):
            assert (x is None) == (y is None) and (x is None or abs(x - y) <= 1e-6 * abs(y)), (on, a, off, b)
    print(f"check_mpi: {on} is within 1e-6 of the run without overlap")
q, f = [list(map(json.loads, open(f"{root}/{d}/metrics.jsonl"))) for d in ("np4z3q8", "np4z3")]
assert len(q) == len(f) == 8
for a, b in zip(q, f):
    assert abs(a["loss"] - b["loss"]) / b["loss"] <= 0.02, ("np4z3q8", a["loss"], b["loss"])
ratio = sum(m["comm_bytes"] for m in f) / sum(m["comm_bytes"] for m in q)
assert ratio > 3.5, ("np4z3q8 bytes", ratio)
print(f"check_mpi: np4z3q8 (int8 weights and gradients) within 2% of fp32's losses, {ratio:.2f}x fewer bytes")
# The checkpoint written by the 3-rank ZeRO run holds the one-rank weights and moments:
# weights within 1e-4 absolute (AdamW moves a weight up to ~lr = 1e-3 a step whatever its
# gradient, so last-ulp gradient differences can shift it by a fraction of a step), moments
# within 1e-3 of the tensor's largest magnitude.
# The same holds for the pipeline runs' checkpoints (weights gathered from the stages, moments
# written by each stage's ranks).
for run, ref, step in [("np3dp3", "one25", 3), ("np4dp2tp2z3", "one8", 8), ("np4pp4", "onepp", 8), ("np4pp2tp2", "onepp", 8), ("np4pp2dp2z1", "onepp", 8)]:
    worst = {}
    for f, is_moment in [("model.safetensors", False), ("optimizer", True)]:
        read = lambda d: moments(d) if is_moment else load_file(f"{d}/{f}")
        a = read(f"{root}/{run}/checkpoints/step-{step}")
        b = read(f"{root}/{ref}/checkpoints/step-{step}")
        assert a.keys() == b.keys(), (run, f)
        for k in b:
            assert a[k].shape == b[k].shape, (run, f, k)
            d = float(np.abs(a[k] - b[k]).max())
            err = d / max(float(np.abs(b[k]).max()), 1e-30) if is_moment else d
            assert err <= (1e-3 if is_moment else 1e-4), (run, f, k, err)
            worst[f] = max(worst.get(f, 0.0), err)
    print(f"check_mpi: {run} checkpoint (weights and Adam moments) matches the single process: "
          f"largest differences: weights {worst['model.safetensors']:.2e} (absolute), "
          f"moments {worst['optimizer']:.2e} (relative)")
PY
# Fault: rank 1 fails at step 2; the job must end non-zero within a minute, saying why.
# Usage: fault NAME LAYOUT-FLAGS...
fault() {
  local name=$1; shift
  local start took
  start=$(date +%s)
  if timeout 60 "${MPIRUN[@]}" -np 2 env GENSLM_FAULT_RANK=1:2 "$BIN" "${ARGS[@]}" --out "$TMP/$name" "$@" > "$TMP/$name.log" 2>&1; then
    echo "check_mpi: the faulty job ($*) succeeded" >&2; exit 1
  fi
  took=$(( $(date +%s) - start ))
  grep -q "injected fault" "$TMP/$name.log" || { cat "$TMP/$name.log" >&2; echo "check_mpi: no message from the failing rank ($*)" >&2; exit 1; }
  [ "$took" -lt 60 ] || { echo "check_mpi: took ${took}s ($*)" >&2; exit 1; }
  echo "check_mpi: a failing rank ($*) ended the job in ${took}s with its message"
}
fault fault --sp 2
# The same with pipeline stages: the last stage fails while the first waits for its gradient.
fault faultpp --pp 2 --grad-accum 2
# With ZeRO-3 the survivor is inside a step with gathers and reduce-scatters in flight on its
# communication threads when rank 1 fails.
fault faultz3 --zero 3 --checkpoint-activations
# --overwrite under a launcher: rank 0 prepares the run and the others read its dataset after
# it; the old run goes only once every rank has. Rank 1 failing before its first step
# (GENSLM_FAULT_RANK=1:0, after reading) leaves the old run exactly as it was (it was deleted as
# soon as rank 0 had its data), with nothing of the new run beside it.
snapshot() { (cd "$1" && find . ! -name .genslm.lock | LC_ALL=C sort | while read -r f; do
  if [ -f "$f" ]; then echo "$f $(md5sum < "$f")"; else echo "$f"; fi; done); }
cp -a "$TMP/one" "$TMP/ow"
snapshot "$TMP/ow" > "$TMP/ow.before"
if timeout 60 "${MPIRUN[@]}" -np 2 env GENSLM_FAULT_RANK=1:0 "$BIN" "${ARGS[@]}" --seed 7 --out "$TMP/ow" --overwrite > "$TMP/ow.log" 2>&1; then
  echo "check_mpi: the faulty --overwrite job succeeded" >&2; exit 1
fi
grep -q "injected fault" "$TMP/ow.log" || { cat "$TMP/ow.log" >&2; echo "check_mpi: no message from the failing rank (--overwrite)" >&2; exit 1; }
snapshot "$TMP/ow" > "$TMP/ow.after"
if ! diff "$TMP/ow.before" "$TMP/ow.after" >&2; then
  cat "$TMP/ow.log" >&2; echo "check_mpi: a rank's failure before the first step did not leave the run --overwrite replaces as it was" >&2; exit 1
fi
# Without the fault the new run (another seed) replaces it, and nothing of the old one stays
# aside.
"${MPIRUN[@]}" -np 2 "$BIN" "${ARGS[@]}" --seed 7 --out "$TMP/ow" --overwrite
if ls -A "$TMP/ow" | grep -E '\.(replaced|removing)-'; then echo "check_mpi: --overwrite left the old run aside" >&2; exit 1; fi
if [ ! -f "$TMP/ow/checkpoints/latest" ] || cmp -s <(head -1 "$TMP/ow/metrics.jsonl" | cut -c1-60) <(head -1 "$TMP/one/metrics.jsonl" | cut -c1-60); then
  echo "check_mpi: the --overwrite run is not the new run" >&2; exit 1
fi
echo "check_mpi: a rank failing before the first step left the run --overwrite replaces as it was; without the fault it was replaced"
