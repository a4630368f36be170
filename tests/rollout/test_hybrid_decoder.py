"""The hybrid (Qwen3.5) rollout against the oracle: transformers' own Qwen3_5ForCausalLM in float64
with its delta rule and conv computed by fasttrain.ops.reference (support.hf_oracle).

The decoder's behaviour log-probs of the tokens it sampled equal the oracle's full forward over the
same left-padded rows; greedy decoding picks the oracle's argmax; rows held for several steps
resume as if the held steps never happened. Several layouts: full attention every 4th and every
2nd layer, grouped-query attention or not, 1 or 3 value heads per q/k head.

Tolerance: float64 throughout, so the two paths differ only by rounding order. Each logit is
reached through `layers` blocks whose sums have at most H + S·(head dims) terms; a first-order
bound is layers·(H + 2·S·D)·u·M with u = 2^-53 and M = 1e3 a bound on the magnitudes summed (unit
scale activations, |logit| < 10, norms' 1/rms < 1e2): about 1e-9 for these sizes. `sample` takes the
log-softmax of float32 logits (as in a run), which adds up to 8·u32·(max|z| + log V), u32 = 2^-24."""

import pytest
import torch

from fasttrain.models import tiny_qwen3_5
from fasttrain.rollout import sample
from fasttrain.rollout.families import decoder_for
from fasttrain.rollout.hybrid_decoder import HybridDecoder

from support.hf_oracle import hf_float64_oracle
from support.tolerances import forward_tol, fp32_logsoftmax_tol

PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [3, 4, 5, 6, 7, 8, 9, 10]]
LAYOUTS = {
    "interval4-gqa-rep2": dict(layers=4, interval=4, heads=4, kv_heads=2, value_heads_per_key=2),
    "interval2-mha-rep1": dict(layers=4, interval=2, heads=4, kv_heads=4, value_heads_per_key=1),
    "interval2-gqa-rep3": dict(layers=4, interval=2, heads=4, kv_heads=1, value_heads_per_key=3),
}


def _tol(model, S):
    return forward_tol(model.config, S)


def model64(layout, seed=0):
    return tiny_qwen3_5(vocab_size=97, seed=seed, dtype=torch.float64, **LAYOUTS[layout])


def oracle_logprobs(model, ids, mask, pos, temperature=1.0):
    with torch.no_grad(), hf_float64_oracle():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    return torch.log_softmax(logits / temperature, -1)


def _fp32_logsoftmax_tol(lp):
    """8·u32·(max|z| + log V) from the oracle's log-probs (|z| - max z = -log p bounds the spread)."""
    return fp32_logsoftmax_tol(lp)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sampled_logprobs_equal_the_oracle(layout):
    model = model64(layout)
    assert isinstance(decoder_for(model), HybridDecoder)
    r = sample(model, PROMPTS, group_size=2, max_new_tokens=9, temperature=1.0, eos_token_ids=[2], seed=3)
    P, T = r.prompt_len, r.completion_ids.shape[1]
    lp = oracle_logprobs(model, r.input_ids, r.attention_mask, r.position_ids)[:, P - 1:P - 1 + T]
    want = lp.gather(2, r.completion_ids[..., None])[..., 0]
    m = r.completion_mask
    assert m.sum() > 20
    err = (r.logprobs.double() - want)[m].abs().max()
    assert err <= _tol(model, P + T) + _fp32_logsoftmax_tol(lp), err


