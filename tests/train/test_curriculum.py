"""The reasoning-gym curriculum (env.curriculum = true): the controller's window and bounds, rows drawn
again at a new level while the probe keeps its own, the level logged per step, and a resumed run
equal to the uninterrupted one in every metric. The tiny byte policy cannot solve a generator, so
the test environment scores an answer 1 when its first byte is even (about half of them): levels move."""
import json
import math

import pytest

from fasttrain.envs import Score
from fasttrain.envs.reasoning_gym import ReasoningGymEnvironment
from fasttrain.envs.rg_curriculum import Curriculum, top_level
from fasttrain.train import Trainer, load_config
from fasttrain.train.run_files import read_jsonl

GENS = {"gcd": {}, "basic_arithmetic": {"weight": 1.0}}


def test_controller_window_bounds_and_state():
    c = Curriculum(["gcd"], window=3, upper=0.75, lower=0.25)
    top = top_level("gcd")
    assert top == 3
    log = [c.observe({"gcd": m}) for m in (0.8, 0.9)]
    assert [r["curriculum_next_level_gcd"] for r in log] == [0, 0]          # window not full yet
    r = c.observe({"gcd": 0.6})                                             # mean 0.7667 >= 0.75
    assert r["curriculum_level_gcd"] == 0 and r["curriculum_next_level_gcd"] == 1
    assert math.isclose(r["curriculum_window_score_gcd"], (0.8 + 0.9 + 0.6) / 3, rel_tol=0, abs_tol=1e-15)
    assert c.scores["gcd"] == []                                            # emptied on a move
    c.observe({"gcd": None})                                                # no rows this step: no entry
    for m in (0.2, 0.3, 0.24):                                              # mean 0.2467 < 0.25: down
        r = c.observe({"gcd": m})
    assert r["curriculum_next_level_gcd"] == 0
    for m in (0.0,) * 3:                                                    # at level 0: stays
        r = c.observe({"gcd": m})
    assert r["curriculum_next_level_gcd"] == 0 and len(c.scores["gcd"]) == 3
    for _ in range(20):
        c.observe({"gcd": 1.0})
    assert c.levels["gcd"] == top                                           # capped at the top level
    st = json.loads(json.dumps(c.state_dict()))
    d = Curriculum(["gcd"], window=3, upper=0.75, lower=0.25)
    d.load_state_dict(st)
    assert d.state_dict() == c.state_dict()
    with pytest.raises(ValueError):
        Curriculum(["gcd"], upper=0.2, lower=0.5)


def test_rows_follow_the_level_and_the_probe_stays():
    env = ReasoningGymEnvironment(GENS, train_rows=20, probe_rows=6, curriculum=True, curriculum_window=1,
                                  curriculum_upper=0.5, curriculum_lower=0.1)
    probe0, train0 = env.prompts("probe"), env.prompts("train")
    assert all("/L0/" in p.id for p in train0) and all("/p/" in p.id for p in probe0)
    v0 = env.train_version
    rep = [p for p in train0 for _ in range(2)]
    out = env.end_step(rep, [Score({"core": 1.0, "format": 1.0}, True, 1.0, True)] * len(rep))
    assert out["curriculum_level_gcd"] == 0 and out["curriculum_next_level_gcd"] == 1
    assert env.train_version != v0
    train1 = env.prompts("train")
    g1 = [p for p in train1 if p.fields["generator"] == "gcd"]
    assert all("/L1/" in p.id for p in g1)
    assert {p.spec for p in train1}.isdisjoint({p.spec for p in probe0})
    assert [p.id for p in env.prompts("probe")] == [p.id for p in probe0]            # frozen
    # level 1 of gcd's curriculum draws values up to 1000 (level 0: up to 100)
    top = max(max(p.fields["entry"]["metadata"]["numbers"]) for p in g1)
    assert top > 100


class ParityRG(ReasoningGymEnvironment):
    def score(self, prompt, answer_text, data_slice="train"):
        b = answer_text.encode()[:1]
        ok = float(bool(b) and b[0] % 2 == 0)
        return Score({"core": ok, "format": 0.0}, True, ok, ok > 0, None)


