"""A training run with tools on the tiny model: scripted model turns (some with a tool call) go
through the trainer; the metrics count tool calls, errors and turns, the token counts are the
model's tokens only, and samples.jsonl holds each answer's turns."""

import pytest
import torch

from fasttrain.train import Trainer, load_config
from fasttrain.train.run_files import read_jsonl

from support.agent_files import tool_specs, write_task

pytestmark = pytest.mark.one_thread      # the one-thread default (tests/conftest.py)

pytest.importorskip("datasets")

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'
BAD = '<tool_call>\n{"name": "fail", "arguments": {"x": 1}}\n</tool_call><|im_end|>'
FINAL = "The answer is 5.<|im_end|>"


def _recipe(tmp_path, **rollout):
    return {
        "run": {"name": "tools", "seed": 3, "steps": 2, "out": str(tmp_path / "runs"), "device": "cpu", "threads": 1},
        "policy": {"model": "support.agent_files:tiny_tool_policy", "dtype": "float32", "rank": 4, "alpha": 8.0},
        "env": {"name": "dataset", "dataset": str(write_task(tmp_path)), "probe_rows": 2,
                "rewards": tool_specs("sees_conversation", "tool_turns"), "tools": tool_specs("add", "fail")},
        "rollout": {"prompts_per_step": 1, "group_size": 3, "max_new_tokens": 80, **rollout},
        "advantages": {"priorities": {}, "floor": -1e9},
        "loss": {"kind": "cispo", "passes": 1, "token_mask": "all"},
        "optim": {"micro_batch": 3}, "probe": {"every": 0, "prompts": 1, "samples": 2},
    }


def test_a_run_with_tools_logs_calls_errors_turns_and_model_tokens(tmp_path, monkeypatch):
    import fasttrain.rollout.multi_turn as mt
    real = mt.sample_turns
    seen = []

    def scripted(model, prompt_ids, **kw):
        tok = scripted.tok
        scripts = [CALL + FINAL, BAD + FINAL, FINAL]
        G = kw["group_size"]
        kw["replay"] = [tok(scripts[b % 3], add_special_tokens=False)["input_ids"] for b in range(len(prompt_ids) * G)]
        roll = real(model, prompt_ids, **kw)
        seen.append(roll)
        return roll

    monkeypatch.setattr(mt, "sample_turns", scripted)
    cfg = load_config(_recipe(tmp_path))
    tr = Trainer(cfg, progress=False)
    tr._setup()
    scripted.tok = tr.tokenizer
    tr.train()
    run = next((tmp_path / "runs").iterdir())
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    train_rolls = [r for r in seen if r.completion_ids.shape[0] == 3]         # the probe samples 2 per prompt
    for r, roll in zip(rows, train_rolls):
        assert r["tool_calls"] == 2 and r["tool_errors"] == 1
        assert r["turns"] == pytest.approx((2 + 2 + 1) / 3)
        assert r["tokens"] == int(roll.action_mask.sum()) < int(roll.completion_mask.sum())
        assert r["mean_length"] == pytest.approx(int(roll.action_mask.sum()) / 3)
        assert r["reward_tool_turns"] == pytest.approx(2 / 3)
        assert r["reward_sees_conversation"] in (0.0, 1.0)           # -1 for an answer that is not a message list
    samples = read_jsonl(run / "samples.jsonl")
    conv = samples[0]["conversations"]
    assert [m["role"] for m in conv[0]] == ["assistant", "tool", "assistant"]
    assert conv[1][1]["content"] == "{'error': 'bad x 1'}"
    assert samples[0]["answers"] == ["The answer is 5."] * 3


def test_the_completions_table_shows_every_turn():
    from fasttrain.train.trackers import completions_table
    samples = {"step": 1, "prompt_ids": ["p"], "answers": ["5"], "valid": [True], "core": [1.0], "rewards": {},
               "conversations": [[{"role": "assistant", "content": "", "tool_calls": [
                   {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
                   {"role": "tool", "name": "add", "content": "5"}, {"role": "assistant", "content": "5"}]]}
    _, rows = completions_table(samples, {"p": "2+3?"})
    assert rows[0][3] == "assistant:  -> add({'a': 2, 'b': 3})\n[tool add] 5\nassistant: 5"


def test_dynamic_sampling_with_tool_rollouts(tmp_path, monkeypatch):
    """rollout.dynamic_sampling with tools: a first round whose answers are all alike (a dead group)
    is dropped, the second round's group (some answers call a tool) is trained on; the tool counts
    are every answer's, the conversations of both groups are in samples.jsonl."""
    import fasttrain.rollout.multi_turn as mt
    import fasttrain.train.trainer as trainer_mod
    real = mt.sample_turns
    seen, updated = [], []

    def scripted(model, prompt_ids, **kw):
        tok = scripted.tok
        G = kw["group_size"]
        n_train = sum(r.group_size == 3 for r in seen)          # the probe samples 2 answers a prompt
        scripts = [FINAL] * 3 if G == 3 and n_train % 2 == 0 else [CALL + FINAL, BAD + FINAL, FINAL]
        kw["replay"] = [tok(scripts[b % 3], add_special_tokens=False)["input_ids"] for b in range(len(prompt_ids) * G)]
        roll = real(model, prompt_ids, **kw)
        seen.append(roll)
        return roll

    real_update = trainer_mod.update_policy

    def update(model, params, optimizer, roll, *a, **k):
        updated.append(roll)
        return real_update(model, params, optimizer, roll, *a, **k)

    monkeypatch.setattr(mt, "sample_turns", scripted)
    monkeypatch.setattr(trainer_mod, "update_policy", update)
    cfg = load_config(_recipe(tmp_path, dynamic_sampling=True, dynamic_max_rounds=2))
    tr = Trainer(cfg, progress=False)
    tr._setup()
    scripted.tok = tr.tokenizer
    tr.train()
    run = next((tmp_path / "runs").iterdir())
    rows = read_jsonl(run / "metrics.jsonl")
    samples = read_jsonl(run / "samples.jsonl")
    train_rolls = [r for r in seen if r.completion_ids.shape[0] == 3]
    for k, (r, s) in enumerate(zip(rows, samples)):
        assert r["dynamic_rounds"] == 1 and r["dynamic_groups"] == 2 and r["dynamic_groups_kept"] == 1
        assert s["kept"] == [False, True] and len(set(s["prompt_ids"])) == 2
        assert r["tool_calls"] == 2 and r["tool_errors"] == 1                 # over both rounds' answers
        assert [m["role"] for m in s["conversations"][3]] == ["assistant", "tool", "assistant"]
        kept_roll = train_rolls[2 * k + 1]
        assert torch.equal(updated[k].completion_ids, kept_roll.completion_ids)      # the live round trained
        assert r["tokens"] == int(kept_roll.action_mask.sum())
        assert r["nonzero_adv_share_before"] == pytest.approx(0.5) and r["nonzero_adv_share"] == 1.0
