"""The plan at long answers: it picks rollout waves, prefill chunks and the micro-batch that fit,
prices them, shows the KV cache, the recurrent state and the conv windows apart, and finds the
largest answer with waves allowed. Pure arithmetic (the models are built on the meta device)."""
import pytest

from fasttrain.plan import gpu_spec, meta_policy, model_config
from fasttrain.plan.memory import Device, fits, gib, rollout_phase
from fasttrain.plan.picks import pick_settings
from fasttrain.plan.report import as_json, make_plan, render
from fasttrain.plan.run_shape import RunShape

H100 = gpu_spec("h100-sxm-80gb")
# the study's step: 4 prompts x 12 answers, 2 passes, the KL term (reference scores), 360-token prompts
STUDY = RunShape(prompts=4, group=12, prompt_tokens=360, new_tokens=32768, micro_batch=8, passes=2,
                 probe_new_tokens=32768)


@pytest.fixture(scope="module")
def m27():
    return meta_policy(model_config("qwen3.5-27b"), name="qwen3.5-27b")


@pytest.fixture(scope="module")
def m8():
    return meta_policy(model_config("qwen3-8b"), name="qwen3-8b")


@pytest.fixture(scope="module")
def plan27(m27):
    return make_plan(model_config("qwen3.5-27b"), STUDY, H100, name="qwen3.5-27b", with_limits=False, model=m27)


def test_27b_nf4_fits_32k_answers_at_the_studys_batch_in_waves(plan27):
    p = plan27
    s = p.shape
    assert p.fits and p.picks.fits
    assert s.wave_prompts < 4                 # 48 rows at once do not fit: their 16 layers' KV alone is 96 GiB
    kv_48 = 16 * 2 * 48 * 4 * (360 + 32768) * 256 * 2
    assert gib(kv_48) > 80
    assert p.memory.phases["rollout"]["kv_cache"] == kv_48 * s.wave_prompts // 4
    assert s.micro_batch < 8 and p.memory.peak + H100.context_bytes < H100.memory_bytes
    print(f"27B at 32K: waves of {s.wave_prompts} prompts, prefill {s.prefill_prompts}, probe waves "
          f"{s.probe_wave_prompts} prefill {s.probe_prefill_prompts}, micro-batch {s.micro_batch}, peak "
          f"{gib(p.peak):.2f} GiB in {p.memory.peak_phase}; seconds added {p.pick_seconds}")


def test_a_recipe_wave_of_the_whole_batch_at_32k_is_refused_by_name(m27):
    m = m27
    picks = pick_settings(m, STUDY.with_(wave=4), H100, Device("cuda", free=H100.memory_bytes))
    assert not picks.fits
    assert any("rollout.wave_prompts" in why and "max_new_tokens" in why for why in picks.blocked)


def test_the_plan_shows_kv_recurrent_and_conv_state_apart(plan27):
    m = plan27.model
    r = plan27.memory.phases["rollout"]
    rows = plan27.shape.wave_prompts * 12
    assert r["recurrent_state"] == rows * 48 * 48 * 128 * 128 * 4
    assert r["conv_state"] == rows * 48 * 3 * 10240 * 2
    assert m.state_bytes == m.conv_bytes + m.recurrent_bytes
    text = render(plan27)
    for label in ("KV cache (full-attention layers)", "recurrent state (Gated DeltaNet, fp32)",
                  "conv windows (Gated DeltaNet)", "rollout waves", "micro-batch"):
        assert label in text
    # what each pick costs in time is printed: waves of one prompt and one answer per micro-batch, on paper
    assert {"wave", "micro_batch", "probe_wave"} <= set(plan27.pick_seconds)
    for f, per, over in (("wave", "step", "one wave"), ("micro_batch", "step", "the recipe's"),
                         ("probe_wave", "probe", "one wave")):
        assert plan27.pick_seconds[f] > 0
        assert f"+{plan27.pick_seconds[f]:.2f} s per {per} over {over}" in text, f
    j = as_json(plan27)
    assert j["picks"]["seconds_added"] == plan27.pick_seconds
    assert {"kv_cache", "recurrent_state", "conv_state"} <= set(j["memory"]["rollout"])
    assert j["picks"]["settings"]["wave"] == plan27.shape.wave_prompts


def test_each_pick_is_the_largest_that_fits(m27):
    """A wave one prompt larger does not fit; the picked one does."""
    m = m27
    dev = Device("cuda", free=H100.memory_bytes)
    s = pick_settings(m, STUDY, H100, dev).shape

    def ok(shape):
        return fits(sum(rollout_phase(m, shape, dev).values()), H100.memory_bytes, H100.context_bytes)[0]
    assert ok(s)
    assert not ok(s.with_(wave=s.wave_prompts + 1, prefill_chunk=1))


def test_a_recipe_wave_is_kept_and_waves_cost_decode_time(m8):
    cfg = model_config("qwen3-8b")
    s = STUDY.with_(new_tokens=4096, probe_new_tokens=4096)
    one = make_plan(cfg, s, H100, name="qwen3-8b", with_limits=False, model=m8)
    two = make_plan(cfg, s.with_(wave=2), H100, name="qwen3-8b", with_limits=False, model=m8)
    assert one.shape.wave_prompts == 4 and two.shape.wave_prompts == 2 and "wave" in two.picks.fixed
    # two waves read the weights twice as often: the decode floor of one wave of 48 rows is weight-bound
    # (the plan's computed time, not a clock)
    on_paper = {"one": one.time.seconds["rollout"], "two": two.time.seconds["rollout"]}
    assert on_paper["two"] > on_paper["one"]


def test_qwen3_8b_published_size(m8):
    m = m8
    assert round(m.params / 1e9, 2) == 8.19 and m.context == 40960


@pytest.mark.parametrize("prompts,group", [(4, 12), (1, 8)])
def test_largest_answer_grows_with_waves_allowed(m8, prompts, group):
    """max_new_tokens with waves allowed fits with the plan's picks and is larger than one batch
    of every row at once allows."""
    from fasttrain.plan.limits import largest_settings
    m = m8
    dev = Device("cuda", free=H100.memory_bytes)
    s = STUDY.with_(prompts=prompts, group=group, new_tokens=1024, probe_new_tokens=1024)
    lim = largest_settings(m, s, H100, dev)
    v = lim["max_new_tokens"]
    print(f"qwen3-8b NF4 at {prompts} x {group}: {v} new tokens (memory alone: {lim.get('max_new_tokens_memory')})")
    assert v is not None and v > 1024
    at = s.with_(new_tokens=v, probe_new_tokens=v)
    assert pick_settings(m, at, H100, dev).fits
    if prompts > 1:                               # the whole batch in one wave does not fit there
        assert not pick_settings(m, at.with_(wave=prompts), H100, dev).fits
