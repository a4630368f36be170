"""The countdown rewards handed unchanged to TRL 1.16's GRPOTrainer: TRL's own reward step
(`_calculate_rewards`, which builds the keyword arguments from the dataset's columns) gives the
hand-computed scores on hand-written completions, in text and in chat layout."""
import json

import pytest

pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402
from support.tiny_grpo import tiny_llama, tiny_tokenizer  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from fasttrain.tasks import countdown as cd  # noqa: E402


@pytest.mark.parametrize("layout", ["text", "chat"])
def test_countdown_rewards_score_as_by_hand_inside_trl(tmp_path, layout):
    rows = [json.loads(l) for l in cd.TRAIN_FILE.read_text().splitlines()[:2]]
    if layout == "chat":
        rows = [{**r, "prompt": [{"role": "user", "content": r["prompt"]}]} for r in rows]
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=4, max_steps=1, report_to=[], save_strategy="no", disable_tqdm=True,
                      beta=0.0, seed=0)
    trainer = GRPOTrainer(model=tiny_llama(), args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=tiny_tokenizer(), reward_funcs=[cd.answer, cd.format])
    # rows[0]: [13, 25, 14] -> 39 (25 + 14); rows[1]: [12, 19, 7, 17] -> 5 (12 - 7)
    texts = [f"<answer>{rows[0]['solution']}</answer>", "<answer>13 + 13 + 13</answer>", "<answer>39 +</answer>",
             "39", "<answer>19 - 7 - 7</answer>", "<answer>(17 - 12) * 1</answer>", "<answer>17 - 12</answer>",
             "<answer>17 - 12 = 5</answer>"]
    inputs = [rows[0]] * 4 + [rows[1]] * 4
    completions = [[{"role": "assistant", "content": t}] for t in texts] if layout == "chat" else texts
    rewards = trainer._calculate_rewards(inputs, [r["prompt"] for r in inputs], completions, [[5, 6]] * 8)
    assert rewards[:, 0].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0]     # answer
    assert rewards[:, 1].tolist() == [1.0, 1.0, 0.5, 0.0, 1.0, 1.0, 1.0, 1.0]     # format
