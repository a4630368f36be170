"""TEMPORARY test-only stand-ins for pieces other issues deliver (fused_logprob, policy_loss,
top_entropy_mask, Thermostat, fasttrain.nn adapters, fasttrain.rollout.sample, models helpers).

`install(monkeypatch)` fills in ONLY what the package does not provide yet, so tests switch to
the real implementations as soon as they land on main. Never imported by the package.
Each stand-in follows the API contract in CONVENTIONS.md and DESIGN.md §5 in plain PyTorch.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import math
import sys
import types
from pathlib import Path

import torch
from torch import nn

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ---- ops -----------------------------------------------------------------------------------
def fused_logprob(hidden, weight, targets, temperature=1.0, ignore_index=-100, bias=None):
    logits = (hidden.float() @ weight.float().T) / temperature
    if bias is not None:
        logits = logits + bias.float() / temperature
    lsm = torch.log_softmax(logits, dim=-1)
    t = targets.clamp_min(0)
    logp = lsm.gather(1, t[:, None])[:, 0]
    ent = -(lsm.exp() * lsm).sum(-1)
    keep = targets != ignore_index
    return torch.where(keep, logp, torch.zeros_like(logp)), torch.where(keep, ent, torch.zeros_like(ent)).detach()


def policy_loss(logp, old_logp, advantages, mask, *, loss="cispo", ref_logp=None, beta=0.0,
                eps_low=0.2, eps_high=0.28, cispo_cap=1.2, zeta=0.0, token_normalizer=None):
    m = mask.to(torch.float32)
    a = advantages.float()
    if a.dim() == 1:
        a = a[:, None].expand_as(logp)
    lp = logp.detach().clamp_min(-20.0)
    factor = torch.where(a > 0, 1 - zeta * lp, torch.where(a < 0, 1 + zeta * lp, torch.ones_like(lp)))
    a2 = a * factor
    ratio = torch.exp(logp - old_logp)
    if loss == "cispo":
        per = -torch.clamp(ratio, max=cispo_cap).detach() * a2 * logp
        hi = (ratio > cispo_cap).float()
        lo = torch.zeros_like(hi)
    else:
        eh = eps_high if loss == "dapo" else eps_low
        per = -torch.minimum(ratio * a2, ratio.clamp(1 - eps_low, 1 + eh) * a2)
        lo = ((ratio < 1 - eps_low) & (a2 < 0)).float()
        hi = ((ratio > 1 + eh) & (a2 > 0)).float()
    kl = torch.zeros_like(per)
    if ref_logp is not None and beta > 0:
        d = ref_logp - logp
        kl = torch.exp(d) - d - 1
        per = per + beta * kl
    n = m.sum()
    if loss == "grpo":
        seq = (per * m).sum(1) / m.sum(1).clamp_min(1)
        total = seq.sum() / (token_normalizer if token_normalizer is not None else (m.sum(1) > 0).sum().clamp_min(1))
    else:
        total = (per * m).sum() / (token_normalizer if token_normalizer is not None else n.clamp_min(1))
    nn_ = n.clamp_min(1)
    stats = {"ratio_mean": (ratio.detach() * m).sum() / nn_,
             "clip_low_frac": (lo * m).sum() / nn_, "clip_high_frac": (hi * m).sum() / nn_ if loss != "cispo" else torch.zeros(()),
             "cap_frac": (hi * m).sum() / nn_ if loss == "cispo" else torch.zeros(()),
             "kl_mean": (kl.detach() * m).sum() / nn_, "repo_r_factor_mean": (factor * m).sum() / nn_,
             "active_tokens": n}
    return total, stats


# ---- rl pieces owned by the policy-loss issue -------------------------------------------------
def top_entropy_mask(entropy, mask, rho=0.2):
    m = mask.bool()
    vals = entropy[m]
    if vals.numel() == 0:
        return m.clone()
    k = max(1, math.ceil(rho * vals.numel()))
    thr = vals.topk(k).values.min()
    return m & (entropy >= thr)


class Thermostat:
    def __init__(self, zeta_min=1e-4, zeta_max=0.05, warmup=5):
        self.zeta_min, self.zeta_max, self.warmup = zeta_min, zeta_max, warmup
        self.zeta, self.target, self._warm, self.history = 0.0, None, [], []

    def update(self, mean_entropy: float) -> float:
        if self.target is None:
            self._warm.append(mean_entropy)
            if len(self._warm) >= self.warmup:
                self.target = sum(self._warm) / len(self._warm)
        else:
            if mean_entropy < self.target:
                self.zeta = self.zeta_min if self.zeta == 0 else min(self.zeta * 2, self.zeta_max)
            elif mean_entropy > self.target:
                self.zeta = self.zeta / 2
                if self.zeta < self.zeta_min:
                    self.zeta = 0.0
        self.history.append(self.zeta)
        return self.zeta

    def state_dict(self):
        return {"zeta": self.zeta, "target": self.target, "warm": list(self._warm), "history": list(self.history)}

    def load_state_dict(self, s):
        self.zeta, self.target, self._warm, self.history = s["zeta"], s["target"], list(s["warm"]), list(s["history"])


# ---- nn: LoRA in place ------------------------------------------------------------------------
class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, r: int, alpha: float):
        super().__init__()
        self.base, self.scale, self.disabled = base, alpha / r, False
        self.lora_A = nn.Parameter(torch.randn(r, base.in_features) / math.sqrt(base.in_features))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r))

    def forward(self, x):
        y = self.base(x)
        if self.disabled:
            return y
        return y + ((x.float() @ self.lora_A.T) @ self.lora_B.T * self.scale).to(y.dtype)


def quantize_model(model, targets=PROJ, blocksize=64, double_quant=False):
    return model


def attach_adapters(model, kind="lora", r=32, alpha=64, rslora=False, targets=None):
    targets = targets or PROJ
    params = []
    for name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            if child_name in targets and isinstance(child, nn.Linear):
                lora = LoRALinear(child, r, alpha)
                setattr(mod, child_name, lora)
                params += [lora.lora_A, lora.lora_B]
    return params


@contextlib.contextmanager
def adapters_disabled(model):
    mods = [m for m in model.modules() if isinstance(m, LoRALinear)]
    for m in mods:
        m.disabled = True
    try:
        yield model
    finally:
        for m in mods:
            m.disabled = False


def save_adapter(model, dir, base_model=""):
    from safetensors.torch import save_file
    d = Path(dir)
    d.mkdir(parents=True, exist_ok=True)
    sd = {n: p.detach().contiguous() for n, p in model.named_parameters() if "lora_" in n}
    save_file(sd, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": base_model}))


def load_adapter(model, dir):
    from safetensors.torch import load_file
    sd = load_file(str(Path(dir) / "adapter_model.safetensors"))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n, t in sd.items():
            params[n].copy_(t)


# ---- rollout --------------------------------------------------------------------------------
class Rollout(types.SimpleNamespace):
    pass


@torch.no_grad()
def sample(model, prompt_ids, *, group_size, max_new_tokens, temperature=1.0, eos_token_ids, seed):
    g = torch.Generator().manual_seed(int(seed) % (2**63))
    dev = next(model.parameters()).device
    rows = [p for p in prompt_ids for _ in range(group_size)]
    P = max(len(p) for p in rows)
    B = len(rows)
    pad = eos_token_ids[0]
    ids = torch.full((B, P), pad, dtype=torch.long)
    att = torch.zeros((B, P), dtype=torch.long)
    for i, p in enumerate(rows):
        ids[i, P - len(p):] = torch.tensor(p)
        att[i, P - len(p):] = 1
    ids, att = ids.to(dev), att.to(dev)
    eos = torch.tensor(eos_token_ids, device=dev)
    out = torch.full((B, max_new_tokens), pad, dtype=torch.long, device=dev)
    cmask = torch.zeros((B, max_new_tokens), dtype=torch.long, device=dev)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    pos = (att.cumsum(-1) - 1).clamp_min(0)
    res = model(input_ids=ids, attention_mask=att, position_ids=pos, use_cache=True)
    past, logits = res.past_key_values, res.logits[:, -1]
    full_att = att
    for t in range(max_new_tokens):
        probs = torch.softmax(logits.float() / temperature, -1)
        tok = torch.multinomial(probs.cpu(), 1, generator=g)[:, 0].to(dev)
        tok = torch.where(done, torch.full_like(tok, pad), tok)
        out[:, t] = tok
        cmask[:, t] = (~done).long()
        done = done | torch.isin(tok, eos)
        if done.all():
            break
        full_att = torch.cat([full_att, (~done | True).long()[:, None]], 1)
        p = full_att.sum(-1, keepdim=True) - 1
        res = model(input_ids=tok[:, None], attention_mask=full_att, position_ids=p, past_key_values=past, use_cache=True)
        past, logits = res.past_key_values, res.logits[:, -1]
    T = max_new_tokens
    return Rollout(input_ids=torch.cat([ids, out], 1), attention_mask=torch.cat([att, cmask], 1),
                   prompt_len=P, completion_ids=out, completion_mask=cmask, lengths=cmask.sum(1),
                   prompt_index=torch.arange(B, device=dev) // group_size)


def chat_prompt_ids(tokenizer, prompt_spec_text, answer_format):
    return tokenizer.encode(prompt_spec_text)


def extract_answer(text):
    return text.strip()


def install(monkeypatch):
    """Fill in what the package lacks; leave real implementations alone."""
    import fasttrain.ops as ops
    import fasttrain.nn as fnn
    import fasttrain.models as models
    import fasttrain.rollout as rollout
    for mod, names in ((ops, ("fused_logprob", "policy_loss")),
                       (fnn, ("quantize_model", "attach_adapters", "adapters_disabled", "save_adapter", "load_adapter")),
                       (models, ("chat_prompt_ids", "extract_answer")),
                       (rollout, ("sample",))):
        for n in names:
            if not callable(getattr(mod, n, None)) or isinstance(getattr(mod, n), types.ModuleType):
                monkeypatch.setattr(mod, n, globals()[n], raising=False)
    for modname, names in (("fasttrain.rl.masks", ("top_entropy_mask",)), ("fasttrain.rl.repo_r", ("Thermostat",))):
        try:
            importlib.import_module(modname)
        except ImportError:
            m = types.ModuleType(modname)
            for n in names:
                setattr(m, n, globals()[n])
            monkeypatch.setitem(sys.modules, modname, m)
