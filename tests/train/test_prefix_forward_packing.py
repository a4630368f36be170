"""The update's forward with the answers packed (fasttrain.train.answer_packing): the same per-token
log-probs and adapter gradients as the padded layout, for answers of strongly varying length in one
micro-batch, with the real answer tokens only through the layers' token-wise work.

The packing itself is checked against a per-row loop (which tokens, in which order, where each
wanted position reads its hidden state, the buckets' padding bound, the round trip through the
buckets, the masks). The forwards (tiny random models in float64: the Llama family with an NF4 base
+ LoRA and a 16-bit base + DoRA, the Qwen3.5 hybrid with an NF4 base) run with and without gradient
checkpointing; the batch mixes answers of 1 to 20 tokens, a row with no answer input at all, a row
whose trailing real tokens are not wanted, two rows of one length that are neighbours (a view
bucket) and two that are not (a gathered bucket), and (Llama) a pad inside an answer.

Tolerances. Values: both layouts compute in float64 with the same ops on the same numbers, and
differ only in how the matrix products and attention's sums are blocked; per layer that reorders
sums of at most H (projections), I (the MLP's down projection) and 2·S·D (attention over S keys of
D dims, scores and values) terms, each moving a result by at most its length times the unit
roundoff u = 2^-53 of the magnitudes summed; the bound is layers·(H + I + 2·S·D)·u times 1e3 for
the magnitudes of the tiny models' activations and their growth through the layers and the
log-softmax (the bound tests/train/test_prefix_forward_hybrid.py uses). Gradients: the adapter
masters are float32, so each gradient is float64 sums rounded to float32 (a few contributions per
parameter); 8 float32 ulps of the largest entry, as the Llama family's shared-prefix test allows.
"""
import pytest
import torch

from fasttrain.models import tiny_llama, tiny_qwen3_5
from fasttrain.models.families import nf4_targets
from fasttrain.nn import adaptable_model, attach_adapters, quantize_model
from fasttrain.train.answer_packing import SLACK, bucket_masks, pack_answers
from fasttrain.train.policy_update import answer_logprobs

from support.tolerances import forward_tol

pytestmark = pytest.mark.one_thread         # tiny models (tests/conftest.py)

U32 = torch.finfo(torch.float32).eps

# answer tokens per row (three prompts, three rows each): 20 and 20 (neighbours: a view bucket), 2,
# 9 and 10 (one gathered bucket: not neighbours; row 7 has a pad inside on the
# Llama batch), 1 (no answer input), 17 and 16 (one bucket of two lengths), 13 with only its first
# 6 wanted (its trailing real tokens are dropped)
ANSWER_LENGTHS = [20, 20, 2, 9, 1, 17, 13, 10, 16]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19]]


