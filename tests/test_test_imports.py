"""The tests share their helpers through one package, tests/support (imported as `support.…`, on pytest's
pythonpath): no file under tests/ changes the import path, and none imports another test module, a
conftest, or a script of bench/ (by an import or by its file's path)."""
import ast
import re
from pathlib import Path

TESTS = Path(__file__).parent
# sys.path changed in place (insert, append, extend, remove, a slice or item set), or pytest's per-test prepend
PATH_CHANGE = re.compile(r"sys\.path\s*(\.\s*(insert|append|extend|remove)\s*\(|\[[^\]]*\]\s*=|\s*[+]?=[^=])"
                         r"|syspath_prepend\s*\(")
BENCH_MODULES = {p.stem for p in (TESTS.parent / "bench").glob("*.py")} | {"bench"}
# loading a module from a file's path (how a test would reach a script of bench/ without an import)
BY_PATH = ("spec_from_file_location", "SourceFileLoader", "run_path")


def violations(source: str) -> list[str]:
    """What in a test file's source breaks the rule above, one line each."""
    out = [f"line {source.count(chr(10), 0, m.start()) + 1}: changes the import path ({m.group(0).strip()})"
           for m in PATH_CHANGE.finditer(source)]
    tree = ast.parse(source)
    loads_by_path = any((n.attr if isinstance(n, ast.Attribute) else n.id) in BY_PATH
                        for n in ast.walk(tree) if isinstance(n, (ast.Attribute, ast.Name)))
    if loads_by_path:
        out += [f"line {n.lineno}: loads a file of bench/ by its path ({n.value!r})" for n in ast.walk(tree)
                if isinstance(n, ast.Constant) and isinstance(n.value, str)
                and (n.value == "bench" or n.value.startswith("bench/"))]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = ["." * node.level + (node.module or "")]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if name.startswith("."):
                out.append(f"line {node.lineno}: relative import {name!r}")
            elif top.startswith("test_") or top == "conftest" or name.split(".")[-1].startswith("test_"):
                out.append(f"line {node.lineno}: imports the test module {name!r}")
            elif top in BENCH_MODULES:
                out.append(f"line {node.lineno}: imports {name!r} from bench/")
    return out


def test_no_test_file_changes_the_path_or_imports_another_test_module():
    bad = {}
    for path in sorted(TESTS.rglob("*.py")):
        if path == Path(__file__) or "__pycache__" in path.parts:
            continue
        found = violations(path.read_text())
        if found:
            bad[str(path.relative_to(TESTS))] = found
    assert not bad, bad


def test_the_import_check_catches_what_it_is_for():
    planted = {
        "insert": "import sys\nsys.path.insert(0, 'tests/train')\n",
        "append": "import sys\nsys.path.append('x')\n",
        "slice": "import sys\nsys.path[:0] = ['x']\n",
        "in a child's code": "CODE = '''\nimport sys\nsys.path.insert(0, {here!r})\n'''\n",
        "prepend": "def f(monkeypatch):\n    monkeypatch.syspath_prepend('x')\n",
        "test module": "from test_stream_load import TOL\n",
        "test module in a package": "from plan.test_planned_time import _fake_rates\n",
        "conftest": "def f():\n    from conftest import make_tiny_recipe\n",
        "bench": "from harness import RESULTS\n",
        "bench by path": ("import importlib.util\nspec = importlib.util.spec_from_file_location('s', ROOT / 'bench' / "
                          "'soak.py')\n"),
        "bench by run_path": "import runpy\nsoak = runpy.run_path('bench/soak.py')\n",
    }
    for what, source in planted.items():
        assert violations(source), what
    allowed = ("import os, sys\nenv = {'PYTHONPATH': os.pathsep.join(sys.path)}\n"
               "from support.tiny_world import tiny_policy\nfrom cuda_emu.emulator import emu\n"
               "from fasttrain.train.run_files import read_jsonl\nif sys.path == []:\n    pass\n"
               "spec = importlib.util.spec_from_file_location('tools_here', tmp / 'tools.py')\n")
    assert violations(allowed) == []
