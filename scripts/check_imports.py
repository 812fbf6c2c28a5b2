#!/usr/bin/env python3
"""File-level import graph of src/: fails on a cycle between files, and on src/model importing
src/parallel or src/train (the model stays plain; parallelism is applied from outside).

A file imports another when it names a module path of it: `use crate::a::b`, `crate::a::b::x`
inline, or `super::b` (resolved against the file's own module). `mod.rs`/`lib.rs` re-exports
count as edges of the module file. Usage: python3 scripts/check_imports.py (run by scripts/test.sh)
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SRC = ROOT / "src"


def module_of(path):
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] in ("mod", "lib", "main"):
        parts = parts[:-1]
    return tuple(parts)


def files():
    return {module_of(p): p for p in SRC.rglob("*.rs")}


def resolve(mods, path):
    """The longest prefix of `path` that is a file module."""
    for n in range(len(path), 0, -1):
        if tuple(path[:n]) in mods:
            return tuple(path[:n])
    return None


def edges(mods):
    out = {m: set() for m in mods}
    for m, p in mods.items():
        text = re.sub(r"//[^\n]*", "", p.read_text())
        # Test modules may import anything.
        text = text.split("#[cfg(test)]\nmod tests")[0]
        for path in re.findall(r"\bcrate((?:::\w+)+)", text):
            t = resolve(mods, path.strip(":").split("::"))
            if t and t != m and t != ():
                out[m].add(t)
        for path in re.findall(r"\bsuper((?:::\w+)+)", text):
            # `super` is the parent of this file's module, for mod.rs files as for others.
            t = resolve(mods, list(m[:-1]) + path.strip(":").split("::"))
            if t and t != m and t != ():
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
    for v in g:
        if v not in index:
            strong(v)
    return comps


# Cycles still allowed: none since issue 18 untangled model/attention <-> model/flash and
# plan/cli <-> plan/report. Any cycle or model -> parallel/train import fails.
KNOWN: set = set()


def main():
    mods = files()
    g = edges(mods)
    # Parent module files (mod.rs) only re-export their children: not part of a cycle.
    for m in list(g):
        if mods[m].name in ("mod.rs", "lib.rs"):
            g[m] = set()
    bad = []
    for comp in cycles(g):
        bad.append("import cycle: " + " <-> ".join("/".join(c) for c in comp))
    for m, ts in g.items():
        if m[:1] == ("model",):
            for t in ts:
                if t[:1] in (("parallel",), ("train",)):
                    bad.append(f"src/{'/'.join(m)}.rs imports src/{'/'.join(t)}")
    new = sorted(set(bad) - KNOWN)
    for b in new:
        print("error:", b)
    for b in sorted(KNOWN - set(bad)):
        print(f"error: '{b}' is gone: remove it from KNOWN in {pathlib.Path(__file__).name}")
    if new or KNOWN - set(bad):
        sys.exit(1)
    print(f"check_imports: {len(mods)} files; no new import cycle or model->parallel/train "
          f"import ({len(KNOWN)} known, listed in the script)")


if __name__ == "__main__":
    main()
