"""The k-pass update: micro-batching gives the one-batch gradient, pass 1 runs on the old policy
(ratio exactly 1), non-finite losses never reach the adapters."""
import dataclasses
import math

import pytest
import torch

from fasttrain.train.config import LossSection


class RecordingSGD(torch.optim.SGD):
    """lr 0: records the (clipped) gradient of every step and leaves the parameters alone."""
    def __init__(self, params):
        super().__init__(params, lr=0.0)
        self.seen = []

    def step(self, closure=None):
        self.seen.append([p.grad.detach().clone() for g in self.param_groups for p in g["params"]])


def _adapted_tiny_policy(dtype: str, seed: int, quantize: str = "nf4", kind: str = "lora"):
    """The tiny policy in NF4 (or its own weights: quantize "none") with adapters whose B is non-zero
    (so they matter for log p)."""
    from support import tiny_world
    from fasttrain.nn import adaptable_model, attach_adapters, quantize_model
    model, tok = tiny_world.tiny_policy(dtype)
    for p in model.parameters():
        p.requires_grad_(False)
    quantize_model(model) if quantize == "nf4" else adaptable_model(model)
    torch.manual_seed(seed)
    params = attach_adapters(model, kind=kind, r=4, alpha=8)
    with torch.no_grad():
        for p in params:
            p.normal_(0, 0.2)
    for p in params:
        p.requires_grad_(True)
    return model, tok, params


def _setup(tiny):
    from support import tiny_world
    from fasttrain.train.answers import sample_answers
    model, tok, params = _adapted_tiny_policy("float32", 3)
    env = tiny_world.make_env()
    roll, _ = sample_answers(model, tok, env, env.prompts("train")[:2], group_size=4, max_new_tokens=6,
                             temperature=1.0, seed=11)
    return model, params, roll


@pytest.mark.parametrize("kind", ["cispo", "dapo", "grpo"])
def test_micro_batches_give_the_one_batch_gradient(tiny, kind):
    from fasttrain.train.policy_update import score_batch, update_policy
    model, params, roll = _setup(tiny)
    adv = torch.linspace(-1.5, 1.5, roll.completion_ids.shape[0])
    mask = roll.completion_mask.bool()
    cfg = LossSection(kind=kind, beta=0.08, passes=1)
    grads = []
    for mb in (8, 3, 1):
        scores = score_batch(model, roll, mb, 1.0, need_ref=True)
        opt = RecordingSGD(params)
        update_policy(model, params, opt, roll, scores, adv, mask, cfg, zeta=0.01, micro_batch=mb,
                      grad_clip=0.0, temperature=1.0)
        grads.append(opt.seen[0])
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            # fp32 sums in a different order: a few ulps of the largest gradient entry
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6 * float(a.abs().max()) + 1e-9)
    assert any(float(g.abs().max()) > 0 for g in grads[0])


def test_first_pass_is_on_policy_and_later_passes_are_not(tiny):
    from fasttrain.train.policy_update import score_batch, update_policy
    model, params, roll = _setup(tiny)
    adv = torch.linspace(-1.0, 1.0, roll.completion_ids.shape[0])
    scores = score_batch(model, roll, 3, 1.0, need_ref=False)
    opt = torch.optim.AdamW(params, lr=5e-2)
    stats = update_policy(model, params, opt, roll, scores, adv, roll.completion_mask.bool(),
                          LossSection(kind="dapo", beta=0.0, passes=2), 0.0, 3, 1.0, 1.0).passes
    assert len(stats) == 2
    assert stats[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-6)       # old log-probs = pass 1
    assert stats[0]["clip_low_frac"] == 0 and stats[0]["clip_high_frac"] == 0
    assert abs(stats[1]["ratio_mean"] - 1.0) > 1e-6                      # pass 2 sees the updated policy


