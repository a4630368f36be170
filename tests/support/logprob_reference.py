"""The exact head the TRL integration tests measure every head against (never imported by the package):
logits in float64 from the same hidden states and weight."""
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

