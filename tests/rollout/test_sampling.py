"""fasttrain.rollout.sample against Hugging Face generate (greedy tokens), a float64 full forward
(log-probs), the exact softmax (sampling distribution), and its own contract (masks, EOS, seeds)."""

import math

import pytest
import torch

from fasttrain.models import tiny_llama
from fasttrain.rollout import sample

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [3, 4, 5, 6, 7, 8, 9, 10], [40]]


def hf_greedy(model, rollout, max_new_tokens, eos, pad):
    P = rollout.prompt_len
    out = model.generate(rollout.input_ids[:, :P], attention_mask=rollout.attention_mask[:, :P],
                         do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos,
                         pad_token_id=pad, min_new_tokens=0)
    return out[:, P:]


def eos_seen_mid_run(model, prompts, steps=12):
    """A token the greedy run emits mid-sequence in row 0 but later than step 3 in others,
    so using it as EOS stops rows at different steps."""
    r = sample(model, prompts, group_size=1, max_new_tokens=steps, temperature=0,
               eos_token_ids=[], seed=0)
    return int(r.completion_ids[0, 4])


def tiny_family(kind):
    from transformers import (MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                              Qwen3Config, Qwen3ForCausalLM)
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(3)
    if kind == "qwen3":
        m = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
    elif kind == "qwen2":
        m = Qwen2ForCausalLM(Qwen2Config(**common))
        with torch.no_grad():  # make the q/k/v biases matter
            for layer in m.model.layers:
                for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    p.bias.normal_(0, 0.5)
    else:
        m = MistralForCausalLM(MistralConfig(sliding_window=None, **common))
    with torch.no_grad():
        m.model.embed_tokens.weight.normal_(0, 1)
        m.lm_head.weight.normal_(0, 0.25)
    return m.eval()


@pytest.mark.parametrize("group_size", [1, 3])
def test_greedy_matches_hf_generate_tiny_llama(group_size):
    model = tiny_llama(vocab_size=128, seed=1)
    eos = eos_seen_mid_run(model, PROMPTS)
    r = sample(model, PROMPTS, group_size=group_size, max_new_tokens=16, temperature=0,
               eos_token_ids=[eos], seed=0, pad_token_id=0)
    ref = hf_greedy(model, r, 16, eos, 0)
    T = r.completion_ids.shape[1]
    assert torch.equal(r.completion_ids, ref[:, :T])
    # HF pads finished rows too; rows still running at our early exit would not exist.
    assert (ref[:, T:] == 0).all()
    assert r.finished.any() and r.lengths.min() < 16


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "mistral"])
def test_greedy_matches_hf_generate_other_families(kind):
    model = tiny_family(kind)
    r = sample(model, PROMPTS, group_size=2, max_new_tokens=10, temperature=0, eos_token_ids=[],
               seed=0, pad_token_id=0)
    ref = hf_greedy(model, r, 10, None, 0)
    assert torch.equal(r.completion_ids, ref)
    assert len(set(map(tuple, r.completion_ids.tolist()))) > 1  # prompts lead somewhere different


def full_forward_logp(model, r, temperature, dtype):
    m = model.to(dtype)
    try:
        with torch.no_grad():
            logits = m(input_ids=r.input_ids, attention_mask=r.attention_mask,
                       position_ids=r.position_ids).logits.double()
    finally:
        model.to(torch.float32)
    P = r.prompt_len
    lp = torch.log_softmax(logits[:, P - 1:-1] / temperature, dim=-1)
    return lp.gather(2, r.completion_ids[..., None])[..., 0]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_full_forward(temperature):
    model = tiny_llama(vocab_size=128, seed=2)
    r = sample(model, PROMPTS, group_size=3, max_new_tokens=14, temperature=temperature,
               eos_token_ids=[2], seed=5)
    m = r.completion_mask
    ref64 = full_forward_logp(model, r, temperature, torch.float64)
    ref32 = full_forward_logp(model, r, temperature, torch.float32)
    own_err = (ref32 - ref64)[m].abs().max().item()   # PyTorch's own fp32 error here
    err = (r.logprobs.double() - ref64)[m].abs().max().item()
    # 2x PyTorch's own fp32 error, with a floor of a few fp32 ulps of |log p| ~ 8 for the case
    # where the fp32 full forward happens to round onto the float64 value.
    tol = max(2 * own_err, 8 * 8 * torch.finfo(torch.float32).eps)
    assert err <= tol, (err, own_err)
    assert (r.logprobs[~m] == 0).all()
    assert (r.logprobs[m] < 0).all()