def test_non_finite_loss_leaves_adapters_untouched(tiny):
    from fasttrain.train.policy_update import NonFiniteLoss, score_batch, update_policy
    model, params, roll = _setup(tiny)
    before = [p.detach().clone() for p in params]
    adv = torch.full((roll.completion_ids.shape[0],), math.nan)
    scores = score_batch(model, roll, 4, 1.0, need_ref=False)
    opt = torch.optim.AdamW(params, lr=1e-2)
    with pytest.raises(NonFiniteLoss) as err:
        update_policy(model, params, opt, roll, scores, adv, roll.completion_mask.bool(),
                      LossSection(kind="cispo", beta=0.0), 0.0, 4, 1.0, 1.0)
    assert torch.equal(err.value.result.old_logp, scores.old_logp)      # what was computed comes back
    assert all(torch.equal(a, b) for a, b in zip(before, params))
    assert all(p.grad is None for p in params)


def _tokens_through_q_proj(model):
    """A forward hook on layer 0's q_proj that counts the tokens it runs (recomputes included)."""
    seen = []
    handle = model.model.layers[0].self_attn.q_proj.register_forward_hook(
        lambda mod, args, out: seen.append(args[0].reshape(-1, args[0].shape[-1]).shape[0]))
    return seen, handle


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("base", [("nf4", "lora"), ("none", "dora")], ids=["nf4-lora", "16bit-dora"])
def test_shared_prefix_forward_equals_the_full_forward_in_float64(tiny, checkpointing, base):
    """Running each prompt once per micro-batch and letting its answers attend to its keys and
    values gives the full forward's log-probs and adapter gradients (float64: equal to rounding),
    with gradient checkpointing off and on; under checkpointing the layers recompute from the
    prompts' U rows, not from B copies, and keep only the layer inputs."""
    from fasttrain.rollout import sample
    from fasttrain.train.policy_update import answer_logprobs
    model, tok, params = _adapted_tiny_policy("float64", 5, *base)
    prompt_ids = [tok.encode(t) for t in ("say a word", "a longer prompt, with more bytes in it", "hi")]
    roll = sample(model, prompt_ids, group_size=3, max_new_tokens=7, temperature=1.0,
                  eos_token_ids=[tok.eos_token_id], seed=2)
    pad = (roll.attention_mask[:, :roll.prompt_len] == 0).sum(1)
    assert int(pad.max()) > int(pad.min())        # prompts of different lengths: left padding is exercised
    B, T, P = roll.completion_ids.shape[0], roll.completion_ids.shape[1], roll.prompt_len
    # two rows end early (as at an EOS): their padded tails are masked and never read
    for b, n in ((1, 3), (5, 5)):
        roll.completion_mask[b, n:] = False
        roll.attention_mask[b, P + n:] = 0
        roll.completion_ids[b, n:] = 0
        roll.input_ids[b, P + n:] = 0
    model.train()
    if checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    seen, hook = _tokens_through_q_proj(model)
    out, saved = {}, {}
    # the full forward, the shared-prefix one in the padded layout, and the shared-prefix one with the
    # answers packed (the default)
    for way in ("full", "padded", "packed"):
        for p in params:
            p.grad = None
        seen.clear()
        numel = [0]

        def pack(t):
            numel[0] += t.numel()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logp, ent = answer_logprobs(model, roll.input_ids, roll.attention_mask, roll.prompt_len,
                                        roll.completion_ids, roll.completion_mask, 1.0, shared_prefix=way != "full",
                                        packed=way == "packed")
        saved[way] = numel[0]
        forward_tokens = sum(seen)
        (logp * torch.linspace(-1, 1, logp.numel()).reshape(logp.shape)).sum().backward()
        out[way] = (logp.detach(), ent, [p.grad.clone() for p in params], forward_tokens, sum(seen))
    hook.remove()
    full = out["full"]
    m = roll.completion_mask.bool()
    # the packed answer inputs: a row's real inputs before its last wanted position (answer_packing)
    last = torch.where(m, torch.arange(T), -1).amax(1)
    real = roll.attention_mask[:, P:P + T - 1].bool()
    n_packed = int((real & (torch.arange(T - 1)[None] < last[:, None])).sum())
    assert n_packed < B * (T - 1)                 # the rows that end early leave something to drop
    # tokens through a layer: the full forward runs B·(P+T), the shared one U·P + B·(T-1) (3 prompts),
    # the packed one U·P + the packed answer inputs
    assert full[3] == B * (P + T) and out["padded"][3] == 3 * P + B * (T - 1)
    assert out["packed"][3] == 3 * P + n_packed
    # the backward recomputes each layer (checkpointing) from those same tokens, or runs nothing
    for way in out:
        assert out[way][4] == out[way][3] * (2 if checkpointing else 1)
    assert bool(m.sum() > 0) and float(full[0][m].abs().max()) > 0
    for way in ("padded", "packed"):
        shared = out[way]
        torch.testing.assert_close(shared[0], full[0], rtol=0, atol=1e-10)
        torch.testing.assert_close(shared[1], full[1], rtol=0, atol=1e-10)
        for a, b in zip(full[2], shared[2]):
            # the adapter masters (and so their gradients) are float32: the two forwards sum the
            # group's contributions in a different order, so allow a few float32 ulps of the largest entry
            scale = float(a.abs().max())
            assert a.dtype == torch.float32 and scale > 0
            torch.testing.assert_close(b, a, rtol=0, atol=8 * torch.finfo(torch.float32).eps * scale)
        if checkpointing:
            # checkpointed layers keep their inputs only: the shared forward keeps less than the full one
            assert saved[way] < saved["full"]


