import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest

from fasttrain.envs import INVALID_CORE, Environment, Prompt
from fasttrain.tasks import load_env
from fasttrain.tasks.signal.panel import World, generate_panel
from fasttrain.tasks.signal.env import SignalEnvironment, squash
from fasttrain.tasks.signal.lang import evaluate, parse

CHANNELS = ["core", "stability", "action_cost", "secondary", "complexity", "format", "syntax",
            "novelty", "neutrality", "min_activity", "pattern_guard", "stress"]
REVERSAL = "<signal>rank(ts_delta(close, 5)) * -1</signal>"
OPEN = Prompt("t/open", "", {"horizon": 5})


@pytest.fixture(scope="module")
def env_a():
    return load_env("signal-a")


@pytest.fixture(scope="module")
def env_b():
    return load_env("signal-b")


def test_protocol_surface(env_a, env_b):
    for env in (env_a, env_b):
        assert isinstance(env, Environment)
        assert [c.name for c in env.channels] == CHANNELS
        pri = {c.name: c.priority for c in env.channels}
        assert pri == {**{n: 1.0 for n in CHANNELS}, "core": 3.0, "pattern_guard": 0.3, "complexity": 0.2}
        assert all(c.description for c in env.channels)
        assert "<signal>" in env.answer_format
    assert env_a.data_slices == ("train", "holdout")
    assert env_b.data_slices == ("slice0", "slice1", "slice2", "slice3")
    with pytest.raises(ValueError):
        env_a.score(OPEN, REVERSAL, "slice0")
    with pytest.raises(ValueError):
        load_env("signal-b", train_slice="slice9")


def test_the_signal_worlds_load_by_name_through_the_tasks_and_other_names_pass_to_envs():
    from fasttrain import envs
    from fasttrain.envs.reasoning_gym import ReasoningGymEnvironment
    from fasttrain.tasks.signal import ENV_NAME
    from fasttrain.tasks.signal.env import SignalEnvironment
    assert ENV_NAME == "signal-a" and isinstance(load_env(ENV_NAME), SignalEnvironment)
    assert isinstance(load_env("support.toy_plugin:make_env"), envs.GuardedEnvironment)   # a plug-in: guarded
    assert isinstance(load_env("reasoning-gym", generators={"gcd": {}}, train_rows=4, probe_rows=2),
                      ReasoningGymEnvironment)
    with pytest.raises(ValueError, match="fasttrain.tasks.load_env"):     # envs/ knows no task
        envs.load_env("signal-a")


def test_format_and_syntax_give_partial_credit(env_a):
    cases = {
        "no tags at all": (0.0, 0.0), "<signal>rank(close)": (0.5, 0.0),
        "<signal>rank(clos)</signal>": (1.0, 0.0), "<signal>rank(close</signal>": (1.0, 0.25),
        "<signal>ts_mean(close, 600)</signal>": (1.0, 0.5),
    }
    for text, (fmt, syn) in cases.items():
        s = env_a.score(OPEN, text, record=False)
        assert not s.valid and s.core == INVALID_CORE and not s.success and s.reason
        assert (s.channels["format"], s.channels["syntax"]) == (fmt, syn), text
    s = env_a.score(Prompt("t/f", "", {"allowed_fields": ("close",)}), "<signal>rank(volume)</signal>",
                    record=False)
    assert not s.valid and s.channels["syntax"] == 0.75 and "volume" in s.reason
    ok = env_a.score(OPEN, "prose first <signal> rank(volume) </signal> prose after", record=False)
    assert ok.valid and ok.channels["format"] == 1.0 and ok.channels["syntax"] == 1.0


