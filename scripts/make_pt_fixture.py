#!/usr/bin/env python3
"""Writes tests/fixtures/torch_views.pt with torch.save: tensors of every float dtype, views
(a transpose, a row at an offset, a strided slice) that share one storage, a 0-d tensor, and
non-tensor objects outside the state dict — what src/convert/torch.rs must read. The Rust test
(`convert::torch::tests`) checks the values against the formulas below.

Usage: python3 scripts/make_pt_fixture.py
"""
import argparse
import collections
import pathlib

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent

a = torch.arange(12, dtype=torch.float32).reshape(3, 4)  # a[i, j] = 4i + j
sd = collections.OrderedDict()
sd["model.a"] = a
sd["model.a_t"] = a.t()  # non-contiguous: [j, i] = 4i + j
sd["model.row"] = a[1]  # offset 4 into the same storage: 4 + j
sd["model.every_other"] = a[:, ::2]  # strides (4, 2): 4i + 2j
sd["model.half"] = torch.arange(5, dtype=torch.float16) * 0.5
sd["model.bf16"] = torch.arange(5, dtype=torch.bfloat16) - 2
sd["model.double"] = torch.arange(4, dtype=torch.float64) / 8
sd["model.long"] = torch.arange(3, dtype=torch.int64) * 1000
sd["model.mask"] = torch.tril(torch.ones(2, 2, dtype=torch.bool))
sd["model.scalar"] = torch.tensor(-3.25)
ckpt = {
    "epoch": 1,
    "global_step": 10,
    "pytorch-lightning_version": "1.6.5",
    "state_dict": sd,
    "hyper_parameters": {"cfg": argparse.Namespace(lr=5e-5, name="x"), "path": pathlib.PurePosixPath("/x")},
    "optimizer_states": [{"state": {}, "param_groups": [{"lr": 5e-5, "params": [0, 1]}]}],
}
torch.save(ckpt, ROOT / "tests" / "fixtures" / "torch_views.pt")
