"""sample_turns(): G multi-turn answers per prompt on one static KV cache, rows at different turns.

Each row decodes its model turn to its end-of-turn token; the caller's `end_of_turn` then says what
comes next for the rows that ended a turn in that step: the token ids of a context turn (a tool
result rendered by the chat template) to append, or None to end the answer. Context tokens are fed
in one forward for all such rows (the decoder's `step_rows`, k tokens per row), and decoding
goes on. Rows that are done, or not fed in a given forward, are held: they write no cache column
that is ever read and their positions do not move, so one batch carries rows at different turns.

Budget, as TRL counts it: model and context tokens together fill at most `max_new_tokens` per
answer (the caller gets each row's room and ends the answer rather than append a context turn that
does not fit); a row stops when its completion reaches the budget.

What it is not: a tool runner or a chat template; those live with the caller (fasttrain.train.
tool_rollout). Sampling is the single-turn sampler's (fasttrain.rollout.sampling.draw_tokens, one
generator per prompt or for the batch), and its Rollout gains the action mask: True on sampled tokens,
False on context tokens (whose behaviour log-probs are 0.0, as in TRL). A mixture of experts' decoder
records the experts of every token it forwards, prompt, sampled and context tokens alike
(Rollout.routing, fasttrain.rollout.moe_decoder), for the update's routing replay.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from .families import decoder_for
from .sampling import Rollout, Truncation, check_sample_args, default_pad, draw_tokens, left_padded

# end_of_turn(rows, turn_ids, room) -> one entry per row: context token ids to append, or None
EndOfTurn = Callable[[list[int], list[list[int]], list[int]], list["list[int] | None"]]


def _replayed(tok: Tensor, replay: Sequence[Sequence[int]], emitted: list[int]) -> Tensor:
    """tok [B] with row b's next replayed id (its emitted[b]-th model token) where it has one."""
    tok = tok.clone()
    for b, (script, k) in enumerate(zip(replay, emitted)):
        if k < len(script):
            tok[b] = int(script[k])
    return tok


def _fits(row: int, context: list[int], room: int) -> bool:
    if len(context) > room:
        raise ValueError(f"sample_turns: row {row}'s context turn has {len(context)} tokens, its room {room}")
    return True


