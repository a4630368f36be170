#!/usr/bin/env python3
"""Mutation run over the CUDA kernels on the emulator (`make test-emu-mutations`; not part of `make test`).

It answers: would some emulator test notice if this barrier, this stride or this lane mask were
wrong? Each mutant is one edit of one site in csrc/cuda/kernels/*.cuh or csrc/cuda/common.cuh:

  barrier  a __syncthreads() or __syncwarp() removed (replaced by a no-op statement)
  stride   a block-stride or grid-stride step doubled (`i += S` -> `i += 2 * (S)`)
  mask     a shuffle or ballot mask narrowed (0xffffffff -> 0x0000ffff)
  tail     on the sites listed in TAIL_SITES, a bound check loosened by one (`<` -> `<=`), run on
           the AddressSanitizer + UBSan build, since such a mutant reads or writes out of bounds

Everything happens in a copy of the sources (build/emu-mutations/src: csrc, CMakeLists.txt,
setup.py, pyproject.toml, python/fasttrain with its built modules, tests/conftest.py,
tests/support and tests/cuda_emu), never in the working tree. The copy's _C_emu is built non-unity (one object per
csrc/cuda_emu/*.cpp), so a mutant in kernels/X.cuh recompiles only cuda_emu/X.cpp and relinks;
then only that op's emulator tests run (OPS below), with -x, against the mutant module
(FASTTRAIN_EMU_LIB). Outcomes: killed (the first failing test is recorded), or survived; a
survivor is then judged by a person into TRIAGE: redundant (the site simplified in the source, with
a comment why) or unreachable at any testable shape (with the reason). A barrier is never removed
only because the emulator cannot judge it: races between blocks and the memory model are a GPU's.

Resumable: each finished mutant is a line of bench/results/emu_mutations.jsonl (its site, the line
it mutated, outcome, killer, seconds); a rerun skips those whose site and line text are unchanged.
The table bench/results/emu_mutations.md is rewritten after each mutant. Prints its cost estimate
(mutants left x the measured or assumed seconds each) before it starts.

  python tools/emu_mutations.py [--list] [--kind K ...] [--file F ...] [--limit N] [--yes]
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "build" / "emu-mutations"
SRC = WORK / "src"
RESULTS = ROOT / "bench" / "results" / "emu_mutations.jsonl"
TABLE = ROOT / "bench" / "results" / "emu_mutations.md"
KERNELS = ["csrc/cuda/common.cuh", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc/cuda/kernels").glob("*.cuh"))]

# Each kernel header: the emulator unit that includes it and the tests that run its op.
OPS = {
    "fused_logprob": (["csrc/cuda_emu/fused_logprob.cpp"],
                      ["tests/cuda_emu/test_real_shapes.py::test_fused_logprob_at_a_hidden_width_of_two_blocks_and_three_chunks",
                       "tests/cuda_emu/test_real_shapes.py::test_the_first_bad_target_is_found_past_the_first_grid_stride",
                       "tests/cuda_emu/test_kernels_fused_logprob.py",
                       "tests/cuda_emu/test_kernels_fused_logprob_kept_set.py"]),
    "policy_loss": (["csrc/cuda_emu/policy_loss.cpp"],
                    ["tests/cuda_emu/test_real_shapes.py::test_policy_loss_finalize_over_more_rows_than_threads",
                     "tests/cuda_emu/test_kernels_policy_loss.py"]),
    "gated_delta": (["csrc/cuda_emu/gated_delta.cpp"], ["tests/cuda_emu/test_kernels_gated_delta.py"]),
    "moe_experts": (["csrc/cuda_emu/moe_experts.cpp"], ["tests/cuda_emu/test_kernels_moe_experts.py"]),
    "nf4": (["csrc/cuda_emu/nf4.cpp"], ["tests/cuda_emu/test_kernels_nf4.py"]),
    "nf4_linear": (["csrc/cuda_emu/nf4_linear.cpp"], ["tests/cuda_emu/test_kernels_nf4_linear.py"]),
}
# common.cuh's warp reductions: the ops whose kernels call them (fused_logprob's block_reduce, the
# MoE routing gradient, the NF4 absmax, the policy loss's chunk sums), cheapest first.
COMMON_OPS = ["nf4", "policy_loss", "fused_logprob", "moe_experts"]

# Tail-guard sample: (file, the exact text on one line, its mutant). Sites where a one-past-the-end
# read or write would land outside an allocation the sanitizer sees.
TAIL_SITES = [
    ("csrc/cuda/kernels/nf4.cuh", "i < n; i += (int64_t)gridDim.x * blockDim.x)", "i <= n; i += (int64_t)gridDim.x * blockDim.x)"),
    ("csrc/cuda/kernels/fused_logprob.cuh", "for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {",
     "for (int64_t h = threadIdx.x; h <= H; h += blockDim.x) {"),
    ("csrc/cuda/kernels/policy_loss.cuh", "for (int64_t b = threadIdx.x; b < B; b += kThreads) rowscale[b]",
     "for (int64_t b = threadIdx.x; b <= B; b += kThreads) rowscale[b]"),
    ("csrc/cuda/kernels/moe_experts.cuh", "i < P; i += (int64_t)gridDim.x * blockDim.x)",
     "i <= P; i += (int64_t)gridDim.x * blockDim.x)"),
    ("csrc/cuda/kernels/nf4_linear.cuh", "n < N; n += (int64_t)gridDim.x * blockDim.x)",
     "n <= N; n += (int64_t)gridDim.x * blockDim.x)"),
]

# Survivors judged by a person: site id -> (outcome, reason). Outcomes: "redundant" (the site was
# then simplified in the source, with a comment; the entry stays as the record) or "unreachable".
TRIAGE: dict[str, tuple[str, str]] = {
    "barrier:csrc/cuda/kernels/fused_logprob.cuh:26:2": (
        "unreachable",
        "block_reduce's first barrier keeps a warp's lane 0 from overwriting smem while other warps still "
        "read the previous reduction's result: a race between warps. The emulator runs every thread to its "
        "first blocking point (the warp shuffle after those reads) before any lane 0 can write, so no "
        "schedule it has can show the race; needed on a GPU, kept"),
    "stride:csrc/cuda/kernels/nf4.cuh:53:2": (
        "unreachable",
        "blockwise8_quantize_kernel is launched with kThreads = 256 threads for the 256 code entries, so "
        "each thread copies one entry and the loop never takes a second trip at any shape: the doubled "
        "step is the same program"),
    "barrier:csrc/cuda/kernels/nf4.cuh:54:2": (
        "unreachable",
        "the barrier orders every thread's write of the shared code table before any warp's lookups, a "
        "race between warps. The emulator runs every thread to its first blocking point (the warp_max "
        "shuffle, or its exit) before any lookup, so every entry is written first under each schedule; "
        "needed on a GPU, kept"),
}

# Sites simplified after a mutant there survived (they no longer exist, so no mutant is made there):
# (where, what was removed, why), listed in the table as redundant.
SIMPLIFIED = [
    ("barrier:csrc/cuda/kernels/policy_loss.cuh:111 (policy_finalize_kernel, before the loss sum's write of red)",
     "__syncthreads();",
     "the removal survived: every read of red (the row count's reduction, thread 0's read of red[0]) "
     "happens before the barrier that publishes S_shared, so the write of red after the row loop needs no "
     "barrier of its own; removed, with that comment"),
    ("stride:csrc/cuda/kernels/fused_logprob.cuh:75 (logprob_stats_kernel, an ignored token's p~ row)",
     "for (j = threadIdx.x; j < cs; j += kThreads) pr[j] = gemm_t(0);",
     "the doubled step survived: the zeros were never read. An ignored token's p~ row feeds only its own "
     "p.W row, which the finalize kernel overwrites with 0; the loop was removed, with that comment"),
    ("barrier:csrc/cuda/kernels/gated_delta.cuh forward_kernel, after the state fill", "__syncthreads();",
     "each thread reads back (into the checkpoint) only the state elements it wrote itself before the "
     "loop's first barrier, and step_columns, which reads other threads' elements, runs after that barrier; "
     "removed, with that comment in the source"),
    ("barrier:csrc/cuda/kernels/gated_delta.cuh backward_kernel, after a chunk's checkpoint fill", "__syncthreads();",
     "the removal survived: as in the forward, each thread copies forward only the state elements it wrote "
     "itself, step_columns reads other threads' elements only after the barrier that follows the q and k "
     "loads, and the previous chunk's reads of the same elements all came before its last barrier; "
     "removed, with that comment in the source"),
    ("barrier:csrc/cuda/kernels/gated_delta.cuh backward_kernel, after thread 0's dbeta and dg sums",
     "__syncthreads();",
     "the removal survived: thread 0 reads only part_b and part_g, which no thread writes again before "
     "the barrier after the next token's loads (or the next chunk's replay), a barrier thread 0 reaches "
     "only after its reads; removed, with that comment in the source"),
]

# Seconds assumed before any mutant of a kind was measured: a unit's compile (torch headers) and link
# on a shared 2-vCPU host, plus the op's tests to their first failure.
ASSUMED_S = {"barrier": 150.0, "stride": 150.0, "mask": 400.0, "tail": 240.0}
TIMEOUT_S = 1500


def niced() -> list[str]:
    """`nice -n k` bringing the children to niceness 10 (the shared host's rule for long runs), not
    beyond when this process already runs niced (make test-emu-mutations, or nice -n 10 by hand)."""
    return ["nice", "-n", str(max(0, 10 - os.nice(0)))]


def site_key(kind: str, file: str, mid: str, text: str) -> str:
    """A site's identity across edits elsewhere in its file: kind, file, the line's text and column (the
    line number is shown, not matched; occurrence() separates identical lines)."""
    parts = mid.split(":")
    col = parts[3] if len(parts) > 3 else ""
    return f"{kind}|{file}|{text.strip()}|{col}"


@dataclass
class Mutant:
    id: str          # kind:file:line[:col]
    kind: str
    file: str
    line: int
    text: str        # the line before the mutation
    new: str         # the line after

    occurrence: int = 0  # how many earlier sites of the file have the same key

    @property
    def key(self) -> str:
        return site_key(self.kind, self.file, self.id, self.text) + f"|{self.occurrence}"

    @property
    def op(self) -> str:
        return Path(self.file).stem


def strip_comment(line: str) -> str:
    i = line.find("//")
    return line if i < 0 else line[:i]


BARRIER = re.compile(r"__sync(threads|warp)\s*\([^;]*?\)\s*;")
# A for loop whose init names the thread (threadIdx, lane, t or a blockIdx-based index) and whose
# step is a block or grid stride.
FOR_STEP = re.compile(r"for\s*\((?P<init>[^;]*);(?P<cond>[^;]*);\s*(?P<var>\w+)\s*\+=\s*")


def step_end(code: str, start: int) -> int:
    """Where a for loop's step that begins at `start` ends: the `)` that closes the for."""
    depth = 0
    for i in range(start, len(code)):
        if code[i] == "(":
            depth += 1
        elif code[i] == ")":
            if depth == 0:
                return i
            depth -= 1
    raise ValueError(f"no closing parenthesis in {code!r}")
THREAD_INIT = re.compile(r"threadIdx|\blane\b|=\s*t\b|blockIdx")
MASK = re.compile(r"(__shfl\w*_sync|__ballot_sync|__any_sync|__all_sync)\s*\(\s*0xffffffffu?")


def find_mutants() -> list[Mutant]:
    out: list[Mutant] = []
    for f in KERNELS:
        lines = (ROOT / f).read_text().splitlines()
        for n, line in enumerate(lines, 1):
            code = strip_comment(line)
            if code.lstrip().startswith("#define"):
                continue
            for m in BARRIER.finditer(code):
                new = line[:m.start()] + "((void)0);  /* mutant: barrier removed */" + line[m.end():]
                out.append(Mutant(f"barrier:{f}:{n}:{m.start()}", "barrier", f, n, line, new))
            for m in FOR_STEP.finditer(code):
                if not THREAD_INIT.search(m.group("init")):
                    continue
                end = step_end(code, m.end())
                step = code[m.end():end].strip()
                new = line[:m.end()] + f"2 * ({step})" + line[end:]
                out.append(Mutant(f"stride:{f}:{n}:{m.start()}", "stride", f, n, line, new))
            for m in MASK.finditer(code):
                new = line[:m.start()] + m.group(1) + "(0x0000ffffu" + line[m.end():]
                out.append(Mutant(f"mask:{f}:{n}:{m.start()}", "mask", f, n, line, new))
    for f, old, new_text in TAIL_SITES:
        lines = (ROOT / f).read_text().splitlines()
        hits = [n for n, line in enumerate(lines, 1) if old in line]
        if len(hits) != 1:
            raise SystemExit(f"TAIL_SITES: {old!r} occurs {len(hits)} times in {f} (want once): update the list")
        n = hits[0]
        out.append(Mutant(f"tail:{f}:{n}", "tail", f, n, lines[n - 1], lines[n - 1].replace(old, new_text)))
    seen: dict[str, int] = {}
    for m in out:
        base = site_key(m.kind, m.file, m.id, m.text)
        m.occurrence = seen.get(base, 0)
        seen[base] = m.occurrence + 1
    return out


def load_results() -> dict[str, dict]:
    """Results by site key (a later line for the same site replaces an earlier one)."""
    done: dict[str, dict] = {}
    legacy: dict[str, dict[int, dict]] = {}  # records written without a key: by base key, then line
    if RESULTS.exists():
        for line in RESULTS.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                if r.get("key"):
                    done[r["key"]] = r
                else:
                    legacy.setdefault(site_key(r["kind"], r["file"], r["id"], r["text"]), {})[r["line"]] = r
    for base, by_line in legacy.items():  # identical lines of one file: occurrences in line order
        for occ, n in enumerate(sorted(by_line)):
            done.setdefault(f"{base}|{occ}", by_line[n])
    return done


def host() -> str:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} vCPUs, {platform.system()} {platform.release()}"