def test_seeded_determinism():
    model = tiny_llama(vocab_size=128, seed=0)
    kw = dict(group_size=4, max_new_tokens=10, temperature=1.0, eos_token_ids=[2])
    a = sample(model, PROMPTS, seed=11, **kw)
    b = sample(model, PROMPTS, seed=11, **kw)
    c = sample(model, PROMPTS, seed=12, **kw)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.completion_ids, c.completion_ids)
    # rows of one group share the prompt but sample independently
    assert len(set(map(tuple, a.completion_ids[:4].tolist()))) > 1


def test_eos_stopping_and_masks():
    model = tiny_llama(vocab_size=64, seed=4)
    eos = [2, 3, 7]
    r = sample(model, PROMPTS, group_size=5, max_new_tokens=20, temperature=1.0,
               eos_token_ids=eos, seed=1, pad_token_id=0)
    B, T = r.completion_ids.shape
    P = r.prompt_len
    assert B == len(PROMPTS) * 5 and P == max(map(len, PROMPTS))
    assert r.prompt_index.tolist() == [b // 5 for b in range(B)]
    is_eos = torch.isin(r.completion_ids, torch.tensor(eos)) & r.completion_mask
    assert is_eos.any()
    for b in range(B):
        n = int(r.lengths[b])
        row, mask = r.completion_ids[b].tolist(), r.completion_mask[b].tolist()
        assert mask == [True] * n + [False] * (T - n)
        assert all(t == 0 for t in row[n:])
        assert not any(t in eos for t in row[:n - 1])  # no EOS before the last kept token
        assert bool(r.finished[b]) == (row[n - 1] in eos)
        assert bool(r.finished[b]) or n == T
        # input_ids = left-padded prompt then completion; masks agree
        p = PROMPTS[b // 5]
        assert r.input_ids[b, P - len(p):P].tolist() == p
        assert r.attention_mask[b].tolist() == [0] * (P - len(p)) + [1] * len(p) + [int(x) for x in mask]
        assert r.input_ids[b, P:].tolist() == row
    # the loop stops once every row has finished
    if r.finished.all():
        assert T == int(r.lengths.max()) < 20


def test_early_exit_when_all_rows_stop():
    model = tiny_llama(vocab_size=128, seed=1)
    first = sample(model, PROMPTS, group_size=1, max_new_tokens=1, temperature=0,
                   eos_token_ids=[], seed=0).completion_ids[:, 0].tolist()
    r = sample(model, PROMPTS, group_size=2, max_new_tokens=30, temperature=0,
               eos_token_ids=first, seed=0)
    assert r.completion_ids.shape == (8, 1) and r.finished.all() and (r.lengths == 1).all()


def test_sampling_distribution_is_softmax_over_temperature():
    """First-token frequencies of 6000 rows against softmax(logits / T): a chi-square test at
    p = 1e-4 (seeded, so the verdict is fixed); a sampler that ignored T would fail it."""
    model = tiny_llama(vocab_size=12, seed=6)
    prompt = [[1, 5, 9]]
    T = 0.6
    r = sample(model, prompt, group_size=6000, max_new_tokens=1, temperature=T,
               eos_token_ids=[], seed=3)
    with torch.no_grad():
        logits = model(torch.tensor(prompt)).logits[0, -1].double()
    p = torch.softmax(logits / T, -1)
    p_wrong = torch.softmax(logits, -1)
    counts = torch.bincount(r.completion_ids[:, 0], minlength=12).double()
    exp = p * 6000

    def chi2(e):
        keep = e > 5
        return (((counts - e) ** 2 / e)[keep].sum().item(), int(keep.sum()) - 1)

    stat, dof = chi2(exp)
    # chi-square upper quantile at p=1e-4 via Wilson-Hilferty
    z = 3.719
    crit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert stat < crit, (stat, crit)
    assert chi2(p_wrong * 6000)[0] > crit
    assert torch.allclose(r.logprobs[:, 0].double(), p.log()[r.completion_ids[:, 0]], atol=1e-5)


def test_bad_arguments_name_the_argument():
    model = tiny_llama(vocab_size=32)
    kw = dict(max_new_tokens=4, eos_token_ids=[2], seed=0)
    with pytest.raises(ValueError, match="prompt_ids"):
        sample(model, [], group_size=1, **kw)
    with pytest.raises(ValueError, match=r"prompt_ids\[1\]"):
        sample(model, [[1], []], group_size=1, **kw)
    with pytest.raises(ValueError, match="outside"):
        sample(model, [[1, 40]], group_size=1, **kw)
    with pytest.raises(ValueError, match="group_size"):
        sample(model, [[1]], group_size=0, **kw)
    with pytest.raises(ValueError, match="temperature"):
        sample(model, [[1]], group_size=1, temperature=-1.0, **kw)


def test_stop_strings_cut_each_row_where_its_text_first_contains_one():
    """Token i reads as the letter chr(97 + i % 26), so texts are letter strings; a stop string
    cuts each row right after the token completing its first occurrence, and the tokens before
    are the ones the same seed samples without stop strings (the noise is drawn for every row)."""
    model = tiny_llama(vocab_size=64, seed=4)
    text = lambda i: chr(97 + i % 26)
    kw = dict(group_size=6, max_new_tokens=24, temperature=1.5, eos_token_ids=[], seed=3)
    free = sample(model, PROMPTS, **kw)
    free_texts = ["".join(text(i) for i in row) for row in free.completion_ids.tolist()]
    stops = ["ab", "c"]
    assert sum(any(s in t for s in stops) for t in free_texts) >= 3       # some rows do stop
    r = sample(model, PROMPTS, stop_strings=stops, token_text=text, **kw)
    for b, full in enumerate(free_texts):
        hits = [full.find(s) + len(s) for s in stops if s in full]
        n = min(hits) if hits else len(full)
        assert int(r.lengths[b]) == n
        assert r.completion_ids[b, :n].tolist() == free.completion_ids[b, :n].tolist()
        assert bool(r.finished[b]) == bool(hits)
    if r.finished.all():
        assert r.completion_ids.shape[1] == int(r.lengths.max())
    with pytest.raises(ValueError, match="token_text"):
        sample(model, PROMPTS, stop_strings=["x"], **kw)


def _reference_draw(z: list[float], T: float, u: float) -> tuple[int, float]:
    """The inverse-CDF draw in exact rational steps: math.fsum of the float64 exps, then the first
    index whose prefix sum exceeds u · total; its log-prob from the logit."""
    m = max(x / T for x in z)
    e = [math.exp(x / T - m) for x in z]
    total = math.fsum(e)
    run = 0.0
    for i, x in enumerate(e):
        run = math.fsum([run, x])
        if run > u * total:
            return i, z[i] / T - m - math.log(total)
    raise AssertionError("no index")


def test_draw_tokens_is_the_inverse_cdf_of_the_tempered_softmax():
    """Each row's token is the first index whose running sum of exp(z / T - max) passes u·total,
    u the row's uniform from its group's generator (checked against an exactly summed reference;
    the uniforms are drawn again from equal seeds), and its log-prob is log softmax(z / T) at
    that token to float32 roundoff. Tokens with logit -inf are never drawn, even with u next to 1."""
    from fasttrain.rollout.sampling import _uniforms, draw_tokens

    torch.manual_seed(0)
    V, rows, seeds = 500, 4, (3, 9, 27)
    logits = torch.randn(rows * len(seeds), V) * 4
    logits[:, -7:] = float("-inf")          # the last tokens can't be drawn
    logits[0, 100:] = float("-inf")         # row 0 has 100 possible tokens
    for T in (1.0, 0.7):
        tok, logp, _ = draw_tokens(logits, T, [torch.Generator().manual_seed(s) for s in seeds], rows)
        u = _uniforms([torch.Generator().manual_seed(s) for s in seeds], rows, "cpu")
        ref_lp = torch.log_softmax(logits.double() / T, -1)
        for b in range(logits.shape[0]):
            want, lp = _reference_draw(logits[b].double().tolist(), T, float(u[b]))
            # a sum's rounding can move the boundary only by ~V·2^-53 of the total: a token
            # differs from the exact one only if u lies that close to a boundary (not here)
            assert int(tok[b]) == want, (T, b)
            assert abs(float(logp[b]) - lp) <= 4 * 2.0 ** -24 * max(1.0, abs(lp))
            assert abs(float(logp[b]) - float(ref_lp[b, want])) <= 4 * 2.0 ** -24 * max(1.0, abs(lp))
        assert logp.dtype == torch.float32 and tok.dtype == torch.long
    # u at the top of [0, 1): the draw stops at the last token of positive probability
    import fasttrain.rollout.sampling as sampling

    old = sampling._uniforms
    try:
        sampling._uniforms = lambda gens, r, device: torch.full((r * len(gens),), 1 - 2.0 ** -53,
                                                               dtype=torch.float64)
        tok, _, _ = draw_tokens(logits, 1.0, [None] * len(seeds), rows)
    finally:
        sampling._uniforms = old
    assert int(tok[0]) == 99 and (tok[1:] == V - 8).all()
    # greedy: the argmax and its untempered log-softmax
    tok, logp, _ = draw_tokens(logits, 0.0, [torch.Generator()], logits.shape[0])
    assert torch.equal(tok, logits.argmax(-1))
    assert torch.allclose(logp, torch.log_softmax(logits, -1).gather(1, tok[:, None])[:, 0])


def test_groups_draw_the_same_tokens_at_any_thread_count_and_batch():
    """A group's uniforms come from its own generator: a rollout samples the tokens of a one-thread
    run at two threads, and a group's answers are the same alone as beside other groups (the model
    runs in float64, so the batch changes its logits by rounding order only)."""
    old = torch.get_num_threads()
    try:
        model = tiny_llama(vocab_size=128, seed=1, dtype=torch.float64)
        prompts, seeds = [[5, 6, 7], [8, 9], [3, 4, 5, 6]], [11, 12, 13]
        runs = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            with torch.inference_mode():
                runs[threads] = sample(model, prompts, group_size=3, max_new_tokens=8,
                                       eos_token_ids=[], seed=seeds, pad_token_id=0)
        assert torch.equal(runs[1].completion_ids, runs[2].completion_ids)
        alone = sample(model, prompts[1:2], group_size=3, max_new_tokens=8, eos_token_ids=[], seed=seeds[1:2],
                       pad_token_id=0)
        assert alone.completion_ids.tolist() == runs[2].completion_ids[3:6, :alone.completion_ids.shape[1]].tolist()
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("native", [True, False], ids=["native-bf16", "fp32-sums"])
def test_a_plain_bf16_models_projections_take_the_hosts_fast_path(monkeypatch, native):
    """A plain (not fasttrain-wrapped) bf16 model sampled on a CPU without native bf16 GEMMs runs
    every projection of the decoder with fp32 sums from the bf16 values (ATen's bf16 GEMM is many
    times slower there), each rounded once to bf16: bit for bit F.linear in fp32 of the same values.
    Both paths are forced by the flag fasttrain.nn.dense_linear reads, so every host runs both."""
    import torch.nn.functional as F

    import fasttrain.models.family_view as view
    import fasttrain.nn.dense_linear as dl

    monkeypatch.setattr(dl, "_NATIVE_BF16", native)
    model = tiny_llama(vocab_size=96, seed=0).to(torch.bfloat16)
    proj = [m for n, m in model.named_modules() if type(m) is torch.nn.Linear and "lm_head" not in n]
    calls = []
    real = view.linear_bf16_as_fp32

    def counted(x, w, out_dtype=None):
        calls.append(w.data_ptr())
        return real(x, w, out_dtype)
    monkeypatch.setattr(view, "linear_bf16_as_fp32", counted)
    r = sample(model, PROMPTS[:2], group_size=1, max_new_tokens=3, temperature=0, eos_token_ids=[], seed=0)
    seen = set(calls)
    if native:
        assert not seen
    else:
        assert {m.weight.data_ptr() for m in proj} <= seen
        h = torch.randn(3, proj[0].in_features, dtype=torch.bfloat16)
        assert torch.equal(view.plain_linear(proj[0], h), F.linear(h.float(), proj[0].weight.float()).bfloat16())
    assert r.completion_ids.shape == (2, 3)
