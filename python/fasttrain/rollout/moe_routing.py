"""The rollout's routing record of a mixture-of-experts policy, as the update replays and measures it.

    rec = ReplayRouting(roll.routing[sl], replay=True)      # one micro-batch's rows
    logp, ent = answer_logprobs(..., routing=rec)           # the MoE forward forces rec's experts
    rec.counts()                                            # (differing pairs, pairs, per-expert tokens)

The record is [B, P+T, L, k]: for row b and column j, the top-k experts each of the L MoE layers
chose for the token at column j in the rollout's own forward (fasttrain.rollout.moe_decoder). The
update's shared-prefix forward (fasttrain.train.prefix_forward_moe) forwards each distinct prompt
once and the answers' input tokens (columns P .. P+T-2); `forced(layer, first, P, A)` gives the
record in that token order. Replay (moe.routing_replay = "rollout", the R3 routing replay of Ma et
al.) forces those experts and takes their weights from the update's router; with replay "off" the
update routes by itself and the record is only measured against. Either way the forward reports
what its own router chose (`seen`), so the disagreement (token-layer pairs whose top-k *set*
differs from the rollout's) and the expert load (tokens per expert) are counted over real tokens
(pads excluded). With `aux` it also keeps each MoE layer's router logits (with their graph) for the
load-balancing loss (fasttrain.rl.router_aux, moe.router_aux_loss_coef), each token weighted by the
rows it stands for. A forward without a record (`experts` None) only measures that loss.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["ReplayRouting", "join_routing", "routing_metrics"]


class ReplayRouting:
    """One forward's view of the rollout's record: what to force, and what the forward chose."""

    def __init__(self, experts: Tensor | None, replay: bool = True, aux: bool = False):
        self.experts = experts                  # [b, P+T, L, k], or None (no record)
        self.replay = replay and experts is not None
        self.aux = aux
        self.valid: Tensor | None = None        # [N] real tokens, in the forward's token order
        self.weight: Tensor | None = None       # [N] the rows each token stands for (0: a pad)
        self.recorded: list[Tensor] = []        # per MoE layer [N, k]: the rollout's experts
        self.own: list[Tensor] = []             # per MoE layer [N, k]: the update's own top-k
        self.router_logits: list[Tensor] = []   # per MoE layer [N, E], with `aux`

    def token_order(self, first: Tensor, P: int, A: int, valid: Tensor, weight: Tensor | None = None) -> None:
        """Lay the record out as the shared-prefix forward's tokens: the U distinct prompts' P columns
        (rows `first`), then every row's A answer inputs; `valid` [U·P + b·A] marks real tokens and
        `weight` the rows each stands for (default: `valid`)."""
        if self.experts is not None:
            e = self.experts.long()
            k = e.shape[-1]
            self.recorded = [torch.cat([e[first, :P, i].reshape(-1, k), e[:, P:P + A, i].reshape(-1, k)])
                             for i in range(e.shape[2])]
        self.valid = valid
        self.weight = valid.long() if weight is None else weight
        self.own = []
        self.router_logits = []

    def forced(self, i: int) -> Tensor | None:
        return self.recorded[i] if self.replay else None

    def logits(self, i: int, logits: Tensor) -> None:
        """MoE layer i's router logits [N, E] of this forward (kept with `aux`; a recompute's replace them)."""
        if not self.aux:
            return
        if len(self.router_logits) <= i:
            self.router_logits.append(logits)
        else:
            self.router_logits[i] = logits

    def aux_loss(self, num_experts: int, top_k: int) -> Tensor:
        """The load-balancing loss of this forward's router logits (fasttrain.rl.router_aux)."""
        from fasttrain.rl.router_aux import load_balancing_loss
        return load_balancing_loss(self.router_logits, self.weight, num_experts, top_k)

    def seen(self, i: int, own: Tensor) -> None:
        if len(self.own) <= i:
            self.own.append(own)
        else:                                   # a checkpoint recompute sees the same tokens again
            self.own[i] = own

    def counts(self, num_experts: int) -> tuple[int, int, Tensor]:
        """(token-layer pairs whose own top-k set differs from the rollout's, pairs, tokens per
        expert [L, E] under the routing the forward used), over real tokens."""
        v = self.valid
        differ = pairs = 0
        load = []
        if self.experts is None:
            return 0, 0, torch.zeros(0, num_experts, dtype=torch.long)
        for rec, own in zip(self.recorded, self.own):
            r, o = rec[v].sort(-1)[0], own[v].long().sort(-1)[0]
            differ += int((r != o).any(-1).sum())
            pairs += int(v.sum())
            used = rec[v] if self.replay else own[v].long()
            load.append(torch.bincount(used.reshape(-1), minlength=num_experts))
        return differ, pairs, (torch.stack(load) if load else torch.zeros(0, num_experts, dtype=torch.long))


def routing_metrics(parts: list[tuple[int, int, Tensor]]) -> dict[str, float]:
    """moe_router_disagreement (share of token-layer pairs) and moe_expert_load_max_over_mean (the
    busiest expert's tokens over the mean, worst MoE layer) from the micro-batches' counts."""
    if not parts:
        return {}
    differ = sum(p[0] for p in parts)
    pairs = sum(p[1] for p in parts)
    load = sum(p[2].double() for p in parts)
    mean = load.mean(-1).clamp_min(1e-12)
    return {"moe_router_disagreement": differ / max(pairs, 1),
            "moe_expert_load_max_over_mean": float((load.max(-1)[0] / mean).max()) if load.numel() else 0.0}


def join_routing(parts, P: int, T: int) -> Tensor | None:
    """The records of rollouts joined as fasttrain.train.answers.join_rollouts joins their rows:
    columns left-padded to P prompt columns and right-padded to P+T (pads hold expert 0 and are
    never read: they are masked tokens); None when any part has no record."""
    if any(getattr(r, "routing", None) is None for r in parts):
        return None
    return torch.cat([torch.nn.functional.pad(r.routing, (0, 0, 0, 0, P - r.prompt_len,
                                                          T - r.completion_ids.shape[1])) for r in parts])