# ---- the copy and its builds ------------------------------------------------------------------------
def make_copy(py: str) -> None:
    """A fresh copy of what the emulator's build and tests read (replaced at every run's start, so a
    run mutates the sources as they were when it started)."""
    if SRC.exists():
        shutil.rmtree(SRC)
    SRC.mkdir(parents=True)
    for f in ("CMakeLists.txt", "setup.py", "pyproject.toml", "MANIFEST.in", "README.md"):
        if (ROOT / f).exists():
            shutil.copy2(ROOT / f, SRC / f)
    ign = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "csrc", SRC / "csrc", ignore=ign)
    shutil.copytree(ROOT / "python", SRC / "python", ignore=ign, symlinks=True)
    (SRC / "tests").mkdir()
    shutil.copy2(ROOT / "tests" / "conftest.py", SRC / "tests" / "conftest.py")
    shutil.copytree(ROOT / "tests" / "support", SRC / "tests" / "support", ignore=ign)   # the tests' helpers
    shutil.copytree(ROOT / "tests" / "cuda_emu", SRC / "tests" / "cuda_emu", ignore=ign)


def build_env(sanitize: bool) -> dict:
    tag = "asan" if sanitize else "plain"
    env = dict(os.environ, FASTTRAIN_CUDA="0", FASTTRAIN_EMU="1", FASTTRAIN_UNITY="0",
               FASTTRAIN_BUILD_TARGET="_C_emu", FASTTRAIN_BUILD_DIR=str(WORK / f"cmake-{tag}"),
               FASTTRAIN_EMU_OUTPUT_DIR=str(WORK / f"out-{tag}"),
               FASTTRAIN_EMU_SANITIZE="1" if sanitize else "0", MAX_JOBS=os.environ.get("MAX_JOBS", "2"))
    return env


