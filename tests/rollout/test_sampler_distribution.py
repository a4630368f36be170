"""The sampler draws the distribution it claims: next-token frequencies against the tempered softmax.

For each decoder (the plain Llama-family one and the Qwen3.5 hybrid), each base (the model's own bf16 weights
under a LoRA adapter, and NF4 under a LoRA adapter, both computing in bf16 as a run does) and each turn (the
first answer token, and the first token of the model turn that follows a tool result in the multi-turn
rollout), N rows of one prompt draw their next token at temperature T, and Pearson's chi-square tests their
counts against N·p (bins with an expected count under 5 merged into one):
- bf16 policies: p is the distribution the rollout claims, softmax(z / T) of the logits it computed, read back
  from the behaviour log-probs it returns for the drawn tokens (every row has the same context, so one
  distribution; the tokens never drawn share the remaining mass). bf16 arithmetic moves those logits away from
  exact ones by more than this test resolves (total variation up to 0.02 on the NF4 hybrid), so the exact
  model is checked where it can be:
- float32 policies (one per decoder, after a tool result): p = softmax(z / T) with z the same policy's logits
  in float64 (adapters merged into float64 weights, the hybrid's delta rule and conv by the float64
  definitions), whose distance from the float32 rollout's is rounding (far under the detectable distance).

The numbers (`detectable_tv` computes the last one; the test asserts it):
- N = 20,000 draws (first turn) and 10,000 (after a tool result: every row replays the turn and is fed the
  result), false-alarm probability alpha = 1e-4 per case (7 cases: at most 7e-4 for the file). The
  generators are seeded, so each verdict is fixed: the test is deterministic.
- Power. If the sampler's distribution q is at total variation d from p on the test's bins, Cauchy-Schwarz
  with sum p = 1 gives sum (q - p)^2 / p >= (sum |q - p|)^2 = 4 d^2, so the statistic is (for large N)
  noncentral chi-square with k = bins - 1 degrees of freedom and noncentrality >= 4 N d^2. The smallest d
  detected with probability 0.95 solves P(chi2_k(4 N d^2) > c_alpha) = 0.95: about 0.025 (N = 20,000) and
  0.035 (N = 10,000) for the k = 9 to 15 here, whatever the direction of the error.
- Cases: all four decoder x base pairs at the first token; after a tool result the hybrid on NF4 (bf16),
  and the plain on NF4 and the hybrid on its own weights in float32 (each decoder and each base after a
  tool result, once each against the exact model). The plain decoder on bf16 weights after a tool result
  was dropped to keep `make test` within its budget (the costliest case, a minute on 2 busy cores): its
  first-turn case and the float32 plain case after a tool result cover what it exercised.
Each case also checks the test can fail: the counts reject the softmax at temperature 1.
"""
from __future__ import annotations

import copy

import pytest
import torch

from fasttrain.models import tiny_llama, tiny_qwen3_5
from fasttrain.models.families import nf4_targets
from fasttrain.nn import adaptable_model, attach_adapters, merge_adapters, quantize_model
from fasttrain.rollout import sample
from fasttrain.rollout.families import decoder_for
from fasttrain.rollout.hybrid_decoder import HybridDecoder
from fasttrain.rollout.multi_turn import sample_turns

from support.chi_square import ALPHA, chi2_quantile, chi_square, detectable_tv, ncx2_sf

from support.hf_oracle import hf_float64_oracle

N_FIRST, N_AFTER_TOOL = 20_000, 10_000
T = 0.7
V = 16                        # a small vocabulary: every token a bin
PROMPT = [1, 5, 9, 4, 7]
TURN = [11, 3, 2]             # the model turn the rollout replays, ending in EOS (id 2)
TOOL = [13, 6, 12, 8]         # the tool result fed after it


def test_the_chi_square_helpers_match_tables():
    assert abs(chi2_quantile(0.05, 1) - 3.841459) < 1e-5           # textbook quantiles
    assert abs(chi2_quantile(1e-4, 5) - 25.74483) < 1e-4
    assert abs(ncx2_sf(chi2_quantile(0.05, 1), 1, (1.959964 + 1.644854) ** 2) - 0.95) < 1e-4  # z-test power


