"""policy.chat_template_kwargs: a Qwen3-style template rendered with thinking on and off through
fasttrain's prompt builders (text prompts, the dataset environment's chat prompts, the rollout
after build_policy), and variables a template does not read left out."""
import json
from pathlib import Path

import pytest
import torch

from fasttrain.envs import Prompt
from fasttrain.models import set_template_kwargs, system_message, template_kwargs
from fasttrain.train.answers import prompt_token_ids, sample_answers

HERE = Path(__file__).parent
OFF = {"enable_thinking": False}
EMPTY_THINK = "<think>\n\n</think>\n\n"


@pytest.fixture
def qwen3(monkeypatch):
    from support import qwen3_style
    return qwen3_style


class TextEnv:                       # an environment whose prompts are one user turn (like signal-a)
    answer_format = "Reply in one word."


def chatml(system: str, user: str) -> str:
    return f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def test_thinking_off_and_on_render_as_qwen3s_template_says(qwen3):
    prompts = [Prompt("p/0", "Name a colour."), Prompt("p/1", "Name a fruit.")]
    want = [chatml(system_message(TextEnv.answer_format), p.spec) for p in prompts]
    tok = qwen3.qwen3_style_tokenizer()
    assert [tok.decode(i) for i in prompt_token_ids(tok, TextEnv(), prompts)] == want      # nothing set: open
    assert set_template_kwargs(tok, OFF) == OFF and template_kwargs(tok) == OFF
    off = prompt_token_ids(tok, TextEnv(), prompts, answer_prefix="Answer:")
    assert [tok.decode(i) for i in off] == [w + EMPTY_THINK + "Answer:" for w in want]
    think = tok.convert_tokens_to_ids(["<think>", "</think>"])
    assert all(i[-len("Answer:") - 6:-len("Answer:")] == [think[0], 198, 198, think[1], 198, 198] for i in off)
    set_template_kwargs(tok, {"enable_thinking": True})
    assert [tok.decode(i) for i in prompt_token_ids(tok, TextEnv(), prompts)] == want


def test_the_dataset_environments_chat_prompts_follow_the_switch(qwen3, tmp_path):
    pytest.importorskip("datasets")
    from fasttrain.envs.dataset import DatasetEnvironment
    rows = [{"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4"},
            {"prompt": [{"role": "user", "content": "3+3?"}], "answer": "6"}]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = DatasetEnvironment(dataset=str(data), rewards=[f"{HERE.parent / 'support' / 'dataset_rewards.py'}:matches"],
                             probe_rows=1, system_prompt="Be brief.")
    tok = qwen3.qwen3_style_tokenizer()
    on = tok.decode(prompt_token_ids(tok, env, env.prompts("train"))[0])
    set_template_kwargs(tok, OFF)
    off = tok.decode(prompt_token_ids(tok, env, env.prompts("train"))[0])
    assert on == chatml("Be brief.", "2+2?") and off == on + EMPTY_THINK
    env.close()


def test_variables_the_template_does_not_read_are_left_out(qwen3):
    tok = qwen3.qwen3_style_tokenizer()
    tok.chat_template = tok.chat_template.replace("enable_thinking", "thinking_off")   # no such switch
    before = prompt_token_ids(tok, TextEnv(), [Prompt("p", "Hi.")])
    assert set_template_kwargs(tok, {**OFF, "thinking_off": True}) == {"thinking_off": True}
    assert template_kwargs(tok) == {"thinking_off": True}
    tok.chat_template = qwen3.QWEN3_STYLE_TEMPLATE.replace("enable_thinking", "other")
    assert set_template_kwargs(tok, OFF) == {}
    assert prompt_token_ids(tok, TextEnv(), [Prompt("p", "Hi.")]) == before


def test_build_policy_sets_the_recipes_variables_and_the_rollout_samples_from_them(qwen3, monkeypatch):
    """The recipe's table reaches the tokenizer in build_policy, the one place that reads it, and
    the rollout (which the probe and the filter share) decodes after the empty think block."""
    from fasttrain.train.config import load_config
    from fasttrain.train.policy import build_policy
    cfg = load_config({"policy": {"model": "support.qwen3_style:tiny_qwen3_style_policy", "dtype": "float32",
                                  "rank": 2, "alpha": 4.0, "chat_template_kwargs": OFF}})
    model, tok, _ = build_policy(cfg, torch.device("cpu"))
    assert template_kwargs(tok) == OFF
    prompts = [Prompt("p/0", "Name a colour.")]
    roll, _ = sample_answers(model, tok, TextEnv(), prompts, group_size=2, max_new_tokens=2, temperature=1.0, seed=0)
    row = roll.input_ids[0, :roll.prompt_len][roll.attention_mask[0, :roll.prompt_len].bool()]
    assert tok.decode(row) == chatml(system_message(TextEnv.answer_format), "Name a colour.") + EMPTY_THINK


def test_every_bundled_recipe_turns_thinking_off():
    from fasttrain.train.config import list_recipes, load_config
    for name in list_recipes():
        assert load_config(name).policy.chat_template_kwargs == OFF, name