def build(py: str, sanitize: bool, configured: set) -> tuple[bool, str]:
    """(ok, log tail). The first build of a kind configures through setup.py; later ones call ninja."""
    env = build_env(sanitize)
    if sanitize not in configured:
        cmd = [*niced(), py, "setup.py", "--quiet", "build_ext"]
    else:
        cmd = [*niced(), "cmake", "--build", env["FASTTRAIN_BUILD_DIR"], "-j", env["MAX_JOBS"],
               "--target", "_C_emu"]
    p = subprocess.run(cmd, cwd=SRC, env=env, capture_output=True, text=True)
    if p.returncode == 0:
        configured.add(sanitize)
    return p.returncode == 0, (p.stdout + p.stderr)[-3000:]


def module_path(sanitize: bool) -> str:
    libs = glob.glob(str(WORK / f"out-{'asan' if sanitize else 'plain'}" / "_C_emu*.so"))
    if len(libs) != 1:
        raise SystemExit(f"expected one _C_emu module in the build output, found {libs}")
    return libs[0]


def objects(sanitize: bool) -> list[Path]:
    return sorted((WORK / f"cmake-{'asan' if sanitize else 'plain'}").rglob("_C_emu.dir/**/*.o"))


def unit_object(sanitize: bool, op: str) -> Path:
    """Where Ninja puts csrc/cuda_emu/<op>.cpp's object (it may be absent: removed after a mutant)."""
    return (WORK / f"cmake-{'asan' if sanitize else 'plain'}" / "CMakeFiles" / "_C_emu.dir" / "csrc" / "cuda_emu"
            / f"{op}.cpp.o")


