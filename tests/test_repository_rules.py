"""Rules the whole repository keeps: it stands alone (no link, comment or doc points outside it),
and no unit test asserts a wall-clock time (speed is measured in bench/, on a named machine)."""
from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# a path out of the repository, the founders' design notes, or an issue number in place of a reason
# (built from pieces so this line does not match itself)
OUTSIDE = re.compile("|".join([r"\.\./" + "shared", "shared/" + "DESIGN", "DESIGN" + r"\.md", "[Ii]" + r"ssue #?[0-9]+"]))
TIMERS = ("time", "timeit")                  # the modules whose clocks a test must not assert on


def _tracked(*patterns: str) -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / p for p in out.splitlines() if (ROOT / p).is_file()]


def test_nothing_points_outside_the_repository():
    hits = []
    for path in _tracked():
        if path.suffix in (".png", ".so", ".safetensors") or path == Path(__file__).resolve():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not hits, "say the reason or point to docs/design.md instead:\n" + "\n".join(hits)


def test_design_doc_is_in_the_repository():
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    for part in ("csrc/", "ops/", "nn/", "rl/", "train/", "fused_logprob", "policy_loss", "nf4_linear",
                 "metrics.jsonl"):
        assert part in text, part


class _Timing:
    """Which asserts of one test file depend on a clock reading (an AST walk, no import).

    A value is timed when it comes from a call of the `time` or `timeit` module's clocks
    (time.perf_counter(), process_time(), monotonic(), time(), their _ns forms, timeit.timeit...,
    also imported by name), or from an expression that reads a timed value: a name assigned from
    one (also through `+=`, a subscript or a tuple), or a call of a function of the file that
    returns one. Names are followed per top-level function (nested functions share it), to a
    fixed point, so a helper that measures and returns (planned, measured) taints its callers'
    asserts. An assert whose test reads a timed value is a timing assertion, whatever it compares
    it with. A hypothesis `deadline=` other than None is one too (a wall-clock bound per example).
    """

    def __init__(self, source: str):
        self.tree = ast.parse(source)
        self.clock_names = {a.asname or a.name for n in ast.walk(self.tree) if isinstance(n, ast.ImportFrom)
                            and n.module in TIMERS for a in n.names}
        self.timed_functions: set[str] = set()
        self.scopes = [n for n in self.tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                   ast.ClassDef))] + [self.tree]
        self.timed: dict[int, set[str]] = {id(s): set() for s in self.scopes}
        changed = True
        while changed:
            changed = any([self._propagate(scope) for scope in self.scopes])

    def _nodes(self, scope):
        if scope is self.tree:          # module level: what is not inside a function or class
            return [n for stmt in scope.body if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                        ast.ClassDef)) for n in ast.walk(stmt)]
        return list(ast.walk(scope))

    def _is_clock(self, call: ast.Call) -> bool:
        f = call.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in TIMERS:
            return f.attr not in ("sleep", "strftime", "gmtime", "localtime", "strptime", "ctime", "asctime")
        return isinstance(f, ast.Name) and (f.id in self.clock_names or f.id in self.timed_functions)

    def reads_timed(self, expr, scope) -> bool:
        for n in ast.walk(expr):
            if isinstance(n, ast.Call) and self._is_clock(n):
                return True
            if isinstance(n, ast.Name) and n.id in self.timed[id(scope)]:
                return True
        return False

    @staticmethod
    def _targets(node) -> list[str]:
        out = []
        for t in ast.walk(node):
            if isinstance(t, ast.Name):
                out.append(t.id)
        return out

    def _propagate(self, scope) -> bool:
        timed, before = self.timed[id(scope)], (len(self.timed[id(scope)]), len(self.timed_functions))
        for n in self._nodes(scope):
            if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and n.value is not None:
                if self.reads_timed(n.value, scope):
                    for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                        timed.update(self._targets(t))
            elif isinstance(n, (ast.For, ast.comprehension)) and self.reads_timed(n.iter, scope):
                timed.update(self._targets(n.target))
            elif isinstance(n, ast.Return) and n.value is not None and scope is not self.tree \
                    and self.reads_timed(n.value, scope) and not isinstance(scope, ast.ClassDef):
                self.timed_functions.add(scope.name)
        return (len(timed), len(self.timed_functions)) != before

    def hits(self) -> list[int]:
        """Line numbers of timing assertions."""
        lines = set()
        for scope in self.scopes:
            for n in self._nodes(scope):
                if isinstance(n, ast.Assert) and self.reads_timed(n.test, scope):
                    lines.add(n.lineno)
                elif isinstance(n, ast.keyword) and n.arg == "deadline" and not (
                        isinstance(n.value, ast.Constant) and n.value.value is None):
                    lines.add(n.value.lineno)
        return sorted(lines)


