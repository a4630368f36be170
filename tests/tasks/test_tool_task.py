"""The built-in tool task: the calculate tool on the countdown parser (never eval), its reward,
`fasttrain run tools`'s recipe, and `fasttrain init --tools` training on the tiny model."""
from fractions import Fraction

import pytest
from typer.testing import CliRunner

from fasttrain.tasks.calculator import calculate, used_calculator
from fasttrain.tasks.countdown import CountdownError
from fasttrain.train.run_files import read_jsonl

pytestmark = pytest.mark.one_thread      # the one-thread default (tests/conftest.py)

pytest.importorskip("datasets")
TINY = ["--set", "policy.model=support.agent_files:tiny_tool_policy", "--set", "policy.dtype=float32",
        "--set", "run.threads=1"]


@pytest.mark.parametrize("expr, value", [("(25 + 14) * 2", "78"), ("7 / 2", "7/2"), ("1/10 + 2/10", "3/10"),
                                          ("12 - 19", "-7"), ("6 × 7", "42")])
def test_calculate_is_exact(expr, value):
    assert calculate(expr) == value
    assert Fraction(value) == Fraction(calculate(expr))


@pytest.mark.parametrize("expr", ["__import__('os').system('true')", "1/0", "(" * 10_000 + "1" + ")" * 10_000,
                                  "9" * 50, "2 ** 10", ""])
def test_calculate_refuses_what_is_not_arithmetic(expr):
    with pytest.raises(CountdownError):
        calculate(expr)


def test_used_calculator_needs_a_call_that_returned_a_value():
    ok = [{"role": "assistant", "content": ""}, {"role": "tool", "name": "calculate", "content": "78"}]
    bad = [{"role": "assistant", "content": ""}, {"role": "tool", "name": "calculate", "content": "{'error': 'x'}"}]
    assert used_calculator(completions=[ok, bad, [{"role": "assistant", "content": "78"}], "78"]) == [1.0, 0, 0, 0]


def test_the_tools_recipe_loads_and_its_tool_has_the_schema():
    from fasttrain.envs.tools import ToolCall, ToolWorkers
    from fasttrain.train import load_config
    cfg = load_config("tools")
    assert cfg.env.tools == ("fasttrain.tasks.calculator:calculate",) and cfg.rollout.max_tool_calls == 2
    w = ToolWorkers(cfg.env.tools, timeout=cfg.env.tool_timeout, shards=1)
    try:
        fn = w.schemas[0]["function"]
        assert fn["name"] == "calculate" and fn["parameters"]["required"] == ["expression"]
        out = w.call({0: [ToolCall("calculate", {"expression": "3 * (4 + 5)"}),
                          ToolCall("calculate", {"expression": "open('/etc/passwd')"})]})
        assert out[0][0][0]["content"] == "27"
        assert out[0][1][0]["content"].startswith("{'error': ") and out[0][1][1]
    finally:
        w.close()


def test_init_tools_writes_a_starter_that_trains(tmp_path, monkeypatch):
    from fasttrain.cli import app
    monkeypatch.chdir(tmp_path)
    r = CliRunner()
    res = r.invoke(app, ["init", "calc", "--tools"])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in (tmp_path / "calc").iterdir()) == ["data.jsonl", "recipe.toml", "rewards.py",
                                                                      "tools.py"]
    res = r.invoke(app, ["run", "calc/recipe.toml", "--no-progress", "--set", "run.steps=1",
                         "--set", "rollout.max_new_tokens=24", "--set", "probe.every=0", *TINY])
    assert res.exit_code == 0, res.output
    (run,) = (tmp_path / "runs").iterdir()
    row = read_jsonl(run / "metrics.jsonl")[0]
    assert row["tool_calls"] >= 0 and row["turns"] >= 1.0 and "tool_errors" in row
    sample = read_jsonl(run / "samples.jsonl")[0]
    assert len(sample["conversations"]) == 16 and sample["conversations"][0][0]["role"] == "assistant"
