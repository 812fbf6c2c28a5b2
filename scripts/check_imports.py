#!/usr/bin/env python3
"""File-level import graph of src/, and the layer rules genslm's architecture rests on.

Fails on
- a cycle between files;
- src/ops importing anything of the crate but src/ops, src/error and src/isa (ops know
  tensors, not models: burn, genslm-kernels, error types and the SIMD tier only);
- src/model importing src/parallel, src/train, src/plan, src/infer, src/cli or src/bench (the
  model stays plain; parallelism is applied from outside);
- a module beside every layer (config, data, tokenizer, backend, atomic, launch, ...: BESIDE)
  importing any of those layers or the model (every layer uses them, so they use none of it).

A file imports another when it names a module path of it: `use crate::a::b` (braced groups
included), `crate::a::b::x` inline, `super::b` / `self::b` (resolved against the file's own
module). A name that a module file re-exports (`pub use child::Name;`) resolves to the file that
defines it, so `crate::model::GenSlm` is an edge to model/neox.rs, not to model/mod.rs; the
re-export itself and `mod child;` are not edges. Test modules (`#[cfg(test)] mod tests { .. }`)
may import anything.

Usage: python3 scripts/check_imports.py [SRC_DIR]; python3 scripts/check_imports.py --self-test
plants a `use crate::model` in src/ops, a `super::` cycle, a model -> train import and a
config -> parallel import, each in a copy of src/, and fails unless every one is caught (both run
by scripts/test.sh).
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Layers below which a module may not reach: module prefix -> what it may import (None = any
# crate module except those in FORBIDDEN).
ALLOWED = {("ops",): {("ops",), ("error",), ("isa",)}}
UPPER = {("model",), ("parallel",), ("train",), ("plan",), ("infer",), ("cli",), ("bench",)}
# The modules beside every layer (settings, data, errors, files, devices, the process's
# environment): every layer may use them, so they use none of the layers above ops.
BESIDE = ["config", "error", "isa", "data", "tokenizer", "rng", "backend", "cuda_toolkit",
          "atomic", "atomic_dir", "run_lock", "progress", "checksum", "alloc", "launch", "host_memory", "pca"]
FORBIDDEN = {
    ("model",): {("parallel",), ("train",), ("plan",), ("infer",), ("cli",), ("bench",)},
    **{(b,): UPPER for b in BESIDE},
}


def module_of(src, path):
    rel = path.relative_to(src).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] in ("mod", "lib", "main"):
        parts = parts[:-1]
    return tuple(parts)


def strip(text):
    """The file's code without comments, string literals and its test module."""
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', text)
    text = re.sub(r"'(?:\\.|[^'\\])'", "' '", text)
    # Test modules: `#[cfg(test)] mod name { ... }`, cut out by matching braces.
    while True:
        m = re.search(r"#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+\w+\s*\{", text)
        if not m:
            return text
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        text = text[: m.start()] + text[i:]


def expand_tree(tree):
    """`a::{b, c::{d, e as f}}` -> [[a, b], [a, c, d], [a, c, e]] (self kept as a segment)."""
    tree = re.sub(r"\s+as\s+\w+", "", tree)  # a rename names the same item
    tree = re.sub(r"\s+", "", tree)
    out = []

    def walk(prefix, t):
        depth, start, parts = 0, 0, []
        for i, ch in enumerate(t):
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            elif ch == "," and depth == 0:
                parts.append(t[start:i])
                start = i + 1
        parts.append(t[start:])
        for p in parts:
            if not p:
                continue
            if "{" in p:
                head = p[: p.index("{")].rstrip(":")
                inner = p[p.index("{") + 1 : p.rindex("}")]
                walk(prefix + [s for s in head.split("::") if s], inner)
            else:
                segs = [s for s in p.split("::") if s]
                if segs and segs[-1] == "self":
                    segs = segs[:-1]
                out.append(prefix + segs)

    walk([], tree)
    return out


def absolute(mod, segs):
    """A path as seen from module `mod` -> segments from the crate root, or None if external."""
    if not segs:
        return None
    if segs[0] == "crate":
        return segs[1:]
    if segs[0] in ("super", "self"):
        base = list(mod)
        while segs and segs[0] in ("super", "self"):
            if segs[0] == "super":
                base = base[:-1]
            segs = segs[1:]
        return base + segs
    return None


