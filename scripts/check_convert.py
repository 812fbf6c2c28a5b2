#!/usr/bin/env python3
"""`genslm convert` reads GenSLM's released checkpoint layout and gives PyTorch's loss.

Builds a GPT-NeoX model of the genslm-25m shape in transformers (seeded random weights, biases
and layer norms perturbed so nothing passes by accident) and writes it the ways users have it:
  - a PyTorch Lightning checkpoint as GenSLM released them: torch.save of a dict whose
    `state_dict` holds the Hugging Face names prefixed with `model.`, beside epoch/optimizer/
    hyper-parameter entries (these hold Python objects, one of which would run a shell command
    if unpickled by Python: convert must never execute it), without the attention buffers
    ("bias_removed") and with them (causal mask, masked_bias, rotary inv_freq);
  - a Hugging Face `pytorch_model.bin` directory (config.json beside it).
Each is converted with `genslm convert`, scored with `genslm score` on a real genome, and the
mean NLL per record compared with the PyTorch model's (≤ 1e-4 relative). Then the bad inputs:
a state dict holding a non-tensor object, a tensor of the wrong shape, integer or boolean
weights, NaN or out-of-range values, one weight under two keys or in two shards, size tuples
shared by memo to exhaust memory, a pickle of a plain object, and a truncated file must each
fail with a clear message naming the problem (no panic).

Usage: python3 scripts/check_convert.py GENSLM_BINARY FASTA
"""
import argparse
import collections
import csv
import io
import os
import pathlib
import subprocess
import zipfile
import sys
import tempfile

import torch
from transformers import GPTNeoXForCausalLM

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from check_hf_roundtrip import read_fasta, record_nll  # noqa: E402
from neox_toml import model_table, neox_config  # noqa: E402

from tokenizers import Tokenizer  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
SEQ_LEN = 256
CONFIG_25M = ROOT / "configs" / "genslm-25m.toml"


