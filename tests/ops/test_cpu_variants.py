"""The CPU kernels' variants: fasttrain._C holds the kernels once per x86-64 level ATen dispatches
(default, AVX2, AVX-512), picks one at load by ATen's capability capped by the CPU's features, and
no code outside a variant uses that variant's instructions.

The disassembly (objdump of the built module) is the proof that a wheel built on an AVX-512 host
runs on an AVX2 or an older one: outside the AVX-512 variant's functions there is no EVEX-encoded
instruction (the AVX-512 encoding, also when it works on xmm/ymm registers) and no zmm register;
outside the AVX2 and AVX-512 variants no VEX-encoded instruction (AVX, AVX2, FMA, F16C) either. A
function belongs to a variant when its name is in the variant's namespace (fasttrain::cpu_avx2::,
fasttrain::cpu_avx512::, core/variant.h) or in ATen's vector namespace of that level
(at::vec::AVX2::, at::vec::AVX512::); lambdas and template instantiations of a variant carry its
namespace in their names.

Forcing each capability the host supports (ATEN_CPU_CAPABILITY) runs the matching variant, whose
kernels then agree with the float64 references within the bounds the op tests derive; a capability
above the CPU's (avx512 forced on an AVX2 host, which ATen takes at its word) runs the best variant
the CPU has.
"""
from __future__ import annotations

import bisect
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from fasttrain._native import build_info, load

HERE = Path(__file__).parent
X86 = platform.machine() in ("x86_64", "AMD64")
LEVELS = ["default", "avx2", "avx512"]                 # lowest first, as ATen orders them
PREFIXES = {0x26, 0x2E, 0x36, 0x3E, 0x64, 0x65, 0x67}   # segment and address-size prefixes
INSN = re.compile(r"^\s*[0-9a-f]+:\t([0-9a-f]{2}(?: [0-9a-f]{2})*)\s*\t(.*)$")
SYMBOL = re.compile(r"^[0-9a-f]+ <(.*)>:$")
TARGET = re.compile(r"(?:(?:^|\s)(?:callq?|jmpq?|j[a-z]{1,3})\s+|# )([0-9a-f]+) <")   # direct targets, rip-relative

pytestmark = pytest.mark.skipif(not X86, reason="the variants are x86-64 ones")


def _variants_compiled() -> list[str]:
    return build_info()["cpu_variants"].split(",")


def _cpu_flags() -> dict:
    return torch._C._cpu._get_cpu_capability() if hasattr(torch._C, "_cpu") else {}


def _host_best() -> str:
    f = _cpu_flags()
    if all(f.get(k) for k in ("avx512_f", "avx512_bw", "avx512_vl", "avx512_dq", "fma3", "f16c")):
        return "avx512"
    if all(f.get(k) for k in ("avx2", "fma3", "f16c")):
        return "avx2"
    return "default"


def encoding(hex_bytes: str) -> str:
    """"evex", "vex" or "legacy" for one instruction's bytes as objdump prints them. In 64-bit mode
    0x62 (BOUND in 32-bit code) always starts an EVEX prefix and 0xC4/0xC5 (LES/LDS) a VEX one."""
    for b in (int(x, 16) for x in hex_bytes.split()):
        if b in PREFIXES:
            continue
        return "evex" if b == 0x62 else "vex" if b in (0xC4, 0xC5) else "legacy"
    return "legacy"


def owner(symbol: str) -> str:
    """The variant a function belongs to, by its demangled name ("" for none: baseline code)."""
    if "cpu_avx512" in symbol or "::AVX512::" in symbol:
        return "avx512"
    if "cpu_avx2" in symbol or "::AVX2::" in symbol:
        return "avx2"
    return ""


def functions(disassembly: str) -> dict[int, dict]:
    """{start address: {"name", "kinds": {"evex", "vex", "zmm"} found in it, "refs": addresses it
    calls, jumps to or takes (rip-relative) outside itself}}"""
    funcs: dict[int, dict] = {}
    cur = None
    for line in disassembly.splitlines():
        m = SYMBOL.match(line)
        if m:
            cur = funcs.setdefault(int(line.split()[0], 16), {"name": m.group(1), "kinds": set(), "refs": set()})
            continue
        m = INSN.match(line)
        if not m or cur is None:
            continue
        kind = encoding(m.group(1))
        if kind != "legacy":
            cur["kinds"].add(kind)
        if "%zmm" in m.group(2):
            cur["kinds"].add("zmm")
        cur["refs"].update(int(a, 16) for a in TARGET.findall(m.group(2)))
    return funcs


