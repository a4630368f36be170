"""The plan's step time from given host rates: measured once and cached, read back, and the phase
times that follow from them (more matmul rate, less update time).

Nothing here measures time: how well the plan predicts a real step on this CPU is
bench/bench_planned_time.py (CPU time moves with the machine's load, so it is no unit test).
"""
import json

import torch


def _fake_rates(**kw):
    from fasttrain.plan.host_rates import HostRates
    base = dict(device="a test CPU (2 cores)", threads=1, matmul_bf16=4e11, matmul_fp32=1e11, bandwidth=3e10,
                attention_fwd_bf16=8e10, attention_fb_bf16=8e10, attention_fwd_fp32=8e10, attention_fb_fp32=8e10,
                decode_rows16_bf16=2e11, decode_rows64_bf16=3e11, decode_attention_bf16=2e10,
                decode_rows16_fp32=6e10, decode_rows64_fp32=8e10, decode_attention_fp32=2e10,
                elementwise_bf16=5e9, elementwise_fp32=8e9, sampling=6e7, decode_layer=1e-4, decode_call=1e-4,
                forward_layer=5e-4, forward_call=5e-4, train_layer=2e-3, train_call=1e-3, train_ckpt_layer=3e-3,
                train_ckpt_call=1e-3, moe_fwd_nf4=3e10, moe_fb_nf4=2e10, moe_decode_nf4=4e9, moe_fwd_16=5e10,
                moe_fb_16=3e10, moe_decode_16=8e9, measured_at="2026-01-02 03:04 UTC")
    return HostRates(**{**base, **kw})


def test_host_rates_are_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    """The calibration (train/) measures and stores; the plan's module (plan/) reads the cache."""
    import fasttrain.plan.host_rates as hr
    import fasttrain.train.calibrate as cal

    monkeypatch.setenv("FASTTRAIN_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(cal, "measure", lambda device, clock=None: calls.append(device) or _fake_rates())
    assert hr.cached_rates("cpu") is None
    first = cal.calibrate("cpu")
    assert cal.calibrate("cpu") == first == hr.cached_rates("cpu") and calls == [torch.device("cpu")]
    assert hr.cache_path() == tmp_path / "host_rates.json"
    cal.calibrate("cpu", refresh=True)
    assert len(calls) == 2
    torch.set_num_threads(torch.get_num_threads() + 1)      # another thread count is another key
    try:
        assert hr.cached_rates("cpu") is None
    finally:
        torch.set_num_threads(torch.get_num_threads() - 1)


def test_plan_on_the_cpu_times_from_this_hosts_rates_and_says_so(tmp_path, monkeypatch):
    """`fasttrain plan --gpu cpu` uses the measured rates (more matmul rate: less update time) and
    names the host and when it was measured; --rates datasheet keeps the table's constants."""
    from typer.testing import CliRunner

    import fasttrain.train.calibrate as cal
    from fasttrain.cli import app

    monkeypatch.setenv("FASTTRAIN_CACHE", str(tmp_path))
    monkeypatch.setattr(cal, "measure", lambda device, clock=None: _fake_rates())
    out = CliRunner().invoke(app, ["plan", "demo", "--gpu", "cpu"]).output
    assert "rates measured on a test CPU (2 cores), 1 thread(s), 2026-01-02 03:04 UTC" in out, out
    def planned_update(*extra):
        text = CliRunner().invoke(app, ["plan", "demo", "--gpu", "cpu", "--json", *extra]).output
        return json.loads(text[text.index("{"):])["seconds"]["update"]
    before = planned_update()
    monkeypatch.setattr(cal, "measure", lambda device, clock=None: _fake_rates(matmul_bf16=8e11, matmul_fp32=2e11))
    assert planned_update() == before                       # read from the cache
    assert planned_update("--remeasure") < before
    table = CliRunner().invoke(app, ["plan", "demo", "--gpu", "cpu", "--rates", "datasheet"]).output
    assert "order-of-magnitude" in table and "rates measured" not in table
