"""Run configuration: typed, frozen dataclasses loaded from TOML recipes.

A recipe is a TOML file whose tables are the sections below; every key is optional (the defaults
are the seed's settings) and an unknown key or a bad value is an error that names the key and
what is allowed. `--set section.key=value` overrides are parsed as TOML values
("loss.kind=dapo", "rollout.group_size=8", "advantages.floor=-inf"). The resolved config is
saved with every run (config.toml), so a run can be repeated and resumed from its own folder.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import tomllib
import typing
import warnings
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from fasttrain.tasks import signal as signal_task

__all__ = ["ConfigError", "Config", "load_config", "load_recipe", "recipe_path", "list_recipes",
           "apply_overrides", "config_to_toml", "config_hash", "SEED_PRIORITIES", "RESUME_CHANGEABLE",
           "resume_changes", "saved_run_data"]


class ConfigError(ValueError):
    """A recipe or override is wrong; the message names the key and what is allowed."""


# What a chat-template variable may be: a TOML scalar.
TemplateValue = typing.Union[bool, int, float, str]
_TEMPLATE_VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# The default task's settings live with the task (fasttrain.tasks.signal); the old name stays for a release.
SEED_PRIORITIES = signal_task.PRIORITIES


@dataclass(frozen=True)
class RunSection:
    name: str = "run"                       # shows in the run id and the ladder table
    seed: int = 42
    steps: int = 600                        # optimizer steps (one rollout batch each)
    out: str = "runs"                       # runs/<run-id>/ goes under this folder
    device: Literal["auto", "cpu", "cuda"] = "auto"
    checkpoint_every: int = 0               # 0: at every probe and at the end
    threads: int = 0                        # torch CPU threads; 0 = torch's default
    kernels: Literal["fused", "reference"] = "fused"  # "reference": plain-PyTorch ops (fasttrain.ops.reference)
    dist_timeout: float = 1800.0            # torchrun ranks: seconds a rank waits in a collective
                                            # for the others before it stops (one died or hangs)
    # experiment trackers fed every metrics line: any of "tensorboard", "wandb", "mlflow", "trackio"
    report_to: tuple[str, ...] = ()
    stop_timeout: float = 60.0              # after SIGTERM/SIGUSR1: seconds to reach a safe point and
                                            # checkpoint, else leave (the last checkpoint stands)
    # What the run does with `fasttrain plan`'s picks (rollout and probe waves and prefill chunks,
    # the micro-batch, fasttrain.plan.picks): "apply" uses them and refuses, before the model
    # loads, a recipe that fits at no wave size; "warn" keeps the recipe's sizes and only warns.
    plan: Literal["apply", "warn"] = "apply"


@dataclass(frozen=True)
class PolicySection:
    model: str = "smollm2-135m"             # fasttrain.models.load_policy spec, or "module:factory"
    dtype: Literal["bfloat16", "float32", "float16"] = "bfloat16"
    # The frozen base under the adapters: "nf4" (4-bit NormalFloat, QLoRA) or "none" (the model's
    # own 16-bit weights, `dtype`; LoRA/DoRA as PEFT trains them on a 16-bit model).
    quantize: Literal["nf4", "none"] = "nf4"
    adapter: Literal["lora", "dora"] = "lora"
    rank: int = 32
    alpha: float = 64.0
    rslora: bool = False
    targets: tuple[str, ...] = ()           # () = the 7 attention/MLP projections
    # true (the default) / false; "auto": off when the plan (fasttrain.plan) fits the update at the
    # recipe's micro-batch without it, else on (a model the plan cannot read keeps it on). Off skips
    # the recompute forward and holds every layer's activations instead: on SmolLM2 at the study's
    # shape that measured 14% off the update's passes, 4% off the step, for 59% more peak memory
    # (bench/results/cpu-2c-Intel-Xeon-amx-2026-12-03-profile-update.md), so it is not the default.
    gradient_checkpointing: Literal["auto", True, False] = True
    attention: Literal["auto", "sdpa", "eager", "flash_attention_2"] = "auto"  # auto: flash-attn 2 on CUDA if installed
    liger: bool = False                     # Liger-Kernel RMSNorm/SwiGLU/RoPE on the policy (CUDA, fasttrain[gpu])
    # Variables every prompt's chat template is rendered with, e.g. { enable_thinking = false }
    # (Qwen3's switch); a variable the model's template does not mention is ignored.
    chat_template_kwargs: dict[str, TemplateValue] = field(default_factory=dict)


@dataclass(frozen=True)
class EnvSection:
    name: str = signal_task.ENV_NAME        # fasttrain.tasks.load_env spec
    prompts: str = ""                       # a prompt selection written by `fasttrain filter`
    train_slice: str = "train"              # data slice for training rewards and the selector
    holdout_slice: str = "holdout"          # later slice, verifies the shipped checkpoint
    # name = "dataset" (fasttrain.envs.dataset): a prompt dataset scored by reward functions with
    # TRL's signature, one GDPO channel each. Relative paths: next to the recipe file first.
    dataset: str = ""                       # JSONL, Parquet, CSV, or a `save_to_disk` folder
    rewards: tuple[str, ...] = ()           # "module:function" or "path/file.py:function"
    probe_dataset: str = ""                 # the probe's own prompts ...
    probe_rows: int = 0                     # ... or the last N rows of `dataset`, never trained on
    system_prompt: str = ""                 # prepended to prompts that have no system message
    reward_timeout: float = 30.0            # seconds per reward call; past it the answers are invalid
    core: str = ""                          # reward for the floor guard, probe, selection; "" = first
    worker_memory_mb: float = 0.0           # a reward worker (and its processes) past this resident
                                            # memory is killed, its answers invalid; 0 = a quarter of RAM
    skip_bad_rows: bool = False             # leave out rows that are not UTF-8, lack a column a reward
                                            # needs or render too long (counted in the report), not stop
    # Tools and environment classes as TRL's GRPOTrainer takes them (fasttrain.envs.tools): answers
    # become multi-turn (model turn, tool results, model turn, ...).
    tools: tuple[str, ...] = ()             # "module:function" or "path/file.py:function"
    environment: str = ""                   # "module:Class" with reset(**row), tools as methods
    tool_timeout: float = 10.0              # seconds per tool call; past it the call is an error
    # name = "reasoning-gym" (fasttrain.envs.reasoning_gym): reasoning-gym's generators, each a
    # table of its weight and its own config's settings: [env.generators.gcd] weight = 1.0
    generators: dict[str, dict[str, Any]] = field(default_factory=dict)
    train_rows: int = 1000                  # train rows over the mixture (probe: env.probe_rows, 0 = 100)
    data_seed: int = 0                      # the generators' rows are a pure function of this seed
    curriculum: bool = False                # reasoning-gym's curricula, the level moved by ...
    curriculum_window: int = 8              # ... the mean score of this many steps' answers:
    curriculum_upper: float = 0.75          # up one level at or above this
    curriculum_lower: float = 0.25          # down one level below this

    def load_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for fasttrain.tasks.load_env(name, ...)."""
        if self.name == "reasoning-gym":
            return {"generators": {k: dict(v) for k, v in self.generators.items()}, "train_rows": self.train_rows,
                    "probe_rows": self.probe_rows, "data_seed": self.data_seed, "curriculum": self.curriculum,
                    "curriculum_window": self.curriculum_window, "curriculum_upper": self.curriculum_upper,
                    "curriculum_lower": self.curriculum_lower}
        if self.name != "dataset":
            return {}
        return {"dataset": self.dataset, "rewards": list(self.rewards), "probe_dataset": self.probe_dataset,
                "probe_rows": self.probe_rows, "system_prompt": self.system_prompt,
                "reward_timeout": self.reward_timeout, "core": self.core, "worker_memory_mb": self.worker_memory_mb,
                "skip_bad_rows": self.skip_bad_rows, "tools": list(self.tools), "environment": self.environment,
                "tool_timeout": self.tool_timeout}


