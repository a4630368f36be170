"""sample(): G completions per prompt from a Llama-family policy, on a static KV cache.

The loop: left-pad the distinct prompts to P, prefill each distinct prompt once (a group's G
rows share it: the prefill is G times cheaper than expanding first, as `generate` does), copy
its cache columns into the G rows, then decode one token per row per step with per-row stopping
at EOS, leaving early when every row has stopped. Sampling is by the inverse CDF in float64 (one
uniform draw per row against the running sum of exp(z / T - max); `draw_tokens`), seeded by a
torch.Generator (one for the batch, or one per prompt: then a group's answers do not depend on
which other prompts share the batch); temperature 0 is greedy. Neither way needs a host sync.

Why not Gumbel-max (argmax(log p - log E), E ~ Exp(1) for every row and vocabulary entry): it
draws B·V exponentials a step, and ATen's CPU exponential_ with a generator runs on one core at
about 17 ns each: 42 ms of a 146 ms SmolLM2 decode step at 48 rows (vocabulary 49,152) on a
2-core Xeon. The inverse CDF draws B uniforms and makes three vectorised passes over [B, V]
(5 ms there), and the same distribution exactly up to float64 rounding of the sums.

Truncated sampling (`Truncation`: top_k, top_p, min_p with transformers' meanings, applied in its
order temperature, top_k, top_p, min_p): each filter keeps a prefix of the logits sorted in
descending order, and a prefix of a prefix is a prefix, so the kept set is {v : z_v >= z_cut} for one
cut per row. Ties at the cut are all kept (transformers splits tied logits arbitrarily at the top_p
boundary by its sort order; a set that depends on a sort's tie order cannot be recorded by one
number). The draw zeroes the weights below the cut, so the token and its log-prob are those of the
kept set's renormalised softmax, and the row records delta = z_token - c > 0 with c midway between
the smallest kept logit and the largest dropped one (fp32, rounded up), from which the update
rebuilds the set relative to its own logit of the token (fasttrain.ops.fused_logprob's keep_delta):
the midpoint leaves half the gap for the two forwards' rounding (a cut at the boundary logit itself
would drop that token whenever the update's rounding puts it a hair lower). top_p alone reads the
1024 largest logits (a partial sort) and sorts a row whole only where they hold less than top_p of
its mass (one host sync a step to ask); on the 2-core EPYC, one thread, [16, 32768] float64: the
whole sort 41 ms, topk(1024) 6 ms, the plain draw about 2 ms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from .compiled_decode import compiled_decode
from .families import decoder_for
from .prefill import prefill_in_chunks


@dataclass
class Rollout:
    """A batch of B = n_prompts * group_size sampled completions; row b answers prompt
    b // group_size. T is the number of decode steps actually run (<= max_new_tokens)."""

    input_ids: Tensor        # [B, P+T] long: left-padded prompt, then completion (pad after EOS)
    attention_mask: Tensor   # [B, P+T] long: 1 on real prompt tokens and on completion tokens
    position_ids: Tensor     # [B, P+T] long: cumsum(attention_mask) - 1, clamped at 0 (pass it to
                             # the model's forward: HF does not derive positions from the mask)
    prompt_len: int          # P
    completion_ids: Tensor   # [B, T] long, pad_token_id after EOS
    completion_mask: Tensor  # [B, T] bool: the token exists (True up to the row's end); decoding
                             # the answer text, positions and attention read it
    action_mask: Tensor      # [B, T] bool: the model sampled the token (False on tool-result
                             # tokens of a multi-turn answer); every training consumer reads it.
                             # Single-turn: the completion mask itself
    lengths: Tensor          # [B] long: completion tokens per row (incl. EOS)
    prompt_index: Tensor     # [B] long: b // group_size
    logprobs: Tensor         # [B, T] fp32: behaviour log-probs of the sampled tokens under
                             # softmax(logits / temperature) (temperature 1 when greedy); 0 off-mask
    finished: Tensor         # [B] bool: the row ended with an EOS token or a stop string
    group_size: int
    # Multi-turn answers (fasttrain.train.tool_rollout): each row's completion as chat messages
    # (assistant, tool, ..., assistant) and the rollout's tool counts; None for single-turn answers.
    conversations: list | None = None
    tool_stats: dict | None = None
    # Mixture-of-experts policies: the experts each MoE layer chose for every forwarded token
    # [B, P+T, L_moe, k] (fasttrain.rollout.moe_decoder), replayed by the update; None otherwise.
    routing: Tensor | None = None
    # Truncated sampling (top_k / top_p / min_p): each sampled token's kept set as delta = z_token -
    # z_cut >= 0 in temperature-scaled logits [B, T] fp32 (+inf off the action mask), replayed by the
    # scoring and the update (fasttrain.ops.fused_logprob keep_delta); None when untruncated.
    keep_delta: Tensor | None = None

    def completion_texts(self, tokenizer, skip_special_tokens: bool = True) -> list[str]:
        """Decoded completions (masked tokens only)."""
        out = []
        for ids, n in zip(self.completion_ids.tolist(), self.lengths.tolist()):
            out.append(tokenizer.decode(ids[:n], skip_special_tokens=skip_special_tokens))
        return out


