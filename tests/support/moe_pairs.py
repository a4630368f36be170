"""Both MoE families in float64 beside fasttrain's surgery of them, the float64 oracle's forward, and the
rollout/update helpers that the MoE families' oracle tests share."""
import copy
from contextlib import ExitStack

import torch

from fasttrain.models.moe import moe_surgery
from fasttrain.models.moe_tiny import tiny_qwen3_5_moe, tiny_qwen3_moe
from fasttrain.train.policy_update import answer_logprobs

from support.hf_oracle import hf_float64_oracle
from support.moe_oracle import hf_routing
from support.tolerances import forward_tol

PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
FAMILIES = {"qwen3_moe": tiny_qwen3_moe, "qwen3_5_moe": tiny_qwen3_5_moe}


def pair(family):
    hf = FAMILIES[family](vocab_size=97, dtype=torch.float64)
    return hf, moe_surgery(copy.deepcopy(hf), nf4=False)


def oracle_tol(model, S):
    return forward_tol(model.config, S)


def oracle_forward(hf, roll, forced=None):
    P, T = roll.prompt_len, roll.completion_ids.shape[1]
    with ExitStack() as st, torch.no_grad():
        if hf.config.model_type.startswith("qwen3_5"):
            st.enter_context(hf_float64_oracle("qwen3_5_moe"))
        rec = st.enter_context(hf_routing(hf, forced))
        lp = hf(roll.input_ids, attention_mask=roll.attention_mask, position_ids=roll.position_ids).logits.log_softmax(-1)
    return lp[:, P - 1:P - 1 + T], rec


def move_router(hf, model, scale: float = 0.1, seed: int = 1) -> None:
    """The same random step on every MoE layer's router of the oracle and of fasttrain's model."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)
                model.get_parameter(name).copy_(p)


def update_logprobs(model, roll, routing=None):
    return answer_logprobs(model, roll.input_ids, roll.attention_mask, roll.prompt_len, roll.completion_ids,
                           roll.completion_mask, 1.0, position_ids=roll.position_ids, prompt_index=roll.prompt_index,
                           routing=routing)[0]


def forwarded(roll):
    """[B, S] the tokens the update forwards (each distinct prompt once, the answers' inputs), real only."""
    B, S = roll.input_ids.shape
    P = roll.prompt_len
    m = torch.zeros(B, S, dtype=torch.bool)
    first = torch.unique(roll.prompt_index, return_inverse=False)
    rows = torch.tensor([int((roll.prompt_index == g).nonzero()[0]) for g in first])
    m[rows, :P] = True
    m[:, P:S - 1] = True
    return m & roll.attention_mask.bool()


def sets_differ(a, b):
    return (a.long().sort(-1)[0] != b.long().sort(-1)[0]).any(-1)
