"""The policy update of one step: score the batch once without gradients (old log-probs,
entropy, reference log-probs), then k passes of micro-batched forward/backward and one AdamW
step per pass.

Forward never materialises logits: the decoder's last hidden states at the answer positions go
through fasttrain.ops.fused_logprob with the lm_head weight. Every micro-batch's loss is divided
by the whole batch's active token count (token_normalizer; GRPO: its count of sequences), so the sum of micro-batch gradients
is the gradient of the one-batch loss.

Two settings give TRL GRPOTrainer's conventions instead of the recipe's (docs/trl.md lists them):
`loss.normalize = "trl"` (every sampled token in the denominator and under the KL term, the entropy
mask zeroing only the policy term; GRPO's row means averaged per micro-batch, then over micro-batches).
The KL estimator (`loss.kl`: "k3_ratio", beta * r * k3 with the ratio in the graph, TRL's default too;
or "k3") is computed inside the loss op, in the same pass as the policy term.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fasttrain.train.config import LossSection

__all__ = ["answer_logprobs", "BatchScores", "score_batch", "update_policy", "UpdateResult", "NonFiniteLoss"]


class NonFiniteLoss(RuntimeError):
    """A pass's loss or gradient norm was not finite. `result`: what the update had computed (the
    earlier passes' stats, the pre-update log-probs and entropies)."""

    def __init__(self, message: str, result: "UpdateResult | None" = None):
        super().__init__(message)
        self.result = result


def _decoder(model):
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(model, "lm_head"):
        raise TypeError("the policy must be a causal LM with .model (decoder) and .lm_head (like HF Llama)")
    return inner


def answer_logprobs(model, input_ids, attention_mask, prompt_len: int, completion_ids, completion_mask,
                    temperature: float, shared_prefix: bool = True, position_ids=None, prompt_index=None,
                    routing=None, packed: bool = True, keep_delta=None):
    """log p and entropy [B, T] of the answer tokens (zeros where completion_mask is 0).

    `shared_prefix`: run each distinct prompt once and let its answers attend to its keys and
    values (fasttrain.train.prefix_forward: same values and gradients as the full forward, with
    or without gradient checkpointing; the model's own forward runs where that one does not apply).
    `position_ids` [B, P+T] and `prompt_index` [B]: the rollout's own (Rollout.position_ids,
    Rollout.prompt_index), which the update passes; callers holding only ids and a mask omit them
    and get cumsum(mask) - 1 positions and groups of equal prompt tokens. `routing`: a mixture of
    experts' rollout record of these rows (fasttrain.rollout.moe_routing.ReplayRouting), replayed by
    the shared-prefix forward; None routes by the model's own router. `packed`: the shared-prefix
    forward runs only the answers' real tokens through the layers (fasttrain.train.answer_packing;
    same values and gradients as the padded layout); False forces the padded layout [B, T-1].
    `keep_delta` [B, T]: a truncated rollout's kept sets (Rollout.keep_delta): each token is scored
    on the softmax restricted to the set it was drawn from, renormalised (log-prob, entropy and
    gradient; fasttrain.ops.fused_logprob); None scores on the whole vocabulary."""
    from fasttrain.ops import fused_logprob
    from fasttrain.train.prefix_forward import shared_prefix_selected

    decoder = _decoder(model)
    if position_ids is None:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    T = completion_ids.shape[1]
    m = completion_mask.bool()
    h = None                                                          # [n, H]: the hidden states at m
    if shared_prefix:
        h = shared_prefix_selected(model, input_ids, attention_mask, position_ids, prompt_len, T, m, prompt_index,
                                   routing=routing, packed=packed)
    if h is None:
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids, use_cache=False).last_hidden_state
        h = hidden[:, prompt_len - 1: prompt_len - 1 + T][m]          # [B, T, H] predicts answer token t
    lm = model.lm_head
    logp_sel, ent_sel = fused_logprob(h, lm.weight, completion_ids[m], temperature,
                                      bias=getattr(lm, "bias", None),
                                      keep_delta=None if keep_delta is None else keep_delta[m])
    logp = torch.zeros(m.shape, dtype=logp_sel.dtype, device=h.device).masked_scatter(m, logp_sel)
    ent = torch.zeros(m.shape, dtype=ent_sel.dtype, device=h.device).masked_scatter(m, ent_sel.detach())
    return logp, ent


@dataclass
class BatchScores:
    old_logp: torch.Tensor | None   # [B, T] pre-update policy (None: pass 1 of the update computes it)
    entropy: torch.Tensor | None    # [B, T] (with old_logp)
    ref_logp: torch.Tensor | None   # [B, T] base model (adapters off), None when beta == 0