@dataclass(frozen=True)
class Truncation:
    """transformers' truncation knobs: top_k (0: off) keeps the k largest logits (ties at the k-th
    kept), top_p (1: off) the smallest prefix by descending logit whose probability reaches top_p
    (over what top_k kept), min_p (0: off) the tokens whose probability is at least min_p times the
    largest. Applied after the temperature, in that order."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self):
        problem = truncation_problem(self.top_k, self.top_p, self.min_p)
        if problem:
            raise ValueError(problem)

    def active(self, vocab: int | None = None) -> bool:
        return self.top_p < 1.0 or self.min_p > 0.0 or (self.top_k > 0 and (vocab is None or self.top_k < vocab))


def truncation_problem(top_k, top_p, min_p) -> str | None:
    """One line naming the first bad knob, or None (shared by the config's check)."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        return f"top_k must be an int >= 0 (0: off), got {top_k!r}"
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not (0.0 < top_p <= 1.0):
        return f"top_p must be in (0, 1] (1: off), got {top_p!r}"
    if isinstance(min_p, bool) or not isinstance(min_p, (int, float)) or not (0.0 <= min_p < 1.0):
        return f"min_p must be in [0, 1) (0: off), got {min_p!r}"
    return None


TOP_P_LIST = 1024     # top_p's partial sort: the largest logits taken first (kept_cut)


def _top_p_cut(vals: Tensor, e: Tensor, total: Tensor, top_p: float) -> tuple[Tensor, Tensor]:
    """(top_p's cut [B, 1], rows whose every listed value is kept [B, 1] bool) from descending logits
    vals [B, n] (a prefix of the row's sorted logits), their weights e = exp(vals - max) (overwritten)
    and the row's total weight: transformers keeps a token while the mass above it is < top_p (the
    first token always)."""
    above = e.cumsum(-1).sub_(e)                                       # mass strictly above each
    count = (above < top_p * total).sum(-1, keepdim=True)
    return vals.gather(1, count.clamp(min=1) - 1), count >= vals.shape[1]


def kept_cut(d: Tensor, m: Tensor, trunc: Truncation) -> Tensor:
    """The cut z_cut [B, 1] of the kept set {v : d_v >= z_cut} of tempered logits d [B, V] (float64,
    row max m [B, 1]). top_p reads a sorted prefix of the row: top_k's k values when top_k is on (ties
    at the k-th value that topk leaves out come after every listed value, so they change no listed
    value's mass above it, only the total), else the TOP_P_LIST largest, and the whole sorted row only
    where those do not reach top_p. A cut inside the list is exact: every value above a listed one
    is listed too."""
    V = d.shape[1]
    cut = torch.full_like(m, -float("inf"))
    k = trunc.top_k if 0 < trunc.top_k < V else 0
    if k:
        vals = d.topk(k, dim=-1, sorted=True).values                  # [B, k] descending
        cut = vals[:, -1:]
    if trunc.top_p < 1.0:
        if k:
            e = (vals - m).exp_()
            tied_out = (d == cut).sum(-1, keepdim=True) - (vals == cut).sum(-1, keepdim=True)
            total = e.sum(-1, keepdim=True) + tied_out * (cut - m).exp()
            cut = torch.maximum(cut, _top_p_cut(vals, e, total, trunc.top_p)[0])
        else:
            # the TOP_P_LIST largest first (a partial sort): where they reach top_p the cut is among
            # them; only the other rows are sorted whole
            total = (d - m).exp_().sum(-1, keepdim=True)
            vals = d.topk(min(V, TOP_P_LIST), dim=-1, sorted=True).values
            cut_p, whole = _top_p_cut(vals, (vals - m).exp_(), total, trunc.top_p)
            if vals.shape[1] < V and bool(whole.any()):
                rows = whole[:, 0].nonzero()[:, 0]
                vs = d[rows].sort(dim=-1, descending=True).values      # [b, V]: top_p's sort
                cut_p[rows] = _top_p_cut(vs, (vs - m[rows]).exp_(), total[rows], trunc.top_p)[0]
            cut = torch.maximum(cut, cut_p)
    if trunc.min_p > 0.0:
        cut = torch.maximum(cut, m + math.log(trunc.min_p))
    return cut


def check_sample_args(prompt_ids, group_size, max_new_tokens, temperature, vocab):
    if not isinstance(prompt_ids, (list, tuple)) or not prompt_ids:
        raise ValueError("sample: prompt_ids must be a non-empty list of token-id lists")
    for i, p in enumerate(prompt_ids):
        if len(p) == 0:
            raise ValueError(f"sample: prompt_ids[{i}] is empty")
        if min(p) < 0 or max(p) >= vocab:
            raise ValueError(f"sample: prompt_ids[{i}] has ids outside [0, {vocab})")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"sample: group_size must be an int >= 1, got {group_size!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"sample: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not (temperature >= 0.0) or temperature == float("inf"):
        raise ValueError(f"sample: temperature must be finite and >= 0, got {temperature!r}")


def default_pad(model, eos: list[int]) -> int:
    for src in (getattr(getattr(model, "generation_config", None), "pad_token_id", None),
                getattr(model.config, "pad_token_id", None)):
        if isinstance(src, int):
            return src
    return eos[0] if eos else 0


def _uniforms(gens: list, rows: int, device) -> Tensor:
    """U[0, 1) float64 draws [len(gens) · rows]: `rows` from each generator, in order."""
    return torch.cat([torch.rand(rows, dtype=torch.float64, device=device, generator=g) for g in gens])


def draw_tokens(logits: Tensor, temperature: float, gens: list, rows: int,
                work: Tensor | None = None, truncation: Truncation | None = None
                ) -> tuple[Tensor, Tensor, Tensor | None]:
    """One token per row of `logits` [B, V] (any float dtype: the draw takes their values in float64)
    from softmax(logits / temperature), truncated when `truncation` is active, and its log-prob.

    Returns (tokens [B] long, log-probs [B] fp32, keep_delta [B] fp32 or None): with a truncation,
    the log-prob is that of the kept set's renormalised softmax and keep_delta the token's kept set
    (the module docstring); None when untruncated or greedy. Rows [i·rows, (i+1)·rows) draw their uniforms from
    gens[i], in row order, so each group's draws do not depend on which other groups share the batch.
    temperature 0 is greedy (the log-prob is then that of the untempered fp32 softmax). work: a
    float64 [B, V] buffer to draw in (a rollout passes the same one every step: a fresh 19 MB buffer
    a step costs its page faults, several ms each time on a VM), else one is allocated.

    The draw: d = logits / T - max in float64, c = cumsum(exp(d)) (the unnormalised CDF), u ~ U[0, 1)
    per row, and the token is the first index with c > u·c[V-1] (right-side search: a token of zero
    probability is never chosen, since its c equals its predecessor's). Each probability is exact up
    to float64 rounding of the exp and the running sum (relative error about V·2^-53), so the tokens
    follow the tempered softmax; the log-prob is d[token] - log c[V-1].
    """
    if temperature <= 0:
        logp = torch.log_softmax(logits.float(), dim=-1)
        tok = logp.argmax(-1)
        return tok, logp.gather(1, tok[:, None])[:, 0], None
    d = logits.double() if work is None else work.copy_(logits)   # [B, V] float64: the one large buffer
    if temperature != 1.0:
        d.div_(temperature)
    m = d.amax(-1, keepdim=True)
    cut = None
    if truncation is not None and truncation.active(d.shape[1]):
        cut = kept_cut(d, m, truncation)
        drop = d < cut
        # the recorded cut: midway to the largest dropped logit, so that another forward's rounding
        # (the update's) moves no token across it; nothing dropped: the whole vocabulary
        below = torch.where(drop, d, -float("inf")).amax(-1, keepdim=True)
        cut = torch.where(below > -float("inf"), (cut + below) / 2, below)
        d.masked_fill_(drop, -float("inf"))                # weight 0: never drawn, not in the sum
        del drop
    c = d.sub_(m).exp_().cumsum_(-1)                       # in d's storage: no second [B, V] buffer
    total = c[:, -1:]
    u = _uniforms(gens, rows, d.device)
    # u·total < total, strictly: the search then lands on a token of positive probability
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    # (non-finite logits make c NaN and the search run off the end: a token is still returned, its
    # log-prob NaN, as the trainer's non-finite checks expect)
    tok = torch.searchsorted(c, target, right=True)[:, 0].clamp_(max=c.shape[1] - 1)
    # the log-prob from the token's logit, not from log(c[t] - c[t-1]), which loses the small ones
    z = logits.gather(1, tok[:, None]).double()
    if temperature != 1.0:
        z = z / temperature
    picked = (z - m - total.log())[:, 0]
    if cut is None:
        return tok, picked.float(), None
    delta = (z - cut)[:, 0]                                # +inf where nothing was dropped
    d32 = delta.float()
    d32 = torch.where(d32.double() < delta, torch.nextafter(d32, torch.full_like(d32, float("inf"))), d32)
    return tok, picked.float(), d32


def left_padded(prompt_ids: Sequence[Sequence[int]], P: int, pad: int, device) -> tuple[Tensor, Tensor]:
    """The prompts left-padded to P columns: ids [n, P] (pad where there is no token) and
    valid [n, P] bool, on `device`."""
    n = len(prompt_ids)
    ids = torch.full((n, P), pad, dtype=torch.long)
    valid = torch.zeros((n, P), dtype=torch.bool)
    for i, p in enumerate(prompt_ids):
        ids[i, P - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
        valid[i, P - len(p):] = True
    return ids.to(device), valid.to(device)


@torch.no_grad()
def sample(model, prompt_ids: Sequence[Sequence[int]], *, group_size: int, max_new_tokens: int,
           temperature: float = 1.0, eos_token_ids: Sequence[int] | int | None, seed: int | Sequence[int],
           pad_token_id: int | None = None, stop_strings: Sequence[str] = (),
           token_text: Callable[[int], str] | None = None, weights=None, compile: bool | str = False,
           prefill_chunk: int = 0, truncation: Truncation | None = None) -> Rollout:
    """Sample `group_size` completions of at most `max_new_tokens` for each prompt.

    eos_token_ids: ids that end a row (included in its completion); [] or None never stops
    early. stop_strings: a row also ends once its decoded text contains one of them (the
    tokens that complete it are part of the completion, like EOS); `token_text(id)` gives a
    token's text and is required with stop_strings. Matching is on text, not token ids, since
    BPE splits a string differently by context (SmolLM2: "</signal>" is 3 tokens, "</signal>."
    ends in the token ">."). The computation runs in the model's parameter dtype; the draw in
    float64 (`draw_tokens`), the log-probs returned in fp32. truncation: top_k / top_p / min_p
    (`Truncation`); the behaviour log-probs are then the kept sets' and the rollout records each
    token's set (Rollout.keep_delta). weights: dense rollout weights (fasttrain.nn.RolloutWeights, refreshed by the
    caller after each optimizer step) used in place of the NF4 projections; None runs the modules.
    compile: run the decode step through torch.compile (fasttrain.rollout.compiled_decode; the
    compiled step is kept per model, its first call per batch shape compiles); True is inductor,
    a string names another torch.compile backend. prefill_chunk: prompts prefilled at once
    (fasttrain.rollout.prefill; 0: all), which bounds the prefill's activations, not the answers.

    seed: an int seeds one generator for the whole batch; a list of one int per prompt seeds one
    generator per group, so each group draws the same answers whatever else is in the batch (how
    data-parallel ranks split a step and still sample what one process would).
    """
    step = None
    if compile and weights is not None and getattr(weights, "packed", False):
        raise ValueError("sample: compile traces plain rollout weights; build them with "
                         "RolloutWeights(model, pack=False)")
    dec = decoder_for(model, weights)
    if compile:
        step = compiled_decode(model, weights, compile if isinstance(compile, str) else "inductor")
        dec = step.dec
    if hasattr(dec, "start_record"):       # a mixture of experts' routing record (a kept decoder's too)
        dec.start_record()
    vocab = model.config.vocab_size
    check_sample_args(prompt_ids, group_size, max_new_tokens, temperature, vocab)
    eos = [eos_token_ids] if isinstance(eos_token_ids, int) else list(eos_token_ids or [])
    stops = [str(x) for x in stop_strings]
    if any(not x for x in stops):
        raise ValueError("sample: stop_strings must be non-empty strings")
    if stops and token_text is None:
        raise ValueError("sample: stop_strings need token_text (a token id -> its text)")
    pad = default_pad(model, eos) if pad_token_id is None else int(pad_token_id)
    device = dec.device
    n, G = len(prompt_ids), group_size
    B = n * G
    P = max(len(p) for p in prompt_ids)
    S = P + max_new_tokens
    if dec.sliding_window is not None and S > dec.sliding_window:
        raise ValueError(f"sample: prompt + completion length {S} exceeds the model's sliding "
                         f"window {dec.sliding_window}, which this decoder does not implement")

    # Left-padded distinct prompts [n, P] and their positions.
    ids, valid = left_padded(prompt_ids, P, pad, device)
    prompt_lens = valid.sum(1)  # [n]
    # Positions of every column of every row: prompt tokens 0..len-1, then len, len+1, ...
    pos = (valid.long().cumsum(1) - 1).clamp_(min=0)
    pos_all = torch.cat([pos, prompt_lens[:, None] + torch.arange(max_new_tokens, device=device)], 1)
    cos, sin = dec.rotary_table(pos_all)  # [n, S, D]

    # Prefill each distinct prompt once, then give its G rows the same cache columns.
    if step is not None:
        cache = step.cache(B, S)            # fixed buffers; S rounded up; columns past P masked until written
    else:
        cache = dec.new_cache(B, S)
        width = S
    h_last, filled = prefill_in_chunks(dec, step, ids, valid, cos, sin, cache, G, prefill_chunk)  # [n, H]
    width = filled if step is not None else width
    logits = dec.lm_head(h_last).repeat_interleave(G, dim=0)  # [B, V], the model's dtype
    cos, sin = cos.repeat_interleave(G, 0), sin.repeat_interleave(G, 0)

    if not isinstance(seed, (list, tuple)):
        gens = [torch.Generator(device=device).manual_seed(int(seed))]
    else:
        if len(seed) != n:
            raise ValueError(f"sample: seed has {len(seed)} values for {n} prompts (one per prompt, or one int)")
        gens = [torch.Generator(device=device).manual_seed(int(s)) for s in seed]
    rows = B // len(gens)
    eos_t = torch.tensor(eos, dtype=torch.long, device=device)
    work = torch.empty(logits.shape, dtype=torch.float64, device=device) if temperature > 0 else None
    key_valid = torch.zeros(B, width, dtype=torch.bool, device=device)
    key_valid[:, :P] = valid.repeat_interleave(G, 0)
    tokens = torch.full((B, max_new_tokens), pad, dtype=torch.long, device=device)
    logps = torch.zeros((B, max_new_tokens), dtype=torch.float32, device=device)
    truncated = truncation is not None and truncation.active(vocab) and temperature > 0
    deltas = torch.full((B, max_new_tokens), float("inf"), device=device) if truncated else None
    live = torch.zeros((B, max_new_tokens), dtype=torch.bool, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    stopped = torch.zeros(B, dtype=torch.bool, device=device)
    keep = max((len(x) for x in stops), default=0)
    tails = [""] * B                      # each row's last `keep` characters (stop strings only)
    piece: dict[int, str] = {}
    steps = 0
    for t in range(max_new_tokens):
        tok, tok_logp, delta = draw_tokens(logits, temperature, gens, rows, work, truncation)
        active = ~done
        tokens[:, t] = torch.where(active, tok, pad)
        logps[:, t] = torch.where(active, tok_logp, 0.0)
        if deltas is not None and delta is not None:
            deltas[:, t] = torch.where(active, delta, float("inf"))
        live[:, t] = active
        if eos_t.numel():
            done = done | (active & torch.isin(tok, eos_t))
        if stops:
            hit = []
            for b, (i, a) in enumerate(zip(tok.tolist(), active.tolist())):
                if not a:
                    continue
                if i not in piece:
                    piece[i] = token_text(i)
                text = tails[b] + piece[i]
                if any(x in text for x in stops):
                    hit.append(b)
                tails[b] = text[-keep:]
            if hit:
                idx = torch.tensor(hit, dtype=torch.long, device=device)
                stopped[idx] = True
                done[idx] = True
        steps = t + 1
        if t + 1 == max_new_tokens or bool(done.all()):
            break
        col = P + t
        # a finished row is held: its token's key is invalid for it and its state does not move
        key_valid[:, col] = ~done
        if step is not None:
            column = torch.full((1,), col, dtype=torch.long, device=device)
            logits = step.step(tokens[:, t].contiguous(), key_valid, cos[:, col].contiguous(),
                               sin[:, col].contiguous(), cache, column, active=~done)
        else:
            h = dec.decode(tokens[:, t], key_valid[:, :col + 1], cos[:, col], sin[:, col], cache, col, active=~done)
            logits = dec.lm_head(h)

    T = steps
    completion_ids = tokens[:, :T].contiguous()
    completion_mask = live[:, :T].contiguous()
    input_ids = torch.cat([ids.repeat_interleave(G, 0), completion_ids], 1)
    attention_mask = torch.cat([valid.repeat_interleave(G, 0), completion_mask], 1).long()
    position_ids = (attention_mask.cumsum(1) - 1).clamp_(min=0)
    lengths = completion_mask.sum(1)
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    if eos_t.numel():
        last = completion_ids.gather(1, (lengths - 1).clamp(min=0)[:, None])[:, 0]
        finished = torch.isin(last, eos_t) & (lengths > 0)
    finished = finished | stopped
    return Rollout(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
        prompt_len=P, completion_ids=completion_ids, completion_mask=completion_mask, action_mask=completion_mask,
        lengths=lengths, prompt_index=torch.arange(B, device=device) // G,
        logprobs=logps[:, :T].contiguous(), finished=finished, group_size=G,
        keep_delta=None if deltas is None else deltas[:, :T].contiguous(),
        routing=dec.routing_record(G, T) if hasattr(dec, "routing_record") else None)
