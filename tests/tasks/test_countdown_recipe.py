"""The countdown recipe: the dataset environment over the packaged data, the probe unseen, and the
rewards scored through the environment's reward workers as in a run."""
import json
from pathlib import Path

from fasttrain.tasks import countdown as cd
from fasttrain.train import load_config
from fasttrain.train.environment import load_run_env


def test_the_countdown_recipe_scores_through_the_dataset_environment():
    cfg = load_config("countdown")
    assert Path(cfg.env.dataset) == cd.TRAIN_FILE.resolve() and Path(cfg.env.probe_dataset) == cd.PROBE_FILE.resolve()
    env = load_run_env(cfg)
    try:
        assert [c.name for c in env.channels] == ["answer", "format"]
        train, probe = env.prompts("train"), env.prompts("probe")
        assert (len(train), len(probe)) == (1000, 100)
        assert not {p.spec for p in train} & {p.spec for p in probe}
        row = json.loads(cd.PROBE_FILE.read_text().splitlines()[0])
        assert probe[0].spec == row["prompt"]
        answers = [cfg.rollout.answer_prefix + row["solution"] + "</answer>", "<answer>1 +</answer>", "no tags"]
        scores = env.score_many([probe[0]] * 3, answers, "train")
        assert [s.channels for s in scores] == [{"answer": 1.0, "format": 1.0}, {"answer": 0.0, "format": 0.5},
                                                {"answer": 0.0, "format": 0.0}]
        assert [s.core for s in scores] == [1.0, 0.0, 0.0] and [s.valid for s in scores] == [True] * 3
    finally:
        env.close()


def test_the_small_countdown_recipe_reads_the_small_files():
    cfg = load_config("countdown_small")
    train, probe = cd.variant_files("countdown_small")
    assert Path(cfg.env.dataset) == train.resolve() and Path(cfg.env.probe_dataset) == probe.resolve()
    assert cfg.env.rewards == ("fasttrain.tasks.countdown:answer", "fasttrain.tasks.countdown:format")
