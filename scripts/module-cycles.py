#!/usr/bin/env python3
"""Finds import cycles between sibling modules inside every folder of src/.

Within one folder (say src/sandbox/docker/), each file and each sub-folder is a node; an edge
A -> B means code of A (any file under it, unit tests excluded) names a path under B
(`crate::…`, `super::…`, `self::…`, in `use` trees or inline). The folder's own `mod.rs` (or the
`<folder>.rs` beside it) is the parent, not a sibling: children using their parent's items is the
normal direction. Prints every cycle; exit 1 when there is one.

Usage: scripts/module-cycles.py [REPO_ROOT]
"""
import os
import re
import sys

root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else ".")
src = os.path.join(root, "src")


def module_path(path):
    """`src/sandbox/docker/container.rs` -> ["sandbox", "docker", "container"]."""
    rel = os.path.relpath(path, src)[:-3].split(os.sep)
    if rel[-1] == "mod":
        rel = rel[:-1]
    if rel in (["lib"], ["main"]):
        return []
    return rel


def is_module(parts):
    base = os.path.join(src, *parts) if parts else src
    return os.path.isfile(base + ".rs") or os.path.isfile(os.path.join(base, "mod.rs"))


def resolve(here, segments):
    """The longest module prefix of a path written in module `here`, or None."""
    if not segments:
        return None
    head, rest = segments[0], segments[1:]
    if head == "crate":
        base = []
    elif head == "self":
        base = list(here)
    elif head == "super":
        base = list(here)
        while rest and rest[0] == "super":
            base, rest = base[:-1], rest[1:]
        base = base[:-1]
    else:
        return None
    parts = list(base)
    for seg in rest:
        if is_module(parts + [seg]):
            parts.append(seg)
        else:
            break
    return parts


def expand_use(tree):
    """`a::{b::C, d}` -> [["a","b","C"], ["a","d"]] (whitespace removed)."""
    tree = re.sub(r"\s+", "", tree)
    tree = re.sub(r"\bas\w+", "", tree)

    def split_top(s):
        depth, cur, out = 0, "", []
        for ch in s:
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            if ch == "," and depth == 0:
                out.append(cur)
                cur = ""
            else:
                cur += ch
        if cur:
            out.append(cur)
        return out

    def go(prefix, s):
        i = s.find("{")
        if i < 0:
            return [prefix + [p for p in s.split("::") if p]]
        head = [p for p in s[:i].split("::") if p]
        inner = s[i + 1 : s.rfind("}")]
        res = []
        for part in split_top(inner):
            res.extend(go(prefix + head, part))
        return res

    return go([], tree)


def references(path):
    text = open(path, encoding="utf-8", errors="replace").read()
    text = re.sub(r"#\[cfg\(test\)\]\s*mod\s+tests\s*\{.*", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    here = module_path(path)
    refs = []
    for m in re.finditer(r"\buse\s+([^;]+);", text):
        for p in expand_use(m.group(1)):
            refs.append(p)
    for m in re.finditer(r"\b((?:crate|super|self)(?:::[A-Za-z_][A-Za-z0-9_]*)+)", text):
        refs.append(m.group(1).split("::"))
    out = set()
    for r in refs:
        t = resolve(here, r)
        if t is not None:
            out.add(tuple(t))
    return here, out


files = []
for dp, _, fs in os.walk(src):
    for f in fs:
        if f.endswith(".rs"):
            files.append(os.path.join(dp, f))

# edges[folder][a] = {b}: sibling a (file stem or sub-folder) of `folder` uses sibling b.
edges = {}
for f in files:
    here, targets = references(f)
    for t in targets:
        # The deepest common folder of `here` and `t`, and the two children of it on each side.
        n = 0
        while n < min(len(here), len(t)) and here[n] == t[n]:
            n += 1
        if n >= len(here) or n >= len(t):
            continue  # one is an ancestor of the other (parent/child): not siblings
        folder = tuple(here[:n])
        a, b = here[n], t[n]
        if a != b:
            edges.setdefault(folder, {}).setdefault(a, set()).add(b)

cycles = []
for folder, g in sorted(edges.items()):
    seen = set()

    def dfs(node, stack):
        for nxt in sorted(g.get(node, ())):
            if nxt in stack:
                c = stack[stack.index(nxt):]
                key = frozenset(c)
                if key not in seen:
                    seen.add(key)
                    cycles.append(("/".join(("src",) + folder), c + [nxt]))
            elif len(stack) < 12:
                dfs(nxt, stack + [nxt])

    for start in sorted(g):
        dfs(start, [start])

for folder, c in cycles:
    print(f"cycle in {folder}/: {' -> '.join(c)}")
if cycles:
    sys.exit(1)
print(f"no cycles between sibling modules in {sum(1 for _ in edges)} folders of src/")
