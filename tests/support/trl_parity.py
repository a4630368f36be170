"""The harness of the TRL parity tests (tests/integrations): the same prompts and fixed completions
given to TRL's GRPOTrainer (through a rollout_func) and to fasttrain's update, with the same LoRA factors,
and what each side's steps record (advantages, per-token loss gradients, LoRA gradients, the norms and the
factors after AdamW). Needs trl: the tests that import it skip without it."""
from __future__ import annotations

import copy
import math

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

import fasttrain.train.policy_update as pu
from fasttrain.nn import adaptable_model, attach_adapters
from fasttrain.ops.kernels import use_kernels
from fasttrain.rl import gdpo_advantages
from fasttrain.rollout.sampling import Rollout, left_padded
from fasttrain.train.config import LossSection, OptimSection
from fasttrain.train.distributed import top_entropy_mask
from fasttrain.train.trainer import adamw

from support.tiny_grpo import tiny_tokenizer
from support.tolerances import U32

U16 = 2.0 ** -8
G, MICRO, TEMPERATURE, LR, CLIP, RANK, ALPHA = 4, 4, 0.7, 0.02, 0.05, 4, 8.0
TARGETS = ["q_proj", "v_proj", "down_proj"]
WEIGHTS = [3.0, 1.0]
EOS, PAD = 1, 0
PROMPTS = {"w5 w9 w12": [8, 12, 15], "w40 w2": [43, 5]}
# 4 answers per prompt, every one distinct (rows are matched across TRL's shuffle by their tokens); some end
# with EOS, some are cut at the length limit (6). The second group's answers all have 3 tokens: the length
# reward is constant there, so its channel contributes exactly 0.
COMPLETIONS = {"w5 w9 w12": [[20, 31, 44, 9, 60, 71], [22, 8, EOS], [25, 27, 40, 41, 10, EOS], [30, 33, 36, 11, EOS]],
               "w40 w2": [[50, 52, EOS], [61, 9, 14], [70, 72, 11], [80, 13, EOS]]}
T_MAX = 6
FP32_GRAD_REL = 2 * 8 * 256 * U32                     # the float32 bound above, relative to a tensor's max
TRL_CONVENTIONS = dict(normalize="trl", kl="k3_ratio")


def even_share(completion_ids, **kwargs):
    return [sum(i % 2 == 0 for i in ids) / len(ids) for ids in completion_ids]


def length(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


REWARDS = [even_share, length]


# ---- the shared starting point ----------------------------------------------------------------
def lora_init(base) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module name: (A [r, in], B [out, r])} for every target, seeded; B is not 0."""
    g = torch.Generator().manual_seed(5)
    out = {}
    for name, mod in base.named_modules():
        if name.rpartition(".")[2] in TARGETS:
            bound = 1 / math.sqrt(mod.in_features)
            a = (torch.rand(RANK, mod.in_features, generator=g) * 2 - 1) * bound
            b = torch.randn(mod.out_features, RANK, generator=g) * 0.05
            out[name] = (a, b)
    return out


def rows():
    """The batch in TRL's order (each prompt's G answers in a row): prompt ids, completion ids."""
    return [(PROMPTS[p], c) for p in PROMPTS for c in COMPLETIONS[p]]


# ---- TRL ----------------------------------------------------------------------------------------
class Capture(TrainerCallback):
    """The clipped gradients before each optimizer step and the adapters after it, by fasttrain's names."""

    def __init__(self, names):
        self.names, self.grads, self.after = names, [], []

    def _named(self, model, what):
        return {self.names[n]: what(p) for n, p in model.named_parameters() if n in self.names}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        self.grads.append(self._named(model, lambda p: p.grad.detach().double().clone()))

    def on_optimizer_step(self, args, state, control, model=None, **kw):
        self.after.append(self._named(model, lambda p: p.detach().double().clone()))