# ---- the policies ---------------------------------------------------------------------------
def policy(decoder: str, base: str, dtype=torch.bfloat16):
    """A tiny policy (Llama or Qwen3.5 hybrid) with a LoRA adapter whose B is not 0, on its own weights
    (`dtype`) or on NF4 computing in `dtype`."""
    if decoder == "plain":
        model = tiny_llama(vocab_size=V, hidden=64, layers=2, seed=3, dtype=dtype)
    else:
        model = tiny_qwen3_5(vocab_size=V, hidden=64, layers=4, interval=2, seed=3, dtype=dtype)
    if base == "nf4":
        quantize_model(model, nf4_targets(model))
    else:
        adaptable_model(model)
    torch.manual_seed(7)
    with torch.no_grad():
        for p in attach_adapters(model, r=4, alpha=8):
            p.add_(torch.randn_like(p) * 0.3)
    return model


def exact_logits(model, context: list[int]) -> torch.Tensor:
    """z [V] of the token after `context` from the policy's float64 copy (adapters merged)."""
    ref = merge_adapters(copy.deepcopy(model), dtype=torch.float64).to(torch.float64)
    with torch.no_grad(), hf_float64_oracle():
        return ref(input_ids=torch.tensor([context])).logits[0, -1].double()


def draws(model, turn: str) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The next token of each row and its behaviour log-prob, and the context they follow."""
    if turn == "first":
        r = sample(model, [PROMPT], group_size=N_FIRST, max_new_tokens=1, temperature=T, eos_token_ids=[2],
                   seed=11)
        return r.completion_ids[:, 0], r.logprobs[:, 0], PROMPT
    budget = len(TURN) + len(TOOL) + 1          # the answer ends with the first token of the next model turn

    def end_of_turn(rows, spans, room):
        return [list(TOOL) for _ in rows]

    r = sample_turns(model, [PROMPT], group_size=N_AFTER_TOOL, max_new_tokens=budget, temperature=T,
                     eos_token_ids=[2], seed=11, end_of_turn=end_of_turn, replay=[TURN] * N_AFTER_TOOL)
    at = len(TURN) + len(TOOL)
    assert r.completion_ids[:, :at].eq(torch.tensor(TURN + TOOL)).all()     # every row got the tool result
    assert r.action_mask[:, at].all() and not r.action_mask[:, len(TURN):at].any()
    return r.completion_ids[:, at], r.logprobs[:, at], PROMPT + TURN + TOOL


def claimed(tokens: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """The distribution the rollout reports: exp(log-prob) of each drawn token (all rows that drew it report
    the same value: one context, one distribution), the tokens never drawn sharing what is left (one bin)."""
    p = torch.zeros(V + 1, dtype=torch.float64)
    for v in tokens.unique().tolist():
        lp = logprobs[tokens == v].double()
        assert float(lp.max() - lp.min()) <= 1e-6, v
        p[v] = lp[0].exp()
    p[V] = (1 - p[:V].sum()).clamp(min=0)
    return p / p.sum()


def check(tokens: torch.Tensor, p: torch.Tensor, p_wrong: torch.Tensor) -> None:
    counts = torch.bincount(tokens, minlength=p.numel()).double()
    stat, k = chi_square(counts, p)
    tv = detectable_tv(tokens.numel(), k)
    assert tv <= 0.04, tv                        # the design: any error of 4% in total variation is seen
    assert stat < chi2_quantile(ALPHA, k), (stat, k)
    wrong, k1 = chi_square(counts, p_wrong)
    assert wrong > chi2_quantile(ALPHA, k1), wrong


# every decoder and base at the first token; after a tool result (the costly draws: every row replays the turn)
# the hybrid on NF4 here, and each decoder with each base in float32 against the exact model below
BF16_CASES = [("plain", "bf16", "first"), ("plain", "nf4", "first"), ("hybrid", "bf16", "first"),
              ("hybrid", "nf4", "first"), ("hybrid", "nf4", "after_tool")]


@pytest.mark.parametrize("decoder,base,turn", BF16_CASES)
def test_bf16_rollouts_draw_the_distribution_their_logprobs_claim(decoder, base, turn):
    model = policy(decoder, base)
    assert isinstance(decoder_for(model), HybridDecoder) == (decoder == "hybrid")
    tokens, logprobs, _ = draws(model, turn)
    p = claimed(tokens, logprobs)
    untempered = torch.where(p > 0, p.clamp(min=1e-300) ** T, torch.zeros_like(p))   # p^T: the T = 1 softmax
    check(tokens, p, untempered / untempered.sum())


@pytest.mark.parametrize("decoder,base", [("plain", "nf4"), ("hybrid", "bf16")])
def test_float32_rollouts_after_a_tool_result_draw_the_exact_tempered_softmax(decoder, base):
    model = policy(decoder, base, torch.float32)
    tokens, _, context = draws(model, "after_tool")
    z = exact_logits(model, context)
    check(tokens, torch.softmax(z / T, -1), torch.softmax(z, -1))
