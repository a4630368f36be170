"""Every CUDA kernel launched with a fixed block size declares it with __launch_bounds__, and no launch
asks for more threads than its kernel's bound. The bound tells ptxas the block size it budgets
registers for (65,536 per SM: up to 255 a thread at 256 threads, 64 at 1024), so a kernel compiled
for its block neither fails its launch for want of registers nor spills without `make ptxas`
showing it; a launch above the bound fails on the GPU ("too many resources requested for launch").
Read from the sources (csrc/cuda/*.cu and csrc/cuda/kernels/*.cuh), so it needs neither nvcc nor a
GPU; the emulator cannot see the attribute (it compiles to nothing there).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.cuda_emu
CUDA = Path(__file__).resolve().parents[2] / "csrc" / "cuda"
# Kernels whose block size is chosen at run time from the shapes (one warp per 32 columns of the
# wider head dim, 32 to 1024 threads): any bound below 1024 would make some head dims unlaunchable.
RUNTIME_BLOCK = {"forward_kernel", "backward_kernel", "decode_kernel"}
KERNEL = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\(([^)]*)\)\s+)?(\w+)\s*\(")
LAUNCH = re.compile(r"\blaunch\(\s*(\w+)(?:<[^;]*?>)?\s*,|\b(\w+)(?:<[^;<>]*>)?\s*<<<")
CONSTANT = re.compile(r"constexpr\s+int\s+(\w+)\s*=\s*([^;]+);")


def sources() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted([*CUDA.glob("*.cu"), *CUDA.glob("kernels/*.cuh")])}


def value(expr: str, constants: dict[str, str]) -> int | None:
    """An integer block size written as a product of literals and constexpr ints, else None."""
    expr = re.sub(r"^dim3\((.*)\)$", r"\1", expr.strip())
    total = 1
    for factor in expr.split("*"):
        f = factor.strip().strip("()")
        if f.isdigit():
            total *= int(f)
        elif f in constants:
            v = value(constants[f], constants)
            if v is None:
                return None
            total *= v
        else:
            return None
    return total


def first_two_arguments(text: str, start: int) -> list[str]:
    """The first two comma-separated arguments from position `start` (the grid and the block of a
    launch): commas inside parentheses belong to an argument."""
    out, depth, cur = [], 0, ""
    for ch in text[start:]:
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            out.append(cur)
            if len(out) == 2:
                break
            cur = ""
            continue
        cur += ch
    return out


def launches(text: str, kernels: set[str]):
    """(kernel, block expression) for each launch in a file. A launch may name a variable instead:
    `auto kernel = cond ? a<..> : b<..>;`, or the parameter of `auto run = [&](auto kernel) {...}`
    called as `run(a<..>)`."""
    aliases = {m.group(1): [k for k in kernels if re.search(rf"\b{k}\b", m.group(2))]
               for m in re.finditer(r"auto\s+(\w+)\s*=\s*([^;\[]+);", text)}
    for m in re.finditer(r"auto\s+(\w+)\s*=\s*\[[^\]]*\]\(auto\s+(\w+)\)", text):
        called = re.findall(rf"\b{m.group(1)}\(\s*(\w+)", text)
        aliases.setdefault(m.group(2), []).extend(k for k in called if k in kernels)
    for m in LAUNCH.finditer(text):
        name = m.group(1) or m.group(2)
        targets = [name] if name in kernels else aliases.get(name, [])
        if not targets:
            continue
        args = first_two_arguments(text, m.end())
        block = args[1] if len(args) == 2 else ""
        for t in targets:
            yield t, block


def test_every_kernel_with_a_fixed_block_declares_its_launch_bounds():
    missing, too_small, seen = [], [], 0
    for name, text in sources().items():
        constants = dict(CONSTANT.findall(text))
        bounds = {}
        for m in KERNEL.finditer(text):
            bounds[m.group(2)] = m.group(1)
            if m.group(1) is None and m.group(2) not in RUNTIME_BLOCK:
                missing.append(f"{name}: {m.group(2)}")
        for kernel, block in launches(text, set(bounds)):
            seen += 1
            threads, bound = value(block, constants), bounds[kernel]
            limit = value(bound, constants) if bound is not None else None
            if bound is not None and (threads is None or limit is None):
                too_small.append(f"{name}: {kernel}'s block {block.strip()!r} or bound {bound!r} is not a constant")
            elif threads is not None and limit is not None and threads > limit:
                too_small.append(f"{name}: {kernel} launched with {threads} threads, bound {limit}")
    assert seen >= 19, f"found only {seen} launches: the parser no longer reads the sources"
    assert not missing, "kernels launched with a fixed block size but no __launch_bounds__: " + ", ".join(missing)
    assert not too_small, "; ".join(too_small)
