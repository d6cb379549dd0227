"""Static import graph of deepinfer_fn/, custom_calls/ and shardings/: no cycles, no private names.

Every `import` and `from ... import` in a module counts, at any depth (inside functions too:
an import moved into a function hides a cycle, it does not remove it); relative imports are
resolved. An edge goes to the module that the import names (`from a import b` -> `a.b` when
that is a module, else `a`); a package's `__init__` is a module of its own, and importing a
submodule adds no edge to its parent package.

Private names: `from m import _x` and `m._x` (an attribute of a name bound to an imported
module) are refused, where `_x` is not a dunder. A private submodule (`pkg._common`) may be
imported by the modules of its own package.

A package's `__init__` runs before any of its modules, so a cycle through package inits can
still break an import that enters through another package (`import shardings` runs
shardings/__init__ -> shardings.mesh -> deepinfer_fn/__init__ -> ... -> `from shardings.mesh
import x` on a half-initialised module). `test_every_entry_point_imports` imports each module
outside deepinfer_fn first, in a fresh set of modules, to catch those.

Exceptions go in the allow-lists below, each with a comment saying why and what removes it;
they are meant to end up empty (a stale entry fails the test too).
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Iterable, Mapping

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("deepinfer_fn", "custom_calls", "shardings")

# (importer, imported) edges left out of the cycle check: none.
ALLOWED_EDGES: dict[tuple[str, str], str] = {}

# (importer, "module._name") private imports allowed.
ALLOWED_PRIVATE: dict[tuple[str, str], str] = {}


# ---- building the graph ---------------------------------------------------------------------


def module_files(root: pathlib.Path, packages: Iterable[str]) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every .py file under the packages."""
    out = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _is_package(name: str, files: Mapping[str, pathlib.Path]) -> bool:
    return files[name].name == "__init__.py"


