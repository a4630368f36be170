"""The layers of python/fasttrain hold: every import, read with the AST (those inside functions and
under `if TYPE_CHECKING:` too, and relative ones), goes down the layer order of docs/design.md
("The layer order"), no module of the package is on an import cycle, and no
module imports another module's private name (a leading underscore).

An import is an arrow from the importing module to the module it names: `from fasttrain.ops import
reference` names the module fasttrain.ops.reference, `from fasttrain.ops import fused_logprob` the
package fasttrain.ops (its __init__), `import fasttrain.train.config as c` fasttrain.train.config.
A module's own package __init__ that Python runs first is not an arrow; an import written in a
function is one (it runs when the function does). Reading `mod._name` off an imported module
counts as importing `_name`.

Three kinds of violation, each a triple (importer, imported, kind):
- "layer": the imported module sits in a layer the importer's layer may not import (a higher one,
  or a different layer of the same rank);
- "cycle": the arrow joins two modules of one strongly connected component of the import graph
  (every arrow on some cycle, so removing the listed arrows is what breaks the cycles);
- "private": imported is "module:name", the private name read from another module.

tests/layer_allowlist.txt lists the violations the code had when this test was written.
The test fails on a violation not in it, and on an entry that is no longer violated: the list can
only shrink, down to empty.
"""
from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "python" / "fasttrain"
ALLOWLIST = Path(__file__).resolve().parent / "layer_allowlist.txt"
KINDS = ("layer", "cycle", "private")