@dataclass(frozen=True)
class RolloutSection:
    prompts_per_step: int = 4
    group_size: int = 12                    # answers per prompt (G)
    max_new_tokens: int = 128
    temperature: float = 1.0
    # Truncated sampling with TRL's / transformers' names and meanings, applied in transformers'
    # order (temperature, top_k, top_p, min_p); each sampled token's kept set is recorded and the
    # update scores it on that set (fasttrain.rollout.sampling). Off: top_k 0, top_p 1, min_p 0.
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    # false: score and train on the whole vocabulary while sampling from the kept set (TRL's way; for
    # comparisons: the importance ratio then measures the kept mass)
    replay_kept_set: bool = True
    # Text prefilled at the start of every answer (e.g. "<signal>"): part of the prompt, not
    # trained on, prepended to the answer the verifier scores. Also used by the probe and filter.
    answer_prefix: str = ""
    # An answer also ends once its text contains one of these (e.g. "</signal>"): the verifier
    # reads nothing after it, so neither sampling nor the update pays for trailing chatter.
    stop_strings: tuple[str, ...] = ()
    # Longest rendered prompt (chat template, system prompt, answer prefix): a longer one is an
    # error naming its row before training starts (or skipped: env.skip_bad_rows). 0 = the model's
    # context (max_position_embeddings) minus max_new_tokens.
    max_prompt_tokens: int = 0
    # The weights the rollout decodes from: "nf4" (the training layers), "dequantized" (a dense
    # merged copy in the model's dtype, 2 bytes per weight more, refreshed after each optimizer
    # step), "auto" (dequantized when that copy takes at most a quarter of the free memory).
    base_weights: Literal["auto", "nf4", "dequantized"] = "auto"
    # The decode step through torch.compile (CPU: inductor; CUDA: mode "reduce-overhead", CUDA
    # graphs over the static cache). Compile time is paid once per run (and per new batch shape).
    # Off by default: on a CPU the eager step (packed weights, fasttrain's decode attention and fused
    # elementwise ops) measured 0.66x the compiled one's time at SmolLM2's rollout shape, and the
    # compile costs seconds to minutes (bench/results, decode-fused); unmeasured on a GPU so far.
    compile: bool = False
    # Tool-calling rounds per answer (TRL's max_tool_calling_iterations); 0: no limit but the
    # budget, max_new_tokens, which the model's and the tools' tokens fill together.
    max_tool_calls: int = 0
    # Waves: prompts whose G answers decode at once (the next wave starts when they have all
    # ended) and prompts prefilled at once within a wave. 0: `fasttrain plan`'s pick, the most that
    # fit the device with every answer at max_new_tokens (fasttrain.plan.picks).
    wave_prompts: int = 0
    prefill_prompts: int = 0
    # DAPO's dynamic sampling (fasttrain.train.dynamic_sampling): groups whose answers all get a
    # zero advantage are dropped and more prompts are sampled, up to dynamic_max_rounds extra
    # generation rounds per step; past that the step trains on what it has. Off by default: on a CPU
    # its extra answers cost about what it gains per second (docs/your-task.md, bench/bench_signal.py).
    dynamic_sampling: bool = False
    dynamic_max_rounds: int = 3