def violations(funcs: dict[int, dict], level: str) -> list[str]:
    """Functions with code of `level` ("evex"/"zmm" for avx512, "vex" for avx2) that code outside
    that level's variants can reach. The region of a level starts as the functions of its variants
    (and of the levels above it) and the unreferenced GCC clones; a function joins it when every
    function that refers to it is in it (GCC's out-of-line copies and clones of inline functions
    inside a variant's unit have no variant in their names, and only that unit's code calls them).
    Whatever stays outside, baseline code or what baseline code refers to, or a function that no
    code refers to (it may be called through a pointer), must hold no instruction of the level."""
    levels = {"avx512": ("avx512",), "avx2": ("avx2", "avx512")}[level]
    kinds = {"avx512": {"evex", "zmm"}, "avx2": {"vex", "evex", "zmm"}}[level]
    starts = sorted(funcs)

    def containing(addr: int) -> int | None:
        i = bisect.bisect_right(starts, addr) - 1
        return starts[i] if i >= 0 else None

    callers: dict[int, set[int]] = {a: set() for a in funcs}
    for a, f in funcs.items():
        for r in f["refs"]:
            t = containing(r)
            if t is not None and t != a:
                callers[t].add(a)
    region = {a for a, f in funcs.items() if owner(f["name"]) in levels}
    # a GCC clone (".isra", ".constprop", ".part", ".cold") is a local function of the unit that
    # made it: with no reference from code, only its own unit's tables reach it
    region |= {a for a, f in funcs.items() if "[clone ." in f["name"] and not callers[a]}
    grew = True
    while grew:
        grew = False
        for a in funcs:
            if a not in region and callers[a] and callers[a] <= region:
                region.add(a)
                grew = True
    return [f"{funcs[a]['name']} ({', '.join(sorted(funcs[a]['kinds'] & kinds))})" for a in starts
            if a not in region and funcs[a]["kinds"] & kinds]


@lru_cache(maxsize=1)
def _disassembly() -> str:
    if shutil.which("objdump") is None:
        pytest.skip("needs objdump (binutils)")
    so = load().__file__
    return subprocess.run(["objdump", "-d", "-C", "-w", so], capture_output=True, text=True, check=True).stdout


def test_the_scan_tells_the_encodings_apart():
    """The check can fail: in a made-up disassembly, AVX-512 code in a function that baseline code
    calls, and AVX code in the default variant, are flagged; the same code in its variant, or in an
    out-of-line copy that only its variant calls, is not."""
    fake = ("0000000000001000 <fasttrain::cpu_default::(anonymous namespace)::decode_range<float>(...)>:\n"
            "    1000:\tc5 fc 10 07          \tvmovups (%rdi),%ymm0\n"
            "    1004:\te8 f7 0f 00 00       \tcall   2000 <std::vector<float>::_M_default_append(unsigned long)>\n"
            "0000000000002000 <std::vector<float>::_M_default_append(unsigned long)>:\n"
            "    2000:\t62 f1 7c 48 10 07    \tvmovups (%rdi),%zmm0\n"
            "    2006:\t67 62 f1 7c 08 10 07 \tvmovups (%edi),%xmm0\n"
            "0000000000003000 <fasttrain::cpu_avx512::nf4_linear_cpu(...)>:\n"
            "    3000:\t62 f1 7c 48 10 07    \tvmovups (%rdi),%zmm0\n"
            "    3006:\te8 f5 0f 00 00       \tcall   4000 <c10::IValue::tagKind() const [clone .isra.0]>\n"
            "0000000000004000 <c10::IValue::tagKind() const [clone .isra.0]>:\n"
            "    4000:\t62 f1 7c 48 10 07    \tvmovups (%rdi),%zmm0\n"
            "0000000000005000 <at::vec::AVX2::Vectorized<float>::loadu(void const*, long)>:\n"
            "    5000:\tc4 e2 7d 18 07       \tvbroadcastss (%rdi),%ymm0\n"
            "0000000000006000 <c10::IValue::tagKind() const [clone .isra.0] [clone .cold]>:\n"
            "    6000:\t62 f1 7c 48 10 07    \tvmovups (%rdi),%zmm0\n"
            "0000000000007000 <c10::detail::torchCheckFail(char const*)>:\n"
            "    7000:\t62 f1 7c 48 10 07    \tvmovups (%rdi),%zmm0\n")
    funcs = functions(fake)
    assert [sorted(f["kinds"]) for f in funcs.values()] == [["vex"]] + [["evex", "zmm"]] * 3 + [["vex"]] + \
        [["evex", "zmm"]] * 2
    assert violations(funcs, "avx512") == ["std::vector<float>::_M_default_append(unsigned long) (evex, zmm)",
                                           "c10::detail::torchCheckFail(char const*) (evex, zmm)"]
    assert violations(funcs, "avx2") == [
        "fasttrain::cpu_default::(anonymous namespace)::decode_range<float>(...) (vex)",
        "std::vector<float>::_M_default_append(unsigned long) (evex, zmm)",
        "c10::detail::torchCheckFail(char const*) (evex, zmm)"]