def _timing_hits(source: str) -> list[int]:
    return _Timing(source).hits()


def test_the_timing_check_catches_what_it_is_for():
    """The check itself can fail: each of these is flagged, and none of the allowed uses is."""
    flagged = {
        "elapsed": "import time\ndef test_a():\n    t = time.perf_counter()\n    work()\n"
                   "    elapsed = time.perf_counter() - t\n    assert elapsed < 1.0\n",
        "inline": "import time\ndef test_a():\n    t0 = time.time()\n    assert time.time() - t0 <= 5\n",
        "by name": "from time import process_time as clock\ndef test_a():\n    s = clock()\n    work()\n"
                   "    assert abs(clock() - s - 0.3) < 0.1\n",
        # the shape of the old plan test: a helper sums CPU seconds in a closure and returns them
        "helper": "import time\ndef _measure(trainer):\n    cpu = {}\n    def inner():\n"
                  "        t = time.process_time()\n        cpu['x'] = cpu.get('x', 0.0) + time.process_time() - t\n"
                  "    measured = 0.0\n    for step in range(3):\n        t = time.process_time()\n"
                  "        measured += time.process_time() - t\n    planned = plan()\n    return planned, measured\n"
                  "def test_a():\n    planned, measured = _measure(1)\n    TOL = 0.3\n"
                  "    assert abs(planned - measured) <= TOL * measured, (planned, measured)\n",
        "timeit": "import timeit\ndef test_a():\n    assert timeit.timeit('x', number=3) < 0.1\n",
        "deadline": "from hypothesis import given, settings\n@settings(max_examples=5, deadline=200)\n"
                    "@given(x=1)\ndef test_a(x):\n    pass\n",
    }
    for name, src in flagged.items():
        assert _timing_hits(src), name
    allowed = (
        # a timing printed, not asserted; a deadline loop that waits for work; no hypothesis deadline
        "import time\ndef test_a():\n    t0 = time.perf_counter()\n    x = work()\n"
        "    print(f'{time.perf_counter() - t0:.1f} s')\n    assert x == 2\n"
        "def test_b():\n    end = time.monotonic() + 600\n    while not done() and time.monotonic() < end:\n"
        "        time.sleep(0.1)\n    assert done()\n"
        "@settings(deadline=None)\ndef test_c():\n    time.sleep(0)\n    assert 1 < 2\n")
    assert _timing_hits(allowed) == []


def test_no_test_asserts_a_wall_clock_time():
    """No assert in tests/ reads a clock (speed and plan accuracy in time live in bench/)."""
    hits = []
    for path in _tracked("tests/*.py", "tests/**/*.py"):
        if path == Path(__file__).resolve():
            continue
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        hits += [f"{path.relative_to(ROOT)}:{n}: {lines[n - 1].strip()}" for n in _timing_hits(text)]
    assert not hits, "speed belongs in bench/:\n" + "\n".join(hits)


def test_hypothesis_examples_have_no_deadline():
    """The suite's hypothesis profile turns its 200 ms default deadline off."""
    from hypothesis import settings

    assert settings.default.deadline is None


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation but '-' and '_' dropped,
    spaces to '-' (code spans and links keep their text)."""
    out = set()
    for line in markdown.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_links_in_the_readme_and_docs_resolve():
    """Every relative link and image of README.md and docs/*.md names a file of the repository, and
    a #fragment names a heading of the page it points to."""
    bad = []
    for page in _tracked("README.md", "docs/*.md"):
        text = page.read_text(encoding="utf-8")
        for m in LINK.finditer(text):
            target = m.group(1) or m.group(2)
            if re.match(r"[a-z]+:", target):             # http(s):, mailto: ...
                continue
            path, _, fragment = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.relative_to(ROOT)}: {target}")
            elif fragment and dest.suffix == ".md" and fragment not in _anchors(dest.read_text(encoding="utf-8")):
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not bad, "\n".join(bad)
