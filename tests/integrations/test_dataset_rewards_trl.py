"""One reward file, two trainers: tests/support/dataset_rewards.py handed unchanged to TRL 1.16's
GRPOTrainer and to fasttrain's dataset environment. On the completions TRL generated, fasttrain
builds the same reward inputs (prompts, completions in TRL's chat or text layout, completion_ids,
dataset columns) and its worker processes return the same scores the functions gave inside TRL."""
import functools
import inspect
import json
from pathlib import Path

import pytest

pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402
from support.tiny_grpo import WORDS, tiny_llama, tiny_tokenizer  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from fasttrain.envs.dataset import DatasetEnvironment  # noqa: E402

REWARD_FILE = Path(__file__).parent.parent / "support" / "dataset_rewards.py"
NAMES = ("matches", "shorter", "chat_shape")
TRL_ONLY = ("trainer_state", "log_extra", "log_metric")       # TRL's trainer hooks, not dataset inputs


def capture(fn, seen):
    """The reward function as TRL calls it, recording its inputs and outputs (sync or async)."""
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def wrapped(**kw):
            out = await fn(**kw)
            seen[fn.__name__] = (kw, out)
            return out
    else:
        @functools.wraps(fn)
        def wrapped(**kw):
            out = fn(**kw)
            seen[fn.__name__] = (kw, out)
            return out
    return wrapped


@pytest.mark.parametrize("layout", ["chat", "text"])
def test_the_same_reward_file_scores_the_same_under_trl_and_fasttrain(tmp_path, monkeypatch, layout):
    from support import dataset_rewards

    def prompt(i):
        text = f"{WORDS[i]} {WORDS[i + 1]} {WORDS[i + 2]}"
        return [{"role": "user", "content": text}] if layout == "chat" else text

    rows = [{"prompt": prompt(3 * i), "answer": WORDS[2 * i + 1]} for i in range(4)]
    tok = tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    seen: dict = {}
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, max_steps=1, report_to=[], save_strategy="no", disable_tqdm=True,
                      beta=0.0, seed=0)
    trainer = GRPOTrainer(model=tiny_llama(), args=args, train_dataset=Dataset.from_list(rows), processing_class=tok,
                          reward_funcs=[capture(getattr(dataset_rewards, n), seen) for n in NAMES])
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))      # generate + score once
    assert sorted(seen) == sorted(NAMES)

    data, probe = tmp_path / "data.jsonl", tmp_path / "probe.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    probe.write_text(json.dumps({"prompt": prompt(100), "answer": "w0"}) + "\n")
    env = DatasetEnvironment(dataset=str(data), probe_dataset=str(probe),
                             rewards=[f"{REWARD_FILE}:{n}" for n in NAMES])
    trl_kw = seen["matches"][0]
    by_prompt = {json.dumps(r["prompt"]): p for r, p in zip(rows, env.prompts("train"))}
    prompts = [by_prompt[json.dumps(x)] for x in trl_kw["prompts"]]
    answers = [c[0]["content"] if layout == "chat" else c for c in trl_kw["completions"]]
    ids = trl_kw["completion_ids"]
    assert len(prompts) == 4 and any(len(i) > 1 for i in ids)

    mine = env.reward_inputs(prompts, answers, ids)
    assert mine == {k: v for k, v in trl_kw.items() if k not in TRL_ONLY}
    scores = env.score_many(prompts, answers, completion_ids=ids)
    assert all(s.valid for s in scores)
    for name in NAMES:
        assert [s.channels[name] for s in scores] == [float(v) for v in seen[name][1]], name
    if layout == "chat":                   # the layout-sensitive reward saw chat messages on both sides
        assert [s.channels["chat_shape"] for s in scores] == [11.0] * 4
    env.close()