def mark_clean_except(sanitize: bool, keep: Path, stamp: int) -> None:
    """Removes `keep` (the unit of the op whose tests run) so that it is rebuilt from the mutant. The
    other units are not dated forward to spare their rebuild: Ninja then drops their dependency
    records (an output newer than its recorded deps) and rebuilds them anyway. So a mutant in
    common.cuh recompiles every unit, and every object rebuilt while a mutant was in place is removed
    after it."""
    keep.unlink(missing_ok=True)


def run_tests(py: str, tests: list[str], sanitize: bool) -> tuple[int, str]:
    env = dict(os.environ, FASTTRAIN_EMU_LIB=module_path(sanitize), PYTHONPATH=str(SRC / "python"))
    env.pop("PYTEST_XDIST_WORKER_COUNT", None)
    if sanitize:
        gxx = lambda name: subprocess.run(["g++", f"-print-file-name={name}"], capture_output=True,  # noqa: E731
                                          text=True).stdout.strip()
        env.update(LD_PRELOAD=f"{gxx('libasan.so')} {gxx('libubsan.so')}",
                   ASAN_OPTIONS="detect_leaks=0:detect_stack_use_after_return=0:alloc_dealloc_mismatch=0",
                   UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1", FASTTRAIN_EMU_SANITIZED="1")
    cmd = [*niced(), py, "-m", "pytest", "-x", "-v", "-p", "no:cacheprovider", "-p", "no:randomly",
           "--capture=sys", "-rf", *tests]
    try:
        p = subprocess.run(cmd, cwd=SRC, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        return p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return -9, out + f"\n[timeout after {TIMEOUT_S} s]"


def killer(rc: int, log: str) -> str:
    """The test that killed the mutant: pytest's first FAILED line, else (a crash: a sanitizer report
    ends the process) the last test that started."""
    m = re.search(r"^FAILED (\S+)", log, re.M)
    if m:
        return m.group(1)
    started = re.findall(r"^(tests/\S+::\S+)", log, re.M)
    what = "timeout" if rc == -9 else f"crash rc={rc}"
    return f"{started[-1] if started else '?'} ({what})"


def render_table(mutants: list[Mutant], done: dict[str, dict]) -> None:
    rows, totals = [], {"killed": 0, "redundant": 0, "unreachable": 0, "survived (to judge)": 0, "not run": 0}
    cost = 0.0
    for m in mutants:
        r = done.get(m.key)
        if r is None:
            totals["not run"] += 1
            rows.append(f"| {m.id} | `{m.text.strip()[:70]}` | not run | |")
            continue
        cost += r.get("seconds", 0.0)
        if r["outcome"] == "killed":
            totals["killed"] += 1
            rows.append(f"| {m.id} | `{m.text.strip()[:70]}` | killed | {r['killer']} |")
        elif m.id in TRIAGE:
            outcome, why = TRIAGE[m.id]
            totals[outcome] += 1
            rows.append(f"| {m.id} | `{m.text.strip()[:70]}` | {outcome} | {why} |")
        else:
            totals["survived (to judge)"] += 1
            rows.append(f"| {m.id} | `{m.text.strip()[:70]}` | SURVIVED | (every selected test passed) |")
    for where, what, why in SIMPLIFIED:
        totals["redundant"] += 1
        rows.append(f"| {where} | `{what}` | redundant (simplified) | {why} |")
    head = [
        "# CUDA kernels: mutation run on the emulator (tools/emu_mutations.py)",
        "",
        f"Host: {host()}. Last written: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC.",
        f"Mutants: {len(mutants) + len(SIMPLIFIED)}; " + ", ".join(f"{k}: {v}" for k, v in totals.items()) +
        f". Measured cost of the mutants run: {cost / 60:.1f} min (build of the unit + its op's tests, nice 10, "
        "on the shared host).",
        "",
        "Site ids are kind:file:line[:column] in the sources the run copied. Killer: the first failing test "
        "(pytest -x), or the test running when the process died (a sanitizer report).",
        "",
        "| site | line | outcome | killer or reason |",
        "|---|---|---|---|",
    ]
    TABLE.parent.mkdir(parents=True, exist_ok=True)
    TABLE.write_text("\n".join(head + rows) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--kind", action="append", choices=["barrier", "stride", "mask", "tail"])
    ap.add_argument("--file", action="append", help="only mutants in these sources (substring match)")
    ap.add_argument("--limit", type=int, default=0, help="stop after this many mutants")
    ap.add_argument("--id", action="append", help="only mutants whose id contains one of these, in this order")
    ap.add_argument("--yes", action="store_true", help="start without asking (the estimate is still printed)")
    ap.add_argument("--python", default=str(ROOT / ".venv" / "bin" / "python"))
    a = ap.parse_args()

    mutants = find_mutants()
    done = load_results()
    if a.list:
        for m in mutants:
            state = done.get(m.key, {}).get("outcome", "-")
            print(f"{m.id:60s} {state:9s} {m.new.strip()}")
        return 0
    todo = [m for m in mutants if (not a.kind or m.kind in a.kind) and (not a.file or any(f in m.file for f in a.file))
            and m.key not in done]
    # one source after another (each switch recompiles two units), tail mutants (sanitized build) last
    todo.sort(key=lambda m: (m.kind == "tail", m.file == "csrc/cuda/common.cuh", m.file, m.line))
    if a.id:
        todo = [m for want in a.id for m in todo if want in m.id]
    if a.limit:
        todo = todo[:a.limit]
    measured: dict[str, list[float]] = {}
    for r in done.values():
        measured.setdefault(r["kind"], []).append(r.get("seconds", 0.0))
    per = {k: (sum(v) / len(v) if v else ASSUMED_S[k]) for k, v in
           ((k, measured.get(k, [])) for k in ASSUMED_S)}
    est = sum(per[m.kind] for m in todo)
    # the copy's first build (all ten units): measured by an earlier run (kept in the build folder),
    # else 30 min, what it took at niceness 10 on the shared 2-vCPU host under other builds
    stamp = WORK / "first_build_seconds.json"
    first = json.loads(stamp.read_text()) if stamp.exists() else {}
    kinds_needed = {"asan" if m.kind == "tail" else "plain" for m in todo}
    units = len(list((ROOT / "csrc" / "cuda_emu").glob("*.cpp")))
    first_builds = sum(0 if len(objects(k == "asan")) >= units else first.get(k, 1800.0) for k in kinds_needed)
    before = sum(1 for m in mutants if m.key in done)
    print(f"{len(mutants)} mutants, {before} done before; this run: {len(todo)}. Estimated cost: {est / 60:.0f} min for the mutants "
          f"({', '.join(f'{k} {v:.0f} s' for k, v in per.items())} each, "
          f"{'measured' if measured else 'assumed'}) + about {first_builds / 60:.0f} min for the copy's first "
          "non-unity build(s) not yet made. Resumable: interrupt at any time.", flush=True)
    if not todo:
        render_table(mutants, done)
        return 0
    if not a.yes and sys.stdin.isatty():
        if input("start? [y/N] ").strip().lower() != "y":
            return 1

    # one run at a time: a second would replace the copy under the first one's build
    WORK.mkdir(parents=True, exist_ok=True)
    lock = WORK / "run.pid"
    if lock.exists():
        try:
            os.kill(int(lock.read_text()), 0)
            raise SystemExit(f"another mutation run (pid {lock.read_text().strip()}) is using {WORK}")
        except (ProcessLookupError, ValueError):
            pass
    lock.write_text(str(os.getpid()))
    # a kill (SIGTERM) unwinds like Ctrl-C: the mutated source is restored and its objects removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    make_copy(a.python)
    configured: set = set()
    for sanitize in sorted({m.kind == "tail" for m in todo}):
        t0 = time.time()
        ok, log = build(a.python, sanitize, configured)
        took = time.time() - t0
        print(f"first build of the copy ({'sanitized' if sanitize else 'plain'}, non-unity): {took:.0f} s", flush=True)
        if ok and took > 60:  # a real first build, not an up-to-date check
            stamp = WORK / "first_build_seconds.json"
            first = json.loads(stamp.read_text()) if stamp.exists() else {}
            first["asan" if sanitize else "plain"] = round(took)
            stamp.write_text(json.dumps(first))
        if not ok:
            print(log)
            raise SystemExit("the unmutated copy does not build")
    # Each op's tests must pass on the unmutated copy first, or a failure would say nothing about a mutant.
    for op in sorted({o for m in todo for o in (COMMON_OPS if m.op == "common" else [m.op])}):
        for sanitize in sorted({m.kind == "tail" for m in todo if m.op in (op, "common")}):
            t0 = time.time()
            rc, log = run_tests(a.python, OPS[op][1], sanitize)
            print(f"baseline {op} ({'sanitized' if sanitize else 'plain'}): rc {rc}, {time.time() - t0:.0f} s",
                  flush=True)
            if rc != 0:
                print(log[-4000:])
                raise SystemExit(f"{op}'s tests fail on the unmutated sources: fix them first")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    for i, m in enumerate(todo, 1):
        path = SRC / m.file
        original = path.read_text()
        st = path.stat()
        lines = original.split("\n")
        assert lines[m.line - 1] == m.text, f"{m.id}: the copy's line differs from the site's"
        lines[m.line - 1] = m.new
        t0 = time.time()
        sanitize = m.kind == "tail"
        ops = COMMON_OPS if m.op == "common" else [m.op]
        built: list[Path] = []
        before: dict[Path, int] = {}
        outcome, kill = "survived", ""
        try:
            path.write_text("\n".join(lines))
            for op in ops:  # common.cuh: one op's unit at a time, until one kills the mutant
                obj = unit_object(sanitize, op)
                mark_clean_except(sanitize, obj, path.stat().st_mtime_ns)
                before = {o: o.stat().st_mtime_ns for o in objects(sanitize)}
                built.append(obj)
                ok, blog = build(a.python, sanitize, configured)
                if not ok:
                    outcome, kill = "killed", "compile error"
                    break
                rc, log = run_tests(a.python, OPS[op][1], sanitize)
                if rc != 0:
                    if rc in (2, 3, 4, 5) and "FAILED" not in log and not re.search(r"^tests/\S+::", log, re.M):
                        print(log[-3000:])
                        raise SystemExit(f"{m.id}: pytest could not run the tests (rc {rc}); nothing recorded")
                    outcome, kill = "killed", killer(rc, log)
                    break
        finally:
            # the source back with its old time stamp; the objects built from the mutant are removed,
            # so the next build recompiles exactly those units and no other
            path.write_text(original)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
            for obj in built:
                obj.unlink(missing_ok=True)
            # and any other object Ninja rebuilt while the mutant was in place (one whose dependency
            # record it lacked): those could hold the mutant too
            for obj in objects(sanitize):
                if obj.stat().st_mtime_ns != before.get(obj, -1):
                    obj.unlink(missing_ok=True)
        sec = time.time() - t0
        rec = dict(id=m.id, key=m.key, kind=m.kind, file=m.file, line=m.line, text=m.text, new=m.new, outcome=outcome,
                   killer=kill, seconds=round(sec, 1),
                   date=f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}", host=host())
        with RESULTS.open("a") as fh:
            fh.write(json.dumps(rec) + "\n")
        done[m.key] = rec
        render_table(mutants, done)
        print(f"[{i}/{len(todo)}] {m.id}: {outcome} {kill} ({sec:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
