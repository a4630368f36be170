"""Plain-torch references for the TRL integration tests (never imported by the package).

`reference_logprob_float64` is the exact answer the tests measure every head against: logits in float64
from the same hidden states and weight. `standin_fused_logprob` is a chunked fp32 stand-in with the
contract's signature, used only while developing before `fasttrain.ops.fused_logprob` landed.
"""
import torch


def reference_logprob_float64(hidden, weight, targets, temperature=1.0, ignore_index=-100, bias=None):
    # hidden: [N, H], weight: [V, H], targets: [N]. Autograd reaches hidden (and weight) through float64.
    logits = hidden.double() @ weight.double().t()
    if bias is not None:
        logits = logits + bias.double()
    logp_all = torch.log_softmax(logits / temperature, dim=-1)  # [N, V] float64, tests only
    valid = targets != ignore_index
    logp = logp_all.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    logp = torch.where(valid, logp, torch.zeros_like(logp))
    entropy = torch.where(valid, entropy, torch.zeros_like(entropy))
    return logp.float(), entropy.detach().float()


def standin_fused_logprob(hidden, weight, targets, temperature=1.0, ignore_index=-100, bias=None, chunk=256):
    # Development stand-in: same contract, [chunk, V] at a time in fp32.
    logps, ents = [], []
    for start in range(0, hidden.shape[0], chunk):
        h = hidden[start:start + chunk].float()
        t = targets[start:start + chunk]
        z = h @ weight.float().t()
        if bias is not None:
            z = z + bias.float()
        lp = torch.log_softmax(z / temperature, dim=-1)
        valid = t != ignore_index
        logps.append(torch.where(valid, lp.gather(-1, t.clamp(min=0).unsqueeze(-1)).squeeze(-1), 0.0))
        ents.append(torch.where(valid, -(lp.exp() * lp).sum(-1), 0.0).detach())
    return torch.cat(logps), torch.cat(ents)
