"""`fasttrain run --dry-run`: everything a run checks before it loads weights, then the plan.

It resolves the recipe and the overrides (an unknown key or a bad value is the same error a run
gives), builds the environment (the dataset is read, each reward function is imported in its
worker process and called once on an empty answer of the first train prompt), checks the
channel priorities and the prompt selection as the trainer does, and prints the run's shape and
the plan's one line (memory and time on paper, from the model's config.json on the meta device).
What it is not: a run. No weights are read, no run folder is written, nothing is trained.
"""
from __future__ import annotations

from pathlib import Path

from fasttrain.train.config import Config

__all__ = ["dry_run"]


def dry_run(cfg: Config) -> list[str]:
    """The lines to print; raises ConfigError / FileNotFoundError as a run would."""
    from fasttrain.train.trainer import Trainer

    trainer = Trainer(cfg, progress=False)                 # env, channels, prompts; no model
    try:
        env, R, L, P = trainer.env, cfg.rollout, cfg.loss, cfg.policy
        lines = [
            f"recipe resolved: run {cfg.run.name!r}, seed {cfg.run.seed}, {cfg.run.steps} steps, device {cfg.run.device}",
            f"policy: {P.model} ({P.dtype}, base {P.quantize}), {P.adapter} rank {P.rank} alpha {P.alpha:g}",
            f"environment: {env.name}: {len(trainer.train_prompts)} train prompts, "
            f"{len(trainer.probe_prompts)} probe prompts; channels "
            + ", ".join(f"{n} (x{w:g})" for n, w in zip(trainer.channel_names, trainer.weights.tolist())),
            f"step: {R.prompts_per_step} prompts x {R.group_size} answers, <= {R.max_new_tokens} new tokens, "
            f"temperature {R.temperature:g}; loss {L.kind}, {L.passes} pass(es), beta {L.beta:g}, "
            f"{L.token_mask} tokens{', REPO-R' if L.repo_r else ''}; lr {cfg.optim.lr:g}",
            _reward_check(trainer),
            _plan_line(cfg, trainer),
            "dry run: no weights loaded, nothing written",
        ]
    finally:
        close = getattr(trainer.env, "close", None)
        if close:
            close()
    return lines


def _reward_check(trainer) -> str:
    """Score one empty answer of the first train prompt: a reward function that cannot be called
    (wrong signature, missing column) shows its reason here instead of at step 1."""
    from fasttrain.train.answers import score_answers
    p = trainer.train_prompts[0]
    (s,) = score_answers(trainer.env, [p], [trainer.cfg.rollout.answer_prefix], "train", record=False,
                         completion_ids=[[]])            # an empty answer: no tokens
    verdict = "scored" if s.valid else f"invalid ({s.reason})"
    return f"reward check on an empty answer to {p.id}: {verdict}; " + \
        ", ".join(f"{k} {v:+.3g}" for k, v in s.channels.items())


def plan_before_load(cfg: Config, trainer, world: int = 1):
    """The plan of the recipe's model from its config.json alone (no weights read), or None for a
    model factory or a model whose config is not found; the prompt tokens are counted by the
    model's tokenizer when one is on disk, else 4 characters are taken as a token (the plan's
    `prompt_estimated` attribute says which)."""
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
        n = max(len(i) for i in prompt_token_ids(tok, trainer.env, trainer.train_prompts[:64], cfg.rollout.answer_prefix))
    else:
        n = max(len(p.spec) for p in trainer.train_prompts[:64]) // 4 + 32
    p = plan_run(cfg, config, n, trainer.device, world=world)
    p.prompt_estimated = tok is None
    return p


def _plan_line(cfg: Config, trainer) -> str:
    """The plan's summary for the recipe's model; its tokenizer counts the prompt tokens when one
    is on disk (no weights are read), else 4 characters are taken as a token."""
    from fasttrain.plan.report import summary_line

    spec = cfg.policy.model
    if ":" in spec and not Path(spec).exists():
        return f"plan: not available for a model factory ({spec}); `fasttrain plan --model config.json` plans it"
    try:
        p = plan_before_load(cfg, trainer)
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