@dataclass(frozen=True)
class AdvantagesSection:
    priorities: dict[str, float] = field(default_factory=lambda: dict(signal_task.PRIORITIES))
    batch_normalize: bool = True            # GDPO's batch-level standardisation
    guard: Literal["projection", "legacy_clamp", "none"] = "projection"
    floor: float = 0.0                      # core <= floor is guarded; -inf turns the floor off
    guard_invalid: bool = True              # invalid answers are always guarded
    warn_share: float = 0.5                 # warn when the non-zero-advantage share stays below
    warn_steps: int = 10                    # ... this many steps in a row


@dataclass(frozen=True)
class LossSection:
    kind: Literal["cispo", "dapo", "grpo"] = "cispo"
    beta: float = 0.08                      # weight of the KL term to the base model (adapters off)
    eps_low: float = 0.2
    eps_high: float = 0.28
    cispo_cap: float = 1.2
    token_mask: Literal["all", "top_entropy"] = "top_entropy"
    rho: float = 0.2                        # share of answer tokens kept by the entropy mask
    passes: int = 1                         # optimizer passes over each rollout batch
    repo_r: bool = False                    # REPO-R token rescaling with the entropy thermostat
    zeta_min: float = 1e-4
    zeta_max: float = 0.05
    thermostat_warmup: int = 5
    # TRL GRPOTrainer's conventions, each a named difference from the recipe (docs/trl.md):
    # normalize "batch": the loss is the masked sum over the batch's loss tokens (the entropy mask's
    # when token_mask = "top_entropy") divided by their count (GRPO: by the batch's sequences), and
    # KL is charged on the loss tokens; "trl": as TRL's GRPOTrainer, every sampled token counts in the
    # denominator and pays the KL term, the entropy mask only zeroes the policy term, and GRPO's row
    # means are averaged per micro-batch, then over the micro-batches.
    normalize: Literal["batch", "trl"] = "batch"
    # The KL estimator, computed inside the loss op (docs/recipes.md derives both), with k3 =
    # e^(ref - log p) - (ref - log p) - 1. "k3_ratio": beta * r * k3, the ratio r = exp(log p - old log p)
    # kept in the graph; its gradient is the unbiased estimate of grad KL(pi || pi_ref), on- and
    # off-policy (DeepSeek-V3.2 §3.1; TRL's use_bias_correction_kl, its default). "k3": beta * k3 as
    # the loss: the forward KL's gradient on-policy, neither KL's off-policy (the older recipe's).
    kl: Literal["k3_ratio", "k3"] = "k3_ratio"
    # Deprecated name of `kl`: true is "k3_ratio", false "k3". Not a field: it sets `kl` (with a
    # FutureWarning) and is never written to a run's config.toml.
    kl_bias_correction: dataclasses.InitVar[bool | None] = None

    def __post_init__(self, kl_bias_correction: bool | None) -> None:
        if kl_bias_correction is not None:
            object.__setattr__(self, "kl", _kl_from_alias(kl_bias_correction))