def batch(hole: bool, vocab: int = 97):
    """(input_ids, attention_mask, position_ids, completion_ids, completion_mask, P, prompt_index)."""
    P, T, G = 7, 20, 3
    B = len(PROMPTS) * G
    g = torch.Generator().manual_seed(4)
    ids = torch.zeros(B, P + T, dtype=torch.long)
    am = torch.zeros_like(ids)
    for b in range(B):
        p = PROMPTS[b // G]
        ids[b, P - len(p):P] = torch.tensor(p)
        am[b, P - len(p):P] = 1
        n = ANSWER_LENGTHS[b]
        ids[b, P:P + n] = torch.randint(3, vocab, (n,), generator=g)
        am[b, P:P + n] = 1
    cm = am[:, P:].clone()
    cm[6, 6:] = 0                               # row 6: only its first 6 answer tokens are wanted
    if hole:                                    # row 7: answer token 4 is a pad (neither it nor the
        am[7, P + 4] = 0                        # token it would predict is wanted)
        ids[7, P + 4] = 0
        cm[7, 4:6] = 0
    pos = (am.cumsum(1) - 1).clamp(min=0)
    return ids, am, pos, ids[:, P:], cm, P, torch.arange(B) // G


# ---- the packing against a loop ---------------------------------------------------------------------
def _loop_packing(am, sel, P, inverse, U):
    """(packed (b, j) list, source list) by the rule of answer_packing, one row at a time."""
    B, T = sel.shape
    packed = [(b, j) for b in range(B) for j in range(T - 1)
              if am[b, P + j] == 1 and bool(sel[b, j + 1:].any())]
    where = {bj: i for i, bj in enumerate(packed)}
    source = [int(inverse[b]) if t == 0 else U + where[(b, t - 1)]
              for b in range(B) for t in range(T) if sel[b, t]]
    return packed, source


@pytest.mark.parametrize("hole", [False, True])
def test_packing_matches_a_loop_and_round_trips(hole):
    ids, am, pos, _, cm, P, groups = batch(hole)
    B, T = cm.shape
    sel = cm.bool()
    pk = pack_answers(am, sel, P, groups, 3)
    packed, source = _loop_packing(am, sel, P, groups, 3)
    assert pk.n == len(packed) < B * (T - 1)
    assert [(int(f) // (T - 1), int(f) % (T - 1)) for f in pk.flat] == packed
    assert pk.source.tolist() == source
    assert [pk.lengths[b] for b in range(B)] == [sum(1 for r, _ in packed if r == b) for b in range(B)]
    assert pk.offsets.tolist() == [sum(pk.lengths[:b]) for b in range(B + 1)]
    # every row with tokens in exactly one bucket; a bucket pads at most SLACK of its real tokens
    rows = sorted(int(r) for bk in pk.buckets for r in bk.rows)
    assert rows == [b for b in range(B) if pk.lengths[b] > 0]
    assert 4 not in rows                         # the 1-token answer has no input
    kinds = set()
    for bk in pk.buckets:
        n, M = bk.rows.shape[0], bk.width
        real = sum(pk.lengths[int(r)] for r in bk.rows)
        assert M == max(pk.lengths[int(r)] for r in bk.rows) and n * M - real <= SLACK * real
        kinds.add("view" if bk.index is None else "gather")
        if bk.index is None:
            r0 = int(bk.rows[0])
            assert bk.rows.tolist() == list(range(r0, r0 + n)) and all(pk.lengths[r0 + i] == M for i in range(n))
    assert kinds == {"view", "gather"}
    # pad: row i's column j is its packed token j, past its end its last token; unpad undoes it
    t = torch.randn(pk.n, 3, dtype=torch.float64)
    outs = []
    for bk in pk.buckets:
        padded = pk.pad(t, bk)
        for i, r in enumerate(bk.rows.tolist()):
            o, L = int(pk.offsets[r]), pk.lengths[r]
            for j in range(bk.width):
                assert torch.equal(padded[i, j], t[o + min(j, L - 1)])
        outs.append(padded.clone())
    assert torch.equal(pk.unpad(outs), t)
    # masks: prompt keys of the row's prompt, then its own answers up to the query and its end
    G = 2
    for bk, mask in zip(pk.buckets, bucket_masks(pk, am[:, :P], G)):
        M = bk.width
        assert mask.shape == (bk.rows.shape[0], 1, G * M, P + M)
        for i, r in enumerate(bk.rows.tolist()):
            L = pk.lengths[r]
            want = torch.zeros(M, P + M, dtype=torch.bool)
            for j in range(M):
                want[j, :P] = am[r, :P].bool()
                for j2 in range(min(j, L - 1) + 1):
                    want[j, P + j2] = True
            assert torch.equal(mask[i, 0], want.repeat(G, 1))


def test_packing_refuses_what_it_cannot_hold_or_would_not_shrink():
    ids, am, pos, _, cm, P, groups = batch(hole=True)
    B, T = cm.shape
    sel = cm.bool()
    assert pack_answers(am, sel, P, groups, 3) is not None
    assert pack_answers(am, sel, P, groups, 3, contiguous=True) is None     # a pad inside row 7
    wanted_after_pad = sel.clone()
    wanted_after_pad[7, 5] = True                                            # its input is the pad
    assert pack_answers(am, wanted_after_pad, P, groups, 3) is None
    full = torch.ones(B, P + T, dtype=torch.long)                            # every input real and wanted
    assert pack_answers(full, torch.ones(B, T, dtype=torch.bool), P, groups, 3) is None
    ids, am, pos, _, cm, P, groups = batch(hole=False)
    assert pack_answers(am, cm.bool(), P, groups, 3, contiguous=True) is not None


# ---- the forwards: packed against padded -------------------------------------------------------------
def _llama(base: str, kind: str):
    model = tiny_llama(vocab_size=97, hidden=64, layers=2, heads=4, kv_heads=2, seed=2, dtype=torch.float64)
    for p in model.parameters():
        p.requires_grad_(False)
    quantize_model(model) if base == "nf4" else adaptable_model(model)
    params = attach_adapters(model, kind=kind, r=4, alpha=8, seed=5)
    with torch.no_grad():
        g = torch.Generator().manual_seed(6)
        for p in params:                       # B non-zero, so the adapters change log p
            noise = torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.2
            p.mul_(1 + noise) if p.dim() == 1 else p.copy_(noise)     # DoRA's magnitude: near its start
    for p in params:
        p.requires_grad_(True)
    return model, params


def _hybrid(kind: str):
    model = tiny_qwen3_5(vocab_size=97, layers=4, interval=2, heads=4, kv_heads=2, value_heads_per_key=2,
                         seed=2, dtype=torch.float64)
    for p in model.parameters():
        p.requires_grad_(False)
    quantize_model(model, targets=nf4_targets(model))
    params = attach_adapters(model, kind=kind, r=4, alpha=8.0, seed=5)
    with torch.no_grad():
        g = torch.Generator().manual_seed(6)
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05)
    for p in params:
        p.requires_grad_(True)
    return model, params


def _tol(model, S: int) -> float:
    return forward_tol(model.config, S, mlp=True)


def _compare(model, params, hole: bool, checkpointing: bool):
    ids, am, pos, comp, cm, P, groups = batch(hole)
    B, T = cm.shape
    model.train()
    if checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    H = model.config.hidden_size
    mlp0 = model.model.layers[0].mlp
    tokens = []
    hook = mlp0.register_forward_pre_hook(lambda m, a: tokens.append(a[0].numel() // H))
    cot = torch.randn(B, T, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    out = {}
    try:
        for packed in (False, True):
            for p in params:
                p.grad = None
            tokens.clear()
            logp, ent = answer_logprobs(model, ids, am, P, comp, cm, 1.0, position_ids=pos, prompt_index=groups,
                                        packed=packed)
            forward = sum(tokens)
            (logp * cot).sum().backward()
            out[packed] = (logp.detach(), ent, [p.grad.clone() for p in params], forward, sum(tokens))
    finally:
        hook.remove()
    pk = pack_answers(am, cm.bool(), P, groups, 3)
    UP = sum(1 for _ in PROMPTS) * P
    # the MLP (each layer's largest token-wise piece) runs U·P + B·(T-1) tokens padded, U·P + N packed;
    # under checkpointing the backward recomputes from the same tokens
    assert out[False][3] == UP + B * (T - 1) and out[True][3] == UP + pk.n
    for packed in (False, True):
        assert out[packed][4] == out[packed][3] * (2 if checkpointing else 1)
    m = cm.bool()
    assert float(out[False][0][m].abs().min()) > 0 and bool((out[True][0][~m] == 0).all())
    tol = _tol(model, P + T)
    assert float((out[True][0] - out[False][0]).abs().max()) <= tol
    assert float((out[True][1] - out[False][1]).abs().max()) <= tol
    for a, b in zip(out[False][2], out[True][2]):
        scale = float(a.abs().max())
        assert a.dtype == torch.float32 and scale > 0
        assert float((a - b).abs().max()) <= 8 * U32 * scale


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("base,kind", [("nf4", "lora"), ("none", "dora")], ids=["nf4-lora", "16bit-dora"])
@pytest.mark.parametrize("hole", [False, True], ids=["contiguous", "pad-inside"])
def test_llama_packed_equals_padded(base, kind, checkpointing, hole):
    model, params = _llama(base, kind)
    _compare(model, params, hole, checkpointing)


@pytest.mark.parametrize("kind,checkpointing", [("lora", False), ("dora", True)])
def test_hybrid_packed_equals_padded(kind, checkpointing):
    model, params = _hybrid(kind)
    _compare(model, params, False, checkpointing)


def test_hybrid_with_a_pad_inside_an_answer_runs_padded():
    """The conv and the delta rule see the padded layout's zeroed positions; packing would skip them,
    so such a batch runs padded (same token count as packed=False)."""
    model, params = _hybrid("lora")
    ids, am, pos, comp, cm, P, groups = batch(hole=True)
    B, T = cm.shape
    H = model.config.hidden_size
    tokens = []
    hook = model.model.layers[0].mlp.register_forward_pre_hook(lambda m, a: tokens.append(a[0].numel() // H))
    try:
        with torch.no_grad():
            answer_logprobs(model, ids, am, P, comp, cm, 1.0, position_ids=pos, prompt_index=groups)
    finally:
        hook.remove()
    assert tokens == [len(PROMPTS) * P + B * (T - 1)]