@dataclass
class UpdateResult:
    passes: list[dict[str, float]]  # one stats dict per pass (loss, grad_norm, the op's stats)
    old_logp: torch.Tensor          # [B, T] the pre-update policy's log-probs (scored, or pass 1's)
    entropy: torch.Tensor           # [B, T] its entropies


def _rollout_args(roll, sl):
    """The rollout's own tensors for rows `sl`, as answer_logprobs takes them. The kept sets go to
    every scoring of the rollout: the old and updated policy's log-probs and the reference's, so the
    KL term compares the policy and the reference restricted to the same set, the one each token was
    drawn from (zero when they agree)."""
    delta = getattr(roll, "keep_delta", None)
    return dict(position_ids=roll.position_ids[sl], prompt_index=roll.prompt_index[sl],
                keep_delta=None if delta is None else delta[sl])


def _replay(roll, sl, replay: bool, aux: bool = False):
    """The rollout's routing record of rows `sl` for one forward (None: no record, a dense model);
    `aux`: also keep the router logits for the load-balancing loss (a record-less forward too)."""
    record = getattr(roll, "routing", None)
    if record is None and not aux:
        return None
    from fasttrain.rollout.moe_routing import ReplayRouting
    return ReplayRouting(None if record is None else record[sl], replay=replay, aux=aux)


def _chunks(n: int, size: int):
    for s in range(0, n, size):
        yield slice(s, min(n, s + size))


@torch.no_grad()
def score_batch(model, roll, micro_batch: int, temperature: float, need_ref: bool,
                need_old: bool = True, routing_replay: bool = True) -> BatchScores:
    """No-grad scores of the batch. `need_old=False` skips the pre-update policy's forward: the
    update's first pass runs on that same policy and returns old_logp and entropy from its own
    forward (the recipe's old log-probs are the first pass's), which saves one forward per
    step. Only a token mask that needs the entropies before the update (top-entropy) needs them here."""
    from fasttrain.nn import adapters_disabled

    was = model.training
    model.eval()
    olds, ents, refs = [], [], []
    B = roll.completion_ids.shape[0]
    for sl in _chunks(B, micro_batch):
        args = (roll.input_ids[sl], roll.attention_mask[sl], roll.prompt_len, roll.completion_ids[sl],
                roll.completion_mask[sl], temperature)
        if need_old:
            lp, ent = answer_logprobs(model, *args, **_rollout_args(roll, sl), routing=_replay(roll, sl, routing_replay))
            olds.append(lp)
            ents.append(ent)
        if need_ref:
            with adapters_disabled(model):
                refs.append(answer_logprobs(model, *args, **_rollout_args(roll, sl))[0])
    model.train(was)
    return BatchScores(torch.cat(olds) if need_old else None, torch.cat(ents) if need_old else None,
                       torch.cat(refs) if need_ref else None)