def _env():
    return ParityRG(GENS, train_rows=16, probe_rows=2, curriculum=True, curriculum_window=1,
                    curriculum_upper=0.5, curriculum_lower=0.2)


def _recipe(out, steps):
    from support.recipes import make_tiny_recipe
    return make_tiny_recipe(out, **{"env.name": "reasoning-gym", "env.generators": GENS, "env.curriculum": True,
                                    "env.curriculum_window": 1, "env.curriculum_upper": 0.5,
                                    "env.curriculum_lower": 0.2, "env.train_rows": 16, "env.probe_rows": 2,
                                    "rollout.prompts_per_step": 4, "advantages.priorities": {},
                                    "advantages.floor": -1e9, "run.steps": steps, "probe.every": 0,
                                    "probe.prompts": 2})


def _rows(run):
    return [{k: v for k, v in json.loads(l).items() if not k.startswith("seconds")}
            for l in (run / "metrics.jsonl").read_text().splitlines()]


def test_curriculum_logged_and_resumed_exactly(tiny):
    full = Trainer(load_config(_recipe(tiny / "a", 4)), progress=False, env=_env())
    full.train()
    part = Trainer(load_config(_recipe(tiny / "b", 2)), progress=False, env=_env())
    part.train()
    Trainer.resume(part.dir, ["run.steps=4"], progress=False, env=_env()).train()
    a, b = _rows(full.dir), _rows(part.dir)
    assert a == b
    levels = [(r["curriculum_level_gcd"], r["curriculum_level_basic_arithmetic"]) for r in a]
    assert len(set(levels)) > 1                                                      # a level moved
    samples = read_jsonl(full.dir / "samples.jsonl")
    for r, s in zip(a, samples):                 # each step's rows were drawn at the level it logs
        for pid in s["prompt_ids"]:
            gen = pid.split("/")[1]
            assert f"/L{r[f'curriculum_level_{gen}']}/" in pid
    assert (full.dir / "samples.jsonl").read_text() == (part.dir / "samples.jsonl").read_text()


def test_init_reasoning_gym_writes_a_recipe_that_trains(tiny, monkeypatch):
    """`fasttrain init NAME --reasoning-gym gcd,spell_backward` writes a recipe that runs as written
    (here on the tiny policy, one step, with dynamic sampling and the curriculum switched on)."""
    from typer.testing import CliRunner
    from fasttrain.cli import app
    monkeypatch.chdir(tiny)
    r = CliRunner()
    res = r.invoke(app, ["init", "rgtask", "--reasoning-gym", "gcd,spell_backward"])
    assert res.exit_code == 0, res.output
    text = (tiny / "rgtask" / "recipe.toml").read_text()
    assert "[env.generators.gcd]" in text and "[env.generators.spell_backward]" in text
    res = r.invoke(app, ["init", "other", "--reasoning-gym", "gcd,spel_backward"])
    assert res.exit_code != 0 and "close names: spell_backward" in " ".join(res.output.split())
    assert not (tiny / "other").exists()
    cfg = load_config(str(tiny / "rgtask" / "recipe.toml"),
                      ["policy.model=support.tiny_world:tiny_policy", "policy.dtype=float32", "policy.rank=4",
                       "run.steps=1", f"run.out={tiny / 'runs'}", "run.device=cpu", "run.threads=1",
                       "rollout.max_new_tokens=4", "rollout.group_size=2", "probe.prompts=2", "probe.samples=1",
                       "env.train_rows=20", "env.probe_rows=4", "rollout.dynamic_sampling=true",
                       "env.curriculum=true"])
    assert cfg.env.generators == {"gcd": {"weight": 1.0}, "spell_backward": {"weight": 1.0}}
    tr = Trainer(cfg, progress=False)
    tr.train()
    row = read_jsonl(tr.dir / "metrics.jsonl")[0]
    assert row["curriculum_level_gcd"] == 0 and "dynamic_groups" in row and "reward_format" in row
