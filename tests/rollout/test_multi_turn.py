"""The multi-turn rollout on one static cache: rows at different turns, held rows untouched.

The oracle is the model's own float64 forward over each row's whole sequence (prompt, model
turns, context turns): every sampled token's behaviour log-prob must equal it, so a held row that
wrote a usable column, moved its position, or saw a neighbour's tokens would fail."""
import pytest
import torch

from fasttrain.models.tiny import tiny_llama
from fasttrain.rollout import sample
from fasttrain.rollout.multi_turn import sample_turns

EOS = [2, 3, 4, 5, 6, 7]          # a tiny random model ends a turn often enough with six end ids


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab_size=48, hidden=32, layers=2, heads=4, seed=3, dtype=torch.float64)


def _full_logprobs(model, prompt, completion):
    """float64 log-probs of `completion` after `prompt` from one forward of the whole sequence, and
    the bound on a sampler that rounds logits to fp32 and takes log_softmax in fp32: a few units of
    roundoff (2^-24) of the largest magnitudes involved, max|z| and |logsumexp|."""
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    logp = torch.log_softmax(logits, -1)
    P = len(prompt)
    at = torch.arange(P - 1, P - 1 + len(completion))
    z = logits[at]
    tol = 4 * 2.0 ** -24 * (z.abs().amax(-1) + torch.logsumexp(z, -1).abs())
    return logp[at, torch.tensor(completion)], tol


def _close(got, ref, tol):
    return bool(((got - ref).abs() <= tol).all())


class Scripted:
    """end_of_turn that appends a context turn of `width(row)` tokens to some rows, at most
    `rounds` times per row, and records what it was asked."""

    def __init__(self, width, rounds=2):
        self.width, self.rounds, self.seen, self.calls = width, rounds, {}, []

    def __call__(self, rows, spans, room):
        self.calls.append((list(rows), [list(s) for s in spans], list(room)))
        out = []
        for r, s, left in zip(rows, spans, room):
            k = self.width(r)
            used = self.seen.get(r, 0)
            if k == 0 or used >= self.rounds or k > left:
                out.append(None)
                continue
            self.seen[r] = used + 1
            out.append([10 + (r + j) % 30 for j in range(k)])
        return out


def test_every_sampled_token_has_the_full_forward_logprob(model):
    prompts = [[1, 11, 12, 13, 14], [1, 20, 21]]
    end = Scripted(lambda r: [0, 3, 1, 7, 2, 5][r])
    roll = sample_turns(model, prompts, group_size=3, max_new_tokens=40, temperature=1.0, eos_token_ids=EOS,
                        seed=[5, 6], end_of_turn=end)
    assert any(len(c[0]) > 1 for c in end.calls) or len(end.calls) > 1     # rows at different turns in a step
    ctx_runs = [sum(1 for t in range(1, int(roll.lengths[b])) if not roll.action_mask[b, t]
                    and roll.action_mask[b, t - 1]) for b in range(6)]
    assert max(ctx_runs) == 2 and min(ctx_runs) == 0                        # rows at different turns
    for b in range(6):
        n = int(roll.lengths[b])
        comp = roll.completion_ids[b, :n].tolist()
        act = roll.action_mask[b, :n]
        ref, tol = _full_logprobs(model, prompts[b // 3], comp)
        got = roll.logprobs[b, :n].double()
        assert _close(got[act], ref[act], tol[act]), b
        assert torch.all(got[~act] == 0)
        assert not roll.completion_mask[b, n:].any() and not roll.action_mask[b, n:].any()


def test_context_tokens_are_masked_and_counted_in_the_budget(model):
    end = Scripted(lambda r: 4, rounds=100)
    roll = sample_turns(model, [[1, 9, 9]], group_size=4, max_new_tokens=24, temperature=1.0,
                        eos_token_ids=EOS, seed=1, end_of_turn=end)
    assert int(roll.lengths.max()) <= 24
    for rows, spans, room in end.calls:
        assert all(s[-1] in EOS for s in spans)                          # a turn ends at its end token
    ctx = roll.completion_mask & ~roll.action_mask
    for b in range(4):                                                  # context runs are 4 tokens long
        runs, k = [], 0
        for v in ctx[b].tolist() + [False]:
            if v:
                k += 1
            elif k:
                runs.append(k)
                k = 0
        assert all(x == 4 for x in runs)


def test_without_context_turns_it_samples_what_the_single_turn_sampler_samples(model):
    prompts = [[1, 11, 12], [1, 30, 31, 32, 33]]
    a = sample(model, prompts, group_size=2, max_new_tokens=12, temperature=1.0, eos_token_ids=EOS, seed=[3, 4])
    b = sample_turns(model, prompts, group_size=2, max_new_tokens=12, temperature=1.0, eos_token_ids=EOS,
                     seed=[3, 4], end_of_turn=lambda rows, spans, room: [None] * len(rows))
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.lengths, b.lengths)
    assert torch.equal(a.completion_mask, b.action_mask) and torch.equal(a.finished, b.finished)
    assert torch.allclose(a.logprobs.double(), b.logprobs.double(), atol=8 * 2.0 ** -24 * 20, rtol=0)


def test_a_row_does_not_depend_on_its_neighbours_turns(model):
    """Row 0's answer is the same whether its neighbours take tool turns or not (greedy)."""
    kw = dict(group_size=1, max_new_tokens=30, temperature=0.0, eos_token_ids=EOS, seed=0)
    alone = sample_turns(model, [[1, 15, 16]], end_of_turn=Scripted(lambda r: 2), **kw)
    mixed = sample_turns(model, [[1, 15, 16], [1, 40, 41, 42, 43, 44]],
                         end_of_turn=Scripted(lambda r: [2, 6][r]), **kw)
    n = int(alone.lengths[0])
    assert torch.equal(alone.completion_ids[0, :n], mixed.completion_ids[0, :n])
    assert torch.equal(alone.action_mask[0, :n], mixed.action_mask[0, :n])


def test_a_hybrid_models_sampled_tokens_have_the_oracles_logprob():
    """Qwen3.5 hybrids take the same per-row step (HybridDecoder.step_rows: a held token leaves the
    conv window and the recurrent state as they were); the oracle is transformers' model in float64
    with fasttrain's float64 delta rule and conv (support.hf_oracle)."""
    from fasttrain.models import tiny_qwen3_5
    from support.hf_oracle import hf_float64_oracle
    hybrid = tiny_qwen3_5(vocab_size=48, hidden=32, layers=4, interval=2, heads=4, kv_heads=2, head_dim=8,
                          linear_k_heads=2, value_heads_per_key=2, linear_head_dim=8, seed=3, dtype=torch.float64)
    prompts = [[1, 11, 12, 13, 14], [1, 20, 21]]
    end = Scripted(lambda r: [0, 3, 1, 7][r])
    roll = sample_turns(hybrid, prompts, group_size=2, max_new_tokens=30, temperature=1.0, eos_token_ids=EOS,
                        seed=[5, 6], end_of_turn=end)
    ctx = roll.completion_mask & ~roll.action_mask
    assert ctx.any() and not ctx.all()                                       # rows at different turns
    with hf_float64_oracle():
        for b in range(4):
            n = int(roll.lengths[b])
            act = roll.action_mask[b, :n]
            ref, tol = _full_logprobs(hybrid, prompts[b // 2], roll.completion_ids[b, :n].tolist())
            assert _close(roll.logprobs[b, :n].double()[act], ref[act], tol[act]), b