def run_trl(tmp_path, base, init, kind, beta, passes, bf16, micro=MICRO, top=1.0, steps=1, lr=LR):
    """TRL's `steps` training steps of `passes` optimizer steps each, every step on the same batch."""
    def rollout_func(prompts, trainer):
        seen: dict[str, int] = {}
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        for p in prompts:
            i = seen[p] = seen.get(p, -1) + 1
            out["prompt_ids"].append(PROMPTS[p])
            out["completion_ids"].append(COMPLETIONS[p][i])
            out["logprobs"].append([0.0] * len(COMPLETIONS[p][i]))
        return out

    loss = {"cispo": dict(loss_type="cispo", epsilon_high=1.2), "dapo": dict(loss_type="dapo", epsilon=0.2,
            epsilon_high=0.28), "grpo": dict(loss_type="grpo", epsilon=0.2, epsilon_high=0.2)}[kind]
    args = GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=bf16, **loss, beta=beta, num_generations=G,
        max_completion_length=T_MAX, temperature=TEMPERATURE, per_device_train_batch_size=micro,
        gradient_accumulation_steps=len(rows()) // micro, num_iterations=passes, max_steps=steps * passes,
        learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=CLIP,
        shuffle_dataset=False, seed=0, reward_weights=WEIGHTS, multi_objective_aggregation="normalize_then_sum",
        top_entropy_quantile=top, logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True)
    model = copy.deepcopy(base)
    lora = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0, task_type="CAUSAL_LM")
    data = Dataset.from_list([{"prompt": p} for p in PROMPTS])
    trainer = GRPOTrainer(model=model, reward_funcs=REWARDS, args=args, train_dataset=data,
                          processing_class=tiny_tokenizer(), peft_config=lora, rollout_func=rollout_func)
    names = {}
    with torch.no_grad():
        for n, p in trainer.model.named_parameters():
            if "lora_" in n:
                mod = n.split("base_model.model.", 1)[1].split(".lora_")[0]
                which = 0 if ".lora_A." in n else 1
                p.copy_(init[mod][which])
                names[n] = f"{mod}.lora_{'AB'[which]}"
    cap = Capture(names)
    trainer.add_callback(cap)
    seen = {"adv": None, "token_grads": []}
    generate = trainer._generate_and_score_completions

    def generate_and_keep(inputs):
        out = generate(inputs)
        seen["adv"] = out["advantages"].detach().double().clone()
        return out

    score = trainer._get_per_token_logps_and_entropies

    def score_and_hook(model, input_ids, *a, **kw):
        out = score(model, input_ids, *a, **kw)
        if out[0].requires_grad:
            ids = input_ids[:, -T_MAX:].clone()
            out[0].register_hook(lambda g: seen["token_grads"].append((ids, g.detach().double().clone())))
        return out

    trainer._generate_and_score_completions = generate_and_keep
    trainer._get_per_token_logps_and_entropies = score_and_hook
    trainer.train()
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    return {"adv": seen["adv"], "token_grads": by_row(seen["token_grads"], steps * passes), "grads": cap.grads,
            "after": cap.after, "grad_norm": norms, "log": [h for h in trainer.state.log_history if "loss" in h]}