def test_shared_prefix_forward_under_checkpointing_keeps_only_layer_inputs(tiny):
    """With checkpointing the autograd graph of the shared forward holds far fewer saved values
    than without it (the layer internals are recomputed in the backward)."""
    from fasttrain.train.prefix_forward import shared_prefix_hidden
    model, tok, params = _adapted_tiny_policy("float32", 5)
    ids = torch.tensor([[0, 5, 6, 7, 8, 9, 10, 11], [3, 4, 5, 6, 7, 8, 9, 10]]).repeat_interleave(4, 0)
    am = torch.ones_like(ids)
    am[:4, 0] = 0
    pos = (am.cumsum(1) - 1).clamp_min(0)
    model.train()
    kept = []
    for on in (False, True):
        if on:
            model.activation_checkpointing_enable({"use_reentrant": False})
        numel = [0]

        def pack(t):
            numel[0] += t.numel()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            h = shared_prefix_hidden(model, ids, am, pos, 5, 3)
        assert h.shape == (8, 3, 64) and h.requires_grad
        kept.append(numel[0])
    # per layer, inputs only: 2 prompts x 5 + 8 answers x 2 tokens, H = 64 (plus the final norm's)
    assert kept[1] < kept[0] / 4


@pytest.mark.parametrize("passes", [1, 2])
def test_old_logprobs_from_the_first_pass_equal_a_separate_forward(tiny, passes):
    """score_batch(need_old=False): the update's first pass fills old_logp and entropy; they and
    every pass's gradient equal those of the run with the separate no-grad forward."""
    from fasttrain.train.policy_update import score_batch, update_policy
    model, params, roll = _setup(tiny)
    adv = torch.linspace(-1.5, 1.5, roll.completion_ids.shape[0])
    mask = roll.completion_mask.bool()
    cfg = LossSection(kind="cispo", beta=0.08, passes=passes)
    start = [p.detach().clone() for p in params]
    runs = []
    for need_old in (True, False):
        with torch.no_grad():
            for p, s in zip(params, start):
                p.copy_(s)
        scores = score_batch(model, roll, 3, 1.0, need_ref=True, need_old=need_old)
        assert (scores.old_logp is None) == (not need_old)
        opt = RecordingSGD(params)
        result = update_policy(model, params, opt, roll, scores, adv, mask, cfg, zeta=0.01, micro_batch=3,
                               grad_clip=0.0, temperature=1.0)
        # the update returns the pre-update log-probs; it never writes into its `scores` argument
        assert (scores.old_logp is None) == (not need_old) and (scores.entropy is None) == (not need_old)
        runs.append((result, opt.seen, result.passes))
    (a, ga, sa), (b, gb, sb) = runs
    torch.testing.assert_close(b.old_logp, a.old_logp, rtol=0, atol=1e-6)
    torch.testing.assert_close(b.entropy, a.entropy, rtol=0, atol=1e-5)
    assert float(a.old_logp[mask].abs().min()) > 0
    for pa, pb in zip(ga, gb):
        for x, y in zip(pa, pb):
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6 * float(x.abs().max()) + 1e-9)
    assert sb[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-6)