@dataclass(frozen=True)
class OptimSection:
    lr: float = 1e-5
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    grad_clip: float = 1.0                  # max global gradient norm; 0 turns clipping off
    micro_batch: int = 8                    # answers per forward/backward
    max_skipped_steps: int = 3              # non-finite losses in a row (updates skipped) before the run stops


@dataclass(frozen=True)
class ProbeSection:
    every: int = 100                        # steps between probes (and at the end); 0 = only at the end
    prompts: int = 50                       # first N of the environment's frozen probe prompts
    samples: int = 1                        # answers per probe prompt
    temperature: float = 1.0
    top_k: int = 0                          # truncation of the probe's draw, as rollout.top_k ...
    top_p: float = 1.0
    min_p: float = 0.0
    max_new_tokens: int = 0                 # 0 = rollout.max_new_tokens
    seed: int = 1234                        # the same seed at every probe: scores compare policies
    wave_prompts: int = 0                   # as rollout.wave_prompts, for the probe (0: the plan's pick)
    prefill_prompts: int = 0                # as rollout.prefill_prompts (0: the plan's pick)


@dataclass(frozen=True)
class FilterSection:
    samples: int = 8                        # answers per prompt to estimate its success rate
    min_keep: int = 32                      # keep at least this many (closest to break-even)
    max_prompts: int = 0                    # 0 = every train prompt
    out: str = ""                           # default: <out>/filter-<recipe>.json


@dataclass(frozen=True)
class MoESection:
    """Mixture-of-experts policies (qwen3_moe, qwen3_5_moe); dense models ignore it (docs/models.md)."""
    # "rollout": the update's policy forwards force the experts the rollout chose for each token,
    # their weights from the update's own router (the R3 routing replay); "off": it routes by itself
    routing_replay: Literal["rollout", "off"] = "rollout"
    # the router stays frozen: in RL its choices drift between the rollout and the update, and a
    # trained router moves them further; true trains its [E, H] weight (full rank, fp32 master)
    train_router: bool = False
    # the load-balancing auxiliary loss is off: added to an RL loss it grew the gradient norm about
    # tenfold in published Qwen3.5-MoE GRPO runs (at 0.001) and reaches the adapters through the hidden
    # states; > 0 adds coef x transformers' load_balancing_loss_func of the update's forward
    router_aux_loss_coef: float = 0.0


