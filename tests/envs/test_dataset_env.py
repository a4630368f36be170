"""The dataset environment: every file format, chat prompts, the held-out probe, reward functions
(sync, async, invalid verdicts, timeouts, a dying worker) and the errors for bad input."""
import json
import math
import os
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("datasets")
from datasets import Dataset, DatasetDict  # noqa: E402

from fasttrain.envs import INVALID_CORE, Environment, load_env  # noqa: E402
from fasttrain.envs.dataset import DatasetEnvironment, DatasetError  # noqa: E402
from fasttrain.envs.reward_functions import RewardSpecError  # noqa: E402

HERE = Path(__file__).parent
REWARDS = str(HERE.parent / "support" / "dataset_rewards.py")
ROWS = [{"prompt": f"What is {i} plus {i}?", "answer": 2 * i, "note": f"n{i}"} for i in range(5)]


def rw(*names: str) -> list[str]:
    return [f"{REWARDS}:{n}" for n in names]


def write_jsonl(path: Path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def jsonl(tmp_path):
    return write_jsonl(tmp_path / "data.jsonl", ROWS)


def test_every_format_loads_the_same_rows(tmp_path):
    ds = Dataset.from_list(ROWS)
    paths = {"jsonl": tmp_path / "d.jsonl", "parquet": tmp_path / "d.parquet", "csv": tmp_path / "d.csv",
             "disk": tmp_path / "disk", "dict": tmp_path / "dict"}
    ds.to_json(str(paths["jsonl"]))
    ds.to_parquet(str(paths["parquet"]))
    ds.to_csv(str(paths["csv"]), index=False)
    ds.save_to_disk(str(paths["disk"]))
    DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(paths["dict"]))
    for kind, path in paths.items():
        env = DatasetEnvironment(dataset=str(path), rewards=rw("matches"), probe_rows=2)
        assert isinstance(env, Environment)
        train, probe = env.prompts("train"), env.prompts("probe")
        assert [p.id for p in train] == ["dataset/0", "dataset/1", "dataset/2"], kind
        assert [p.id for p in probe] == ["dataset/3", "dataset/4"], kind
        assert [p.spec for p in train + probe] == [r["prompt"] for r in ROWS], kind
        assert [dict(p.fields) for p in train + probe] == [{"answer": r["answer"], "note": r["note"]} for r in ROWS]
        # the `answer` column reaches the reward by name: "6" is right for row 3 only
        s = env.score_many([probe[0], probe[1]], ["it is 6", "it is 6"])
        assert [x.channels["matches"] for x in s] == [1.0, 0.0], kind
        env.close()


def test_chat_message_prompts_go_through_the_chat_template(tmp_path, monkeypatch):
    from support.tiny_world import ByteTokenizer

    from fasttrain.train.answers import prompt_token_ids

    rows = [{"prompt": [{"role": "user", "content": "hi"}], "answer": "a"},
            {"prompt": [{"role": "system", "content": "Own rules."}, {"role": "user", "content": "yo"}], "answer": "b"},
            {"prompt": [{"role": "user", "content": "probe me"}], "answer": "c"}]
    env = DatasetEnvironment(dataset=write_jsonl(tmp_path / "chat.jsonl", rows), rewards=rw("chat_shape"),
                             probe_rows=1, system_prompt="Be brief.")
    train = env.prompts("train")
    assert env.chat_messages(train[0]) == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert env.chat_messages(train[1]) == rows[1]["prompt"]          # its own system message stays

    class TemplatedBytes(ByteTokenizer):
        chat_template = "a template"

        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
            return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    ids = prompt_token_ids(TemplatedBytes(), env, train)
    assert [TemplatedBytes().decode(x) for x in ids] == ["<system>Be brief.<user>hi<assistant>",
                                                         "<system>Own rules.<user>yo<assistant>"]
    ids = prompt_token_ids(ByteTokenizer(), env, train, answer_prefix="<n>")   # no template: plain layout
    assert ByteTokenizer().decode(ids[0]) == "System: Be brief.\n\nUser: hi\n\nAssistant:<n>"
    # the reward sees the prompt's messages and a one-message assistant completion, as under TRL
    s = env.score_many(train, ["x", "y"])
    assert [x.channels["chat_shape"] for x in s] == [11.0, 21.0]
    env.close()


def test_the_last_rows_are_held_out_and_overlaps_are_refused(tmp_path, jsonl):
    env = DatasetEnvironment(dataset=jsonl, rewards=rw("matches"), probe_rows=1)
    assert [p.id for p in env.prompts("train")] == [f"dataset/{i}" for i in range(4)]
    assert [p.spec for p in env.prompts("probe")] == [ROWS[4]["prompt"]]
    env.close()
    dup = write_jsonl(tmp_path / "dup.jsonl", ROWS + [ROWS[1]])
    with pytest.raises(DatasetError, match=r"held-out rows .*1 probe prompt.*probe row 5 = training row 1"):
        DatasetEnvironment(dataset=dup, rewards=rw("matches"), probe_rows=2)
    probe = write_jsonl(tmp_path / "probe.jsonl", [{"prompt": "new", "answer": 1, "note": ""}, ROWS[2]])
    with pytest.raises(DatasetError, match=r"env.probe_dataset: 1 probe prompt.*probe row 1 = training row 2"):
        DatasetEnvironment(dataset=jsonl, rewards=rw("matches"), probe_dataset=probe)
    ok = write_jsonl(tmp_path / "ok.jsonl", [{"prompt": "new", "answer": 1, "note": ""}])
    env = DatasetEnvironment(dataset=jsonl, rewards=rw("matches"), probe_dataset=ok)
    assert len(env.prompts("train")) == 5 and [p.id for p in env.prompts("probe")] == ["probe_dataset/0"]
    env.close()


