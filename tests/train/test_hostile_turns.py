"""Hostile model turns: malformed JSON, 10,000 tool calls in one turn, JSON nested 10,000 deep,
a call to something never registered. Each ends as an error message or a stopped answer; nothing
crashes and nothing runs that the user did not register."""
import pytest

from support.agent_files import smollm2_tokenizer, tool_specs
from fasttrain.envs.tools import ToolWorkers
from fasttrain.models.tool_template import CHATML_TOOLS, MAX_CALLS_PER_TURN, parse_turn
from fasttrain.train.tool_rollout import ToolTurns

pytestmark = pytest.mark.one_thread      # the one-thread default (tests/conftest.py)


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def workers():
    w = ToolWorkers(tool_specs("add"), timeout=5.0, shards=1)
    yield w
    w.close()


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _block(body):
    return f"<tool_call>\n{body}\n</tool_call>"


@pytest.mark.parametrize("body", ['{"name": "add", "arguments": {"a": 1, "b": 2}', '{"name": add}', "[1, 2]",
                                  '{"arguments": {}}', '{"name": 5, "arguments": {}}', "", "null",
                                  '{"name": "add", "arguments": "{not json"}'])
def test_malformed_calls_make_a_plain_turn_without_calls(tok, body):
    t = parse_turn(tok, _ids(tok, _block(body) + "<|im_end|>"))
    assert t.calls == [] and t.malformed and "tool_calls" not in t.message


def test_an_unclosed_call_is_malformed(tok):
    t = parse_turn(tok, _ids(tok, '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}'))
    assert t.calls == [] and t.malformed


def test_json_nested_10000_deep_is_refused_before_json_reads_it(tok):
    deep = '{"name": "add", "arguments": {"a": ' + "[" * 10_000 + "]" * 10_000 + ', "b": 1}}'
    t = parse_turn(tok, _ids(tok, _block(deep) + "<|im_end|>"))
    assert t.calls == [] and t.malformed


def test_deep_json_through_transformers_parse_response_falls_back_to_text(tok):
    trl_templates = pytest.importorskip("trl.chat_template_utils")
    import copy
    t2 = copy.copy(tok)
    t2.response_template = trl_templates.qwen3_template
    deep = '{"name": "add", "arguments": {"a": ' + "[" * 10_000 + "]" * 10_000 + ', "b": 1}}'
    t = parse_turn(t2, _ids(tok, _block(deep) + "<|im_end|>"), prefix=_ids(tok, "<|im_start|>assistant\n"))
    assert t.calls == [] and t.malformed
    ok = parse_turn(t2, _ids(tok, _block('{"name": "add", "arguments": {"a": 1, "b": 2}}') + "<|im_end|>"),
                    prefix=_ids(tok, "<|im_start|>assistant\n"))
    assert ok.calls == [("add", {"a": 1, "b": 2})] and not ok.malformed


def test_10000_calls_in_one_turn_stop_the_answer_and_run_nothing(tok, workers):
    text = "".join(_block('{"name": "add", "arguments": {"a": 1, "b": 2}}') for _ in range(10_000)) + "<|im_end|>"
    ids = _ids(tok, text)
    assert parse_turn(tok, ids).malformed
    turns = ToolTurns(tok, workers, CHATML_TOOLS, [[1, 2, 3]])
    assert turns([0], [ids], [10 ** 6]) == [None]
    assert turns.tool_calls == 0 and turns.malformed == 1
    few = "".join(_block('{"name": "add", "arguments": {"a": 1, "b": 2}}') for _ in range(MAX_CALLS_PER_TURN))
    assert len(parse_turn(tok, _ids(tok, few + "<|im_end|>")).calls) == MAX_CALLS_PER_TURN


def test_names_the_user_did_not_register_run_nothing(tok, workers, tmp_path):
    marker = tmp_path / "ran"
    calls = [("os.system", {"command": f"touch {marker}"}), ("eval", {"source": "1"}),
             ("__import__", {"name": "os"}), ("add.__globals__", {}), ("reset", {}), ("get_reward", {})]
    text = "".join(_block('{"name": "%s", "arguments": %s}' % (n, str(a).replace("'", '"'))) for n, a in calls)
    turns = ToolTurns(tok, workers, CHATML_TOOLS, [[1, 2, 3]])
    out = turns([0], [_ids(tok, text + "<|im_end|>")], [10 ** 5])
    assert out[0] is not None                                           # errors are tool results; it goes on
    tools = [m for m in turns.conversations[0] if m["role"] == "tool"]
    assert [m["content"] for m in tools] == [f"{{'error': 'Tool {n} not found.'}}" for n, _ in calls]
    assert not marker.exists() and turns.tool_errors == len(calls)