@dataclass(frozen=True)
class Config:
    run: RunSection = field(default_factory=RunSection)
    policy: PolicySection = field(default_factory=PolicySection)
    env: EnvSection = field(default_factory=EnvSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    advantages: AdvantagesSection = field(default_factory=AdvantagesSection)
    loss: LossSection = field(default_factory=LossSection)
    optim: OptimSection = field(default_factory=OptimSection)
    probe: ProbeSection = field(default_factory=ProbeSection)
    filter: FilterSection = field(default_factory=FilterSection)
    moe: MoESection = field(default_factory=MoESection)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {f.name: _section_dict(getattr(self, f.name)) for f in dataclasses.fields(self)}


# Value checks beyond the type: key -> (predicate, what is allowed).
_RULES: dict[str, tuple[typing.Callable[[Any], bool], str]] = {
    "run.steps": (lambda v: v >= 1, "an integer >= 1"),
    "run.checkpoint_every": (lambda v: v >= 0, "an integer >= 0"),
    "run.threads": (lambda v: v >= 0, "an integer >= 0"),
    "run.dist_timeout": (lambda v: v > 0, "a number of seconds > 0"),
    "run.stop_timeout": (lambda v: v > 0, "a number of seconds > 0"),
    "run.report_to": (lambda v: all(x in ("tensorboard", "wandb", "mlflow", "trackio") for x in v)
                      and len(set(v)) == len(v),
                      'a list of distinct tracker names among "tensorboard", "wandb", "mlflow", "trackio"'),
    "policy.rank": (lambda v: v >= 1, "an integer >= 1"),
    "policy.alpha": (lambda v: v > 0, "a number > 0"),
    "rollout.prompts_per_step": (lambda v: v >= 1, "an integer >= 1"),
    "rollout.group_size": (lambda v: v >= 2, "an integer >= 2 (GDPO needs a group)"),
    "rollout.max_new_tokens": (lambda v: v >= 1, "an integer >= 1"),
    "rollout.max_prompt_tokens": (lambda v: v >= 0, "an integer >= 0 (0: the model's context minus max_new_tokens)"),
    "rollout.temperature": (lambda v: v > 0, "a number > 0"),
    "rollout.top_k": (lambda v: v >= 0, "an integer >= 0 (0: off)"),
    "rollout.top_p": (lambda v: 0 < v <= 1, "a number in (0, 1] (1: off)"),
    "rollout.min_p": (lambda v: 0 <= v < 1, "a number in [0, 1) (0: off)"),
    "probe.top_k": (lambda v: v >= 0, "an integer >= 0 (0: off)"),
    "probe.top_p": (lambda v: 0 < v <= 1, "a number in (0, 1] (1: off)"),
    "probe.min_p": (lambda v: 0 <= v < 1, "a number in [0, 1) (0: off)"),
    "rollout.stop_strings": (lambda v: all(len(x) > 0 for x in v), "a list of non-empty strings"),
    "env.probe_rows": (lambda v: v >= 0, "an integer >= 0"),
    "env.reward_timeout": (lambda v: 0 < v < math.inf, "a number of seconds > 0"),
    "env.worker_memory_mb": (lambda v: v == 0 or 64 <= v < math.inf, "0 (a quarter of the host's memory) or a number of MB >= 64"),
    "env.tool_timeout": (lambda v: 0 < v < math.inf, "a number of seconds > 0"),
    "env.train_rows": (lambda v: v >= 1, "an integer >= 1"),
    "env.curriculum_window": (lambda v: v >= 1, "an integer >= 1"),
    "env.curriculum_upper": (lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "env.curriculum_lower": (lambda v: 0 <= v < 1, "a number in [0, 1)"),
    "rollout.dynamic_max_rounds": (lambda v: v >= 0, "an integer >= 0"),
    "rollout.max_tool_calls": (lambda v: v >= 0, "an integer >= 0 (0: no limit but max_new_tokens)"),
    "rollout.wave_prompts": (lambda v: v >= 0, "an integer >= 0 (0: the plan picks)"),
    "rollout.prefill_prompts": (lambda v: v >= 0, "an integer >= 0 (0: the plan picks)"),
    "probe.wave_prompts": (lambda v: v >= 0, "an integer >= 0 (0: the plan picks)"),
    "probe.prefill_prompts": (lambda v: v >= 0, "an integer >= 0 (0: the plan picks)"),
    "advantages.floor": (lambda v: not math.isnan(v) and v != math.inf, "a number or -inf"),
    "advantages.warn_share": (lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    "advantages.warn_steps": (lambda v: v >= 1, "an integer >= 1"),
    "loss.beta": (lambda v: v >= 0, "a number >= 0"),
    "loss.eps_low": (lambda v: 0 <= v < 1, "a number in [0, 1)"),
    "loss.eps_high": (lambda v: v >= 0, "a number >= 0"),
    "loss.cispo_cap": (lambda v: v > 0, "a number > 0"),
    "loss.rho": (lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "loss.passes": (lambda v: v >= 1, "an integer >= 1"),
    "loss.zeta_min": (lambda v: v > 0, "a number > 0"),
    "loss.zeta_max": (lambda v: v > 0, "a number > 0"),
    "loss.thermostat_warmup": (lambda v: v >= 1, "an integer >= 1"),
    "optim.lr": (lambda v: v > 0, "a number > 0"),
    "optim.weight_decay": (lambda v: v >= 0, "a number >= 0"),
    "optim.beta1": (lambda v: 0 <= v < 1, "a number in [0, 1)"),
    "optim.beta2": (lambda v: 0 <= v < 1, "a number in [0, 1)"),
    "optim.eps": (lambda v: v > 0, "a number > 0"),
    "optim.grad_clip": (lambda v: v >= 0, "a number >= 0"),
    "optim.micro_batch": (lambda v: v >= 1, "an integer >= 1"),
    "optim.max_skipped_steps": (lambda v: v >= 1, "an integer >= 1"),
    "probe.every": (lambda v: v >= 0, "an integer >= 0"),
    "probe.prompts": (lambda v: v >= 1, "an integer >= 1"),
    "probe.samples": (lambda v: v >= 1, "an integer >= 1"),
    "probe.temperature": (lambda v: v > 0, "a number > 0"),
    "probe.max_new_tokens": (lambda v: v >= 0, "an integer >= 0"),
    "filter.samples": (lambda v: v >= 1, "an integer >= 1"),
    "filter.min_keep": (lambda v: v >= 1, "an integer >= 1"),
    "filter.max_prompts": (lambda v: v >= 0, "an integer >= 0"),
    "moe.router_aux_loss_coef": (lambda v: v >= 0, "a number >= 0 (0, the default, leaves the load-balancing "
                                                   "loss out: it hurts RL, see docs/models.md)"),
}


def _section_dict(sec: Any) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(sec):
        v = getattr(sec, f.name)
        out[f.name] = list(v) if isinstance(v, tuple) else (dict(v) if isinstance(v, dict) else v)
    return out


def _coerce(key: str, value: Any, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        # by type as well as value: 1 == True and 0 == False, and neither is a switch's value
        if not any(value == a and type(value) is type(a) for a in allowed):
            raise ConfigError(f"{key}: {value!r} is not allowed; allowed values: "
                              + ", ".join(_literal_text(a) for a in allowed))
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: {value!r} is not allowed; allowed values: true, false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: {value!r} is not an integer")
        return value
    if tp is float:
        if isinstance(value, str) and value.strip().lower() in ("-inf", "inf", "+inf"):
            value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: {value!r} is not a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: {value!r} is not a string")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or not all(isinstance(x, str) for x in value):
            raise ConfigError(f"{key}: {value!r} is not a list of strings")
        return tuple(value)
    if origin is dict and typing.get_args(tp)[1] == TemplateValue:
        return _template_kwargs(key, value)
    if origin is dict and typing.get_args(tp)[1] == dict[str, Any]:
        return _generator_tables(key, value)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: {value!r} is not a table of name = number")
        out = {}
        for k, v in value.items():
            out[str(k)] = _coerce(f"{key}.{k}", v, float)
        return out
    raise ConfigError(f"{key}: unsupported type {tp}")  # pragma: no cover


def _literal_text(a: Any) -> str:
    """An allowed value as a recipe writes it: true/false for booleans, else its repr."""
    return ("true" if a else "false") if isinstance(a, bool) else repr(a)


def _template_kwargs(key: str, value: Any) -> dict[str, TemplateValue]:
    allowed = "a table of name = true/false, number or string (e.g. { enable_thinking = false })"
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: {value!r} is not allowed; allowed: {allowed}")
    for k, v in value.items():
        if not _TEMPLATE_VARIABLE.fullmatch(str(k)):
            raise ConfigError(f"{key}.{k}: not a template variable name; allowed: letters, digits and _, "
                              "not starting with a digit")
        if not isinstance(v, (bool, int, float, str)):
            raise ConfigError(f"{key}.{k}: {v!r} is not allowed; allowed: true, false, a number or a string")
    return {str(k): v for k, v in value.items()}


def _generator_tables(key: str, value: Any) -> dict[str, dict[str, Any]]:
    """env.generators: a table of generator name -> table of TOML scalars or lists of them."""
    allowed = "a table of generator name = { weight = 1.0, setting = value, ... }"
    if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
        raise ConfigError(f"{key}: {value!r} is not allowed; allowed: {allowed}")
    for name, table in value.items():
        for k, v in table.items():
            if not (isinstance(v, (bool, int, float, str)) or
                    (isinstance(v, list) and all(isinstance(x, (bool, int, float, str)) for x in v))):
                raise ConfigError(f"{key}.{name}.{k}: {v!r} is not allowed; allowed: a number, string, "
                                  "true/false or a list of those")
    return {str(n): dict(t) for n, t in value.items()}


def _kl_from_alias(value: Any) -> str:
    """loss.kl of the deprecated loss.kl_bias_correction (said once per place, as a FutureWarning)."""
    kl = "k3_ratio" if _coerce("loss.kl_bias_correction", value, bool) else "k3"
    warnings.warn(f"loss.kl_bias_correction is deprecated: write loss.kl = {json.dumps(kl)} "
                  f"(kl_bias_correction = {_literal_text(value)} means that)", FutureWarning, stacklevel=3)
    return kl


def _loss_alias(given: dict[str, Any]) -> dict[str, Any]:
    """[loss] with kl_bias_correction replaced by the kl it names; both given must agree."""
    if "kl_bias_correction" not in given:
        return given
    given = dict(given)
    kl = _kl_from_alias(given.pop("kl_bias_correction"))
    if "kl" in given and given["kl"] != kl:
        raise ConfigError(f"loss.kl_bias_correction (deprecated) names loss.kl = {json.dumps(kl)}, which "
                          f"contradicts loss.kl = {given['kl']!r}; keep loss.kl alone")
    given["kl"] = kl
    return given


def saved_run_data(saved: dict[str, Any]) -> dict[str, Any]:
    """A run folder's config.toml (parsed) as the run trained: a run saved before loss.kl existed
    holds neither loss.kl nor loss.kl_bias_correction and trained with "k3" (config.toml holds every
    key), so resuming it keeps k3 instead of taking today's default."""
    loss = saved.get("loss")
    if isinstance(loss, dict) and "kl" not in loss and "kl_bias_correction" not in loss:
        return {**saved, "loss": {**loss, "kl": "k3"}}
    return saved


def _build(data: dict[str, Any]) -> Config:
    hints = typing.get_type_hints(Config)
    sections = {}
    for sec_name, sec_val in data.items():
        if sec_name not in hints:
            raise ConfigError(f"unknown section [{sec_name}]; allowed sections: "
                              + ", ".join(f.name for f in dataclasses.fields(Config)))
        if not isinstance(sec_val, dict):
            raise ConfigError(f"[{sec_name}] must be a table, got {sec_val!r}")
    for f in dataclasses.fields(Config):
        cls = hints[f.name]
        sec_hints = {k: t for k, t in typing.get_type_hints(cls).items()
                     if not isinstance(t, dataclasses.InitVar)}        # aliases: handled before
        given = data.get(f.name, {})
        if f.name == "loss":
            given = _loss_alias(given)
        kwargs = {}
        for k, v in given.items():
            if k in _UNREPLAYED_KNOBS and f.name in ("rollout", "probe"):
                raise ConfigError(f"{f.name}.{k} is not supported: it changes the sampled distribution in a way "
                                  "the update does not replay (the update would train on another distribution "
                                  "than the one each token was drawn from); use top_k, top_p or min_p")
            if k not in sec_hints:
                raise ConfigError(f"unknown key '{f.name}.{k}'; allowed keys in [{f.name}]: "
                                  + ", ".join(sec_hints))
            key = f"{f.name}.{k}"
            v = _coerce(key, v, sec_hints[k])
            rule = _RULES.get(key)
            if rule and not rule[0](v):
                raise ConfigError(f"{key}: {v!r} is not allowed; allowed: {rule[1]}")
            kwargs[k] = v
        sections[f.name] = cls(**kwargs)
    cfg = Config(**sections)
    if cfg.env.name != "dataset":
        used = [k for k in _DATASET_KEYS if getattr(cfg.env, k) != getattr(EnvSection, k)
                and not (cfg.env.name == "reasoning-gym" and k == "probe_rows")]
        if used:
            raise ConfigError(f"env.{used[0]} is read only with env.name = \"dataset\" "
                              f"(env.name is {cfg.env.name!r})")
    if cfg.env.name != "reasoning-gym":
        used = [k for k in _RG_KEYS if getattr(cfg.env, k) != EnvSection.__dataclass_fields__[k].default
                and k != "generators"] + (["generators"] if cfg.env.generators else [])
        if used:
            raise ConfigError(f"env.{used[0]} is read only with env.name = \"reasoning-gym\" "
                              f"(env.name is {cfg.env.name!r})")
    elif cfg.env.curriculum_lower >= cfg.env.curriculum_upper:
        raise ConfigError(f"env.curriculum_lower ({cfg.env.curriculum_lower}) must be below env.curriculum_upper "
                          f"({cfg.env.curriculum_upper})")
    if cfg.loss.zeta_min > cfg.loss.zeta_max:
        raise ConfigError(f"loss.zeta_min ({cfg.loss.zeta_min}) must be <= loss.zeta_max ({cfg.loss.zeta_max})")
    return cfg


_RG_KEYS = ("generators", "train_rows", "data_seed", "curriculum", "curriculum_window", "curriculum_upper",
            "curriculum_lower")
# Sampling knobs of TRL / transformers that fasttrain refuses by name, with the reason.
_UNREPLAYED_KNOBS = ("repetition_penalty", "presence_penalty")

_DATASET_KEYS = ("dataset", "rewards", "probe_dataset", "probe_rows", "system_prompt", "reward_timeout", "core",
                 "worker_memory_mb", "tools", "environment", "tool_timeout")


def _near_recipe(data: dict[str, Any], folder: Path) -> dict[str, Any]:
    """[env] paths of a recipe file, relative to its folder when they exist there (else as given:
    relative to the current folder), so `fasttrain run NAME/recipe.toml` works from anywhere."""
    env = data.get("env")
    if not isinstance(env, dict):
        return data

    def near(p: Any) -> Any:
        if isinstance(p, str) and p and not Path(p).is_absolute() and (folder / p).exists():
            return str((folder / p).resolve())
        return p

    env = dict(env)
    for key in ("dataset", "probe_dataset"):
        if key in env:
            env[key] = near(env[key])
    def near_spec(spec: Any) -> Any:
        file, sep, fn = spec.rpartition(":") if isinstance(spec, str) else ("", "", "")
        return f"{near(file)}:{fn}" if sep and file.endswith(".py") else spec

    for key in ("rewards", "tools"):
        if isinstance(env.get(key), list):
            env[key] = [near_spec(spec) for spec in env[key]]
    if "environment" in env:
        env["environment"] = near_spec(env["environment"])
    return {**data, "env": env}


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text                          # a bare word: a string ("loss.kind=dapo")


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `section.key=value` overrides to raw recipe data (a new dict is returned)."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        path, text = item.split("=", 1)
        parts = path.strip().split(".")
        if len(parts) < 2:
            raise ConfigError(f"override {item!r}: key must be section.key (e.g. loss.kind)")
        sec, key = parts[0], parts[1]
        value = _parse_value(text.strip())
        table = out.setdefault(sec, {})
        if not isinstance(table, dict):
            raise ConfigError(f"override {item!r}: [{sec}] is not a table")
        if len(parts) == 3:                  # advantages.priorities.core=2.0
            sub = dict(table.get(key, {}) or {})
            if key == "priorities" and not sub:
                sub = dict(signal_task.PRIORITIES)
            sub[parts[2]] = value
            table[key] = sub
        elif len(parts) == 2:
            table[key] = value
            if sec == "loss" and key in ("kl", "kl_bias_correction"):   # one setting, two names: the later wins
                table.pop("kl_bias_correction" if key == "kl" else "kl", None)
        else:
            raise ConfigError(f"override {item!r}: too many dots")
    return out


def recipe_path(name_or_path: str) -> Path:
    """A recipe by file path, or by name among the bundled recipes (fasttrain/recipes/*.toml)."""
    p = Path(name_or_path)
    if p.suffix == ".toml" and p.exists():
        return p
    bundled = resources.files("fasttrain.recipes") / f"{p.stem if p.suffix == '.toml' else name_or_path}.toml"
    if bundled.is_file():
        return Path(str(bundled))
    raise ConfigError(f"recipe {name_or_path!r} not found; bundled recipes: {', '.join(list_recipes())}")


def list_recipes() -> list[str]:
    return sorted(Path(str(p)).stem for p in resources.files("fasttrain.recipes").iterdir()
                  if str(p).endswith(".toml"))


def load_recipe(name_or_path: str) -> dict[str, Any]:
    path = recipe_path(name_or_path)
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None


def load_config(recipe: str | dict[str, Any] = "demo", overrides: list[str] | None = None) -> Config:
    data = _near_recipe(load_recipe(recipe), recipe_path(recipe).parent) if isinstance(recipe, str) else recipe
    return _build(apply_overrides(data, list(overrides or [])))


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {v!r} as TOML")


def config_to_toml(cfg: Config) -> str:
    lines = ["# fasttrain resolved config (every key, defaults included)"]
    for sec, vals in cfg.to_dict().items():
        lines.append(f"\n[{sec}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in vals.items()]
    return "\n".join(lines) + "\n"


def config_hash(cfg: Config) -> str:
    return hashlib.sha256(config_to_toml(cfg).encode()).hexdigest()[:8]


# Settings `--resume RUN --set key=value` may change: they steer the rest of the run without
# making its past steps another run's (cadence, length, learning rate, where metrics go). Every
# other key is the run's identity; changing it mid-run would make a run no recipe describes.
RESUME_CHANGEABLE = ("run.steps", "run.checkpoint_every", "run.report_to", "run.threads", "run.dist_timeout",
                     "run.stop_timeout", "optim.lr", "optim.max_skipped_steps", "probe.every",
                     "env.reward_timeout", "env.worker_memory_mb")


def resume_changes(saved: Config, new: Config) -> dict[str, tuple[Any, Any]]:
    """{key: (saved value, new value)} of what the overrides change; ConfigError naming every
    key that a resumed run may not change."""
    old_d, new_d = saved.to_dict(), new.to_dict()
    changed = {f"{sec}.{k}": (v, new_d[sec][k]) for sec, vals in old_d.items() for k, v in vals.items()
               if new_d[sec][k] != v}
    refused = [k for k in changed if k not in RESUME_CHANGEABLE]
    if refused:
        raise ConfigError(f"--resume: {', '.join(f'{k} ({changed[k][0]!r} -> {changed[k][1]!r})' for k in refused)} "
                          f"cannot change in the middle of a run (the steps so far were trained with the saved "
                          f"value); a resumed run may change {', '.join(RESUME_CHANGEABLE)}. Start a new run "
                          f"to change the others.")
    return changed