def _resolve_from(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute module of `from <level dots><target> import ...` inside `module`."""
    if level == 0:
        return target or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _known_prefix(name: str, known) -> str | None:
    """The longest dotted prefix of `name` that is a known module."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        cand = ".".join(parts[:n])
        if cand in known:
            return cand
    return None


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _may_import_private(importer: str, private_module: str) -> bool:
    """A private module `a.b._c` is open to the modules of package `a.b`."""
    parent = private_module.rsplit(".", 1)[0]
    return importer == parent or importer.startswith(parent + ".")


def _private_segment(importer: str, module: str) -> str | None:
    """The first private segment of `module`'s path that `importer` may not use, as a dotted
    prefix (e.g. 'custom_calls._common'), else None."""
    parts = module.split(".")
    for n in range(1, len(parts) + 1):
        if _private(parts[n - 1]) and not _may_import_private(importer, ".".join(parts[:n])):
            return ".".join(parts[:n])
    return None


def analyse(module: str, source: str, known, is_package: bool = False):
    """(imported modules set, private uses [(line, 'module._name')]) of one module's source.

    `known`: the set of dotted module names that count (internal modules)."""
    tree = ast.parse(source)
    edges: set[str] = set()
    private: list[tuple[int, str]] = []
    bound: dict[str, str] = {}      # local name -> internal module it is bound to

    def note_module(line, target):
        seg = _private_segment(module, target)
        if seg is not None:
            private.append((line, seg))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                hit = _known_prefix(alias.name, known)
                if hit is None:
                    continue
                edges.add(hit)
                note_module(node.lineno, hit)
                if alias.asname:
                    bound[alias.asname] = hit
                else:   # `import a.b.c` binds `a`; attribute chains are resolved below
                    top = alias.name.split(".")[0]
                    if top in known:
                        bound.setdefault(top, top)
        elif isinstance(node, ast.ImportFrom):
            src = _resolve_from(module, is_package, node.level, node.module)
            base = _known_prefix(src, known)
            if base is None:
                continue
            for alias in node.names:
                full = f"{src}.{alias.name}"
                if full in known:        # a submodule
                    edges.add(full)
                    note_module(node.lineno, full)
                    bound[alias.asname or alias.name] = full
                    continue
                edges.add(base)
                note_module(node.lineno, base)
                if _private(alias.name) and base == src:
                    private.append((node.lineno, f"{src}.{alias.name}"))
    # attribute access on names bound to modules: m._x, a.b._x
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain, cur = [node.attr], node.value
        while isinstance(cur, ast.Attribute):
            chain.append(cur.attr)
            cur = cur.value
        if not isinstance(cur, ast.Name) or cur.id not in bound:
            continue
        chain.reverse()                     # attributes after the bound name, outermost last
        mod = bound[cur.id]
        for i, attr in enumerate(chain):
            sub = f"{mod}.{attr}"
            if sub in known:
                mod = sub
                continue
            if i == len(chain) - 1 and _private(attr):
                private.append((node.lineno, f"{mod}.{attr}"))
            break
    edges.discard(module)
    return edges, private


def import_graph(root: pathlib.Path = ROOT, packages: Iterable[str] = PACKAGES):
    """(graph {module: set of modules it imports}, private uses {module: [(line, name)]})."""
    files = module_files(root, packages)
    known = set(files)
    graph, private = {}, {}
    for name, path in files.items():
        graph[name], private[name] = analyse(name, path.read_text(), known,
                                             _is_package(name, files))
    return graph, private


def find_cycle(graph: Mapping[str, Iterable[str]]) -> list[str] | None:
    """One cycle of the directed graph as a path [a, b, ..., a], or None."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = {n: WHITE for n in graph}
    for start in sorted(graph):
        if color[start] != WHITE:
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        color[start] = GREY
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                color[node] = BLACK
                stack.pop()
                path.pop()
                continue
            if nxt not in color:
                continue
            if color[nxt] == GREY:
                return path[path.index(nxt):] + [nxt]
            if color[nxt] == WHITE:
                color[nxt] = GREY
                stack.append((nxt, iter(sorted(graph[nxt]))))
                path.append(nxt)
    return None


# ---- the checks on this repository -------------------------------------------------------------


def test_no_import_cycles():
    graph, _ = import_graph()
    assert "deepinfer_fn.kernels" in graph and "shardings.moe" in graph   # the walk found them
    stale = [e for e in ALLOWED_EDGES if e[1] not in graph.get(e[0], ())]
    assert not stale, f"allow-listed edges that no longer exist (remove them): {stale}"
    pruned = {m: {d for d in deps if (m, d) not in ALLOWED_EDGES} for m, deps in graph.items()}
    cycle = find_cycle(pruned)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_private_imports():
    _, private = import_graph()
    found = {(m, name): line for m, uses in private.items() for line, name in uses}
    stale = [e for e in ALLOWED_PRIVATE if e not in found]
    assert not stale, f"allow-listed private imports that no longer exist (remove them): {stale}"
    bad = sorted(f"{m}:{line} uses {name}" for (m, name), line in found.items()
                 if (m, name) not in ALLOWED_PRIVATE)
    assert not bad, "private names of other modules imported:\n" + "\n".join(bad)


ENTRY_SCRIPT = """
import importlib, json, sys
import jax  # noqa: F401  third-party modules stay loaded between entries
failed = {}
for name in sys.argv[1:]:
    for k in [k for k in sys.modules if k.split(".")[0] in %r]:
        del sys.modules[k]
    try:
        importlib.import_module(name)
    except Exception as e:  # noqa: BLE001
        failed[name] = f"{type(e).__name__}: {e}"
print(json.dumps(failed))
""" % (PACKAGES,)


def test_every_entry_point_imports():
    """Each module outside deepinfer_fn (and deepinfer_fn itself) imports as the first module
    of a process (our modules are dropped from sys.modules between entries)."""
    entries = ["deepinfer_fn"] + sorted(m for m in module_files(ROOT, PACKAGES)
                                        if not m.startswith("deepinfer_fn"))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", ENTRY_SCRIPT, *entries], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    failed = json.loads(out.stdout.strip().splitlines()[-1])
    assert not failed, "imports that fail when they come first:\n" + "\n".join(
        f"{k}: {v}" for k, v in failed.items())


# ---- the checker itself ------------------------------------------------------------------------


def test_find_cycle_on_synthetic_graphs():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"b2"}, "b2": {"b"}}) == ["b", "b2", "b"]
    # a diamond is no cycle; edges to modules outside the graph are ignored
    assert find_cycle({"a": {"b", "c"}, "b": {"d"}, "c": {"d"}, "d": {"numpy"}}) is None


def test_analyse_resolves_imports_inside_functions_and_relative():
    known = {"p", "p.a", "p.b", "p.sub", "p.sub.c", "q"}
    src = ("import numpy\n"
           "from . import b\n"
           "from .sub import c as cc\n"
           "def f():\n"
           "    import q\n"
           "    from p.sub.c import thing\n")
    edges, private = analyse("p.a", src, known)
    assert edges == {"p.b", "p.sub.c", "q"} and private == []
    edges, _ = analyse("p.sub", "from .. import a\nfrom . import c\n", known, is_package=True)
    assert edges == {"p.a", "p.sub.c"}
    edges, _ = analyse("p.sub.c", "from ..b import x\n", known)
    assert edges == {"p.b"}


def test_cycle_through_function_level_imports_is_found(tmp_path):
    for name, text in {"pkg/__init__.py": "", "pkg/x.py": "from pkg import y\n",
                       "pkg/y.py": "def f():\n    from pkg.x import g\n"}.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    graph, _ = import_graph(tmp_path, ["pkg"])
    assert graph == {"pkg": set(), "pkg.x": {"pkg.y"}, "pkg.y": {"pkg.x"}}
    assert find_cycle(graph) == ["pkg.x", "pkg.y", "pkg.x"]


def test_analyse_finds_private_names():
    known = {"p", "p.a", "p.b", "p._util", "p.sub", "p.sub.c", "q", "q._impl"}
    src = ("from p.b import _hidden, public\n"
           "from p import b, sub\n"
           "import p.sub.c\n"
           "import q as qq\n"
           "def f(obj):\n"
           "    b._secret()\n"
           "    p.sub.c._deep(obj._fine)\n"
           "    qq.ok, b.__name__\n"
           "    from q._impl import thing\n"
           "    from p._util import helper\n")
    _, private = analyse("p.a", src, known)
    assert sorted(private) == [(1, "p.b._hidden"), (6, "p.b._secret"), (7, "p.sub.c._deep"),
                               (9, "q._impl")]