class RunsAShellCommand:
    """Unpickled by Python, this would run `touch MARKER`; convert must leave it inert."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def model_25m():
    cfg = neox_config(model_table(CONFIG_25M))
    torch.manual_seed(25)
    model = GPTNeoXForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # biases and layer norms: away from their 0/1 initial values
                p.add_(0.05 * torch.randn_like(p))
    return model


def nll_per_record(model, fasta):
    tok = Tokenizer.from_file(str(ROOT / "tokenizers" / "genslm69.json"))
    out = {}
    for rid, seq in read_fasta(fasta):
        total, n = record_nll(model, tok, seq, SEQ_LEN)
        out[rid] = (total / n, n)
    return out


def released_names(model):
    """The state dict under transformers 4's names (GenSLM's era): its output head is
    `embed_out`, which transformers 5 calls `lm_head` in memory."""
    return collections.OrderedDict(
        ("embed_out.weight" if k == "lm_head.weight" else k, v) for k, v in model.state_dict().items()
    )


def lightning_checkpoint(model, path, marker, buffers):
    sd = collections.OrderedDict(("model." + k, v) for k, v in released_names(model).items())
    if buffers:  # what transformers < 4.31 kept in GPT-NeoX state dicts
        cfg = model.config
        n, d = cfg.max_position_embeddings, cfg.hidden_size // cfg.num_attention_heads
        rot = int(d * model_table(CONFIG_25M)["rotary_pct"])
        for i in range(cfg.num_hidden_layers):
            p = f"model.gpt_neox.layers.{i}.attention."
            sd[p + "bias"] = torch.tril(torch.ones(n, n, dtype=torch.bool)).view(1, 1, n, n)
            sd[p + "masked_bias"] = torch.tensor(-1e9)
            sd[p + "rotary_emb.inv_freq"] = 1.0 / 10000 ** (torch.arange(0, rot, 2).float() / rot)
    torch.save({
        "epoch": 0,
        "global_step": 1234,
        "pytorch-lightning_version": "1.6.5",
        "state_dict": sd,
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"current": {"completed": 0}}}},
        "callbacks": {"ModelCheckpoint": {"best_model_path": "/lus/x.pt"}},
        "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 5e-5}]}],
        "lr_schedulers": [],
        "hparams_name": "cfg",
        "hyper_parameters": {"cfg": argparse.Namespace(lr=5e-5), "hook": RunsAShellCommand(marker)},
    }, path)


def run(cmd):
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True)


def convert_and_score(genslm, src, out, fasta, expect, extra=()):
    r = run([genslm, "--quiet", "convert", src, "--out", out, *extra])
    assert r.returncode == 0, f"convert {src} failed:\n{r.stderr}"
    r = run([genslm, "score", "--model", out, "--fasta", fasta, "--seq-len", SEQ_LEN])
    assert r.returncode == 0, f"score {out} failed:\n{r.stderr}"
    worst = 0.0
    for row in csv.DictReader(io.StringIO(r.stdout), delimiter="\t"):
        ref, n = expect[row["id"]]
        assert int(row["n_tokens"]) == n, (row["id"], row["n_tokens"], n)
        rel = abs(float(row["mean_nll"]) - ref) / ref
        worst = max(worst, rel)
    assert worst <= 1e-4, f"{src}: genslm's NLL differs from PyTorch's by {worst:.2e} relative"
    print(f"  {pathlib.Path(src).name}: genslm score = PyTorch NLL (worst rel. diff {worst:.1e})")


def must_fail(genslm, src, out, needles, extra=()):
    r = run([genslm, "convert", src, "--out", out, *extra])
    msg = r.stderr.strip()
    assert r.returncode != 0, f"convert {src} should fail but exited 0"
    assert "panicked" not in msg and "internal error" not in msg, msg
    for n in needles:
        assert n in msg, f"convert {src}: message lacks {n!r}: {msg}"
    assert not pathlib.Path(out).exists(), f"{out} exists after a failed convert"
    print(f"  refused {pathlib.Path(src).name}: {msg.splitlines()[-1]}")


def main():
    genslm, fasta = pathlib.Path(sys.argv[1]).resolve(), pathlib.Path(sys.argv[2])
    model = model_25m()
    expect = nll_per_record(model, fasta)
    with tempfile.TemporaryDirectory() as tmp:
        t = pathlib.Path(tmp)
        marker = t / "pickle-code-ran"
        for buffers, name in [(False, "patric_25m_bias_removed.pt"), (True, "patric_25m_with_buffers.pt")]:
            lightning_checkpoint(model, t / name, marker, buffers)
            convert_and_score(genslm, t / name, t / (name + ".out"), fasta, expect, ["--config", CONFIG_25M])
        assert not marker.exists(), "convert executed code from the pickle"
        print("  the pickled os.system call was not executed")
        # transformers 5 writes only safetensors: the .bin of older releases is written here.
        model.save_pretrained(t / "hf_bin")
        (t / "hf_bin" / "model.safetensors").unlink()
        torch.save(released_names(model), t / "hf_bin" / "pytorch_model.bin")
        convert_and_score(genslm, t / "hf_bin", t / "hf_bin.out", fasta, expect)
        # --out a link to an empty directory: the model goes into the directory it names.
        (t / "real_out").mkdir()
        (t / "link_out").symlink_to(t / "real_out")
        convert_and_score(genslm, t / "hf_bin", t / "link_out", fasta, expect)
        assert (t / "link_out").is_symlink() and (t / "real_out" / "model.safetensors").is_file()
        assert not [p.name for p in t.iterdir() if ".partial-" in p.name]

        sd = {"state_dict": collections.OrderedDict(("model." + k, v) for k, v in released_names(model).items())}
        sd["state_dict"]["model.gpt_neox.embed_in.weight"] = argparse.Namespace(x=1)
        torch.save(sd, t / "object.pt")
        must_fail(genslm, t / "object.pt", t / "o1", ["model.gpt_neox.embed_in.weight", "argparse.Namespace", "not a tensor"], ["--config", CONFIG_25M])
        sd["state_dict"]["model.gpt_neox.embed_in.weight"] = torch.zeros(68, 512)
        torch.save(sd, t / "shape.pt")
        must_fail(genslm, t / "shape.pt", t / "o2", ["model.gpt_neox.embed_in.weight", "[68, 512]", "[69, 512]"], ["--config", CONFIG_25M])
        # Integer and boolean weights: refused by name (cast to f32 they loaded as nonsense).
        for dtype, name in [(torch.int32, "I32"), (torch.bool, "Bool")]:
            sd["state_dict"]["model.gpt_neox.embed_in.weight"] = torch.ones(69, 512, dtype=dtype)
            torch.save(sd, t / f"{name}.pt")
            must_fail(genslm, t / f"{name}.pt", t / f"o_{name}", ["model.gpt_neox.embed_in.weight", f"holds {name} values"], ["--config", CONFIG_25M])
        # A broadcast view (stride 0): 1 stored element read as 69x512. Scaled up (2^20 x 2^14
        # from a 500-byte file) it would ask for 64 GiB: refused before anything is allocated.
        sd["state_dict"]["model.gpt_neox.embed_in.weight"] = torch.zeros(1).expand(69, 512)
        torch.save(sd, t / "broadcast.pt")
        must_fail(genslm, t / "broadcast.pt", t / "o6", ["model.gpt_neox.embed_in.weight", "35328 elements", "holds 1"], ["--config", CONFIG_25M])
        # Values that are not finite as f32 (NaN; an F64 beyond f32's range): refused naming the
        # tensor, where the converted model failed later as "corrupt" in every command.
        for fill, dtype, name in [(float("nan"), torch.float32, "nan"), (1e300, torch.float64, "f64big")]:
            sd["state_dict"]["model.gpt_neox.embed_in.weight"] = torch.full((69, 512), fill, dtype=dtype)
            torch.save(sd, t / f"{name}.pt")
            must_fail(genslm, t / f"{name}.pt", t / f"o_{name}", ["model.gpt_neox.embed_in.weight", "not finite as f32"], ["--config", CONFIG_25M])
        # One weight under two keys (with and without Lightning's prefix): one copy would
        # silently replace the other.
        good = released_names(model)
        sd["state_dict"]["model.gpt_neox.embed_in.weight"] = good["gpt_neox.embed_in.weight"]
        sd["state_dict"]["gpt_neox.embed_in.weight"] = torch.zeros(69, 512)
        torch.save(sd, t / "twice.pt")
        must_fail(genslm, t / "twice.pt", t / "o_twice", ["gpt_neox.embed_in.weight", "two copies of one weight"], ["--config", CONFIG_25M])
        del sd["state_dict"]["gpt_neox.embed_in.weight"]
        # ... or in two shards of a sharded safetensors directory.
        from safetensors.torch import save_file
        shards = t / "shards"
        shards.mkdir()
        model.config.to_json_file(shards / "config.json")
        save_file({k: v.contiguous() for k, v in good.items()}, shards / "a.safetensors")
        save_file({"embed_out.weight": torch.zeros_like(good["embed_out.weight"])}, shards / "b.safetensors")
        (shards / "model.safetensors.index.json").write_text(
            '{"weight_map": {"embed_out.weight": "a.safetensors", "gpt_neox.embed_in.weight": "b.safetensors"}}')
        must_fail(genslm, shards, t / "o_shards", ["embed_out.weight", "two copies of one weight"])
        # A size tuple of 200,000 entries shared (by memo) by 20,000 tensors: 1.1 MB of pickle
        # that asked for ~64 GB as each tensor copied the tuple; refused at the first tensor.
        def x(s):
            b = s.encode()
            return b"X" + len(b).to_bytes(4, "little") + b
        def get(i):
            return b"j" + i.to_bytes(4, "little")
        p = b"\x80\x02}" + x("state_dict")
        p += b"(" + b"K\x01" * 200_000 + b"tr\x00\x00\x00\x000"
        p += b"ctorch._utils\n_rebuild_tensor_v2\nr\x01\x00\x00\x000"
        p += b"(" + x("storage") + b"ctorch\nFloatStorage\n" + x("0") + x("cpu") + b"K\x01tQr\x02\x00\x00\x000"
        p += b"}("
        for i in range(20_000):
            p += x(f"k{i}") + get(1) + b"(" + get(2) + b"K\x00" + get(0) + get(0) + b"tR"
        p += b"us."
        with zipfile.ZipFile(t / "shapes.pt", "w", zipfile.ZIP_STORED) as z:
            z.writestr("archive/data.pkl", p)
            z.writestr("archive/data/0", b"\0" * 4)
        must_fail(genslm, t / "shapes.pt", t / "o_shapes", ["k0", "at most 8"], ["--config", CONFIG_25M])
        # Two million nested tuples (a 2 MB pickle): a clear refusal, not a stack overflow.
        with zipfile.ZipFile(t / "nested.pt", "w", zipfile.ZIP_STORED) as z:
            z.writestr("archive/data.pkl", b"\x80\x02)" + b"\x85" * 2_000_000 + b".")
        must_fail(genslm, t / "nested.pt", t / "o7", ["nested.pt", "holds a tuple, not a checkpoint"], ["--config", CONFIG_25M])
        torch.save(argparse.Namespace(x=1), t / "plain_object.pt")
        must_fail(genslm, t / "plain_object.pt", t / "o3", ["argparse.Namespace", "not a checkpoint"], ["--config", CONFIG_25M])
        data = (t / "patric_25m_bias_removed.pt").read_bytes()
        (t / "truncated.pt").write_bytes(data[: len(data) // 2])
        must_fail(genslm, t / "truncated.pt", t / "o4", ["truncated.pt"], ["--config", CONFIG_25M])
        must_fail(genslm, t / "patric_25m_bias_removed.pt", t / "o5", ["--config"])
    print("check_convert: GenSLM-layout checkpoints convert faithfully; bad inputs are refused")


if __name__ == "__main__":
    main()
