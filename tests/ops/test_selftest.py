"""`fasttrain selftest` on the CPU (part of `make test`): the quick run passes, a deliberately wrong
kernel makes it fail (so its tolerances are not vacuous), the report holds what a bug report needs,
and `fasttrain info`'s verdict line follows the last run."""
import json

import pytest
import torch

import fasttrain.ops as F
from fasttrain import selftest
from fasttrain.selftest import harness


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(harness, "KERNELS", dict(harness.kernel_faces()))


def test_quick_selftest_passes_on_cpu(tmp_path, capsys):
    out = tmp_path / "st.json"
    assert selftest.main(["--device", "cpu", "--quick", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["passed"] and rep["failed"] == 0 and rep["failing"] == []
    # every op's kernels; the optional GPU packages are checked on CUDA only
    assert {r["op"] for r in rep["rows"]} == set(selftest.CASES) - {"gpu_packages"}
    for key in ("name", "driver", "torch", "cuda_runtime", "compute_capability", "build", "cpu_capability"):
        assert key in rep["device"], key
    for r in rep["rows"]:
        assert r["passed"] and r["max_err"] <= r["tol"] and r["kernel_ms"] > 0 and r["ref_ms"] > 0, r
    printed = capsys.readouterr().out
    assert printed.count("pass ") == rep["cases"] and "cases passed" in printed
    assert "verified by selftest --quick" in selftest.verdict_line("cpu")


def _wrong_logprob(h, w, t, temperature=1.0, ignore_index=-100, bias=None, keep_delta=None):
    return F.fused_logprob(h, w, t, temperature * 1.001, ignore_index, bias, keep_delta)   # a 0.1% temperature slip


def _wrong_policy_loss(*args, **kw):
    return F.policy_loss(*args, **{**kw, "zeta": 0.0})                         # REPO-R's factor left out


def _wrong_linear(x, q, st, a=None, b=None, scale=1.0, m=None, wsq=None):
    return F.nf4_linear(x, q, st, a, b, scale * 1.01, m, wsq)                # LoRA scale off by 1%


def _wrong_dense_linear(x, w, bias=None, a=None, b=None, scale=1.0, m=None, norm=None):
    from fasttrain.nn.dense_linear import dense_linear
    return dense_linear(x, w, bias, a, b, scale * 1.01, m, norm)             # LoRA scale off by 1%


def _wrong_quantize(w, blocksize=64, double_quant=False):
    packed, st = F.nf4_quantize(w, blocksize=blocksize, double_quant=double_quant)
    packed = packed.clone()
    packed[-1] ^= 1                                                          # one flipped bit
    return packed, st


def _wrong_dora_norm(q, st, a, b, s, wsq=None):
    return F.nf4_dora_norm(q, st, a, b, s, wsq) * (1 + 1e-4)


def _wrong_delta_rule(q, k, v, g, beta, **kw):
    return F.gated_delta_rule(q, k, v, g, beta * 1.001, **kw)                  # write strength off by 0.1%


def _wrong_conv(x, w, state=None, activation=True):
    return F.causal_conv1d(x, w.roll(1, dims=1), state, activation)           # taps in the wrong order


def _wrong_decode_attention(q, k, v, valid, scale):
    return F.decode_attention(q, k, v, valid, scale * 1.01)                   # softmax scale off by 1%


def _wrong_masked_attention(q, k, v, mask, scale):
    return F.masked_attention(q, k, v, mask, scale * 1.01)                     # softmax scale off by 1%


@pytest.mark.parametrize("op,wrong", [("fused_logprob", _wrong_logprob), ("policy_loss", _wrong_policy_loss),
                                      ("nf4_linear", _wrong_linear), ("nf4_quantize", _wrong_quantize),
                                      ("nf4_dora_norm", _wrong_dora_norm), ("dense_linear", _wrong_dense_linear),
                                      ("gated_delta_rule", _wrong_delta_rule), ("causal_conv1d", _wrong_conv),
                                      ("decode_attention", _wrong_decode_attention),
                                      ("masked_attention", _wrong_masked_attention)])
def test_a_wrong_kernel_fails(op, wrong, tmp_path, monkeypatch):
    monkeypatch.setitem(harness.KERNELS, op, wrong)
    out = tmp_path / "st.json"
    assert selftest.main(["--device", "cpu", "--quick", "--op", op, "--json", str(out)]) == 1
    rep = json.loads(out.read_text())
    assert not rep["passed"] and rep["failing"] and all(r["op"] == op for r in rep["failing"])
    assert all(r["max_err"] > r["tol"] or r["detail"] for r in rep["failing"])
    assert "FAILED selftest --quick" in selftest.verdict_line("cpu")


def test_a_raising_kernel_fails_its_case_and_the_rest_still_run(monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setitem(harness.KERNELS, "nf4_dora_norm", boom)
    rep = selftest.run_selftest("cpu", quick=True, ops=["nf4_dora_norm", "nf4_quantize"])
    bad = [r for r in rep["rows"] if not r["passed"]]
    assert [r["op"] for r in bad] == ["nf4_dora_norm"] and "illegal memory access" in bad[0]["detail"]
    assert any(r["op"] == "nf4_quantize" and r["passed"] for r in rep["rows"])


def test_selftest_checks_the_kernels_even_when_the_reference_is_chosen(monkeypatch):
    """FASTTRAIN_KERNELS=reference must not turn the selftest into reference-against-reference."""
    monkeypatch.setenv("FASTTRAIN_KERNELS", "reference")
    monkeypatch.setitem(harness.KERNELS, "nf4_dora_norm", _wrong_dora_norm)
    rep = selftest.run_selftest("cpu", quick=True, ops=["nf4_dora_norm"])
    assert not rep["passed"]


def test_output_dtype_is_checked():
    chk = harness.Check()
    chk.close("y", torch.zeros(3, dtype=torch.float32), torch.zeros(3, dtype=torch.float64), 0.0, torch.float64)
    assert not chk.row("op", "case", 0.0, 0.0).passed
    chk = harness.Check()
    chk.close("y", torch.tensor([float("nan")]), torch.tensor([1.0], dtype=torch.float64), 1e9)
    assert not chk.row("op", "case", 0.0, 0.0).passed


def test_cli_command(tmp_path):
    from typer.testing import CliRunner
    from fasttrain.cli import app
    out = tmp_path / "st.json"
    res = CliRunner().invoke(app, ["selftest", "--device", "cpu", "--quick", "--op", "nf4_dora_norm", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["cases"] == 1
    res = CliRunner().invoke(app, ["info"])
    assert res.exit_code == 0 and "kernels on cpu" in res.output


def test_one_parser_behind_both_entry_points(capsys):
    """`fasttrain selftest` and `python -m fasttrain.selftest` (tools/gpu_check.sh) are the one Typer
    command: the CLI registers fasttrain.selftest.command's, and `python -m` parses its flags."""
    import subprocess
    import sys

    from fasttrain.cli import app
    from fasttrain.selftest import command
    assert [c.callback for c in app.registered_commands if c.name == "selftest"] == [command.selftest]
    assert command.main(["--device", "cpu", "--op", "no_such_op"]) == 2          # refused before any case runs
    assert "unknown --op no_such_op" in capsys.readouterr().err
    res = subprocess.run([sys.executable, "-m", "fasttrain.selftest", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert all(flag in res.stdout for flag in ("--device", "--quick", "--json", "--op"))


@pytest.mark.parametrize("face,wrong", [
    ("rms_norm", lambda x, w, eps: F.rms_norm(x, w, eps + 1e-2)),                    # eps slipped
    ("silu_mul", lambda gu: F.silu_mul(gu * (1 + 2.0 ** -6))),                      # inputs off by 1.6%
    ("rotary_cache_write_", lambda qkv, c, s, kc, vc, col, n: F.rotary_cache_write_(qkv, s, c, kc, vc, col, n))])
def test_a_wrong_decode_fused_kernel_fails(face, wrong, tmp_path):
    harness.KERNELS[face] = wrong          # the fixture gives each test its own KERNELS
    out = tmp_path / "st.json"
    assert selftest.main(["--device", "cpu", "--quick", "--op", "decode_fused", "--json", str(out)]) == 1
    rep = json.loads(out.read_text())
    assert rep["failing"] and all(r["op"] == "decode_fused" and r["case"].startswith(face) for r in rep["failing"])
