"""The plan's step time from given host rates: measured once and cached, read back, and the phase
times that follow from them (more matmul rate, less update time).

Nothing here measures time: how well the plan predicts a real step on this CPU is
bench/bench_planned_time.py (CPU time moves with the machine's load, so it is no unit test).
"""
import json

import torch

from support.rates import fake_rates as _fake_rates


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