def test_bad_input_is_a_clear_error(tmp_path, jsonl):
    def err(match, **kw):
        args = {"dataset": jsonl, "rewards": rw("matches"), "probe_rows": 1, **kw}
        with pytest.raises((DatasetError, RewardSpecError), match=match):
            DatasetEnvironment(**args)

    err(r"env.dataset: '.*nope.jsonl' does not exist", dataset=str(tmp_path / "nope.jsonl"))
    err(r"env.dataset is not set", dataset="")
    (tmp_path / "x.txt").write_text("a")
    err(r"unknown format '.txt'", dataset=str(tmp_path / "x.txt"))
    nocol = write_jsonl(tmp_path / "q.jsonl", [{"question": "q", "answer": 1}])
    err(r"has no 'prompt' column; its columns are question, answer", dataset=nocol)
    (tmp_path / "empty.jsonl").write_text("\n")
    err(r"'.*empty.jsonl' has no rows", dataset=str(tmp_path / "empty.jsonl"))
    (tmp_path / "empty.csv").write_text("prompt,answer\n")
    err(r"'.*empty.csv' has no rows", dataset=str(tmp_path / "empty.csv"))
    Dataset.from_list(ROWS).select([]).to_parquet(str(tmp_path / "empty.parquet"))
    err(r"'.*empty.parquet' has no rows", dataset=str(tmp_path / "empty.parquet"))
    err(r"row 1: 'prompt' must be text or a non-empty list of chat messages",
        dataset=write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok"}, {"prompt": [{"role": "user"}]}]))
    (tmp_path / "folder").mkdir()
    err(r"not one written by datasets' save_to_disk", dataset=str(tmp_path / "folder"))
    err(r"env.probe_rows = 5 holds out every row", probe_rows=5)
    err(r"set env.probe_rows = N .* or env.probe_dataset", probe_rows=0)
    err(r"both set", probe_dataset=jsonl)
    err(r"env.rewards is empty", rewards=[])
    err(r"env.core: 'nope' is not one of the rewards: matches", core="nope")
    err(r"no such file", rewards=[str(tmp_path / "missing.py") + ":f"])
    err(r"cannot load .*:absent.*AttributeError", rewards=rw("absent"))
    err(r"cannot load 'no_such_module_xyz:f'.*ModuleNotFoundError", rewards=["no_such_module_xyz:f"])
    err(r"must look like 'package.module:function'", rewards=["just_a_name"])
    err(r"two reward functions are named 'matches'", rewards=rw("matches", "matches"))


def test_sync_async_and_every_kind_of_invalid_verdict(jsonl):
    env = DatasetEnvironment(dataset=jsonl, rewards=rw("matches", "shorter", "picky"), probe_rows=1)
    assert [c.name for c in env.channels] == ["matches", "shorter", "picky"] and env.core == "matches"
    p = env.prompts("train")[2]                                      # answer 4
    answers = ["4", "raise", "none", "nan", "inf", "str", "44"]
    ids = [[7] * (k + 1) for k in range(len(answers))]               # k + 1 tokens each
    s = env.score_many([p] * len(answers), answers, completion_ids=ids)
    assert [x.valid for x in s] == [True, False, False, False, False, False, True]
    assert [x.reason for x in s] == [
        None, "reward 'picky' raised ValueError: picky cannot read 'raise'", "reward 'picky' returned None",
        "reward 'picky' returned nan", "reward 'picky' returned inf", "reward 'picky' returned a non-number 'x'",
        None]
    assert [x.channels["shorter"] for x in s] == [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0]  # async, ids passed
    assert [x.channels["matches"] for x in s] == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    # an invalid answer's failed channel takes the call's lowest valid value; its core is <= -1
    assert [x.channels["picky"] for x in s] == [1.0] * 7
    assert [x.core for x in s] == [1.0, INVALID_CORE, INVALID_CORE, INVALID_CORE, INVALID_CORE, INVALID_CORE, 1.0]
    assert [x.success for x in s] == [True, False, False, False, False, False, True]
    assert env.invalid_counts == {"matches": 0, "shorter": 0, "picky": 5}
    env.close()


def test_core_names_the_channel_the_guard_and_probe_use(jsonl):
    env = DatasetEnvironment(dataset=jsonl, rewards=rw("matches", "shorter"), probe_rows=1, core="shorter")
    s = env.score_many(env.prompts("train")[:1], ["0"], completion_ids=[[1, 2, 3]])[0]
    assert (s.core, s.success, s.channels["matches"]) == (-3.0, False, 1.0)
    bad = env.score_many(env.prompts("train")[:2], ["0", "0"], completion_ids=[[1] * 5, [1] * 9])
    assert [b.core for b in bad] == [-5.0, -9.0]
    env.close()
    # invalid core sits below every valid core of the same call, even when those are below -1
    env = DatasetEnvironment(dataset=jsonl, rewards=rw("shorter", "picky"), probe_rows=1)
    s = env.score_many(env.prompts("train")[:1] * 2, ["ok", "none"], completion_ids=[[1] * 4, [1]])
    assert [x.core for x in s] == [-4.0, -4.0] and [x.valid for x in s] == [True, False]
    env.close()


def test_hung_rewards_time_out_together_and_the_next_call_works(jsonl):
    hung = ["stuck", "stuck_async", "sleepy"]                        # busy loop, awaited sleep, blocking sleep
    env = DatasetEnvironment(dataset=jsonl, rewards=rw("matches", *hung), probe_rows=1, reward_timeout=0.5)
    p = env.prompts("train")[2]
    workers = env.pool.pids()
    s = env.score_many([p, p], ["hang", "4"])
    assert [x.reason for x in s] == ["; ".join(f"reward '{n}' timed out after 0.5 s" for n in hung)] * 2
    assert [x.channels["matches"] for x in s] == [0.0, 1.0]          # the other reward still scored
    assert len(set(workers) - set(env.pool.pids())) == 3 and env.pool.timeouts == 3   # hung ones killed
    s = env.score_many([p], ["4"])
    assert s[0].valid and [f.restarts for f in env.rewards] == [0, 1, 1, 1]
    assert s[0].channels == {"matches": 1.0, "stuck": 0.5, "stuck_async": 0.25, "sleepy": 0.0}
    env.close()


def test_a_reward_whose_process_dies_makes_its_answers_invalid(jsonl):
    env = DatasetEnvironment(dataset=jsonl, rewards=rw("stuck"), probe_rows=1)
    p = env.prompts("train")[0]
    s = env.score_many([p], ["die"])[0]
    assert not s.valid and s.reason == "reward 'stuck' crashed (its worker process exited with code 3)"
    assert env.score_many([p], ["fine"])[0].valid
    env.close()


def test_verl_rows_give_rewards_a_ground_truth_column(tmp_path):
    rows = [{"data_source": "toy", "prompt": [{"role": "user", "content": f"Say {w}."}], "ability": "echo",
             "reward_model": {"style": "rule", "ground_truth": w}, "extra_info": {"index": i}}
            for i, w in enumerate(["red", "green", "blue"])]
    Dataset.from_list(rows).to_parquet(str(tmp_path / "verl.parquet"))
    env = DatasetEnvironment(dataset=str(tmp_path / "verl.parquet"), rewards=rw("ground_truth_equal"), probe_rows=1)
    train = env.prompts("train")
    assert train[1].fields["ground_truth"] == "green" and train[1].fields["extra_info"] == {"index": 1}
    s = env.score_many(train, ["green", "green"])
    assert [x.channels["ground_truth_equal"] for x in s] == [0.0, 1.0]
    env.close()


def test_load_env_builds_it_by_name_with_a_module_spec(jsonl, monkeypatch):
    env = load_env("dataset", dataset=jsonl, rewards=["support.dataset_rewards:matches"], probe_rows=1)
    assert env.name == "dataset:data.jsonl" and env.score(env.prompts("probe")[0], "8").core == 1.0
    env.close()


def test_a_worker_that_cannot_restart_costs_answers_not_the_run(tmp_path, jsonl):
    copy = tmp_path / "gone.py"
    copy.write_text(Path(REWARDS).read_text())
    env = DatasetEnvironment(dataset=jsonl, rewards=[f"{copy}:stuck", f"{REWARDS}:matches"], probe_rows=1)
    p = env.prompts("train")[0]
    assert env.score_many([p], ["die"])[0].reason.startswith("reward 'stuck' crashed")
    copy.unlink()                                                    # the next start cannot import it
    s = env.score_many([p], ["0"])[0]
    assert not s.valid and s.channels["matches"] == 1.0
    assert s.reason.startswith("reward 'stuck' could not be restarted: env.rewards: cannot load")
    env.close()


def test_a_reward_over_its_memory_is_killed_and_the_next_call_works(jsonl):
    env = DatasetEnvironment(dataset=jsonl, rewards=rw("matches", "hungry"), probe_rows=1, worker_memory_mb=200)
    p = env.prompts("train")[2]
    s = env.score_many([p, p], ["hog", "4"])
    assert [x.valid for x in s] == [False, False] and [x.channels["matches"] for x in s] == [0.0, 1.0]
    assert re.fullmatch(r"reward 'hungry' used \d+ MB, over env.worker_memory_mb = 200 \(killed with its processes\)",
                        s[0].reason), s[0].reason
    assert env.counters()["reward_workers_over_memory"] == 1 and env.rewards[1].restarts == 1
    s = env.score_many([p], ["4"])
    assert s[0].valid and s[0].channels == {"matches": 1.0, "hungry": 0.5}
    env.close()
