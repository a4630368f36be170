"""The same tools file and environment class through TRL 1.16's own tool loop and through
fasttrain, with the same model turns fed to both (TRL's generation replaced by a replay of fixed
token ids; fasttrain's rollout replaying them), on SmolLM2's tokenizer with TRL's own Qwen3
training template (ChatML tokens) and TRL's Qwen3 response parser. Compared: the prompt ids, the
completion ids (model and tool tokens), the masks, each answer's conversation, and get_reward."""
import copy
from pathlib import Path

import pytest
import torch

pytest.importorskip("datasets")
trl = pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.chat_template_utils import qwen3_template  # noqa: E402

from support import agent_tools  # noqa: E402
from support.agent_files import TOOLS, smollm2_tokenizer, tool_specs, write_task  # noqa: E402
from fasttrain.envs.dataset import DatasetEnvironment  # noqa: E402
from fasttrain.models import tiny_llama  # noqa: E402
from fasttrain.train.answers import answer_token_ids, score_answers  # noqa: E402
from fasttrain.train.tool_rollout import sample_tool_answers  # noqa: E402

G = 3
CALL = '<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>'
SCRIPTS = [
    [CALL % ("increment", '{"step": 3}') + "<|im_end|>", "Done.<|im_end|>"],
    [CALL % ("add", '{"a": 2, "b": 3}') + "\n" + CALL % ("increment", '{"step": 1}') + "<|im_end|>",
     CALL % ("increment", '{"step": 2}') + "<|im_end|>", "Counted to three.<|im_end|>"],
    ["I will not count.<|im_end|>"],
]
ROW = {"prompt": [{"role": "user", "content": "Use the counter."}], "target": 3}


@pytest.fixture(scope="module")
def tok():
    t = copy.copy(smollm2_tokenizer())
    t.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen3_training.jinja").read_text()
    t.response_template = qwen3_template
    return t


def _turn_ids(tok):
    return [[tok(x, add_special_tokens=False)["input_ids"] for x in s] for s in SCRIPTS]


def _trl(tok, tmp_path, M):
    agent_tools.RECORDED.clear()
    model = tiny_llama(vocab_size=49152, hidden=32, layers=2, heads=4, seed=0)
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, per_device_train_batch_size=G,
                      num_generations=G, max_completion_length=M, report_to=[], logging_steps=1, beta=0.0)
    trainer = GRPOTrainer(model=model, reward_funcs=[agent_tools.record_completions], args=args,
                          train_dataset=Dataset.from_list([ROW] * 4), processing_class=tok,
                          tools=[agent_tools.add], environment_factory=agent_tools.Counter)
    turns = _turn_ids(tok)
    P = []
    next_turn = [0] * G

    def replay(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """TRL's generation, replaced: the first call gets every row's prompt (rows in order); later
        calls get the rows with tool results, each known by its first turn (the rows' first turns differ)."""
        if not P:
            P.append(len(prompt_ids[0]))
            rows = list(range(len(prompt_ids)))
        else:
            rows = [next(r for r in range(G) if list(ids[P[0]:P[0] + len(turns[r][0])]) == turns[r][0])
                    for ids in prompt_ids]
        out = []
        for r in rows:
            out.append(list(turns[r][next_turn[r]]))
            next_turn[r] += 1
        return out, [[0.0] * len(c) for c in out]

    trainer._generate_single_turn = replay
    out = trainer._generate_and_score_completions([dict(ROW) for _ in range(G)])
    rewards = [e.get_reward() for e in trainer.environments]
    return out, agent_tools.RECORDED[-1], rewards


def _fasttrain(tok, tmp_path, M):
    import json
    (tmp_path / "ft").mkdir()
    data = tmp_path / "ft" / "data.jsonl"
    data.write_text("".join(json.dumps({**ROW, "target": t}) + "\n" for t in (3, 4)))
    env = DatasetEnvironment(dataset=str(data), probe_rows=1, rewards=tool_specs("tool_turns"),
                             tools=tool_specs("add"), environment=f"{TOOLS}:Counter")
    try:
        model = tiny_llama(vocab_size=49152, hidden=32, layers=2, heads=4, seed=0)
        prompt = env.prompts("train")[0]
        replay = [sum(t, []) for t in _turn_ids(tok)]
        roll, texts = sample_tool_answers(model, tok, env, [prompt], group_size=G, max_new_tokens=M,
                                          temperature=1.0, seed=[0], eos_token_ids=[tok.eos_token_id], replay=replay)
        scores = score_answers(env, [prompt] * G, texts, "train", completion_ids=answer_token_ids(roll),
                               conversations=roll.conversations)
        return roll, [s.channels["Counter"] for s in scores]
    finally:
        env.close()


@pytest.mark.parametrize("M, expected", [(200, [1.0, 1.0, 0.0]),      # every turn fits
                                         (120, [1.0, 0.0, 0.0])])     # row 1's last call is cut by the budget
def test_fasttrain_and_trls_tool_loop_build_the_same_answers(tok, tmp_path, M, expected):
    ref, trl_completions, trl_rewards = _trl(tok, tmp_path, M)
    roll, rewards = _fasttrain(tok, tmp_path, M)
    for b in range(G):
        pm = ref["prompt_mask"][b].bool()
        assert roll.input_ids[b, :roll.prompt_len][roll.attention_mask[b, :roll.prompt_len].bool()].tolist() == \
            ref["prompt_ids"][b][pm].tolist()
        cm = ref["completion_mask"][b].bool()
        n = int(roll.lengths[b])
        assert roll.completion_ids[b, :n].tolist() == ref["completion_ids"][b][cm].tolist(), b
        assert roll.action_mask[b, :n].tolist() == ref["tool_mask"][b][cm].bool().tolist(), b
    assert roll.conversations == trl_completions
    assert trl_rewards == expected and rewards == expected