def test_the_update_uses_the_rollouts_positions_and_groups(tiny):
    """Positions and groups come from the rollout (Rollout.position_ids, Rollout.prompt_index), not
    rebuilt from the mask and the prompt tokens: a rollout whose positions are twice as far apart scores
    differently, and one that declares every row its own group runs the prompts unshared."""
    from fasttrain.train.policy_update import score_batch
    model, params, roll = _setup(tiny)
    base = score_batch(model, roll, 8, 1.0, need_ref=False).old_logp
    shifted = dataclasses.replace(roll, position_ids=roll.position_ids * 2)   # RoPE sees distances
    m = roll.completion_mask.bool()
    assert float((score_batch(model, shifted, 8, 1.0, need_ref=False).old_logp - base)[m].abs().max()) > 1e-4
    rows_seen = []
    # the shared-prefix forward embeds the distinct prompts first ([U, P]), then the answers
    hook = model.model.embed_tokens.register_forward_pre_hook(lambda mod, args: rows_seen.append(args[0].shape[0]))
    try:
        score_batch(model, roll, 8, 1.0, need_ref=False)
        grouped = rows_seen[:]
        rows_seen.clear()
        score_batch(model, dataclasses.replace(roll, prompt_index=torch.arange(8)), 8, 1.0, need_ref=False)
    finally:
        hook.remove()
    assert grouped[0] == 2            # two prompts of four answers each: each prompt runs once
    assert rows_seen[0] == 8          # every row its own group: eight prompt rows, nothing shared


def test_the_updates_attention_backward_is_fasttrains_and_gives_torchs_gradient(tiny, monkeypatch):
    """The update's attention (prefix_forward's prompt and answer calls) through fasttrain.ops'
    attention backward (forced, float32: "auto" takes it for bf16 on CPUs with native bf16) gives
    the adapter gradient of torch's SDPA backward, up to float32 sums in another order (the
    micro-batch test's tolerance); the calls are counted, so the path is shown to be taken."""
    import fasttrain.ops.attention as A
    from fasttrain.train.policy_update import score_batch, update_policy
    model, params, roll = _setup(tiny)
    adv = torch.linspace(-1.5, 1.5, roll.completion_ids.shape[0])
    mask = roll.completion_mask.bool()
    cfg = LossSection(kind="cispo", beta=0.08, passes=1)
    calls = []
    real = A._backward
    monkeypatch.setattr(A, "_backward", lambda *a: calls.append(1) or real(*a))
    grads = {}
    for kind in ("fasttrain", "flash"):
        old = A.set_attention_backward(kind)
        try:
            scores = score_batch(model, roll, 4, 1.0, need_ref=True)
            opt = RecordingSGD(params)
            update_policy(model, params, opt, roll, scores, adv, mask, cfg, zeta=0.01, micro_batch=4,
                          grad_clip=0.0, temperature=1.0)
            grads[kind] = opt.seen[0]
        finally:
            A.set_attention_backward(old)
        if kind == "fasttrain":
            assert len(calls) >= 2 * model.config.num_hidden_layers      # prompt + answers, every layer
            n = len(calls)
    assert len(calls) == n                                                 # "flash": none
    for a, b in zip(grads["flash"], grads["fasttrain"]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6 * float(a.abs().max()) + 1e-9)
    assert any(float(g.abs().max()) > 0 for g in grads["flash"])


