"""Tools in worker processes: schemas from transformers' get_json_schema, results as TRL renders
them (str(result); an exception or a timeout as str({"error": ...})), and hostile tools that
hang, print, return 10 MB or kill their process, none of which stops the caller."""
import pytest

from support.agent_files import TOOLS, tool_specs
from fasttrain.envs.reward_functions import RewardSpecError
from fasttrain.envs.tools import MAX_RESULT_CHARS, ToolCall, ToolWorkers, check_arguments, error_text

pytestmark = pytest.mark.one_thread      # the one-thread default (tests/conftest.py)


@pytest.fixture(scope="module")
def box():
    w = ToolWorkers(tool_specs("add", "shout", "fail", "hang", "noisy", "huge", "die"), timeout=1.0, shards=2)
    yield w
    w.close()


def _contents(replies):
    return {slot: [m["content"] for m, _ in msgs] for slot, msgs in replies.items()}


def test_schemas_are_transformers_get_json_schema(box):
    from transformers.utils import get_json_schema
    import importlib.util
    spec = importlib.util.spec_from_file_location("agent_tools_here", TOOLS)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert box.schemas[0] == get_json_schema(mod.add)
    assert [s["function"]["name"] for s in box.schemas] == ["add", "shout", "fail", "hang", "noisy", "huge", "die"]


def test_results_are_rendered_as_trl_renders_them(box):
    out = box.call({0: [ToolCall("add", {"a": 2, "b": 3}), ToolCall("shout", {"text": "hi"})],
                    1: [ToolCall("fail", {"x": 7})]})
    assert _contents(out) == {0: ["5", "HI"], 1: ["{'error': 'bad x 7'}"]}
    assert [f for _, f in out[0]] == [False, False] and out[1][0][1] is True
    assert out[0][0][0] == {"role": "tool", "name": "add", "content": "5"}


def test_unknown_tools_and_bad_arguments_run_nothing(box):
    out = box.call({0: [ToolCall("os.system", {"command": "true"}), ToolCall("add", {"a": "2", "b": 3}),
                        ToolCall("add", {"a": 1}), ToolCall("add", [1, 2]), ToolCall("add", {"a": 1, "b": 2, "c": 3}),
                        ToolCall("__import__", {"name": "os"}), ToolCall("add", {"a": True, "b": 1})]})
    got = _contents(out)[0]
    assert got[0] == "{'error': 'Tool os.system not found.'}"
    assert got[1] == error_text("argument 'a' must be integer, got str")
    assert "missing required argument(s) ['a', 'b']"[:26] in got[2] and "['b']" in got[2]
    assert got[3] == error_text("arguments must be a JSON object, got list")
    assert "unknown argument(s) ['c']" in got[4]
    assert got[5] == "{'error': 'Tool __import__ not found.'}"
    assert got[6] == error_text("argument 'a' must be integer, got bool")
    assert all(failed for _, failed in out[0])


def test_check_arguments_accepts_ints_for_numbers_and_nothing_else():
    schema = {"parameters": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}}
    assert check_arguments(schema, {"x": 1}) is None and check_arguments(schema, {"x": 1.5}) is None
    assert check_arguments(schema, {"x": "1"}) == "argument 'x' must be number, got str"


def test_a_hanging_tool_times_out_and_the_other_rows_still_get_answers(box):
    restarts = box.restarts
    out = box.call({0: [ToolCall("hang", {"x": 1}), ToolCall("add", {"a": 1, "b": 1})],
                    1: [ToolCall("add", {"a": 2, "b": 2})]})
    assert _contents(out) == {0: ["{'error': 'timed out after 1 s'}", "2"], 1: ["4"]}
    assert box.restarts == restarts + 1


def test_prints_go_to_stderr_and_a_10_mb_result_is_cut_in_the_worker(box, capfd):
    out = box.call({0: [ToolCall("noisy", {"x": 1}), ToolCall("huge", {"x": 1})]})
    quiet, big = _contents(out)[0]
    assert quiet == "quiet"
    assert len(big) == MAX_RESULT_CHARS + 1                 # over the cap: the rollout drops it
    assert "noise on stdout" not in capfd.readouterr().out


def test_a_tool_that_kills_its_worker_is_an_error_and_the_next_call_works(box):
    out = box.call({0: [ToolCall("die", {"x": 1}), ToolCall("add", {"a": 5, "b": 5})]})
    assert _contents(out) == {0: ["{'error': 'crashed (its worker process exited with code 3)'}", "10"]}


def test_bad_specs_are_errors_that_name_the_key(tmp_path):
    with pytest.raises(RewardSpecError, match="env.tools: 'nope' must look like"):
        ToolWorkers(["nope"])
    bad = tmp_path / "t.py"
    bad.write_text("def f(x):\n    return x\n")
    with pytest.raises(RewardSpecError, match="cannot load: DocstringParsingException"):
        ToolWorkers([f"{bad}:f"], shards=1)
