"""Preflight: what a run checks before its first step, and `fasttrain run --dry-run`, which runs
those checks alone.

Before any weight is read: the channel priorities against the environment's channels, the prompt
selection (env.prompts), and the plan from the model's config.json (memory and time on paper, on
the meta device); with run.plan = "apply" a recipe that fits at no wave size is refused there.
Once the weights are in: the plan again from the loaded model's config, its one line printed, its
picks applied (run.plan = "apply") or a warning when it will not fit (run.plan = "warn"), and
policy.gradient_checkpointing = "auto" resolved.

The dry run resolves the recipe and the overrides (an unknown key or a bad value is the same error
a run gives), builds the environment (the dataset is read, each reward function is imported in its
worker process and called once on an empty answer of the first train prompt), makes the checks
above as the trainer does, and prints the run's shape and the plan's one line. What it is not: a
run. No weights are read, no run folder is written, nothing is trained.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from fasttrain.tasks import signal as signal_task
from fasttrain.train import distributed
from fasttrain.train.config import Config, ConfigError

__all__ = ["check_channels", "select_train_prompts", "plan_before_load", "refuse_unfit", "plan_after_load",
           "resolve_checkpointing", "dry_run"]


# ---- the recipe against the environment -------------------------------------------------------
def check_channels(cfg: Config, env) -> tuple[list[str], torch.Tensor]:
    """(the environment's channel names, their priorities as float64 weights); ConfigError for a
    priority that names no channel."""
    names = [c.name for c in env.channels]
    unknown = [k for k in cfg.advantages.priorities if k not in names]
    if unknown:
        # An error for every environment. The one exception is the untouched default, the seed's
        # priorities (written for the signal channels): another environment keeps its own there.
        default = cfg.advantages.priorities == signal_task.PRIORITIES
        if cfg.env.name.startswith("signal") or not default:
            raise ConfigError(f"advantages.priorities: unknown channel(s) {unknown}; the channels of "
                              f"{env.name} are {', '.join(names)} (or set advantages.priorities = {{}} "
                              f"to use the environment's own priorities)")
    weights = torch.tensor([cfg.advantages.priorities.get(c.name, c.priority) for c in env.channels],
                           dtype=torch.float64)
    return names, weights


def select_train_prompts(cfg: Config, env):
    """The environment's train prompts, or those of the selection file env.prompts, in its order."""
    prompts = env.prompts("train")
    sel = cfg.env.prompts
    if sel:
        path = Path(sel)
        if not path.exists():
            raise ConfigError(f"env.prompts: selection file {sel!r} does not exist; "
                              "write it with `fasttrain filter RECIPE`")
        keep = json.loads(path.read_text())["prompt_ids"]
        by_id = {p.id: p for p in prompts}
        missing = [k for k in keep if k not in by_id]
        if missing:
            raise ConfigError(f"env.prompts: {len(missing)} prompt ids of {sel} are not in {env.name}")
        prompts = [by_id[k] for k in keep]
    if not prompts:
        raise ConfigError(f"env.name: {env.name} has no train prompts")
    return prompts


# ---- the plan -----------------------------------------------------------------------------------
def plan_before_load(cfg: Config, env, prompts, device, world: int = 1):
    """The plan of the recipe's model from its config.json alone (no weights read), or None for a
    model factory or a model whose config is not found; the prompt tokens (of the first 64 train
    prompts) are counted by the model's tokenizer when one is on disk, else 4 characters are taken
    as a token (the plan's `prompt_estimated` attribute says which)."""
    from fasttrain.plan import model_config
    from fasttrain.plan.report import plan_run

    spec = cfg.policy.model
    if ":" in spec and not Path(spec).exists():
        return None
    try:
        config = model_config(_config_spec(spec))
    except (FileNotFoundError, ValueError):
        return None
    tok = _tokenizer_without_weights(spec)
    if tok is not None:
        from fasttrain.train.answers import prompt_token_ids
        n = max(len(i) for i in prompt_token_ids(tok, env, prompts[:64], cfg.rollout.answer_prefix))
    else:
        n = max(len(p.spec) for p in prompts[:64]) // 4 + 32
    p = plan_run(cfg, config, n, device, world=world)
    p.prompt_estimated = tok is None
    return p


def refuse_unfit(cfg: Config, p) -> None:
    """ConfigError naming what to change when the plan's picks fit at no size (run.plan = "apply")."""
    if p is not None and p.picks is not None and not p.picks.fits:
        raise ConfigError(f"{cfg.policy.model} on {p.gpu.title}: " + "; ".join(p.picks.blocked)
                          + " (run.plan = \"warn\" runs it anyway)")


def plan_after_load(cfg: Config, tokenizer, env, prompts, model_config, device, world: int = 1):
    """(the plan or None, its one line, whether it fits) from the loaded model's config and the
    longest of the first 16 train prompts; a plan that cannot be made is said in the line (the plan
    informs, it never stops a run)."""
    from fasttrain.plan.report import plan_run, summary_line
    from fasttrain.train.answers import prompt_token_ids
    try:
        ids = prompt_token_ids(tokenizer, env, prompts[:16], cfg.rollout.answer_prefix)
        p = plan_run(cfg, model_config, max(len(i) for i in ids), device, world=world)
        return p, summary_line(p), p.fits
    except Exception as e:  # the plan informs; it never stops a run
        return None, f"plan: not available ({type(e).__name__}: {e})", True


def resolve_checkpointing(cfg: Config, model, p) -> str | None:
    """policy.gradient_checkpointing = "auto": the plan's pick (off when the update fits at the
    picked micro-batch without it); on, as built, when there is no plan. Returns the line that says
    which and why (None when the recipe fixes it)."""
    from fasttrain.train.policy import set_checkpointing
    if cfg.policy.gradient_checkpointing != "auto":
        return None
    on = p is None or bool(p.shape.gradient_checkpointing)
    set_checkpointing(model, on)
    why = "no plan for this model" if p is None else \
        "the plan fits the update without it" if not on else "the update does not fit without it"
    return f"gradient checkpointing: {'on' if on else 'off'} (auto: {why})"


# ---- the dry run --------------------------------------------------------------------------------
def dry_run(cfg: Config) -> list[str]:
    """The lines to print; raises ConfigError / FileNotFoundError as a run would."""
    from fasttrain.train.environment import load_run_env
    from fasttrain.train.policy import pick_device

    # the trainer's own order of checks up to its first weight (fasttrain.train.trainer.Trainer)
    distributed.init_from_env(cfg.run.dist_timeout)
    distributed.check_prompts_per_step(cfg.rollout.prompts_per_step)
    env = load_run_env(cfg)
    device = pick_device(cfg.run.device)
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    names, weights = check_channels(cfg, env)
    train = select_train_prompts(cfg, env)
    probe = env.prompts("probe")[: cfg.probe.prompts]
    try:
        R, L, P = cfg.rollout, cfg.loss, cfg.policy
        lines = [
            f"recipe resolved: run {cfg.run.name!r}, seed {cfg.run.seed}, {cfg.run.steps} steps, device {cfg.run.device}",
            f"policy: {P.model} ({P.dtype}, base {P.quantize}), {P.adapter} rank {P.rank} alpha {P.alpha:g}",
            f"environment: {env.name}: {len(train)} train prompts, "
            f"{len(probe)} probe prompts; channels "
            + ", ".join(f"{n} (x{w:g})" for n, w in zip(names, weights.tolist())),
            f"step: {R.prompts_per_step} prompts x {R.group_size} answers, <= {R.max_new_tokens} new tokens, "
            f"temperature {R.temperature:g}; loss {L.kind}, {L.passes} pass(es), beta {L.beta:g}, "
            f"{L.token_mask} tokens{', REPO-R' if L.repo_r else ''}; lr {cfg.optim.lr:g}",
            _reward_check(cfg, env, train[0]),
            _plan_line(cfg, env, train, device),
            "dry run: no weights loaded, nothing written",
        ]
    finally:
        close = getattr(env, "close", None)
        if close:
            close()
    return lines


def _reward_check(cfg: Config, env, p) -> str:
    """Score one empty answer of the first train prompt: a reward function that cannot be called
    (wrong signature, missing column) shows its reason here instead of at step 1."""
    from fasttrain.train.answers import score_answers
    (s,) = score_answers(env, [p], [cfg.rollout.answer_prefix], "train", record=False,
                         completion_ids=[[]])            # an empty answer: no tokens
    verdict = "scored" if s.valid else f"invalid ({s.reason})"
    return f"reward check on an empty answer to {p.id}: {verdict}; " + \
        ", ".join(f"{k} {v:+.3g}" for k, v in s.channels.items())


def _plan_line(cfg: Config, env, prompts, device) -> str:
    """The plan's summary for the recipe's model; its tokenizer counts the prompt tokens when one
    is on disk (no weights are read), else 4 characters are taken as a token."""
    from fasttrain.plan.report import summary_line

    spec = cfg.policy.model
    if ":" in spec and not Path(spec).exists():
        return f"plan: not available for a model factory ({spec}); `fasttrain plan --model config.json` plans it"
    try:
        p = plan_before_load(cfg, env, prompts, device)
        if p is None:
            from fasttrain.plan import model_config
            model_config(_config_spec(spec))          # the error that says why
            return "plan: not available"
        how = "tokens estimated at 4 characters each" if p.prompt_estimated else "tokens counted"
        return f"{summary_line(p)} (longest prompt {p.shape.prompt_tokens} {how})"
    except (FileNotFoundError, ValueError) as e:
        return f"plan: not available ({e})"


def _config_spec(spec: str) -> str:
    return "smollm2-135m" if spec in ("", "default", "smollm2-135m") else spec


def _tokenizer_without_weights(spec: str):
    """The tokenizer of a model folder, or of the bundled model once converted; None otherwise."""
    from fasttrain.models import BUNDLED_NAME
    folder = None
    if spec in ("", "default", BUNDLED_NAME):
        from fasttrain.models.bundled import bundled_gguf, converted_dir_for
        from fasttrain.models.gguf_conversion import is_converted
        try:
            d = converted_dir_for(bundled_gguf())
        except FileNotFoundError:
            return None
        folder = d if is_converted(d) else None
    elif Path(spec).is_dir():
        folder = Path(spec)
    if folder is None:
        return None
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception:           # a tokenizer that does not load: the prompt tokens are estimated
        return None
