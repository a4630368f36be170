"""Tool answers end to end on a tiny model with SmolLM2's tokenizer and the ChatML tool template:
scripted model turns (replay) go through the multi-turn rollout, the workers and the template
diff; the conversation, the token ids, the masks and what reward functions see are checked."""
import pytest
import torch

from support.agent_files import TOOLS, smollm2_tokenizer, tiny_tool_policy, tool_specs, write_task
from fasttrain.envs.dataset import DatasetEnvironment
from fasttrain.models.tool_template import CHATML_TOOLS, tool_suffix_ids
from fasttrain.train.answers import answer_token_ids, score_answers
from fasttrain.train.tool_rollout import sample_tool_answers

pytestmark = pytest.mark.one_thread      # the one-thread default (tests/conftest.py)

pytest.importorskip("datasets")

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'
FINAL = "The answer is 5.<|im_end|>"


@pytest.fixture(scope="module")
def policy():
    return tiny_tool_policy()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    folder = tmp_path_factory.mktemp("task")
    e = DatasetEnvironment(dataset=str(write_task(folder)), rewards=tool_specs("sees_conversation", "tool_turns"),
                           probe_rows=2, tools=tool_specs("add", "fail", "huge"), tool_timeout=5.0)
    yield e
    e.close()


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _run(policy, env, scripts, max_new=120, **kw):
    model, tok = policy
    prompts = env.prompts("train")[:1]
    replay = [_ids(tok, "".join(s)) for s in scripts]
    return sample_tool_answers(model, tok, env, prompts, group_size=len(scripts), max_new_tokens=max_new,
                               temperature=1.0, seed=[0], eos_token_ids=[tok.eos_token_id], replay=replay, **kw)


def test_a_tool_turn_is_run_rendered_and_masked(policy, env):
    model, tok = policy
    roll, texts = _run(policy, env, [[CALL, FINAL], [FINAL]])
    conv = roll.conversations
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    assert conv[0] == [{"role": "assistant", "content": "", "tool_calls": [call]},
                       {"role": "tool", "name": "add", "content": "5"},
                       {"role": "assistant", "content": "The answer is 5."}]
    assert conv[1] == [{"role": "assistant", "content": "The answer is 5."}]
    suffix = tool_suffix_ids(tok, [{"role": "tool", "name": "add", "content": "5"}], CHATML_TOOLS)
    assert tok.decode(suffix) == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    a, f = _ids(tok, CALL), _ids(tok, FINAL)
    n = int(roll.lengths[0])
    assert roll.completion_ids[0, :n].tolist() == a + suffix + f
    assert roll.action_mask[0, :n].tolist() == [True] * len(a) + [False] * len(suffix) + [True] * len(f)
    assert roll.completion_mask[0, :n].all() and bool(roll.finished[0])
    assert torch.all(roll.logprobs[0, len(a):len(a) + len(suffix)] == 0)
    assert texts == ["The answer is 5.", "The answer is 5."]
    assert roll.tool_stats == {"tool_calls": 1, "tool_errors": 0, "turns": 3, "tool_results_dropped": 0}


def test_reward_functions_get_the_conversation_and_the_ids_with_tool_tokens(policy, env):
    roll, texts = _run(policy, env, [[CALL, FINAL], [FINAL]])
    prompts = [env.prompts("train")[0]] * 2
    scores = score_answers(env, prompts, texts, "train", completion_ids=answer_token_ids(roll),
                           conversations=roll.conversations)
    assert [s.channels for s in scores] == [{"sees_conversation": 1.0, "tool_turns": 1.0},
                                            {"sees_conversation": 1.0, "tool_turns": 0.0}]


def test_a_tool_turn_over_the_budget_is_dropped_and_the_answer_ends(policy, env):
    model, tok = policy
    a = _ids(tok, CALL)
    roll, _ = _run(policy, env, [[CALL, FINAL]], max_new=len(a) + 5)        # the tool turn needs ~20 tokens
    assert roll.conversations[0] == [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}]
    assert roll.completion_ids[0, :int(roll.lengths[0])].tolist() == a
    assert roll.tool_stats["tool_results_dropped"] == 1 and roll.tool_stats["tool_calls"] == 1


def test_max_tool_calls_stops_the_loop_as_trl_does(policy, env):
    roll, _ = _run(policy, env, [[CALL, CALL, FINAL]], max_tool_calls=1)
    roles = [m["role"] for m in roll.conversations[0]]
    assert roles == ["assistant", "tool", "assistant"]                      # the second call is not run
    assert roll.conversations[0][-1]["tool_calls"][0]["function"]["name"] == "add"
    assert roll.tool_stats["tool_calls"] == 1


def test_errors_are_rendered_and_the_answer_goes_on(policy, env):
    bad = ('<tool_call>\n{"name": "fail", "arguments": {"x": 1}}\n</tool_call>\n'
           '<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call><|im_end|>')
    roll, _ = _run(policy, env, [[bad, FINAL]])
    tools = [m for m in roll.conversations[0] if m["role"] == "tool"]
    assert [m["content"] for m in tools] == ["{'error': 'bad x 1'}", "{'error': 'Tool rm not found.'}"]
    assert roll.conversations[0][-1] == {"role": "assistant", "content": "The answer is 5."}
    assert roll.tool_stats["tool_errors"] == 2


def test_a_10_mb_result_is_dropped_without_tokenising_it(policy, env):
    huge = '<tool_call>\n{"name": "huge", "arguments": {"x": 1}}\n</tool_call><|im_end|>'
    roll, _ = _run(policy, env, [[huge, FINAL]], max_new=3000)
    assert [m["role"] for m in roll.conversations[0]] == ["assistant"]
    assert roll.tool_stats["tool_results_dropped"] == 1


def test_the_plan_and_the_length_check_count_the_tool_schemas(policy, env):
    from fasttrain.train.answers import prompt_token_ids
    model, tok = policy
    prompts = env.prompts("train")[:2]
    ids = prompt_token_ids(tok, env, prompts)
    roll, _ = _run(policy, env, [[FINAL]])
    assert ids[0] == roll.input_ids[0, :roll.prompt_len][roll.attention_mask[0, :roll.prompt_len].bool()].tolist()
    assert '"name": "add"' in tok.decode(ids[0])
