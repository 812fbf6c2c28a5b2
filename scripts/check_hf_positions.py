#!/usr/bin/env python3
"""genslm and Hugging Face transformers agree on all three position encodings.

Rotary checkpoints are plain GPT-NeoX. Learned-position and ALiBi checkpoints have
model_type "genslm_neox" and carry src/model/modeling_genslm.py, which transformers runs with
trust_remote_code=True (and refuses to load without it).

  make POSITION OUT_DIR
      POSITION is rotary, learned or alibi. Writes a small random model built in transformers
      (shaped like configs/tiny.toml, with perturbed biases and LayerNorms so nothing matches
      by accident) to OUT_DIR with save_pretrained, for `genslm score` to read.

  check MODEL_DIR FASTA SEQ_LEN SCORES.tsv
      Loads MODEL_DIR (a model directory, or a genslm run directory's latest checkpoint) with
      AutoModelForCausalLM (trust_remote_code=True), computes the mean next-token NLL of every
      FASTA record in non-overlapping windows of SEQ_LEN tokens, and compares it with the TSV
      printed by `genslm score --model MODEL_DIR --fasta FASTA --seq-len SEQ_LEN` (relative
      difference <= 1e-4). For a genslm_neox checkpoint it also checks that loading without
      trust_remote_code fails and that plain GPTNeoXForCausalLM, forced on the same weights,
      gives different logits.

Needs torch, transformers, tokenizers and safetensors.
"""
import csv
import importlib.util
import json
import pathlib
import shutil
import sys

import torch
import transformers
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, GPTNeoXConfig, GPTNeoXForCausalLM

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from check_hf_roundtrip import encode, read_fasta, record_nll, window_nll, windows  # noqa: E402
MODELING = ROOT / "src" / "model" / "modeling_genslm.py"
TOLERANCE = 1e-4
# The keys genslm writes for learned/ALiBi checkpoints beside those of config_to_hf.
REMOTE_CODE_KEYS = {
    "model_type": "genslm_neox",
    "architectures": ["GenSlmNeoXForCausalLM"],
    "auto_map": {
        "AutoConfig": "modeling_genslm.GenSlmNeoXConfig",
        "AutoModelForCausalLM": "modeling_genslm.GenSlmNeoXForCausalLM",
    },
}


def fail(msg):
    sys.exit(f"check_hf_positions: FAILED: {msg}")