@pytest.mark.parametrize("kl", ["k3_ratio", "k3"])
@pytest.mark.parametrize("normalize", ["batch", "trl"])
def test_the_update_charges_the_chosen_kl_on_the_loss_tokens(tiny, monkeypatch, kl, normalize):
    """A = 0, so only the KL term acts. In the second pass (off-policy) each token's dL/dlogp is
    beta r (logp - ref) / N for "k3_ratio" or beta (1 - e^(ref - logp)) / N for "k3", computed inside
    the loss op, on the loss tokens (normalize "batch", the default; N their count) or on every
    sampled token (normalize "trl", TRL's convention), and exactly 0 elsewhere."""
    import fasttrain.train.policy_update as pu
    model, params, roll = _setup(tiny)
    B = roll.completion_ids.shape[0]
    sampled = roll.completion_mask.bool() & roll.action_mask.bool()
    loss_mask = sampled.clone()
    loss_mask[:, 1::2] = False                                    # half the answer tokens are loss tokens
    scores = pu.score_batch(model, roll, B, 1.0, need_ref=True)
    cfg = LossSection(kind="dapo", beta=0.5, passes=2, kl=kl, normalize=normalize)
    seen, real = [], pu.answer_logprobs

    def keep_token_grads(*a, **kw):
        logp, ent = real(*a, **kw)
        if logp.requires_grad:
            logp.register_hook(lambda g, lp=logp.detach(): seen.append((lp.double(), g.detach().double())))
        return logp, ent

    monkeypatch.setattr(pu, "answer_logprobs", keep_token_grads)
    opt = torch.optim.SGD(params, lr=20.0)                         # pass 1's step makes pass 2 off-policy
    passes = pu.update_policy(model, params, opt, roll, scores, torch.zeros(B), loss_mask, cfg, 0.0, B, 0.0,
                              1.0).passes
    assert len(seen) == 2
    mask = sampled if normalize == "trl" else loss_mask
    n = float(mask.sum())
    # the logged KL (kl_mean, without beta) is the mean of the loss's own KL term over the charged
    # tokens: r k3 ("k3_ratio") or k3; in pass 1 r = 1 up to the two forwards' rounding
    for (lp, _), stats in zip(seen, passes):
        d = scores.ref_logp.double() - lp
        r = torch.exp(lp - scores.old_logp.double())
        k3 = d.exp() - d - 1
        term = r * k3 if kl == "k3_ratio" else k3
        want = float(term[mask].mean())
        # n float32 terms (each 10 roundings) summed, then divided: (n + 12) EPS32 of the mean's scale
        assert abs(stats["kl_mean"] - want) <= (n + 12) * 2.0**-23 * want, (stats["kl_mean"], want)
    lp, g = seen[1]
    d = scores.ref_logp.double() - lp
    r = torch.exp(lp - scores.old_logp.double())
    assert float((r - 1)[mask].abs().max()) > 1e-3                 # pass 2 is off-policy
    want = torch.where(mask, 0.5 * (-r * d if kl == "k3_ratio" else 1 - d.exp()) / n, torch.zeros_like(d))
    assert (g[~mask] == 0).all()
    # float32 from the same float32 inputs: 10 roundings of the result, and k3's 1 - e^d loses up to
    # 2 ulp of e^d (the exp's error) to cancellation
    bound = 10 * 2.0**-23 * (want.abs() + 0.5 * d.exp() / n)
    assert ((g - want).abs() <= bound).all(), float((g - want).abs().max())