@pytest.mark.parametrize("layout", ["interval4-gqa-rep2", "interval2-gqa-rep3"])
def test_greedy_tokens_are_the_oracles_argmax(layout):
    model = model64(layout, seed=1)
    r = sample(model, PROMPTS, group_size=1, max_new_tokens=10, temperature=0, eos_token_ids=[], seed=0)
    P = r.prompt_len
    lp = oracle_logprobs(model, r.input_ids, r.attention_mask, r.position_ids)[:, P - 1:-1]
    top2 = lp.topk(2, -1).values
    assert (top2[..., 0] - top2[..., 1]).min() > 1e-6          # no near-tie decided by rounding
    assert torch.equal(lp.argmax(-1), r.completion_ids)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_rows_held_for_several_steps_resume_unchanged(layout):
    """Drive the decoder by hand: each row is held at some steps (the held steps feed junk tokens);
    its final logits equal the oracle over the row's own tokens only, at the row's own positions."""
    model = model64(layout, seed=2)
    dec = HybridDecoder(model)
    n, steps = len(PROMPTS), 8
    P = max(len(p) for p in PROMPTS)
    ids = torch.zeros(n, P, dtype=torch.long)
    valid = torch.zeros(n, P, dtype=torch.bool)
    for i, p in enumerate(PROMPTS):
        ids[i, P - len(p):] = torch.tensor(p)
        valid[i, P - len(p):] = True
    g = torch.Generator().manual_seed(5)
    feed = torch.randint(3, 97, (n, steps), generator=g)
    active = torch.ones(n, steps, dtype=torch.bool)
    active[0, 2:5] = False          # held three steps, then resumes
    active[1, 0] = False            # held at the first step
    active[2, 3:] = False           # held to the end (a finished row)
    cache = dec.new_cache(n, P + steps)
    pos0 = (valid.long().cumsum(1) - 1).clamp(min=0)
    cos, sin = dec.rotary_table(pos0)
    with torch.no_grad():
        h = dec.prefill(ids, valid, cos, sin, cache)
        key_valid = torch.cat([valid, torch.zeros(n, steps, dtype=torch.bool)], 1)
        pos = valid.sum(1)                                       # next position of each row
        for t in range(steps):
            col = P + t
            a = active[:, t]
            key_valid[:, col] = a
            c, s = dec.rotary_table(pos[:, None])
            h = torch.where(a[:, None], dec.decode(feed[:, t], key_valid[:, :col + 1], c[:, 0], s[:, 0], cache,
                                                   col, active=a), h)
            pos = pos + a.long()
        got = torch.log_softmax(dec.lm_head(h), -1)
    for i, p in enumerate(PROMPTS):
        seq = torch.tensor([p + feed[i][active[i]].tolist()])
        want = oracle_logprobs(model, seq, torch.ones_like(seq), torch.arange(seq.shape[1])[None])[0, -1]
        assert (got[i] - want).abs().max() <= _tol(model, seq.shape[1]), i


def test_left_padding_leaves_the_state_at_zero():
    model = model64("interval4-gqa-rep2")
    dec = HybridDecoder(model)
    ids = torch.tensor([[0, 0, 0, 5, 6], [7, 8, 9, 10, 11]])
    valid = ids != 0
    valid[1] = True
    cache = dec.new_cache(2, 5)
    cos, sin = dec.rotary_table((valid.long().cumsum(1) - 1).clamp(min=0))
    alone = dec.new_cache(1, 2)
    c1, s1 = dec.rotary_table(torch.arange(2)[None])
    with torch.no_grad():
        h = dec.prefill(ids, valid, cos, sin, cache)
        h1 = dec.prefill(ids[:1, 3:], valid[:1, 3:], c1, s1, alone)
    tol = _tol(model, 5)
    assert (h[0] - h1[0]).abs().max() <= tol
    for i, kind in enumerate(dec.kinds):
        if kind == "linear_attention":
            assert (cache.rec[i][0] - alone.rec[i][0]).abs().max() <= tol
            assert cache.rec[i].dtype == torch.float64


def test_bf16_model_keeps_a_float32_recurrent_state():
    model = tiny_qwen3_5(vocab_size=97, dtype=torch.bfloat16)
    dec = HybridDecoder(model)
    cache = dec.new_cache(2, 8)
    rec = [t for t in cache.rec if t is not None]
    conv = [t for t in cache.conv if t is not None]
    kv = [t for t in cache.kv if t is not None]
    assert rec and all(t.dtype == torch.float32 for t in rec)
    assert all(t.dtype == torch.bfloat16 and t.shape == (2, 3, dec.conv_dim) for t in conv)
    assert len(kv) == sum(k == "full_attention" for k in dec.kinds)
    r = sample(model, PROMPTS, group_size=2, max_new_tokens=5, temperature=1.0, eos_token_ids=[], seed=0)
    assert torch.isfinite(r.logprobs).all() and (r.logprobs <= 0).all()


def test_hf_generate_smoke():
    """transformers' unmodified generate (its own torch fallbacks, float32) runs on the tiny hybrid
    and its first greedy token is ours (a smoke test: the oracle above is the equality test)."""
    model = tiny_qwen3_5(vocab_size=97, seed=4)
    out = model.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=3, do_sample=False)
    r = sample(model, PROMPTS[:1], group_size=1, max_new_tokens=3, temperature=0, eos_token_ids=[], seed=0)
    assert out.shape == (1, len(PROMPTS[0]) + 3)
    assert int(out[0, len(PROMPTS[0])]) == int(r.completion_ids[0, 0])


def test_compiled_sampling_gives_the_eager_tokens():
    """sample(compile=...) on a hybrid: the fixed-shape step (tensor column, every cache column under
    the key mask, the cache kept across calls, finished rows held) under torch.compile's aot_eager
    backend samples eager's tokens, twice in a row, with rows finishing early (EOS)."""
    import torch._dynamo
    torch._dynamo.reset()
    model = model64("interval4-gqa-rep2", seed=7)
    kw = dict(group_size=2, max_new_tokens=9, temperature=1.0, eos_token_ids=[2, 3, 4], seed=3)
    ref = sample(model, PROMPTS, **kw)
    assert not ref.completion_mask.all()                       # some rows finished and were held
    for _ in range(2):
        got = sample(model, PROMPTS, compile="aot_eager", **kw)
        assert torch.equal(got.completion_ids, ref.completion_ids)
        # float64: masked columns add exact zeros; only the reduction order may differ
        torch.testing.assert_close(got.logprobs, ref.logprobs, rtol=0, atol=1e-9)