def by_row(records, passes) -> list[torch.Tensor]:
    """Per pass (optimizer step), dL/d log p [B, T_MAX] in the batch's own order (rows found by their
    completion tokens)."""
    order = {tuple(c + [PAD] * (T_MAX - len(c))): i for i, (_, c) in enumerate(rows())}
    out = [torch.zeros(len(rows()), T_MAX, dtype=torch.float64) for _ in range(passes)]
    per_pass = len(records) // passes
    for k, (ids, g) in enumerate(records):
        for r in range(ids.shape[0]):
            out[k // per_pass][order[tuple(ids[r].tolist())]] = g[r, -T_MAX:]
    return out


# ---- fasttrain ----------------------------------------------------------------------------------
def rollout() -> Rollout:
    prompts = [p for p, _ in rows()]
    P = max(len(p) for p in prompts)
    ids, valid = left_padded(prompts, P, PAD, "cpu")
    comp = torch.full((len(prompts), T_MAX), PAD, dtype=torch.long)
    cmask = torch.zeros(len(prompts), T_MAX, dtype=torch.bool)
    for b, (_, c) in enumerate(rows()):
        comp[b, :len(c)] = torch.tensor(c)
        cmask[b, :len(c)] = True
    attn = torch.cat([valid, cmask], 1).long()
    return Rollout(input_ids=torch.cat([ids, comp], 1), attention_mask=attn,
                   position_ids=(attn.cumsum(1) - 1).clamp(min=0), prompt_len=P, completion_ids=comp,
                   completion_mask=cmask, action_mask=cmask, lengths=cmask.sum(1),
                   prompt_index=torch.arange(len(prompts)) // G, logprobs=torch.zeros(len(prompts), T_MAX),
                   finished=torch.ones(len(prompts), dtype=torch.bool), group_size=G)


def run_fasttrain(base, init, kind, beta, passes, dtype, monkeypatch, micro=MICRO, top=1.0, steps=1, lr=LR,
                  **loss_settings):
    """fasttrain's update in `dtype` (float64: with the reference kernels, fasttrain.ops.reference) as its
    Trainer runs it, `steps` times on the same batch; top < 1: the loss tokens are the top share of entropy,
    as loss.token_mask = "top_entropy"."""
    if dtype == torch.float64:
        with use_kernels("reference"):
            return _run_fasttrain(base, init, kind, beta, passes, dtype, monkeypatch, micro, top, steps, lr,
                                  **loss_settings)
    return _run_fasttrain(base, init, kind, beta, passes, dtype, monkeypatch, micro, top, steps, lr, **loss_settings)


def _run_fasttrain(base, init, kind, beta, passes, dtype, monkeypatch, micro, top, steps, lr, **loss_settings):
    model = copy.deepcopy(base).to(dtype)
    adaptable_model(model, tuple(TARGETS))
    params = attach_adapters(model, r=RANK, alpha=ALPHA, targets=tuple(TARGETS))
    named = {}
    with torch.no_grad():
        for name, mod in model.named_modules():
            if name in init:
                mod.lora_A.copy_(init[name][0])
                mod.lora_B.copy_(init[name][1])
                named[f"{name}.lora_A"], named[f"{name}.lora_B"] = mod.lora_A, mod.lora_B
    if dtype == torch.float64:
        for p in params:
            p.data = p.data.double()
    roll = rollout()
    rewards = torch.tensor([[f(completion_ids=[c])[0] for f in REWARDS] for _, c in rows()], dtype=torch.float64)
    adv = gdpo_advantages(rewards, G, torch.tensor(WEIGHTS), batch_normalize=True)
    cfg = LossSection(kind=kind, beta=beta, eps_low=0.2, eps_high=0.2 if kind == "grpo" else 0.28, cispo_cap=1.2,
                      token_mask="all" if top == 1.0 else "top_entropy", rho=top, passes=passes, **loss_settings)
    opt = adamw(params, OptimSection(lr=lr, grad_clip=CLIP, micro_batch=micro))    # the Trainer's optimizer
    grads, after, token_grads = [], [], []
    step = opt.step

    def step_and_keep(*a, **kw):
        grads.append({n: p.grad.detach().double().clone() for n, p in named.items()})
        out = step(*a, **kw)
        after.append({n: p.detach().double().clone() for n, p in named.items()})
        return out

    opt.step = step_and_keep
    logprobs = pu.answer_logprobs

    def logprobs_and_hook(*a, **kw):
        logp, ent = logprobs(*a, **kw)
        if logp.requires_grad:
            ids = a[4].clone()
            logp.register_hook(lambda g: token_grads.append((ids, g.detach().double().clone())))
        return logp, ent

    monkeypatch.setattr(pu, "answer_logprobs", logprobs_and_hook)
    norms, stats = [], []
    for _ in range(steps):
        scores = pu.score_batch(model, roll, micro, TEMPERATURE, need_ref=beta > 0, need_old=top < 1.0)
        loss_mask = roll.action_mask if top == 1.0 else top_entropy_mask(scores.entropy, roll.action_mask, top)
        result = pu.update_policy(model, params, opt, roll, scores, adv, loss_mask, cfg, 0.0, micro, CLIP,
                                  TEMPERATURE)
        norms += [s["grad_norm"] for s in result.passes]
        stats += result.passes
    monkeypatch.undo()
    return {"adv": adv.double(), "token_grads": by_row(token_grads, steps * passes), "grads": grads,
            "after": after, "grad_norm": norms, "stats": stats, "theta0": {n: init_of(init, n) for n in named}}


def init_of(init, name):
    mod, _, which = name.rpartition(".lora_")
    return init[mod][0 if which == "A" else 1].double()


# ---- bounds -------------------------------------------------------------------------------------
def adam_bound(g1, e1, g2=None, e2=None, b1=0.9, b2=0.999, eps=1e-8):
    """Entry-wise bound on how far AdamW's step (lr = 1) moves when its gradients move by e1 (and e2): the
    first-order change of m_hat / (sqrt(v_hat) + eps), capped at the largest possible change (2 per step)."""
    if g2 is None:
        return torch.minimum(2 * e1 / (g1.abs() + eps), torch.full_like(g1, 2.0))
    c1, c2 = 1 - b1 ** 2, 1 - b2 ** 2
    m = (b1 * (1 - b1) * g1 + (1 - b1) * g2) / c1
    v = (b2 * (1 - b2) * g1 ** 2 + (1 - b2) * g2 ** 2) / c2
    s = v.sqrt()
    dm = (b1 * (1 - b1) * e1 + (1 - b1) * e2) / c1
    dv = (b2 * (1 - b2) * 2 * g1.abs() * e1 + (1 - b2) * 2 * g2.abs() * e2) / c2
    ds = dv / (2 * s.clamp(min=eps))
    return torch.minimum(dm / (s + eps) + m.abs() * ds / (s + eps) ** 2, torch.full_like(g1, 2.0))


def flat(d):
    return torch.cat([v.flatten() for _, v in sorted(d.items())])
