#!/usr/bin/env python3
"""`genslm embed --pool none` agrees with Hugging Face transformers' `output_hidden_states`.

Loads MODEL_DIR (learned/ALiBi checkpoints through their exported modeling file), tokenizes every
FASTA record with Hugging Face `tokenizers`, and runs transformers on the windows genslm
documents (src/infer/token_states.rs), rewritten here: windows of W tokens every S tokens, each
token's state taken from the first window whose end passes it. Compares every row of
STATES.parquet (token, codon, layer, context, embedding) with hidden_states[layer] of that
window at the token's position (max |diff| <= 1e-4 relative to the state's scale).

LAYERS are the layers asked of genslm (e.g. 0,1,-1), resolved here in Hugging Face's
numbering: hidden_states has num_hidden_layers + 1 entries, -1 the last (after the final
LayerNorm).

Usage: python3 scripts/check_token_states.py MODEL_DIR FASTA W S LAYERS STATES.parquet
"""
import pathlib
import sys

import numpy as np
import pyarrow.parquet as pq
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from check_hf_roundtrip import encode, read_fasta  # noqa: E402
from check_hf_positions import resolve_model_dir  # noqa: E402


def fail(msg):
    sys.exit(f"check_token_states: FAILED: {msg}")


def main():
    model_dir = resolve_model_dir(pathlib.Path(sys.argv[1]))
    fasta, w, s = pathlib.Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    asked, path = [int(x) for x in sys.argv[5].split(",")], sys.argv[6]
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, trust_remote_code=True, attn_implementation="eager").eval()
    df = pq.read_table(path).to_pandas()
    tok = Tokenizer.from_file(str(ROOT / "tokenizers" / "genslm69.json"))
    text = {i: t for t, i in tok.get_vocab().items()}
    worst, rows = 0.0, 0
    for rid, seq in read_fasta(fasta):
        ids = encode(tok, seq)
        n = len(ids)
        ours = df[df.id == rid]
        count = model.config.num_hidden_layers + 1
        layers = sorted({x % count for x in asked})
        if sorted(set(ours.layer)) != layers:
            fail(f"{rid}: layers {sorted(set(ours.layer))} in the file, {layers} asked ({asked})")
        # HF's states per token: (context, {layer: vector}) from the window that owns it.
        ref = [None] * n
        begin, prev_end = 0, 0
        while begin < n:
            end = min(begin + w, n)
            with torch.no_grad():
                hs = model(input_ids=torch.tensor([ids[begin:end]]), output_hidden_states=True).hidden_states
            for t in range(max(begin, prev_end), end):
                ref[t] = (t - begin, {l: hs[l][0, t - begin].double().numpy() for l in layers})
            if end == n:
                break
            prev_end, begin = end, begin + s
        if len(ours) != n * len(layers):
            fail(f"{rid}: {len(ours)} rows for {n} tokens x {len(layers)} layers")
        for r in ours.itertuples():
            t = r.token_index
            ctx, states = ref[t]
            want_meta = (text[ids[t]], ctx, t, 3 * t)  # genslm69: token t is codon t
            got_meta = (r.codon, r.context, r.codon_index, r.base_offset)
            if got_meta != want_meta:
                fail(f"{rid} token {t}: (codon, context, codon_index, base_offset) {got_meta}, expected {want_meta}")
            want = states[r.layer]
            err = np.abs(np.asarray(r.embedding, dtype=np.float64) - want).max() / max(1.0, np.abs(want).max())
            worst = max(worst, err)
            if err > 1e-4:
                fail(f"{rid} token {t} layer {r.layer}: max |diff| {err:.2e}")
            rows += 1
        print(f"{rid}: {n} tokens x layers {layers} match")
    print(f"check_token_states: {rows} rows equal transformers' hidden_states (worst rel. diff {worst:.1e}; window {w}, stride {s})")


if __name__ == "__main__":
    main()