def test_the_decode_step_compiles_to_one_graph_with_fixed_shapes():
    """decode with a tensor column and a full-width key mask has the same shapes every step (the
    states are written in place of fixed buffers), so torch.compile traces it once; aot_eager runs
    the traced graph without code generation and gives eager's values bit for bit."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    model = tiny_qwen3_5(vocab_size=97, seed=5)
    dec = HybridDecoder(model)
    n, P, S = 2, 5, 12
    ids = torch.randint(3, 97, (n, P), generator=torch.Generator().manual_seed(0))
    valid = torch.ones(n, P, dtype=torch.bool)
    cos, sin = dec.rotary_table(torch.arange(S)[None].expand(n, S))

    def run(step):
        cache = dec.new_cache(n, S)
        with torch.no_grad():
            dec.prefill(ids, valid, cos[:, :P], sin[:, :P], cache)
            kv = torch.zeros(n, S, dtype=torch.bool)
            kv[:, :P] = True
            tok, outs = torch.tensor([5, 6]), []
            for t in range(5):
                col = P + t
                active = torch.tensor([True, t not in (1, 2)])       # row 1 held for two steps
                kv[:, col] = active
                h = step(tok, kv, cos[:, col].contiguous(), sin[:, col].contiguous(), cache, torch.tensor([col]),
                         active)
                outs.append(h.clone())
                tok = dec.lm_head(h).argmax(-1)
        return torch.stack(outs)

    eager = run(dec.decode)
    torch._dynamo.reset()
    counters.clear()
    compiled = run(torch.compile(dec.decode, backend="aot_eager", dynamic=False))
    assert torch.equal(eager, compiled)
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("layout", ["interval4-gqa-rep2", "interval2-gqa-rep3"])
def test_step_rows_with_held_tokens_equals_the_oracle_over_each_rows_own_tokens(layout):
    """The multi-turn step (k tokens per row, any of them held): three calls of k = 3 with held
    tokens at the front, middle and end of a call, and a row held for a whole call; each row's last
    valid hidden state equals the oracle's over the row's prompt and its valid tokens only."""
    model = model64(layout, seed=6)
    dec = HybridDecoder(model)
    n, k, calls = len(PROMPTS), 3, 3
    P = max(len(p) for p in PROMPTS)
    S = P + k * calls + 1
    scratch = S - 1
    ids = torch.zeros(n, P, dtype=torch.long)
    valid = torch.zeros(n, P, dtype=torch.bool)
    for i, p in enumerate(PROMPTS):
        ids[i, P - len(p):] = torch.tensor(p)
        valid[i, P - len(p):] = True
    feed = torch.randint(3, 97, (calls, n, k), generator=torch.Generator().manual_seed(8))
    ok = torch.ones(calls, n, k, dtype=torch.bool)
    ok[0, 0, 0] = ok[0, 1, 1] = ok[0, 2, 2] = False        # held at the front, the middle, the end
    ok[1, 1] = False                                       # a whole call held
    ok[2, 0, 1:] = False
    cache = dec.new_cache(n, S)
    cos, sin = dec.rotary_table((valid.long().cumsum(1) - 1).clamp(min=0))
    key_valid = torch.zeros(n, S, dtype=torch.bool)
    key_valid[:, :P] = valid
    written = torch.zeros(n, dtype=torch.long)
    last_h = torch.zeros(n, model.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        last_h = dec.prefill(ids, valid, cos, sin, cache)
        for c in range(calls):
            v = ok[c]
            at = written[:, None] + v.long().cumsum(1) - 1                 # each valid token's index
            cols = torch.where(v, P + at, torch.full_like(at, scratch))
            cs, sn = dec.rotary_table(valid.sum(1)[:, None] + at.clamp(min=0))
            h = dec.step_rows(feed[c], v, cols, key_valid, cs, sn, cache)
            key_valid[torch.arange(n)[:, None].expand_as(cols)[v], cols[v]] = True
            for b in range(n):
                if v[b].any():
                    last_h[b] = h[b, int(v[b].nonzero().max())]
            written = written + v.sum(1)
        got = torch.log_softmax(dec.lm_head(last_h), -1)
    for b, p in enumerate(PROMPTS):
        own = p + [int(t) for c in range(calls) for t, o in zip(feed[c, b], ok[c, b]) if o]
        seq = torch.tensor([own])
        want = oracle_logprobs(model, seq, torch.ones_like(seq), torch.arange(seq.shape[1])[None])[0, -1]
        assert (got[b] - want).abs().max() <= _tol(model, seq.shape[1]), b
