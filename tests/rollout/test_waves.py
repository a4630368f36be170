"""A rollout in waves (prompts decoded a few at a time) and in prefill chunks: the same answers as
one batch, and a cache that holds one wave's rows, the bytes the plan counts for it.

Same answers: each prompt's sampler is its own generator (seed = one int per prompt), so a
group's uniform draws do not depend on which other groups share its batch; the model runs in
float64, so a row's logits in a wave differ from its logits in the full batch by rounding order
only (about 1e-15 relative), which can change a token only where a row's uniform falls within
that rounding of a boundary of its CDF (probability ~1e-13 per draw). The tokens are compared exactly and the behaviour log-probs to the
float32 log-softmax's roundoff, 8·u32·(max|z| + log V).

Cache bytes: every cache the decoder allocates is recorded (its storage bytes) and its lifetime
followed, so the test sees the largest set of caches alive at once. Answers end at EOS at very
different lengths (a random model and a common token as EOS); the plan's worst case (every
answer at max_new_tokens) sets the cache's width, so each wave's cache is what the plan counts
for a wave of that many prompts, and the rollout never holds more than one wave's.
"""
import math
import weakref

import pytest
import torch

from fasttrain.models import tiny_llama, tiny_qwen3_5
from fasttrain.rollout import sample
from fasttrain.rollout.decoder import LlamaFamilyDecoder
from fasttrain.rollout.hybrid_decoder import HybridCache, HybridDecoder
from fasttrain.train.answers import join_rollouts

# the longest prompt first, so every wave's cache is as wide as the plan's (prompt P + T)
PROMPTS = [[3, 4, 5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 9], [11, 12], [20, 21, 22], [7, 3]]
SEEDS = [11, 12, 13, 14, 15]
G, T = 3, 24


def _models():
    return {"llama": tiny_llama(vocab_size=24, hidden=32, layers=2, heads=4, kv_heads=2, seed=1,
                                dtype=torch.float64),
            "hybrid": tiny_qwen3_5(vocab_size=24, hidden=32, layers=4, interval=2, heads=4, kv_heads=2,
                                   seed=1, dtype=torch.float64)}


@pytest.fixture(scope="module")
def models():
    return _models()


def _in_waves(model, wave: int, prefill_chunk: int = 0):
    parts = [sample(model, PROMPTS[a:a + wave], group_size=G, max_new_tokens=T, temperature=1.0,
                    eos_token_ids=[5], seed=SEEDS[a:a + wave], pad_token_id=0, prefill_chunk=prefill_chunk)
             for a in range(0, len(PROMPTS), wave)]
    return join_rollouts(parts, 0)


def _same_answers(a, b):
    assert torch.equal(a.lengths, b.lengths)
    for r in range(a.lengths.shape[0]):
        n = int(a.lengths[r])
        assert a.completion_ids[r, :n].tolist() == b.completion_ids[r, :n].tolist(), r
    m = a.completion_mask
    tol = 8 * 2.0**-24 * (float(a.logprobs.abs().max()) + math.log(24))
    assert torch.allclose(a.logprobs[:, :m.shape[1]][m], b.logprobs[:, :m.shape[1]][m], rtol=0, atol=tol)
    assert torch.equal(a.finished, b.finished)


@pytest.mark.parametrize("kind", ["llama", "hybrid"])
@pytest.mark.parametrize("wave,chunk", [(1, 0), (2, 1), (5, 2)])
def test_waves_and_prefill_chunks_give_the_answers_of_one_batch(models, kind, wave, chunk):
    model = models[kind]
    whole = sample(model, PROMPTS, group_size=G, max_new_tokens=T, temperature=1.0, eos_token_ids=[5],
                   seed=SEEDS, pad_token_id=0)
    lengths = whole.lengths.tolist()
    assert min(lengths) <= 3 and max(lengths) == T           # answers end at very different lengths
    _same_answers(_in_waves(model, wave, chunk), whole)


def _nbytes(cache) -> int:
    if isinstance(cache, HybridCache):
        ts = [t for kv in cache.kv if kv is not None for t in kv] + [t for t in cache.conv + cache.rec if t is not None]
        return sum(t.untyped_storage().nbytes() for t in ts)
    return cache.untyped_storage().nbytes()


@pytest.mark.parametrize("kind", ["llama", "hybrid"])
def test_a_wave_holds_the_cache_bytes_the_plan_counts(models, kind, monkeypatch):
    from fasttrain.plan import Device, meta_policy
    from fasttrain.plan.memory import rollout_phase
    from fasttrain.plan.run_shape import RunShape

    model = models[kind]
    cls = HybridDecoder if kind == "hybrid" else LlamaFamilyDecoder
    made, live, peak = [], {}, [0]
    original = cls.new_cache

    def recording(self, batch, seq):
        cache = original(self, batch, seq)
        key = len(made)
        live[key] = _nbytes(cache)
        made.append((batch, live[key]))
        weakref.finalize(cache, live.pop, key, None)      # the cache object gone: its tensors with it
        peak[0] = max(peak[0], sum(live.values()))
        return cache
    monkeypatch.setattr(cls, "new_cache", recording)
    wave = 2
    _in_waves(model, wave)
    m = meta_policy(model.config, dtype="float64", rank=4, alpha=8.0)
    s = RunShape(prompts=len(PROMPTS), group=G, prompt_tokens=max(map(len, PROMPTS)), new_tokens=T, micro_batch=4,
                 dtype="float64", wave=wave, rank=4, alpha=8.0)
    plan = rollout_phase(m, s, Device("cpu"))
    planned = plan["kv_cache"] + plan["recurrent_state"] + plan["conv_state"]
    batch_caches = [b for rows, b in made if rows > wave]          # the waves' caches (the others: a prefill's own)
    assert batch_caches[0] == planned                              # the first wave holds the longest prompt
    assert max(batch_caches) == planned
    # one wave's cache and one prefill's own cache at most, never two waves' (nor the whole batch's)
    prefill_own = max(b for rows, b in made if rows <= wave)
    assert peak[0] <= planned + prefill_own
    whole = rollout_phase(m, s.with_(wave=0), Device("cpu"))
    assert peak[0] < whole["kv_cache"] + whole["recurrent_state"] + whole["conv_state"]