def test_the_module_holds_the_levels_aten_dispatches():
    if "native" in _variants_compiled():
        pytest.skip("a -march=native build (FASTTRAIN_NATIVE_ARCH=1) holds one variant for this host")
    assert _variants_compiled() == LEVELS


def test_no_avx512_or_avx_instruction_outside_its_variant():
    if "native" in _variants_compiled():
        pytest.skip("a -march=native build (FASTTRAIN_NATIVE_ARCH=1) holds one variant for this host")
    funcs = functions(_disassembly())
    bad512 = violations(funcs, "avx512")
    assert not bad512, "AVX-512 code that code outside the AVX-512 variant reaches:\n" + "\n".join(bad512[:20])
    bad2 = violations(funcs, "avx2")
    assert not bad2, "AVX code that baseline code reaches:\n" + "\n".join(bad2[:20])
    # the variants do hold their level's code (the scan sees what it looks for)
    held = {v: set().union(*(f["kinds"] for f in funcs.values() if owner(f["name"]) == v)) for v in ("avx2", "avx512")}
    assert {"evex", "zmm"} <= held["avx512"] and "vex" in held["avx2"] and "evex" not in held["avx2"], held


def out_of_line_math(funcs: dict) -> list[str]:
    """The functions of csrc/core/math.h (namespace fasttrain::math) that the module holds as code of
    their own: each is a few instructions of a kernel's inner loop, meant to be inlined (FT_HD), and
    a call per element keeps the loop from vectorizing."""
    def own_name(name: str) -> str:            # "float a::b<float, int>(float)" -> "a::b"
        depth, bare = 0, []
        for ch in name.split(" [clone")[0]:
            depth += ch == "<"
            if depth == 0:
                bare.append(ch)
            depth -= ch == ">"
        return "".join(bare).split("(")[0].split(" ")[-1]
    return sorted({f["name"] for f in funcs.values() if own_name(f["name"]).startswith("fasttrain::math::")})


def test_the_kernels_inner_math_is_inlined():
    """The check can fail (a made-up disassembly with an out-of-line math function is flagged), and on
    the built module no fasttrain::math function is left out of line in any variant."""
    fake = ("0000000000001000 <float fasttrain::math::cpu_avx2::gdr_decayed<float>(float, float)>:\n"
            "    1000:\tc5 fa 59 c1          \tvmulss %xmm1,%xmm0,%xmm0\n"
            "0000000000002000 <fasttrain::cpu_avx2::nf4_linear_cpu(...)>:\n"
            "    2000:\tc5 fc 10 07          \tvmovups (%rdi),%ymm0\n")
    assert out_of_line_math(functions(fake)) == ["float fasttrain::math::cpu_avx2::gdr_decayed<float>(float, float)"]
    left = out_of_line_math(functions(_disassembly()))
    assert not left, "fasttrain::math functions compiled out of line:\n" + "\n".join(left[:20])


def _run_variant_check(capability: str) -> dict:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "PYTHONPATH": os.pathsep.join(sys.path)}
    p = subprocess.run([sys.executable, str(HERE / "variant_check.py")], env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("capability", LEVELS)
def test_forcing_a_capability_runs_its_variant_within_the_tolerances(capability):
    if "native" in _variants_compiled():
        pytest.skip("a -march=native build (FASTTRAIN_NATIVE_ARCH=1) holds one variant for this host")
    best = _host_best()
    out = _run_variant_check(capability)
    expected = LEVELS[min(LEVELS.index(capability), LEVELS.index(best))]   # capped by the CPU's features
    assert out["variant"] == expected, out
    assert out["failures"] == [], out