def test_hand_built_channels(env_a):
    # complexity: rank, neg, ts_delta, close = 4 nodes of 40, plus 0.5 over a budget of 3
    s = env_a.score(OPEN, "<signal>rank(-ts_delta(close, 5))</signal>", record=False)
    assert s.channels["complexity"] == pytest.approx(-0.1)
    s = env_a.score(Prompt("t/b", "", {"budget": 3}), "<signal>rank(-ts_delta(close, 5))</signal>",
                    record=False)
    assert s.channels["complexity"] == pytest.approx(-0.6)
    # pattern guard: copied field, degenerate nesting, healthy
    pg = lambda e: env_a.score(OPEN, f"<signal>{e}</signal>", record=False).channels["pattern_guard"]
    assert pg("close") == -0.5 and pg("-rank(close) * 2") == -0.5
    assert pg("rank(rank(returns - delay(returns, 1)))") == -0.25
    assert pg("ts_mean(returns, 5) / ts_std(returns, 20)") == 0.0
    # a constant is flat every day: invalid, pattern guard -1, min_activity 0
    c = env_a.score(OPEN, "<signal>3.5</signal>", record=False)
    assert not c.valid and c.channels["pattern_guard"] == -1.0 and c.channels["min_activity"] == 0.0
    d = env_a.score(OPEN, "<signal>close - close</signal>", record=False)
    assert not d.valid and d.channels["pattern_guard"] == -0.25