class Crate:
    def __init__(self, src):
        self.src = src
        self.files = {module_of(src, p): p for p in src.rglob("*.rs")}
        self.code = {m: strip(p.read_text()) for m, p in self.files.items()}
        # Re-exports: (module, name) -> absolute path of the thing re-exported.
        self.reexports = {}
        for m, text in self.code.items():
            for tree in re.findall(r"\bpub(?:\([^)]*\))?\s+use\s+([^;]+);", text):
                for segs in expand_tree(tree):
                    # `pub use child::X` in a module file names its child relative to itself.
                    full = absolute(m, segs) or (list(m) + segs if tuple(m) + (segs[0],) in self.files else None)
                    if full:
                        self.reexports[(m, segs[-1])] = full

    def resolve(self, segs, seen=0):
        """The file module an absolute path lands in (through re-exports)."""
        cur = ()
        for i, s in enumerate(segs):
            nxt = cur + (s,)
            if nxt in self.files:
                cur = nxt
                continue
            target = self.reexports.get((cur, s))
            if target is not None and seen < 8:
                return self.resolve(list(target) + list(segs[i + 1 :]), seen + 1)
            break
        return cur

    def edges(self):
        out = {m: set() for m in self.files}
        for m, text in self.code.items():
            if m[-1:] == ("tests",):
                continue  # a test module in a file of its own
            paths = []
            # `use` statements (re-exports excluded: they are aliases, resolved by `resolve`).
            for vis, tree in re.findall(r"\b(pub(?:\([^)]*\))?\s+)?use\s+([^;]+);", text):
                if vis:
                    continue
                paths += [absolute(m, segs) for segs in expand_tree(tree)]
            body = re.sub(r"\buse\s+[^;]+;", "", text)
            for p in re.findall(r"\b((?:crate|super|self)(?:::\w+)+)", body):
                paths.append(absolute(m, p.split("::")))
            for full in paths:
                if not full:
                    continue
                t = self.resolve(full)
                if t and t != m:
                    out[m].add(t)
        return out


def cycles(g):
    index, low, stack, on, comps, i = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = i[0]
        i[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(g):
        if v not in index:
            strong(v)
    return comps


def name(m):
    return "src/" + "/".join(m) if m else "src/lib.rs"


def problems(src):
    crate = Crate(src)
    g = crate.edges()
    bad = []
    for comp in cycles(g):
        bad.append("import cycle: " + " <-> ".join(name(c) for c in comp))
    for m, ts in sorted(g.items()):
        for t in sorted(ts):
            for layer, allowed in ALLOWED.items():
                if m[: len(layer)] == layer and not any(t[: len(a)] == a for a in allowed):
                    bad.append(f"{name(m)} imports {name(t)} (src/{'/'.join(layer)} may import "
                               f"only {', '.join(name(a) for a in sorted(allowed))})")
            for layer, forbidden in FORBIDDEN.items():
                if m[: len(layer)] == layer and any(t[: len(f)] == f for f in forbidden):
                    bad.append(f"{name(m)} imports {name(t)} (src/{'/'.join(layer)} stays below it)")
    return g, bad


# The self-test's plants: (file, line appended, a fragment the error must contain).
PLANTS = [
    ("ops/gelu.rs", "use crate::model::GenSlm;", "src/ops/gelu imports src/model/neox"),
    ("ops/attention/options.rs", "use super::naive::naive_attention;",
     "import cycle: src/ops/attention/naive <-> src/ops/attention/options"),
    ("model/position.rs", "fn _planted() { let _ = crate::train::optim::AdamW::new; }",
     "src/model/position imports src/train/optim"),
    ("config/mod.rs", "use crate::parallel::pipeline::schedule::Schedule;",
     "src/config imports src/parallel/pipeline/schedule"),
]


def self_test():
    """Each plant, alone in a copy of src/, must make the check fail with its error."""
    import shutil
    import tempfile

    failed = False
    for rel, line, want in PLANTS:
        with tempfile.TemporaryDirectory() as tmp:
            src = pathlib.Path(tmp) / "src"
            shutil.copytree(ROOT / "src", src)
            with open(src / rel, "a") as f:
                f.write("\n" + line + "\n")
            _, bad = problems(src)
        hit = [b for b in bad if want in b]
        print(f"planted `{line}` in src/{rel}: " + ("; ".join(hit) if hit else "NOT CAUGHT"))
        failed |= not hit
    if failed:
        sys.exit(1)
    print("check_imports self-test: every planted violation caught")


def main():
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    src = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "src"
    g, bad = problems(src)
    for b in bad:
        print("error:", b)
    if bad:
        sys.exit(1)
    n = sum(len(v) for v in g.values())
    print(f"check_imports: {len(g)} files, {n} file imports; 0 cycles; ops imports only ops/error/isa; "
          f"model imports no parallel/train/plan/infer/cli/bench; {len(BESIDE)} modules beside "
          f"the layers import none of them")


if __name__ == "__main__":
    main()