def update_policy(model, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, roll,
                  scores: BatchScores, advantages: torch.Tensor, loss_mask: torch.Tensor,
                  loss_cfg: LossSection, zeta: float, micro_batch: int, grad_clip: float,
                  temperature: float, routing_replay: bool = True, router_aux_loss_coef: float = 0.0) -> UpdateResult:
    """k passes; returns one stats dict per pass and the pre-update policy's log-probs and
    entropies (`scores`' own when it has them, else pass 1's). Raises NonFiniteLoss (after zeroing
    grads) when a pass's loss or gradient norm is not finite; the caller skips the step.
    `routing_replay`: a mixture of experts' forwards force the rollout's experts (roll.routing);
    pass 1's stats then hold the router disagreement and expert load (rollout.moe_routing).
    `router_aux_loss_coef`: a mixture of experts' load-balancing loss (fasttrain.rl.router_aux, as
    transformers computes it over a forward's router logits) times this is added to each
    micro-batch's loss, weighted by the micro-batch's share of the batch's rows, so one micro-batch
    gives transformers' value and several their row-weighted mean; 0 (the default) computes nothing."""
    from fasttrain.ops import policy_loss
    from fasttrain.train import distributed

    B = roll.completion_ids.shape[0]
    trl = loss_cfg.normalize == "trl"
    # The tokens the op sums over: the loss mask, or (TRL's convention) every sampled token, the
    # advantage set to 0 off the loss mask so that only the KL term reaches those tokens.
    op_mask = roll.action_mask.bool() & roll.completion_mask.bool() if trl else loss_mask
    op_adv = advantages
    if trl and not torch.equal(op_mask, loss_mask.bool()):
        op_adv = advantages.reshape(B, -1) * loss_mask.to(advantages.dtype)
    # The whole batch's denominator, so micro-batch gradients add up to the one-batch gradient:
    # active tokens (CISPO, DAPO) or sequences with an active token (GRPO's mean of means).
    # Both count the whole batch over every data-parallel rank (distributed.sum_values).
    count = op_mask.any(dim=1).sum() if loss_cfg.kind == "grpo" else op_mask.sum()
    batch_count, batch_tokens = distributed.sum_values([float(count), float(op_mask.sum())])
    normalizer = torch.tensor(batch_count, dtype=torch.float32, device=loss_mask.device).clamp_min(1)
    n_chunks = len(range(0, B, micro_batch)) * distributed.world_size()
    aux = _aux_shape(model) if router_aux_loss_coef else None       # (E, k) of a mixture of experts
    model.train()
    out = []
    fill_old = scores.old_logp is None          # pass 1 provides the old log-probs and entropy
    old_logp, entropy = scores.old_logp, scores.entropy
    for k in range(loss_cfg.passes):
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), dtype=torch.float64)
        acc: dict[str, float] = {}
        olds, ents, routed = [], [], []
        for sl in _chunks(B, micro_batch):
            m = op_mask[sl]
            first_fill = fill_old and k == 0
            if not bool(m.any()) and not first_fill:
                continue
            replay = _replay(roll, sl, routing_replay, aux=aux is not None)
            with torch.set_grad_enabled(bool(m.any())):
                logp, ent = answer_logprobs(model, roll.input_ids[sl], roll.attention_mask[sl], roll.prompt_len,
                                            roll.completion_ids[sl], roll.completion_mask[sl], temperature,
                                            **_rollout_args(roll, sl), routing=replay)
            if replay is not None and replay.experts is not None and k == 0:
                routed.append(replay.counts(_num_experts(model)))
            if first_fill:
                olds.append(logp.detach())
                ents.append(ent)
                old = olds[-1]
            else:
                old = old_logp[sl]
            if not bool(m.any()):
                continue
            # TRL's GRPO: the mean of this micro-batch's row means, over the micro-batches
            norm = torch.full_like(normalizer, float((sl.stop - sl.start) * n_chunks)) \
                if trl and loss_cfg.kind == "grpo" else normalizer
            ref = None if scores.ref_logp is None else scores.ref_logp[sl]
            loss, stats = policy_loss(
                logp, old, op_adv[sl], m, loss=loss_cfg.kind, ref_logp=ref, beta=loss_cfg.beta,
                eps_low=loss_cfg.eps_low, eps_high=loss_cfg.eps_high, cispo_cap=loss_cfg.cispo_cap, zeta=zeta,
                token_normalizer=norm, kl=loss_cfg.kl)
            if aux is not None:
                aux_v = replay.aux_loss(*aux)
                share = (sl.stop - sl.start) / (B * distributed.world_size())
                loss = loss + router_aux_loss_coef * share * aux_v.to(loss.dtype)
                stats["moe_router_aux_loss"] = aux_v.detach()
            loss.backward()
            total += loss.detach().double().cpu()
            w = float(m.sum()) / batch_tokens                # stats: token-weighted over the batch
            for key, v in stats.items():
                if key != "active_tokens":
                    acc[key] = acc.get(key, 0.0) + w * float(v)
        if fill_old and k == 0:
            old_logp, entropy = torch.cat(olds), torch.cat(ents)
        distributed.sum_gradients(params)               # the whole batch's gradient on every rank
        loss_v, acc = distributed.sum_stats(float(total), acc)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else math.inf)
        gn = float(grad_norm)
        if not (math.isfinite(loss_v) and math.isfinite(gn)):
            optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLoss(f"loss {loss_v}, gradient norm {gn}", UpdateResult(out, old_logp, entropy))
        optimizer.step()
        out.append({"loss": loss_v, "grad_norm": gn, **acc, **_routing_metrics(routed)})
    optimizer.zero_grad(set_to_none=True)
    return UpdateResult(out, old_logp, entropy)


def _aux_shape(model) -> tuple[int, int] | None:
    """(experts, top-k) of a mixture of experts' MoE layers, or None for a dense model."""
    from fasttrain.nn.moe_experts import moe_blocks
    blocks = moe_blocks(model)
    return (blocks[0][1].num_experts, blocks[0][1].top_k) if blocks else None


def _num_experts(model) -> int:
    from fasttrain.nn.moe_experts import moe_blocks
    return moe_blocks(model)[0][1].num_experts


def _routing_metrics(routed) -> dict[str, float]:
    """A mixture of experts' router disagreement and expert load (empty for dense models)."""
    if not routed:
        return {}
    from fasttrain.rollout.moe_routing import routing_metrics
    return routing_metrics(routed)