def _reference(env, expr, data_slice, horizon=5):
    """float64 re-implementation of core, action cost, stability, secondary, neutrality."""
    sl = env.slice(data_slice)
    sig = evaluate(parse(expr), sl.data)[sl.start:].astype(np.float64)
    z = (sig - sig.mean(1, keepdims=True)) / sig.std(1, keepdims=True)
    z = np.clip(z, -3, 3)
    z -= z.mean(1, keepdims=True)
    w = z / np.abs(z).sum(1, keepdims=True)
    r = sl.fwd1.astype(np.float64)
    pnl = (w * r).sum(1)
    to = np.r_[np.abs(w[0]).sum(), np.abs(np.diff(w, axis=0)).sum(1)]
    net = pnl - env.fee_bp * 1e-4 * to
    srs = [f.mean() / f.std() * np.sqrt(252) for f in np.array_split(net, 4)]
    core = np.mean(srs) / (abs(np.mean(srs)) + 3)
    def ic(h):
        zr = sl.fwd_rank[h].astype(np.float64)
        return np.array([np.corrcoef(w[d], zr[d])[0, 1] for d in range(len(w))])
    ic1 = ic(1)
    a, b = ic1[: len(ic1) // 2].mean(), ic1[len(ic1) // 2:].mean()
    return dict(core=core, action_cost=-to.mean() * env.fee_bp,
                stability=1 - abs(a - b) / (abs(a) + abs(b) + 0.01), secondary=ic(horizon).mean(),
                neutrality=-max(0, abs(np.corrcoef(pnl, sl.market)[0, 1]) - 0.1) / 0.9)


@pytest.mark.parametrize("expr", ["rank(ts_delta(close, 5)) * -1", "ts_corr(close, volume, 10)"])
def test_channels_match_float64_reference(env_a, expr):
    s = env_a.score(OPEN, f"<signal>{expr}</signal>", record=False)
    ref = _reference(env_a, expr, "train")
    for k, v in ref.items():
        assert s.channels[k] == pytest.approx(v, rel=2e-3, abs=2e-4), k
    assert s.core == s.channels["core"] and s.success == (s.core > 0)


def test_squash_is_sign_preserving_and_bounded():
    assert squash(0.0) == 0.0 and squash(3.0) == 0.5 and squash(-3.0) == -0.5
    assert -1 < squash(-1e6) < squash(-40) < squash(-20) < 0 < squash(1) < squash(1e6) < 1


def _random_exprs(n, seed):
    rng = np.random.default_rng(seed)
    fields = ["open", "high", "low", "close", "volume", "returns"]
    def gen(depth, top=False):
        if depth == 0 or (not top and rng.random() < 0.3):
            return fields[rng.integers(6)]
        k = rng.integers(4)
        if k == 0:
            return f"({gen(depth - 1)} {'+-*/'[rng.integers(4)]} {gen(depth - 1)})"
        if k == 1:
            return f"{['abs', 'log', 'sign', 'rank', 'zscore'][rng.integers(5)]}({gen(depth - 1)})"
        if k == 2:
            op = ["ts_mean", "ts_std", "ts_delta", "ts_rank", "delay"][rng.integers(5)]
            return f"{op}({gen(depth - 1)}, {rng.integers(2, 30)})"
        return f"ts_corr({gen(depth - 1)}, {gen(depth - 1)}, {rng.integers(3, 30)})"
    return [gen(3, top=True) for _ in range(n)]   # an idea, not a bare field


def test_planted_reversal_beats_random_on_both_slices(env_a):
    randoms = [f"<signal>{e}</signal>" for e in _random_exprs(40, seed=7)]
    for sl in ("train", "holdout"):
        rev = env_a.score(OPEN, REVERSAL, sl, record=False)
        assert rev.valid and rev.success and rev.core > 0.25, (sl, rev.core)
        cores = [s.core for s in env_a.score_many([OPEN] * len(randoms), randoms, sl, record=False)
                 if s.valid]
        assert len(cores) >= 20
        assert np.median(cores) < 0.0                     # random ideas do not earn net of costs
        assert rev.core > np.percentile(cores, 90) and rev.core > np.median(cores) + 0.4


def test_env_b_is_harsher(env_a, env_b):
    # same answer, same data: B's cost is exactly 19x A's fee on the same turnover
    b_at_a_fee = SignalEnvironment("b", fee_bp=env_a.fee_bp)
    for sl in env_b.data_slices:
        hard = env_b.score(OPEN, REVERSAL, sl, record=False).channels["action_cost"]
        soft = b_at_a_fee.score(OPEN, REVERSAL, sl, record=False).channels["action_cost"]
        assert hard == pytest.approx(19 * soft, rel=1e-9) and hard < 0
    assert env_b.fee_bp == 19 * env_a.fee_bp
    # stress off in B, reversal does not survive the costs there, random ideas rarely do
    s = env_b.score(OPEN, REVERSAL, "train", record=False)
    assert s.channels["stress"] == 0.0 and s.core < 0
    randoms = [f"<signal>{e}</signal>" for e in _random_exprs(30, seed=11)]
    valid = [x for x in env_b.score_many([OPEN] * 30, randoms, "slice1", record=False) if x.valid]
    assert sum(x.success for x in valid) <= 0.2 * len(valid)
    # train/holdout aliases follow the chosen slices
    env = load_env("signal-b", train_slice="slice2")
    assert env.score(OPEN, REVERSAL, "train", record=False) == env.score(OPEN, REVERSAL, "slice2", record=False)


def test_novelty_archive():
    env = load_env("signal-a")
    baseline = env.score(OPEN, "<signal>-ts_delta(close, 5)</signal>")          # a seeded baseline
    assert baseline.channels["novelty"] == pytest.approx(0.0, abs=1e-6)
    answers = ["<signal>ts_mean(returns, 10) * -1</signal>"] * 2
    first = env.score_many([OPEN] * 2, answers)
    assert first[0].channels["novelty"] == first[1].channels["novelty"] > 0.2   # order-free in a batch
    assert first[0].success
    again = env.score(OPEN, answers[0])                                         # now archived
    assert again.channels["novelty"] == pytest.approx(0.0, abs=1e-6)
    fresh = load_env("signal-a")                                                # per instance
    assert fresh.score(OPEN, answers[0]).channels["novelty"] == first[0].channels["novelty"]


def test_prompts_are_deterministic_versioned_and_probe_unseen(env_a):
    train, probe = env_a.prompts("train"), env_a.prompts("probe")
    assert len(train) == 500 and len(probe) == 50
    assert len({p.id for p in train + probe}) == 550
    assert all("signal-prompts-v3" in p.id for p in train + probe)
    assert {p.fields["key"] for p in train}.isdisjoint({p.fields["key"] for p in probe})
    again = SignalEnvironment("a").prompts("train")
    assert [(p.id, p.spec) for p in again] == [(p.id, p.spec) for p in train]
    assert all(env_a.answer_format in p.spec for p in train[:5])
    with pytest.raises(ValueError):
        env_a.prompts("test")
    # the spec's constraints are enforced: a field outside the list makes the answer invalid
    p = next(p for p in train if "volume" not in p.fields["allowed_fields"])
    assert not env_a.score(p, "<signal>rank(volume)</signal>", record=False).valid


_FINGERPRINT = r"""
import hashlib, numpy as np
from fasttrain.tasks import load_env
from fasttrain.tasks.signal.panel import WORLD_A, generate_panel
h = hashlib.sha256()
for k, v in sorted(generate_panel(WORLD_A).items()):
    h.update(k.encode()); h.update(v.tobytes())
env = load_env("signal-a")
s = env.score(env.prompts("train")[3], "<signal>rank(ts_delta(close, 5)) * -1</signal>")
print(h.hexdigest(), repr(sorted(s.channels.items())))
"""


def test_determinism_across_processes():
    env_vars = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    outs = [subprocess.run([sys.executable, "-c", _FINGERPRINT], capture_output=True, text=True,
                           env=env_vars, timeout=600, check=True).stdout for _ in range(2)]
    assert outs[0] == outs[1] and len(outs[0]) > 64


def test_data_generation_is_planted():
    p = generate_panel(World(seed=123))                  # a fresh world (speed: bench/bench_env.py)
    r = p["returns"].astype(np.float64)
    assert p["close"].shape == (2000, 200) and np.isfinite(r).all()
    assert 0.012 < r.std() < 0.04
    kurt = ((r - r.mean()) ** 4).mean() / r.var() ** 2
    assert kurt > 4.0                                    # fat tails
    a = np.abs(r - r.mean(1, keepdims=True)).mean(1)     # volatility clustering: |r| autocorrelated
    assert np.corrcoef(a[:-1], a[1:])[0, 1] > 0.2
    assert (p["high"] >= p["close"]).all() and (p["low"] <= p["close"]).all() and (p["low"] > 0).all()


def test_hostile_answers_are_fast_and_invalid(env_a):
    hostile = ["<signal>" + "(" * 10_000 + "close" + ")" * 10_000 + "</signal>",
               "<signal>1e999</signal>", "<signal>__import__('os').system('x')</signal>",
               "<signal>\u00e9\u4e2d</signal>", "<signal></signal>", "", "<signal>" * 5000]
    out = env_a.score_many([OPEN] * len(hostile), hostile, record=False)
    # the limits reject these before any evaluation (how fast: bench/bench_env.py)
    assert not any(s.valid for s in out) and all(s.reason for s in out)


def _shown_examples(env, prompt) -> list[str]:
    """Every example answer the model sees with `prompt`: the shared format line and the spec."""
    import re
    shown = re.findall(r"<signal>(.*?)</signal>", env.answer_format + "\n" + prompt.spec)
    return list(dict.fromkeys(e for e in shown if e != "..."))   # distinct, in order


@pytest.mark.parametrize("variant", ["a", "b"])
def test_every_example_a_prompt_shows_is_valid_for_that_prompt(variant, env_a, env_b):
    """Each prompt shows three example answers (one example was copied by every valid answer of the
    real model, leaving GDPO nothing to rank). Each must be valid for that very prompt (its fields)
    and within its budget, on every train and probe prompt: an example the prompt forbids teaches an
    answer the verifier rejects."""
    from fasttrain.tasks.signal.lang import count_nodes
    env = env_a if variant == "a" else env_b
    prompts, answers, seen = [], [], set()
    for p in env.prompts("train") + env.prompts("probe"):
        shown = _shown_examples(env, p)
        assert len(shown) == 3, (p.id, shown)
        assert all(count_nodes(parse(e)) <= p.fields["budget"] for e in shown), (p.id, shown)
        for e in shown:
            # validity depends on the answer, the allowed fields and the data slice, never on the
            # style, horizon or budget: score each (example, fields) once (all 1650 scorings take ~2 min)
            if (e, p.fields["allowed_fields"]) not in seen:
                seen.add((e, p.fields["allowed_fields"]))
                prompts.append(p)
                answers.append(f"<signal>{e}</signal>")
    scores = env.score_many(prompts, answers, record=False)
    bad = [(p.id, a, s.reason) for p, a, s in zip(prompts, answers, scores) if not s.valid]
    assert not bad, f"{len(bad)} invalid examples, first: {bad[:3]}"
    # they are different answers, not three spellings of one signal
    first = [s.core for s in scores[:3]]
    assert len({round(c, 9) for c in first}) == 3