def import_modeling():
    spec = importlib.util.spec_from_file_location("modeling_genslm", MODELING)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def perturb(model):
    """Weights large enough that attention is far from uniform (so positions matter), and
    LayerNorms and biases away from their 1/0 init (so a dropped one shows)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ("layernorm" in name or "layer_norm" in name) and name.endswith("weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif "embed_in" in name or "embed_pos" in name:
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.12)


def make(position, out):
    shape = dict(
        vocab_size=69,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        max_position_embeddings=2048,
        rotary_pct=0.25,
        rotary_emb_base=10000.0,
        layer_norm_eps=1e-5,
        hidden_act="gelu_fast",
        tie_word_embeddings=False,
        # genslm69 has no [BOS]/[EOS]; [PAD] is 3 (tokenizers/README.md).
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=3,
        genslm_position=position,
        genslm_vocab="genslm69",
        genslm_name=f"hf-tiny-{position}",
    )
    torch.manual_seed(1234)
    if position == "rotary":
        # transformers >= 5 saves rotary_pct and rotary_emb_base as rope_parameters (genslm
        # reads either).
        model = GPTNeoXForCausalLM(GPTNeoXConfig(**shape))
    else:
        m = import_modeling()
        model = m.GenSlmNeoXForCausalLM(m.GenSlmNeoXConfig(**shape))
    perturb(model)
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    if position != "rotary":
        # Written the way genslm writes them, not left to save_pretrained's auto-class logic.
        path = out / "config.json"
        cfg = json.loads(path.read_text())
        cfg.update(REMOTE_CODE_KEYS)
        path.write_text(json.dumps(cfg, indent=2) + "\n")
        shutil.copy(MODELING, out / MODELING.name)

    # The directory loads back as the same model through the path users take.
    back = AutoModelForCausalLM.from_pretrained(
        out, trust_remote_code=True, attn_implementation="eager"
    )
    # Every tensor comes back bit for bit, under the same name...
    saved, loaded = model.state_dict(), back.state_dict()
    if saved.keys() != loaded.keys():
        fail(f"{out} loads back with other tensors: {sorted(saved.keys() ^ loaded.keys())}")
    changed = [n for n in saved if not torch.equal(saved[n], loaded[n])]
    if changed:
        fail(f"{out} loads back with other values in {', '.join(changed)}")
    # ...with the same config (eps, heads, positions: a wrong eps moves the logits no more than
    # GEMM rounding does, so it is compared here, not through them)...
    bookkeeping = {"_name_or_path", "architectures", "auto_map", "dtype", "transformers_version"}
    want, got = model.config.to_dict(), back.config.to_dict()
    differ = sorted(k for k in (want.keys() | got.keys()) - bookkeeping if want.get(k) != got.get(k))
    if differ:
        fail(f"{out} loads back with another config: " + ", ".join(
            f"{k} {want.get(k)!r} -> {got.get(k)!r}" for k in differ))
    # ...and runs the same function. Relative to the logits' scale: CPU GEMM
    # kernels may round differently for buffers at other alignments (the mmapped safetensors
    # against freshly allocated weights), and these sharpened weights amplify that to ~2e-5 of
    # the logits on some machines; a wrong config (positions, heads, eps) is off by far more.
    x = torch.randint(5, 69, (2, 40))
    with torch.no_grad():
        ref = model(input_ids=x).logits
        diff = (back.eval()(input_ids=x).logits - ref).abs().max().item()
    scale = max(1.0, ref.abs().max().item())
    if diff > 1e-4 * scale:
        fail(f"{out} does not load back as the model saved (max |logit diff| {diff:.3g})")
    model_type = json.loads((out / "config.json").read_text())["model_type"]
    print(f"make: {position} model ({type(back).__name__}, model_type {model_type}) in {out}")


def resolve_model_dir(path):
    """A model directory, or a genslm run directory (its checkpoints/latest), as genslm takes."""
    if (path / "config.json").is_file():
        return path
    latest = path / "checkpoints" / "latest"
    if latest.is_file():
        return path / "checkpoints" / latest.read_text().strip()
    fail(f"{path}: no config.json and no checkpoints/latest")


def check(model_dir, fasta, seq_len, tsv):
    model_dir = resolve_model_dir(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        for k in f.keys():
            if f.get_tensor(k).dtype != torch.float32:
                fail(f"{k} is {f.get_tensor(k).dtype}; genslm writes float32 master weights")
    remote = cfg.get("model_type") == "genslm_neox"
    if remote:
        for key, want in REMOTE_CODE_KEYS.items():
            if cfg.get(key) != want:
                fail(f"config.json: {key} is {cfg.get(key)!r}, expected {want!r}")
        carried = model_dir / MODELING.name
        if not carried.is_file():
            fail(f"{model_dir} has no {MODELING.name}")
        if carried.read_bytes() != MODELING.read_bytes():
            print(f"note: {carried} differs from {MODELING.relative_to(ROOT)}; checking the former")
        try:
            # False is what an unset trust_remote_code resolves to when nobody answers the prompt.
            AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=False)
        except Exception as e:
            first = str(e).strip().splitlines()[0]
            print(f"without trust_remote_code: {type(e).__name__}: {first}")
        else:
            fail("AutoModelForCausalLM loaded a genslm_neox checkpoint without trust_remote_code")

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, trust_remote_code=True, attn_implementation="eager"
    ).eval()
    print(f"{model_dir}: {type(model).__name__}, position {cfg.get('genslm_position', 'rotary')}")
    vocab = cfg.get("genslm_vocab") or ("genslm71" if cfg["vocab_size"] >= 71 else "genslm69")
    tok = Tokenizer.from_file(str(ROOT / "tokenizers" / f"{vocab}.json"))
    ours = {r["id"]: r for r in csv.DictReader(open(tsv), delimiter="\t")}
    records = read_fasta(fasta)
    worst = 0.0
    for rid, seq in records:
        if rid not in ours:
            fail(f"record {rid} is not in {tsv}")
        total, n = record_nll(model, tok, seq, seq_len)
        if int(ours[rid]["n_tokens"]) != n:
            fail(f"{rid}: genslm predicted {ours[rid]['n_tokens']} tokens, transformers {n}")
        mine, theirs = float(ours[rid]["mean_nll"]), total / n
        rel = abs(mine - theirs) / abs(theirs)
        worst = max(worst, rel)
        print(f"{rid}\ttransformers {theirs:.6f}\tgenslm {mine:.6f}\trel {rel:.2e}")
    if worst > TOLERANCE:
        fail(f"relative difference {worst:.2e} > {TOLERANCE:g}")

    if remote:
        forced_differs(model_dir, model, tok, records[0][1], seq_len)
    print(f"check_hf_positions: transformers reproduces genslm's loss (worst rel. {worst:.1e})")


def forced_differs(model_dir, model, tok, seq, seq_len):
    """Plain GPT-NeoX on the same weights (rotary, no position table, no ALiBi) must give other
    logits, or this check could not tell the faithful model from the wrong one."""
    transformers.logging.set_verbosity_error()  # the forced load rightly warns about the mismatch
    plain = GPTNeoXForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    x = next(windows(encode(tok, seq), seq_len))
    nll, logits = window_nll(model, x)
    nll_plain, logits_plain = window_nll(plain, x)
    diff = (logits - logits_plain).abs().max().item()
    rel = abs(nll_plain - nll) / abs(nll)
    print(f"forced GPTNeoXForCausalLM: max |logit diff| {diff:.3g}, window NLL off by {rel:.2e}")
    if diff < 1e-3:
        fail("plain GPT-NeoX gives the same logits: this model cannot show that positions matter")


def main():
    args = sys.argv[1:]
    transformers.utils.logging.disable_progress_bar()
    if len(args) == 3 and args[0] == "make":
        if args[1] not in ("rotary", "learned", "alibi"):
            fail(f"position {args[1]!r}: expected rotary, learned or alibi")
        make(args[1], pathlib.Path(args[2]))
    elif len(args) == 5 and args[0] == "check":
        check(pathlib.Path(args[1]), pathlib.Path(args[2]), int(args[3]), args[4])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