# The layer order, bottom up: (rank, layer, the modules and packages in it). A module may import its
# own layer and any layer of a lower rank; two layers of one rank are siblings that import neither
# each other. The longest matching prefix places a module. docs/design.md states the same table.
LAYERS: tuple[tuple[int, str, tuple[str, ...]], ...] = (
    (0, "core", ("fasttrain", "fasttrain.host", "fasttrain.extras", "fasttrain.safe_json", "fasttrain._native",
                 "fasttrain._C", "fasttrain._C_cuda", "fasttrain._C_emu")),
    (1, "ops", ("fasttrain.ops",)),
    (2, "nn", ("fasttrain.nn",)),
    (3, "models", ("fasttrain.models",)),
    (4, "selftest", ("fasttrain.selftest",)),
    (5, "rl", ("fasttrain.rl",)),
    (5, "envs", ("fasttrain.envs",)),
    (6, "tasks", ("fasttrain.tasks", "fasttrain.recipes")),
    (7, "rollout", ("fasttrain.rollout",)),
    (8, "plan", ("fasttrain.plan",)),
    (9, "train", ("fasttrain.train",)),
    (10, "integrations", ("fasttrain.integrations",)),
    (10, "cli", ("fasttrain.cli", "fasttrain.__main__")),
)


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Every Python module of the package, by dotted name."""
    return {module_name(p, package): p for p in sorted(package.rglob("*.py"))}


def layer_of(module: str) -> tuple[int, str]:
    best = None
    for rank, layer, prefixes in LAYERS:
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > len(best[0])):
                best = (p, rank, layer)
    if best is None:
        raise KeyError(f"{module} is in no layer: place it in LAYERS and in docs/design.md")
    return best[1], best[2]


NATIVE = ("fasttrain._C", "fasttrain._C_cuda", "fasttrain._C_emu")     # compiled modules, no .py


def _ours(module: str) -> bool:
    return module == "fasttrain" or module.startswith("fasttrain.")


def _private(n: str) -> bool:
    return n.startswith("_") and not (n.startswith("__") and n.endswith("__"))


def arrows(name: str, source: str, is_package: bool, modules) -> tuple[set[str], set[tuple[str, str]]]:
    """(the fasttrain modules `name` imports, the (module, private name) pairs it takes from them).
    `modules`: the package's module names (to tell `from pkg import submodule` from a name)."""
    tree = ast.parse(source)
    imported: set[str] = set()
    private: set[tuple[str, str]] = set()
    aliases: dict[str, str] = {}             # a local name bound to a fasttrain module -> that module

    def base_of(node: ast.ImportFrom) -> str:
        if node.level == 0:
            return node.module or ""
        parts = name.split(".") if is_package else name.split(".")[:-1]
        parts = parts[:len(parts) - (node.level - 1)]
        return ".".join(parts + ([node.module] if node.module else []))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _ours(a.name):
                    imported.add(a.name)
                    if a.asname:
                        aliases[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom):
            base = base_of(node)
            if not _ours(base):
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in modules or sub in NATIVE:
                    imported.add(sub)
                    aliases[a.asname or a.name] = sub
                else:
                    imported.add(base)
                    if _private(a.name) and base != name:
                        private.add((base, a.name))
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str) and _ours(node.args[0].value)
              and ((isinstance(node.func, ast.Name) and node.func.id == "__import__")
                   or (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"))):
            imported.add(node.args[0].value)      # __import__("fasttrain.x"), importlib.import_module("fasttrain.x")
    for node in ast.walk(tree):              # mod._name read off a module bound by an import
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and _private(node.attr) and aliases[node.value.id] != name
                and f"{aliases[node.value.id]}.{node.attr}" not in modules):
            private.add((aliases[node.value.id], node.attr))
    imported.discard(name)
    return imported, private


def import_graph(package: Path = PACKAGE) -> tuple[dict[str, set[str]], dict[str, set[tuple[str, str]]]]:
    modules = package_modules(package)
    graph, private = {}, {}
    for name, path in modules.items():
        graph[name], private[name] = arrows(name, path.read_text(encoding="utf-8"), path.name == "__init__.py",
                                            modules)
    return graph, private


def strongly_connected(graph: dict[str, set[str]]) -> dict[str, int]:
    """Tarjan's algorithm (iterative): module -> the index of its strongly connected component."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    component: dict[str, int] = {}
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component[w] = index[v]
                        if w == v:
                            break
    return component


def violations(graph: dict[str, set[str]], private: dict[str, set[tuple[str, str]]]) -> set[tuple[str, str, str]]:
    found = set()
    for importer, targets in graph.items():
        rank, layer = layer_of(importer)
        for target in targets:
            t_rank, t_layer = layer_of(target)
            if t_layer != layer and t_rank >= rank:
                found.add((importer, target, "layer"))
    component = strongly_connected(graph)
    for importer, targets in graph.items():
        for target in targets:
            if target in component and component[target] == component[importer]:
                found.add((importer, target, "cycle"))
    for importer, pairs in private.items():
        for module, n in pairs:
            found.add((importer, f"{module}:{n}", "private"))
    return found


def read_allowlist(path: Path = ALLOWLIST) -> set[tuple[str, str, str]]:
    entries = set()
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        assert len(parts) == 3 and parts[2] in KINDS, f"{path.name}:{n}: want 'importer imported kind', got {line!r}"
        entries.add(tuple(parts))
    return entries


def check(found: set[tuple[str, str, str]], allowed: set[tuple[str, str, str]]) -> list[str]:
    """The complaints: violations not allowed, and allowed entries no longer violated."""
    return ([f"new {k} violation: {a} -> {b}" for a, b, k in sorted(found - allowed, key=lambda e: (e[2], e))]
            + [f"fixed, remove from {ALLOWLIST.name}: {a} {b} {k}" for a, b, k in sorted(allowed - found)])


def test_every_module_has_a_layer():
    unplaced = []
    for name in package_modules():
        try:
            layer_of(name)
        except KeyError:
            unplaced.append(name)
    assert not unplaced, f"place these in LAYERS and in docs/design.md's layer order: {unplaced}"


def test_layers_hold_up_to_the_allowlist():
    graph, private = import_graph()
    problems = check(violations(graph, private), read_allowlist())
    assert not problems, "\n".join(problems)


def test_the_allowlist_names_real_modules_once_each():
    lines = [ln.split("#", 1)[0].split() for ln in ALLOWLIST.read_text(encoding="utf-8").splitlines()]
    entries = [tuple(ln) for ln in lines if ln]
    assert len(entries) == len(set(entries)), [e for e, n in Counter(entries).items() if n > 1]
    modules = set(package_modules())
    for importer, imported, _ in read_allowlist():
        assert importer in modules, importer
        assert imported.split(":")[0] in modules, imported


def test_the_design_doc_places_every_module():
    """docs/design.md's layer order names each entry of LAYERS (a package as `ops/`, a module as
    `host.py`), so the doc and the test cannot drift apart unseen."""
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    section = text[text.index("### The layer order"):]
    section = section[:section.index("\n#", 1)]
    for _, _, prefixes in LAYERS:
        for p in prefixes:
            if p == "fasttrain" or p in NATIVE:
                continue
            short = p.removeprefix("fasttrain.")
            assert f"`{short}/`" in section or f"`{short}.py`" in section, f"the layer order does not place {p}"


def test_the_layer_check_catches_what_it_is_for(tmp_path):
    """A small package with one of each defect (an upward import inside a function, an import
    between sibling layers, a cycle closed by relative imports, private names taken by import and
    by attribute) gives exactly those violations, and an allowlist entry that is no longer
    violated is reported."""
    files = {
        "__init__.py": "__version__ = '0'\n",
        "ops/__init__.py": "",
        "ops/a.py": "import torch\n\ndef f():\n    from fasttrain.train import loop\n    return loop\n",
        "train/__init__.py": "",
        "train/loop.py": "from ..ops import a\nfrom . import b\n\ndef _step():\n    pass\n",
        "train/b.py": "from .loop import _step\n",
        "train/c.py": "from fasttrain import __version__\nfrom fasttrain.ops import a\nfrom fasttrain.ops.a import f\n",
        "rl/__init__.py": "",
        "rl/x.py": "import fasttrain.envs.y as y\n\ndef g():\n    return y._z()\n",
        "envs/__init__.py": "",
        "envs/y.py": "def _z():\n    return 1\n",
    }
    for rel, text in files.items():
        (tmp_path / "fasttrain" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fasttrain" / rel).write_text(text)
    graph, private = import_graph(tmp_path / "fasttrain")
    found = violations(graph, private)
    assert found == {
        ("fasttrain.ops.a", "fasttrain.train.loop", "layer"),
        ("fasttrain.rl.x", "fasttrain.envs.y", "layer"),
        ("fasttrain.ops.a", "fasttrain.train.loop", "cycle"),
        ("fasttrain.train.loop", "fasttrain.ops.a", "cycle"),
        ("fasttrain.train.loop", "fasttrain.train.b", "cycle"),
        ("fasttrain.train.b", "fasttrain.train.loop", "cycle"),
        ("fasttrain.train.b", "fasttrain.train.loop:_step", "private"),
        ("fasttrain.rl.x", "fasttrain.envs.y:_z", "private"),
    }
    assert check(found, found) == []
    stale = ("fasttrain.train.c", "fasttrain.ops.a", "layer")
    assert check(found, found | {stale}) == [
        f"fixed, remove from {ALLOWLIST.name}: fasttrain.train.c fasttrain.ops.a layer"]
    missing = ("fasttrain.rl.x", "fasttrain.envs.y", "layer")
    assert check(found, found - {missing}) == ["new layer violation: fasttrain.rl.x -> fasttrain.envs.y"]


def test_the_plan_runs_no_trainer_or_rollout_code():
    """plan/ reads shapes and stored rates: no module of it imports train/ (above it) or rollout/
    (below it, but running the rollout is the calibration's work, fasttrain.train.calibrate)."""
    graph, _ = import_graph()
    reached = sorted((m, t) for m, targets in graph.items() if m.startswith("fasttrain.plan")
                     for t in targets if t.startswith(("fasttrain.train", "fasttrain.rollout")))
    assert reached == [], reached