@torch.no_grad()
def sample_turns(model, prompt_ids: Sequence[Sequence[int]], *, group_size: int, max_new_tokens: int,
                 temperature: float, eos_token_ids: Sequence[int] | int, seed: int | Sequence[int],
                 end_of_turn: EndOfTurn, pad_token_id: int | None = None, weights=None,
                 replay: Sequence[Sequence[int]] | None = None, truncation: Truncation | None = None) -> Rollout:
    """Multi-turn answers (module docstring). A model turn ends at one of `eos_token_ids` (needed:
    a turn must end). `end_of_turn` is called once per step with the rows whose turn ended there
    and that have room left; a context turn longer than its row's room is an error (the caller
    drops it instead).

    replay: per row, the token ids its model turns emit, in order, instead of sampled ones (a row
    whose list runs out samples again); their log-probs are still the model's. It drives the same
    model turns through this rollout and another trainer's loop, for comparisons and tests; a replayed
    token's kept set is the whole vocabulary (it was not drawn from a truncated set).
    truncation: top_k / top_p / min_p as in fasttrain.rollout.sampling.sample (Rollout.keep_delta:
    +inf on context tokens)."""
    dec = decoder_for(model, weights)
    if not hasattr(dec, "step_rows"):           # the per-row step with held tokens (both families have it)
        raise ValueError(f"sample_turns: multi-turn answers (tools) need a decoder with a per-row step; "
                         f"{type(dec).__name__} has no step_rows")
    vocab = model.config.vocab_size
    check_sample_args(prompt_ids, group_size, max_new_tokens, temperature, vocab)
    eos = [eos_token_ids] if isinstance(eos_token_ids, int) else list(eos_token_ids or [])
    if not eos:
        raise ValueError("sample_turns: eos_token_ids is empty; a model turn must be able to end")
    pad = default_pad(model, eos) if pad_token_id is None else int(pad_token_id)
    device = dec.device
    n_p, G = len(prompt_ids), group_size
    B, P, M = n_p * G, max(len(p) for p in prompt_ids), max_new_tokens
    S = P + M + 1                                   # the last column is the held tokens' scratch
    scratch = S - 1

    ids, valid = left_padded(prompt_ids, P, pad, device)
    pos = (valid.long().cumsum(1) - 1).clamp_(min=0)
    cos, sin = dec.rotary_table(pos)
    small = dec.new_cache(n_p, P)
    h_last = dec.prefill(ids, valid, cos, sin, small)                       # each prompt once
    cache = dec.new_cache(B, S)
    dec.copy_prompts(small, cache, G, P)                                    # ... into its G rows
    del small
    logits = dec.lm_head(h_last).float().repeat_interleave(G, dim=0)     # [B, V]
    work = torch.empty(logits.shape, dtype=torch.float64, device=device) if temperature > 0 else None

    if isinstance(seed, (list, tuple)):
        if len(seed) != n_p:
            raise ValueError(f"sample_turns: seed has {len(seed)} values for {n_p} prompts")
        gens = [torch.Generator(device=device).manual_seed(int(s)) for s in seed]
    else:
        gens = [torch.Generator(device=device).manual_seed(int(seed))]
    per_gen = B // len(gens)
    eos_t = torch.tensor(eos, dtype=torch.long, device=device)
    key_valid = torch.zeros(B, S, dtype=torch.bool, device=device)
    key_valid[:, :P] = valid.repeat_interleave(G, 0)
    prompt_len = key_valid.sum(1)                                            # [B] positions start here
    tokens = torch.full((B, M), pad, dtype=torch.long, device=device)
    logps = torch.zeros((B, M), dtype=torch.float32, device=device)
    truncated = truncation is not None and truncation.active(vocab) and temperature > 0
    deltas = torch.full((B, M), float("inf"), device=device) if truncated else None
    action = torch.zeros((B, M), dtype=torch.bool, device=device)
    n = torch.zeros(B, dtype=torch.long, device=device)                     # completion tokens so far
    turn_start = torch.zeros(B, dtype=torch.long, device=device)
    live = torch.ones(B, dtype=torch.bool, device=device)                   # decoding a model turn
    rows_all = torch.arange(B, device=device)

    def feed(tok: Tensor, ok: Tensor, start: Tensor) -> Tensor:
        """Write tok [B, k] (ok bool [B, k]: which exist) as completion tokens start, start+1, ...
        of each row [B]; held tokens go to the scratch column. Returns hidden states [B, k, H]."""
        at = start[:, None] + torch.arange(tok.shape[1], device=device)[None]  # [B, k] completion index
        cols = torch.where(ok, P + at, torch.full_like(at, scratch))
        c, s = dec.rotary_table(prompt_len[:, None] + at)
        h = dec.step_rows(tok, ok, cols, key_valid, c, s, cache)
        key_valid[rows_all[:, None].expand_as(cols)[ok], cols[ok]] = True
        return h

    while bool(live.any()):
        tok, tok_logp, delta = draw_tokens(logits, temperature, gens, per_gen, work, truncation)
        if replay is not None:
            drawn = tok
            tok = _replayed(tok, replay, action.sum(1).tolist())
            logp = torch.log_softmax(logits / temperature if temperature > 0 else logits, dim=-1)
            tok_logp = torch.where(tok == drawn, tok_logp, logp.gather(1, tok[:, None])[:, 0]) \
                if delta is not None else logp.gather(1, tok[:, None])[:, 0]
            if delta is not None:
                delta = torch.where(tok == drawn, delta, float("inf"))
        b = rows_all[live]
        tokens[b, n[b]] = tok[b]
        logps[b, n[b]] = tok_logp[b]
        if deltas is not None and delta is not None:
            deltas[b, n[b]] = delta[b]
        action[b, n[b]] = True
        ended = live & torch.isin(tok, eos_t)
        full = live & (n + 1 >= M)
        write = live & ~full                  # an ended turn's last token is context for the next
        if bool(write.any()):
            h = feed(tok[:, None], write[:, None], n)
            logits = dec.lm_head(h[:, 0]).float()
        n = n + live.long()
        live = live & ~ended & ~full
        turned = ended & ~full
        if not bool(turned.any()):
            continue
        rows = rows_all[turned].tolist()
        spans = [tokens[r, turn_start[r]:n[r]].tolist() for r in rows]
        room = [M - int(n[r]) for r in rows]
        context = end_of_turn(rows, spans, room)
        fed = [(r, list(c)) for r, c, left in zip(rows, context, room) if c and _fits(r, c, left)]
        if not fed:
            continue
        k = max(len(c) for _, c in fed)
        ctx = torch.full((B, k), pad, dtype=torch.long, device=device)
        ok = torch.zeros((B, k), dtype=torch.bool, device=device)
        for r, c in fed:
            ctx[r, :len(c)] = torch.as_tensor(c, dtype=torch.long)
            ok[r, :len(c)] = True
            tokens[r, n[r]:n[r] + len(c)] = ctx[r, :len(c)]
        h = feed(ctx, ok, n)
        n = n + ok.long().sum(1)
        for r, c in fed:
            logits[r] = dec.lm_head(h[r, len(c) - 1]).float()
            turn_start[r] = n[r]
            live[r] = bool(n[r] < M)

    T = int(n.max())
    completion_ids = tokens[:, :T].contiguous()
    completion_mask = torch.arange(T, device=device)[None] < n[:, None]
    input_ids = torch.cat([ids.repeat_interleave(G, 0), completion_ids], 1)
    attention_mask = torch.cat([valid.repeat_interleave(G, 0), completion_mask], 1).long()
    last = completion_ids.gather(1, (n - 1).clamp(min=0)[:, None])[:, 0]
    act_last = action[:, :T].gather(1, (n - 1).clamp(min=0)[:, None])[:, 0]
    return Rollout(
        input_ids=input_ids, attention_mask=attention_mask,
        position_ids=(attention_mask.cumsum(1) - 1).clamp_(min=0), prompt_len=P,
        completion_ids=completion_ids, completion_mask=completion_mask,
        action_mask=action[:, :T].contiguous(), lengths=n.clone(), prompt_index=rows_all // G,
        logprobs=logps[:, :T].contiguous(), finished=torch.isin(last, eos_t) & act_last & (n > 0),
        group_size=G, routing=dec.routing_record(G, T) if hasattr(dec, "routing_record") else None,
        keep_delta=None if deltas is None else deltas[:, :T].contiguous())
