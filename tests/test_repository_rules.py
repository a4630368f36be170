"""Rules the whole repository keeps: it stands alone (no link, comment or doc points outside it),
and no unit test asserts a wall-clock time (speed is measured in bench/, on a named machine)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# a path out of the repository, the founders' design notes, or an issue number in place of a reason
# (built from pieces so this line does not match itself)
OUTSIDE = re.compile("|".join([r"\.\./" + "shared", "shared/" + "DESIGN", "DESIGN" + r"\.md", "[Ii]" + r"ssue #?[0-9]+"]))
# an assert that compares a measured duration
WALL_CLOCK = re.compile(r"assert\b.*(perf_counter|time\.time\(|monotonic\(|elapsed|seconds?\b).*[<>]"
                        r"|assert\b.*[<>].*(perf_counter|time\.time\(|monotonic\(|elapsed)")


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


def test_no_test_asserts_a_wall_clock_time():
    hits = []
    for path in _tracked("tests/*.py", "tests/**/*.py"):
        if path == Path(__file__).resolve():
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if WALL_CLOCK.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "speed belongs in bench/:\n" + "\n".join(hits)
