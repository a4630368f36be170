"""Environment classes in TRL's protocol: reset(**row) per answer in the worker that holds the
row's instance, its string appended to the last user message, public methods as tools, get_reward()
as a channel named after the class, and reward functions that ask for `environments=` run with the
instances."""
import pytest

from support.agent_files import TOOLS, tiny_tool_policy, tool_specs, write_task
from fasttrain.envs.dataset import DatasetEnvironment
from fasttrain.envs.tools import ToolCall, ToolWorkers
from fasttrain.train.answers import answer_token_ids, score_answers
from fasttrain.train.tool_rollout import sample_tool_answers

pytestmark = pytest.mark.one_thread      # the one-thread default (tests/conftest.py)

pytest.importorskip("datasets")


@pytest.fixture(scope="module")
def policy():
    return tiny_tool_policy()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    folder = tmp_path_factory.mktemp("counter")
    rows = [{"prompt": [{"role": "user", "content": "Use the counter."}], "target": t} for t in (3, 4, 5, 6)]
    e = DatasetEnvironment(dataset=str(write_task(folder, rows)), probe_rows=1, environment=f"{TOOLS}:Counter",
                           rewards=tool_specs("rewards_see_environments"), tools=tool_specs("add"))
    yield e
    e.close()


def test_the_class_methods_are_tools_and_get_reward_a_channel(env):
    names = [s["function"]["name"] for s in env.tool_workers.schemas]
    assert names == ["add", "increment"]                     # reset, get_reward and _private are not tools
    assert [c.name for c in env.channels] == ["rewards_see_environments", "Counter"]


def test_a_counter_episode_scores_by_its_instance(policy, env):
    model, tok = policy
    call = '<tool_call>\n{"name": "increment", "arguments": {"step": %d}}\n</tool_call><|im_end|>'
    scripts = [call % 3 + "Done.<|im_end|>", call % 2 + call % 1 + "Done.<|im_end|>", "Done.<|im_end|>"]
    prompt = env.prompts("train")[0]                         # target 3
    roll, texts = sample_tool_answers(model, tok, env, [prompt], group_size=3, max_new_tokens=160, temperature=1.0,
                                      seed=[0], eos_token_ids=[tok.eos_token_id],
                                      replay=[tok(s, add_special_tokens=False)["input_ids"] for s in scripts])
    assert "Use the counter.Count to 3." in tok.decode(roll.input_ids[0, :roll.prompt_len])   # TRL: appended
    tools = [[m["content"] for m in c if m["role"] == "tool"] for c in roll.conversations]
    assert tools == [["3"], ["2", "3"], []]                 # each answer has its own instance
    scores = score_answers(env, [prompt] * 3, texts, "train", completion_ids=answer_token_ids(roll),
                           conversations=roll.conversations)
    assert [s.channels["Counter"] for s in scores] == [1.0, 1.0, 0.0]
    assert [s.channels["rewards_see_environments"] for s in scores] == [1.0, 1.0, 1.0]


def test_a_lost_instance_is_an_error_not_a_crash():
    w = ToolWorkers(tool_specs("hang"), environment=f"{TOOLS}:Counter", timeout=1.0, shards=1)
    try:
        assert w.reset([{"target": 2}]) == [("ok", "Count to 2.")]
        out = w.call({0: [ToolCall("hang", {"x": 1})]})
        assert out[0][0][0]["content"] == "{'error': 'timed out after 1 s'}"
        again = w.call({0: [ToolCall("increment", {"step": 1})]})
        assert "its environment instance was lost" in again[0][0][0]["content"] and again[0][0][1]
        assert w.rewards([0])[0][0] is None
        assert w.reset([{"target": 2}]) == [("ok", "Count to 2.")]          # the next rollout starts afresh
        assert w.call({0: [ToolCall("increment", {"step": 2})]})[0][0][0]["content"] == "2"
        assert w.rewards([0]) == [(1.0, None)]
    finally:
        w.close()


def test_a_reset_that_raises_spoils_only_its_answer():
    w = ToolWorkers([], environment=f"{TOOLS}:Flaky", timeout=5.0, shards=1)
    try:
        got = w.reset([{"target": 1}, {"target": "boom"}])
        assert got[0] == ("ok", "Count to 1.") and got[1] == ("raised", "reset exploded")
        assert w.call({0: [ToolCall("increment", {"step": 1})]})[0][0][0]["content"] == "1"
        assert w.rewards([0])[0] == (1.0, None)
        value, why = w.rewards([1])[0]
        assert value is None and "get_reward raised" in why
    finally:
        w.close()


def test_a_worker_that_cannot_start_again_fails_its_calls_not_the_run(tmp_path):
    f = tmp_path / "gone.py"
    f.write_text('import time\n\n\ndef wait(x: int) -> str:\n    """Waits.\n\n    Args:\n        x: Seconds.\n'
                 '    """\n    time.sleep(x)\n    return "done"\n')
    w = ToolWorkers([f"{f}:wait"], timeout=1.0, shards=1)
    try:
        f.unlink()                                         # the next start cannot import it
        first = w.call({0: [ToolCall("wait", {"x": 30})]})
        assert first[0][0][0]["content"] == "{'error': 'timed out after 1 s'}"
        again = w.call({0: [ToolCall("wait", {"x": 0})]})
        assert "no such file" in again[0][0][0]["content"] and again[0][0][1]          # an error message
    finally:
        w.close()


def test_a_fresh_worker_imports_the_tools_before_the_calls_deadline(tmp_path):
    """A tool file that takes 3 s to import, with a 1 s tool deadline: after a timeout replaces
    the worker, the fresh one imports the file within the pool's load timeout, and the next call's
    deadline bounds the call alone (before, the import ran inside it and timed the call out)."""
    f = tmp_path / "slow.py"
    f.write_text('import time\n\ntime.sleep(3)\n\n\ndef wait(x: int) -> str:\n    """Waits.\n\n    Args:\n'
                 '        x: Seconds.\n    """\n    time.sleep(x)\n    return "done"\n')
    w = ToolWorkers([f"{f}:wait"], timeout=1.0, shards=1)
    try:
        first = w.call({0: [ToolCall("wait", {"x": 30})]})
        assert first[0][0][0]["content"] == "{'error': 'timed out after 1 s'}" and w.restarts == 1
        assert w.call({0: [ToolCall("wait", {"x": 0})]})[0][0][0]["content"] == "done"
        assert w.restarts == 1
    finally:
        w.close()
