"""Truncated sampling (top_k, top_p, min_p): the kept set is transformers', the draw follows the kept set's
renormalised softmax and never leaves it, and the record (keep_delta) names the set.

The chi-square test is tests/support/chi_square.py's, as the sampler's distribution test uses it: N = 20,000
rows of one logit row draw one token each; alpha = 1e-4; bins of expected count < 5 merged. Its power:
a sampler whose distribution is at total variation d from the truncated softmax is detected with
probability 0.95 for d >= `detectable_tv` (about 0.025 at the k <= 20 degrees of freedom here; the test
asserts <= 0.04). The same counts must reject the untruncated softmax (the test can fail), and a token
outside the kept set is checked for separately (any one is a failure, not a statistical event).
"""
from __future__ import annotations

import math

import pytest
import torch

from fasttrain.rollout import sampling
from fasttrain.rollout.sampling import Truncation, draw_tokens, kept_cut

from support.chi_square import ALPHA, chi2_quantile, chi_square, detectable_tv

V = 64
N = 20_000
TEMP = 0.8


def row(seed: int = 0) -> torch.Tensor:
    """One row of logits with a spread that makes each knob bind (a few large, a long tail)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, generator=g, dtype=torch.float64) * 2.0


def truncated_softmax(z: torch.Tensor, trunc: Truncation) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [V], kept [V] bool) for tempered logits z [V] by the definitions, in float64: top_k keeps the k
    largest (ties kept), top_p the descending prefix whose mass above each kept token is < top_p (of the
    top_k-renormalised softmax), min_p the tokens with p >= min_p * p_max."""
    kept = torch.ones(V, dtype=torch.bool)
    if 0 < trunc.top_k < V:
        kept &= z >= z.sort(descending=True).values[trunc.top_k - 1]
    if trunc.top_p < 1:
        p = torch.softmax(torch.where(kept, z, -math.inf), -1)
        order = p.argsort(descending=True)
        above = 0.0
        keep_p = torch.zeros(V, dtype=torch.bool)
        for v in order.tolist():
            if above < trunc.top_p and kept[v]:
                keep_p[v] = True
            above += float(p[v])
        kept &= keep_p
    if trunc.min_p > 0:
        p = torch.softmax(torch.where(kept, z, -math.inf), -1)
        kept &= p >= trunc.min_p * p.max()
    return torch.softmax(torch.where(kept, z, -math.inf), -1), kept


KNOBS = [Truncation(top_k=20), Truncation(top_p=0.8), Truncation(min_p=0.1),
         Truncation(top_k=20, top_p=0.8, min_p=0.1), Truncation(top_k=5, top_p=0.95)]


@pytest.mark.parametrize("listed", [1024, 12, 3])
@pytest.mark.parametrize("trunc", KNOBS, ids=str)
def test_kept_set_is_transformers_warpers(trunc, listed, monkeypatch):
    """listed: top_p's partial sort (1024: the whole row here; 12 and 3: rows whose cut is in the list and
    rows sorted whole)."""
    monkeypatch.setattr(sampling, "TOP_P_LIST", listed)
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
    for seed in range(5):
        d = torch.stack([row(seed), row(seed + 100)]) / TEMP
        scores = d.clone()
        if trunc.top_k:
            scores = TopKLogitsWarper(trunc.top_k)(None, scores)
        if trunc.top_p < 1:
            scores = TopPLogitsWarper(trunc.top_p)(None, scores)
        if trunc.min_p:
            scores = MinPLogitsWarper(trunc.min_p)(None, scores)
        cut = kept_cut(d, d.amax(-1, keepdim=True), trunc)
        assert torch.equal(d >= cut, scores > -math.inf), seed
        for b in range(2):
            assert torch.equal(d[b] >= cut[b], truncated_softmax(d[b], trunc)[1])


def test_ties_at_the_cut_are_kept():
    z = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0]], dtype=torch.float64)
    m = z.amax(-1, keepdim=True)
    assert kept_cut(z, m, Truncation(top_k=2)).item() == 2.0            # all three tied at the 2nd kept
    # top_p: the first 2.0 (in any order) brings the mass above the next one past 0.5: a sort-order split
    # in transformers; every tied token kept here
    assert kept_cut(z, m, Truncation(top_p=0.5)).item() == 2.0


@pytest.mark.parametrize("trunc", [Truncation(top_k=20, top_p=0.8, min_p=0.1), Truncation(top_p=0.8)], ids=str)
def test_draws_follow_the_kept_sets_softmax_and_never_leave_it(trunc):
    z = row(1)
    logits = z.float()[None].expand(N, V).contiguous()
    tok, logp, delta = draw_tokens(logits, TEMP, [torch.Generator().manual_seed(5)], N, truncation=trunc)
    zt = logits[0].double() / TEMP
    q, kept = truncated_softmax(zt, trunc)
    assert 1 < int(kept.sum()) < V                                    # the truncation binds, not all kept
    assert bool(kept[tok].all())                                      # never a token outside the kept set
    # the behaviour log-prob is the truncated one (float64 draw, fp32 result: relative 2^-24 plus the sums)
    assert torch.allclose(logp.double(), q[tok].log(), rtol=0, atol=1e-6)
    # the record: delta = z_token - c with c midway between the smallest kept logit and the largest dropped
    # one, never below (rounded up to fp32), and it names the set
    c = (zt[kept].min() + zt[~kept].max()) / 2
    exact = zt[tok] - c
    assert bool((delta.double() >= exact).all()) and bool((delta.double() - exact <= 2 ** -23 * exact.abs() + 1e-30).all())
    for t in tok.unique()[:8].tolist():
        d = float(delta[tok == t][0])
        assert torch.equal(zt >= zt[t] - d, kept)
    counts = torch.bincount(tok, minlength=V).double()
    stat, k = chi_square(counts, q)
    assert detectable_tv(N, k) <= 0.04
    assert stat < chi2_quantile(ALPHA, k), (stat, k)
    full = torch.softmax(zt, -1)                                       # the untruncated draw: rejected
    wrong, _ = chi_square(counts, full)
    assert wrong == math.inf or wrong > chi2_quantile(ALPHA, int((full * N >= 5).sum())), wrong


def test_untruncated_draw_records_nothing_and_is_unchanged():
    logits = row(2).float()[None].expand(64, V).contiguous()
    a = draw_tokens(logits, TEMP, [torch.Generator().manual_seed(1)], 64)
    b = draw_tokens(logits, TEMP, [torch.Generator().manual_seed(1)], 64, truncation=Truncation(top_k=V))
    assert a[2] is None and b[2] is None
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("kw,msg", [({"top_p": 0.0}, "top_p must be in"), ({"top_p": 1.5}, "top_p must be in"),
                                    ({"top_k": -1}, "top_k must be"), ({"min_p": 1.0}, "min_p must be in"),
                                    ({"min_p": -0.1}, "min_p must be in")])
def test_bad_knobs_are_one_clear_line(kw, msg):
    with pytest.raises(ValueError, match=msg) as e:
        Truncation(**kw)
    assert "\n" not in str(e.value)
