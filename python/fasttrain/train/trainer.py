"""The training loop (docs/design.md, "One training step"): rollout -> verifier -> GDPO + floor guard -> k-pass
policy update (REPO-R, CISPO/DAPO, β·KL) -> log / probe / checkpoint.

    trainer = Trainer(cfg)                     # or Trainer.resume(run_dir)
    result = trainer.train()                   # writes runs/<run-id>/ (docs/design.md, "The run folder")

Determinism: the prompts of step s, each prompt's rollout seed (run.seed, s, its place in the step)
and torch's global seed at step s are pure functions of (run.seed, s), and checkpoints hold adapters, AdamW moments, the thermostat and RNG
states, so a resumed run repeats an uninterrupted one bit for bit on CPU. A stateful
environment (one whose score_many takes `record`, like the signal novelty archive) is brought
back to its state by replaying the recorded answers of samples.jsonl.

Under torchrun each rank runs this loop on its block of the step's prompts; the values that span
the batch go through fasttrain.train.distributed (the identity in one process), and rank 0 alone
writes the run folder.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import math
import shutil
import signal
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fasttrain.rl import floor_guard, gdpo_advantages, guarded_answers, legacy_clamp, nonzero_share
from fasttrain.ops.logprob import logprob_pack_cache
from fasttrain.rl.masks import token_stats
from fasttrain.train import distributed
from fasttrain.train.answers import (answer_token_ids, group_seeds, is_stateful, join_rollouts, sample_answers,
                                     score_answers, tool_settings, truncation_of)
from fasttrain.train.checkpoint import (check_family, load_checkpoint, newest_checkpoint_name, pick_checkpoint,
                                        rng_state, save_checkpoint, set_rng_state)
from fasttrain.train.config import (SEED_PRIORITIES, Config, ConfigError, config_hash, config_to_toml, load_config,
                                    resume_changes, saved_run_data)
from fasttrain.train.environment import load_run_env
from fasttrain.train.policy import build_policy, pick_device, rollout_weights, set_checkpointing
from fasttrain.train.policy_update import NonFiniteLoss, score_batch, update_policy
from fasttrain.train.preemption import Preempted, StopSignals
from fasttrain.train.probe import run_probe, select_shipped
from fasttrain.train.run_files import append_jsonl, new_run_id, read_jsonl, truncate_jsonl, write_json
from fasttrain.train.trackers import Trackers

__all__ = ["Trainer", "TrainingStopped", "Preempted"]


class TrainingStopped(RuntimeError):
    """The run cannot continue (optim.max_skipped_steps non-finite losses in a row, non-finite
    adapters at a checkpoint); the message says why and how to go on."""


def _checkpoint_step(ckpt: Path | None) -> int:
    return int(json.loads((ckpt / "trainer_state.json").read_text())["step"]) if ckpt is not None else 0


def _env_counters(env) -> dict[str, int]:
    f = getattr(env, "counters", None)
    return {k: int(v) for k, v in f().items()} if callable(f) else {}


def step_seed(seed: int, step: int, salt: int = 0) -> int:
    return (seed * 1_000_003 + step * 7919 + salt) % (2**62)


def adamw(params, o) -> torch.optim.Optimizer:
    """The run's optimizer: AdamW with optim's lr, betas, eps and weight decay (the differential tests
    against TRL build theirs here too, so a changed convention shows there)."""
    return torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                             weight_decay=o.weight_decay, foreach=False)


class Trainer:
    def __init__(self, cfg: Config, run_dir: str | Path | None = None, *, progress: bool = True,
                 env=None, console=None):
        self.cfg = cfg
        # torchrun's ranks join here (a no-op in one process); rank 0 alone shows progress
        distributed.init_from_env(cfg.run.dist_timeout)
        distributed.check_prompts_per_step(cfg.rollout.prompts_per_step)
        self.main = distributed.is_main()
        self.progress = progress and self.main
        from rich.console import Console
        self.console = (console or Console(stderr=True)) if self.main else Console(stderr=True, quiet=True)
        self.run_id = Path(run_dir).name if run_dir else distributed.broadcast_object(
            new_run_id(cfg.run.name, config_hash(cfg)))
        self.dir = Path(run_dir) if run_dir else Path(cfg.run.out) / self.run_id
        self.env = env if env is not None else load_run_env(cfg)
        self.device = pick_device(cfg.run.device)
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        self._check_channels()
        self.train_prompts = self._train_prompts()
        self._train_version = getattr(self.env, "train_version", None)   # a curriculum's level moves it
        self.prompt_cursor = 0                     # dynamic sampling's place in the prompt stream
        self.probe_prompts = self.env.prompts("probe")[: cfg.probe.prompts]
        # rows left out by env.skip_bad_rows, with the reason (export.json and report.md count them)
        self.skipped_rows: list[str] = list(getattr(self.env, "skipped_rows", []))
        self.step = 0
        self.probes: list[dict[str, Any]] = []
        self.warnings: list[dict[str, Any]] = []
        self.nonfinite_in_row = 0
        self.low_share_in_row = 0
        self.zeta_log: list[float] = []
        self.trackers = Trackers([], print)       # started by train() from run.report_to
        self._setup_done = False
        self._stop: StopSignals | None = None     # while train() runs: SIGTERM / SIGUSR1
        # each phase's batch, halved on out-of-memory (saved in checkpoints)
        self.sizes: dict[str, int | None] = {"rollout": None, "scores": cfg.optim.micro_batch,
                                             "update": cfg.optim.micro_batch}
        # prompts prefilled at once in the rollout and the probe, and the probe's wave (prompts
        # decoded at once); 0: all. The recipe's, or the plan's picks (_apply_plan)
        self.prefill = {"rollout": cfg.rollout.prefill_prompts, "probe": cfg.probe.prefill_prompts}
        self.probe_wave = cfg.probe.wave_prompts
        if cfg.rollout.wave_prompts:
            self.sizes["rollout"] = cfg.rollout.wave_prompts
        self._oom_retries = 0
        self._checkpointed_step = -1
        self._mid_step = False                     # a step's scoring, update and logging under way

    # ---- set-up ---------------------------------------------------------------------------
    def _check_channels(self) -> None:
        names = [c.name for c in self.env.channels]
        unknown = [k for k in self.cfg.advantages.priorities if k not in names]
        if unknown:
            # An error for every environment. The one exception is the untouched default, the seed's
            # priorities (written for the signal channels): another environment keeps its own there.
            default = self.cfg.advantages.priorities == SEED_PRIORITIES
            if self.cfg.env.name.startswith("signal") or not default:
                raise ConfigError(f"advantages.priorities: unknown channel(s) {unknown}; the channels of "
                                  f"{self.env.name} are {', '.join(names)} (or set advantages.priorities = {{}} "
                                  f"to use the environment's own priorities)")
        self.channel_names = names
        self.weights = torch.tensor([self.cfg.advantages.priorities.get(c.name, c.priority)
                                     for c in self.env.channels], dtype=torch.float64)

    def _train_prompts(self):
        prompts = self.env.prompts("train")
        sel = self.cfg.env.prompts
        if sel:
            path = Path(sel)
            if not path.exists():
                raise ConfigError(f"env.prompts: selection file {sel!r} does not exist; "
                                  "write it with `fasttrain filter RECIPE`")
            keep = json.loads(path.read_text())["prompt_ids"]
            by_id = {p.id: p for p in prompts}
            missing = [k for k in keep if k not in by_id]
            if missing:
                raise ConfigError(f"env.prompts: {len(missing)} prompt ids of {sel} are not in {self.env.name}")
            prompts = [by_id[k] for k in keep]
        if not prompts:
            raise ConfigError(f"env.name: {self.env.name} has no train prompts")
        return prompts

    def _setup(self) -> None:
        if self._setup_done:
            return
        cfg = self.cfg
        if cfg.run.plan == "apply":
            self._refuse_what_cannot_fit()
        self.model, self.tokenizer, self.named_params = build_policy(cfg, self.device)
        from fasttrain.train.prompt_length import check_prompt_lengths
        kept = check_prompt_lengths(cfg, self.tokenizer, self.env, self.model,
                                    {"train": self.train_prompts, "probe": self.probe_prompts}, self.skipped_rows)
        self.train_prompts, self.probe_prompts = kept["train"], kept["probe"]
        if self.skipped_rows:
            self._warn(0, f"env.skip_bad_rows: {len(self.skipped_rows)} row(s) left out; the first: "
                          f"{self.skipped_rows[0]}")
        self.params = list(self.named_params.values())
        distributed.broadcast_parameters(self.params)          # every rank starts from rank 0's adapters
        self.rollout_weights = rollout_weights(cfg, self.model)
        o = cfg.optim
        self.optimizer = adamw(self.params, o)
        from fasttrain.rl.repo_r import Thermostat
        L = cfg.loss
        self.thermostat = Thermostat(zeta_min=L.zeta_min, zeta_max=L.zeta_max, warmup=L.thermostat_warmup)
        self._setup_done = True
        self._print_plan()

    def _refuse_what_cannot_fit(self) -> None:
        """Before any weight is read: the plan from the model's config.json (where one is found
        without loading: a bundled name, a model folder) and the prompts' tokens (counted by its
        tokenizer when on disk, else estimated); a recipe that fits at no wave size is refused,
        naming the setting to change."""
        from fasttrain.train.dry_run import plan_before_load
        try:
            p = plan_before_load(self.cfg, self, world=distributed.world_size())
        except Exception:       # a folder the plan cannot read: the load that follows says why, in one paragraph
            p = None
        if p is not None and p.picks is not None and not p.picks.fits:
            raise ConfigError(f"{self.cfg.policy.model} on {p.gpu.title}: " + "; ".join(p.picks.blocked)
                              + " (run.plan = \"warn\" runs it anyway)")
        if p is not None:
            self._apply_plan(p.shape)           # refuses a run that needs gradient checkpointing turned on

    def _print_plan(self) -> None:
        """The plan's one-line summary before the first step, and with run.plan = "apply" its
        picks applied (rollout waves and prefill chunks, the probe's, the micro-batch); a warning
        when it will not fit (run.plan = "warn") or a refusal (run.plan = "apply")."""
        from fasttrain.plan.report import plan_run, summary_line
        from fasttrain.train.answers import prompt_token_ids
        try:
            ids = prompt_token_ids(self.tokenizer, self.env, self.train_prompts[:16], self.cfg.rollout.answer_prefix)
            p = plan_run(self.cfg, self.model.config, max(len(i) for i in ids), self.device,
                         world=distributed.world_size())
            line, ok = summary_line(p), p.fits
        except Exception as e:  # the plan informs; it never stops a run
            p, line, ok = None, f"plan: not available ({type(e).__name__}: {e})", True
        if distributed.is_main():
            self.console.print(line, markup=False, highlight=False)
        self._resolve_checkpointing(p)
        if p is not None and self.cfg.run.plan == "apply":
            if p.picks is not None and not p.picks.fits:
                raise ConfigError(f"{self.cfg.policy.model} on {p.gpu.title}: " + "; ".join(p.picks.blocked)
                                  + " (run.plan = \"warn\" runs it anyway)")
            self._apply_plan(p.shape)
        elif not ok:
            self._warn(0, f"{line}; see `fasttrain plan` for the largest micro_batch, group_size and max_new_tokens that fit")

    def _resolve_checkpointing(self, p) -> None:
        """policy.gradient_checkpointing = "auto": the plan's pick (off when the update fits at the
        picked micro-batch without it); on, as built, when there is no plan. Said in one line."""
        if self.cfg.policy.gradient_checkpointing != "auto":
            return
        on = p is None or bool(p.shape.gradient_checkpointing)
        set_checkpointing(self.model, on)
        why = "no plan for this model" if p is None else \
            "the plan fits the update without it" if not on else "the update does not fit without it"
        if distributed.is_main():
            self.console.print(f"gradient checkpointing: {'on' if on else 'off'} (auto: {why})",
                               markup=False, highlight=False)

    def _apply_plan(self, s) -> None:
        """The plan's picks as the phases' sizes (what the recipe fixes, the plan kept as it is)."""
        if s.gradient_checkpointing and self.cfg.policy.gradient_checkpointing is False:
            raise ConfigError("the update does not fit without gradient checkpointing even at one answer per "
                              "micro-batch: set policy.gradient_checkpointing = true (run.plan = \"warn\" runs it anyway)")
        self.sizes["rollout"] = s.wave_prompts if s.wave_prompts < s.prompts else None
        self.sizes["scores"] = self.sizes["update"] = s.micro_batch
        self.prefill = {"rollout": s.prefill_prompts if s.prefill_prompts < s.wave_prompts else 0,
                        "probe": s.probe_prefill_prompts if s.probe_prefill_prompts < s.probe_wave_prompts else 0}
        self.probe_wave = s.probe_wave_prompts if s.probe_wave_prompts < s.probe_prompts else 0
        if s.rollout_weights == "nf4" and self.cfg.rollout.base_weights == "auto":
            self.rollout_weights = None          # its bytes go to the cache (fasttrain.plan.picks)

    def _prompts_for_step(self, step: int):
        n, P = len(self.train_prompts), self.cfg.rollout.prompts_per_step
        start = (step - 1) * P
        out = []
        for i in range(start, start + P):
            epoch, j = divmod(i, n)
            order = np.random.default_rng([self.cfg.run.seed, epoch]).permutation(n)
            out.append(self.train_prompts[order[j]])
        return out

    # ---- one step -------------------------------------------------------------------------
    def _advantages(self, scores) -> tuple[torch.Tensor, dict[str, float]]:
        a_cfg = self.cfg.advantages
        G = self.cfg.rollout.group_size
        rewards = torch.tensor([[s.channels[c] for c in self.channel_names] for s in scores], dtype=torch.float64)
        core = torch.tensor([s.core for s in scores], dtype=torch.float64)
        valid = torch.tensor([s.valid for s in scores])
        adv = gdpo_advantages(rewards, G, self.weights, a_cfg.batch_normalize).double()
        guarded = guarded_answers(core, valid, a_cfg.floor, a_cfg.guard_invalid)
        if a_cfg.guard == "projection":
            adv = floor_guard(adv, guarded, G)
        elif a_cfg.guard == "legacy_clamp":
            adv = legacy_clamp(adv, core)
        info = {"nonzero_adv_share": nonzero_share(adv), "guarded_share": float(guarded.double().mean()),
                "adv_abs_mean": float(adv.abs().mean())}
        return adv.to(torch.float32), info

    def _train_step(self, step: int) -> dict[str, Any]:
        cfg, R = self.cfg, self.cfg.rollout
        times: dict[str, float] = {}
        t = time.perf_counter()
        distributed.collective_seconds(reset=True)
        torch.manual_seed(step_seed(cfg.run.seed, step, 1))
        if getattr(self.env, "train_version", None) != self._train_version:     # a curriculum moved a level
            self.train_prompts = self._train_prompts()
            self._train_version = self.env.train_version
        self._oom_retries = 0
        dyn = None
        if R.dynamic_sampling:              # rounds of sampling and scoring (fasttrain.train.dynamic_sampling)
            from fasttrain.train.dynamic_sampling import dynamic_step, kept_advantages
            dyn = dynamic_step(self, step)
            roll, prompts, texts, scores, turns = dyn["roll"], dyn["prompts"], dyn["texts"], dyn["scores"], dyn["turns"]
            times["rollout"] = dyn["rollout_seconds"]
            times["verify"] = time.perf_counter() - t - times["rollout"]
        else:
            prompts = self._prompts_for_step(step)
            lo, hi = distributed.shard_bounds(len(prompts))        # this rank's whole groups
            # a stop signal during the rollout drops the step (nothing of it is recorded yet; one process)
            with self._stop.abortable(distributed.world_size() == 1) if self._stop else nullcontext():
                roll, texts = self._with_oom_retry(step, "rollout", lambda n: self._sample(step, prompts, lo, hi, n))
            times["rollout"] = time.perf_counter() - t
            t = time.perf_counter()
            self._mid_step = True           # from here on the step changes state (environment, adapters)
            scores, texts, turns = self._score_step(prompts, lo, hi, texts, answer_token_ids(roll),
                                                    roll.conversations)       # whole step, every rank
            times["verify"] = time.perf_counter() - t
        t = time.perf_counter()
        if dyn is None:
            adv, adv_info = self._advantages(scores)
            adv = adv[lo * R.group_size:hi * R.group_size].to(self.device)
        else:                               # the kept groups: the live ones standardised over the batch
            adv, adv_info = kept_advantages(self, dyn["kept_scores"], dyn["live"])
            k = dyn["groups_per_rank"] * R.group_size
            adv = adv[distributed.rank() * k:(distributed.rank() + 1) * k].to(self.device)
            adv_info.update(dyn["info"])
            if adv_info["dynamic_cap_reached"]:
                self._warn(step, f"dynamic sampling: {adv_info['dynamic_rounds']} extra round(s) (rollout."
                                 f"dynamic_max_rounds = {R.dynamic_max_rounds}) left step {step} with "
                                 f"{sum(dyn['live'])} live group(s) of {R.prompts_per_step}; it trains on those")
        times["advantages"] = time.perf_counter() - t

        t = time.perf_counter()
        L = cfg.loss
        top_entropy = L.token_mask == "top_entropy"
        # the entropy mask needs the entropies before the update; otherwise pass 1 of the update
        # gives the old log-probs and entropy from its own forward (one forward less per step)
        with logprob_pack_cache():           # the head is frozen here: its packed copies kept for the phase
            batch = self._with_oom_retry(step, "scores", lambda mb: score_batch(
                self.model, roll, mb, R.temperature, need_ref=L.beta > 0, need_old=top_entropy,
                routing_replay=cfg.moe.routing_replay == "rollout"))
        mask = roll.action_mask.bool()          # the model's own tokens: every consumer below reads it
        loss_mask = mask
        if top_entropy:                                        # over every rank's answer tokens
            loss_mask = distributed.top_entropy_mask(batch.entropy, mask, L.rho)
        times["logprob"] = time.perf_counter() - t

        t = time.perf_counter()
        zeta = float(self.thermostat.zeta) if L.repo_r else 0.0
        skipped = False
        try:
            # a head that trains is written by the optimizer in place, which bumps its version: its
            # packed copies are then made again, never reused stale
            with logprob_pack_cache():
                result = self._with_oom_retry(step, "update", lambda mb: update_policy(
                    self.model, self.params, self.optimizer, roll, batch, adv, loss_mask, L, zeta, mb,
                    cfg.optim.grad_clip, R.temperature, routing_replay=cfg.moe.routing_replay == "rollout",
                    router_aux_loss_coef=cfg.moe.router_aux_loss_coef),
                    undo=self._undo_update() if L.passes > 1 else None)
            self.nonfinite_in_row = 0
        except NonFiniteLoss as e:
            skipped, result = True, e.result
            self.nonfinite_in_row += 1
            self._warn(step, f"non-finite loss at step {step} ({e}): update skipped "
                             f"({self.nonfinite_in_row} in a row)")
        passes = result.passes
        gap = self._logprob_gap(roll, result, mask)
        # entropy of the pre-update policy (scored before the update, or by its first pass), all ranks
        n_tok, n_loss, ent_sum = distributed.sum_values(token_stats(result.entropy, mask, loss_mask))
        n_tok, n_loss = int(n_tok), int(n_loss)
        mean_entropy = ent_sum / max(1, n_tok)
        # KL to the base: the loss op's own k3 estimate in pass 1 (the pre-update policy, over every
        # rank's tokens; r = 1 there up to two forwards' rounding, so "k3_ratio"'s r * k3 is k3), the
        # value the loss used; 0 without a reference (beta = 0)
        kl = passes[0].get("kl_mean", math.nan) if passes else math.nan
        if batch.ref_logp is None:
            kl = 0.0
        if L.repo_r:
            self.thermostat.update(mean_entropy)
        times["update"] = time.perf_counter() - t

        ch_mean = {f"reward_{c}": float(np.mean([s.channels[c] for s in scores])) for c in self.channel_names}
        last = passes[-1] if passes else {}
        row: dict[str, Any] = {
            "step": step,
            "reward": float(np.mean([s.total(self.env.channels) for s in scores])),
            **ch_mean,
            "core": float(np.mean([s.core for s in scores])),
            "success": float(np.mean([s.success for s in scores])),
            "valid": float(np.mean([s.valid for s in scores])),
            "cost": ch_mean.get("reward_action_cost", math.nan),
            "kl": kl, "entropy": mean_entropy, **adv_info,
            "zeta": zeta, "zeta_next": float(self.thermostat.zeta) if L.repo_r else 0.0,
            "loss": last.get("loss", math.nan), "grad_norm": last.get("grad_norm", math.nan),
            "pass_losses": [p["loss"] for p in passes],
            "ratio_mean": last.get("ratio_mean", math.nan),
            "clip_low_frac": last.get("clip_low_frac", math.nan),
            "clip_high_frac": last.get("clip_high_frac", math.nan),
            "cap_frac": last.get("cap_frac", math.nan),
            "repo_r_factor_mean": last.get("repo_r_factor_mean", math.nan),
            **gap,
            **{k: v for k, v in (passes[0] if passes else {}).items() if k.startswith("moe_")},   # MoE routing
            "tokens": n_tok, "loss_tokens": n_loss,
            "mean_length": n_tok / (len(scores) if dyn is None else len(dyn["kept_scores"])), "skipped": skipped,
            "lr": self.optimizer.param_groups[0]["lr"],
            # out-of-memory retries of this step, and the sizes the phases now run with
            "oom_retries": self._oom_retries, "rollout_chunk_prompts": self.sizes["rollout"] or len(prompts),
            "scores_micro_batch": self.sizes["scores"], "update_micro_batch": self.sizes["update"],
            # a plug-in's batch verifier that raised or returned the wrong length (run total)
            "verifier_batch_failures": 0,
            **_env_counters(self.env),                        # the environment's run totals
            **self._tool_metrics(roll, len(scores)),
            **{f"seconds_{k}": v for k, v in times.items()},
        }
        row["seconds_step"] = sum(times.values())
        row["seconds_collectives"] = distributed.collective_seconds()   # part of the above; 0 in one process
        samples = {"step": step, "prompt_ids": [p.id for p in prompts], "answers": texts,
                   "core": [s.core for s in scores], "valid": [s.valid for s in scores],
                   "rewards": {c: [s.channels[c] for s in scores] for c in self.channel_names},
                   "reasons": [s.reason for s in scores]}
        if turns is not None:
            samples["conversations"] = turns               # each answer's turns (assistant, tool, ...)
        if dyn is not None:
            samples["kept"] = dyn["kept"]                  # per group: trained on (dynamic sampling)
        end_step = getattr(self.env, "end_step", None)     # a curriculum sees every answer's score
        if callable(end_step):
            row.update(end_step([p for p in prompts for _ in range(R.group_size)], scores))
        self._check_share(step, adv_info.get("nonzero_adv_share_before", adv_info["nonzero_adv_share"]))
        return row, samples

    @staticmethod
    def _logprob_gap(roll, result, mask) -> dict[str, float]:
        """rollout_logprob_gap (mean) and rollout_logprob_gap_max: |Δ log p| of the sampled tokens
        between the rollout's decode and the update's forward on the pre-update policy, every rank's tokens."""
        from fasttrain.rl.logprob_gap import logprob_gap_parts
        have = result is not None and result.old_logp is not None
        total, top, n = logprob_gap_parts(roll.logprobs, result.old_logp, mask) if have else (0.0, 0.0, 0)
        total, n = distributed.sum_values([total, float(n)])        # every rank joins the collectives
        top = max(distributed.gather_list([top]))
        if n == 0:
            return {"rollout_logprob_gap": math.nan, "rollout_logprob_gap_max": math.nan}
        return {"rollout_logprob_gap": total / n, "rollout_logprob_gap_max": top}

    # ---- out of memory ------------------------------------------------------------------------
    def _sample(self, step: int, prompts, lo: int, hi: int, per_chunk: int | None, key=None):
        """This rank's answers, sampled `per_chunk` prompts at a time (each group's generator is
        seeded by its place in the step, so chunks draw the answers of one batch; `key`: the
        seed key, default (run.seed, step))."""
        R, mine = self.cfg.rollout, prompts[lo:hi]
        seeds = group_seeds(key or [self.cfg.run.seed, step], lo, hi)
        n = per_chunk or len(mine)
        parts, texts = [], []
        for a in range(0, len(mine), n):
            roll, tx = sample_answers(self.model, self.tokenizer, self.env, mine[a:a + n], group_size=R.group_size,
                                      max_new_tokens=R.max_new_tokens, temperature=R.temperature,
                                      seed=seeds[a:a + n], answer_prefix=R.answer_prefix,
                                      stop_strings=R.stop_strings, weights=self.rollout_weights,
                                      compile_decode=R.compile, prefill_chunk=self.prefill["rollout"],
                                      truncation=truncation_of(R),
                                      tool_settings={**tool_settings(self.cfg), "first_slot": a * R.group_size})
            parts.append(roll)
            texts += tx
        pad = getattr(self.model.config, "pad_token_id", None)
        roll = join_rollouts(parts, pad if isinstance(pad, int) else 0)
        if not R.replay_kept_set and roll.keep_delta is not None:   # score on the whole vocabulary, as TRL does
            roll = dataclasses.replace(roll, keep_delta=None)
        return roll, texts

    def _undo_update(self):
        """A function that puts the adapters and AdamW back as they are now (before an update
        that may run out of memory part-way, after some passes stepped). The copy is kept in host
        memory: it must not add to the device memory the update needs. Only an update of k > 1
        passes needs it: with one pass nothing has stepped before its end, and pass 1 starts by
        clearing the gradients."""
        params = [p.detach().to("cpu", copy=True) for p in self.params]
        state = {p: {k: (v.to("cpu", copy=True), v.device) if torch.is_tensor(v) else v for k, v in st.items()}
                 for p, st in self.optimizer.state.items()}
        training = self.model.training

        def undo() -> None:
            with torch.no_grad():
                for p, v in zip(self.params, params):
                    p.copy_(v)
                    p.grad = None
            self.optimizer.state.clear()
            for p, st in state.items():
                self.optimizer.state[p] = {k: v[0].to(v[1], copy=True) if isinstance(v, tuple) else v
                                           for k, v in st.items()}
            self.model.train(training)
        return undo

    def _with_oom_retry(self, step: int, phase: str, run, undo=None):
        """run(size) with the phase's size (rollout: prompts per chunk, None = all; scores and
        update: answers per micro-batch). torch.OutOfMemoryError halves the size (kept for the rest
        of the run) and runs the phase again, down to one; the step's other phases are not redone."""
        training = self.model.training
        while True:
            size = self.sizes[phase]
            try:
                return run(size)
            except torch.OutOfMemoryError as e:
                now = size or (self.cfg.rollout.prompts_per_step // distributed.world_size())
                what = {"rollout": "prompts per rollout chunk", "scores": "answers per scoring micro-batch",
                        "update": "answers per update micro-batch"}[phase]
                if now <= 1 or (phase == "update" and distributed.world_size() > 1):
                    why = ("with one row" if now <= 1 else
                           "in the update under torchrun (the ranks' collectives cannot redo one rank's update)")
                    raise TrainingStopped(
                        f"step {step}: out of memory {why} ({phase}: {str(e).strip()[:200]}). Lower "
                        f"rollout.max_new_tokens or rollout.group_size, or see `fasttrain plan`; the last "
                        f"checkpoint is {newest_checkpoint_name(self.dir / 'checkpoints')}.") from None
                self.sizes[phase] = now // 2
                self._oom_retries += 1
                self._warn(step, f"out of memory in the {phase} of step {step} with {now} {what}: "
                                 f"retrying with {now // 2} (kept for the rest of the run)")
                del e
                if undo is not None:
                    undo()
                self.model.train(training)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()

    def _tool_metrics(self, roll, answers: int) -> dict[str, float]:
        """Per step, over every rank: tool calls, the calls that ended in an error message (or
        could not be read), and model turns per answer; nothing for single-turn answers."""
        if roll.tool_stats is None:
            return {}
        st = roll.tool_stats
        calls, errors, turns, dropped = distributed.sum_values(
            [float(st["tool_calls"]), float(st["tool_errors"]), float(st["turns"]), float(st["tool_results_dropped"])])
        return {"tool_calls": int(calls), "tool_errors": int(errors), "turns": turns / max(1, answers),
                "tool_results_dropped": int(dropped)}

    def _score_step(self, prompts, lo: int, hi: int, texts: list[str], ids: list[list[int]],
                    turns: list | None = None):
        """(scores, answer texts, conversations or None) of the whole step in the one-process
        order, on every rank. A stateful environment scores every answer on every rank, in that
        order, so its state stays the one-process state; a stateless one scores each rank's
        answers where they are."""
        G = self.cfg.rollout.group_size
        turns = turns if turns is not None else [None] * len(texts)
        if is_stateful(self.env) or distributed.world_size() == 1:
            both = distributed.gather_list(list(zip(texts, ids, turns)))
            texts, ids, turns = [x[0] for x in both], [x[1] for x in both], [x[2] for x in both]
            rep = [p for p in prompts for _ in range(G)]
            conv = turns if turns and turns[0] is not None else None
            return score_answers(self.env, rep, texts, self.cfg.env.train_slice, record=True,
                                 completion_ids=ids, conversations=conv), texts, conv
        rep = [p for p in prompts[lo:hi] for _ in range(G)]
        conv = turns if turns and turns[0] is not None else None
        mine = score_answers(self.env, rep, texts, self.cfg.env.train_slice, record=True, completion_ids=ids,
                             conversations=conv)
        both = distributed.gather_list(list(zip(mine, texts, turns)))
        conv = [x[2] for x in both]
        return [x[0] for x in both], [x[1] for x in both], conv if conv and conv[0] is not None else None

    def _say(self, msg: str) -> None:
        """A line on the console (every rank under torchrun: a stop concerns each)."""
        if distributed.world_size() > 1:
            print(f"[rank {distributed.rank()}] {msg}", file=sys.stderr, flush=True)
        else:
            self.console.print(msg, markup=False, highlight=False)

    def _warn(self, step: int, msg: str) -> None:
        self.warnings.append({"step": step, "message": msg})
        self.console.print(f"[yellow]warning:[/yellow] {msg}")

    def _check_share(self, step: int, share: float) -> None:
        a = self.cfg.advantages
        self.low_share_in_row = self.low_share_in_row + 1 if share < a.warn_share else 0
        if self.low_share_in_row == a.warn_steps:
            self._warn(step, f"the share of answers with a non-zero advantage has stayed under "
                             f"{a.warn_share:.0%} for {a.warn_steps} steps (now {share:.0%}): the floor guard "
                             f"(advantages.guard={a.guard!r}, advantages.floor={a.floor}, "
                             f"guard_invalid={a.guard_invalid}) zeroes every group whose answers are all "
                             f"invalid or at or below the floor. Lower the floor (advantages.floor=-inf), "
                             f"filter prompts (fasttrain filter), or raise rollout.group_size.")

    # ---- probes and checkpoints -------------------------------------------------------------
    def _probe(self, step: int) -> dict[str, Any]:
        from fasttrain.nn import save_adapter
        t = time.perf_counter()
        res = run_probe(self.model, self.tokenizer, self.env, self.probe_prompts, self.cfg, step,
                        weights=self.rollout_weights, wave=self.probe_wave, prefill_chunk=self.prefill["probe"])
        if self.main:
            save_adapter(self.model, self.dir / "probes" / f"step_{step:06d}" / "adapter", base_model=self.cfg.policy.model)
        res["seconds_with_save"] = time.perf_counter() - t
        self.probes.append(res)
        if self.main:
            append_jsonl(self.dir / "probes.jsonl", res)
            self.trackers.log_probe(res)
        return res

    def _family(self) -> dict[str, str]:
        """The policy's model family and model_type, kept in checkpoints so a resume on another
        family's model is refused by name (its adapters would not fit)."""
        from fasttrain.models.families import family_of
        model_type = str(getattr(getattr(self.model, "config", None), "model_type", "unknown"))
        try:
            return {"family": family_of(self.model).name, "model_type": model_type}
        except ValueError:
            return {"family": model_type, "model_type": model_type}

    def _state(self) -> dict[str, Any]:
        return {"run_id": self.run_id, **self._family(), "thermostat": self.thermostat.state_dict(), "rng": rng_state(),
                "nonfinite_in_row": self.nonfinite_in_row, "low_share_in_row": self.low_share_in_row,
                "warnings": self.warnings, "zeta_log": self.zeta_log, "sizes": self.sizes,
                "prompt_cursor": self.prompt_cursor,
                # the environment's counters and state (plug-in wrapper, dataset rewards), if any
                "env": self.env.state_dict() if callable(getattr(self.env, "state_dict", None)) else None}

    def _nonfinite_state(self) -> str | None:
        """The first adapter tensor or optimizer moment that holds a NaN or an infinity, or None."""
        for n, p in self.named_params.items():
            if not bool(torch.isfinite(p).all()):
                return f"adapter {n}"
            for k, v in self.optimizer.state.get(p, {}).items():
                if torch.is_tensor(v) and v.is_floating_point() and not bool(torch.isfinite(v).all()):
                    return f"AdamW {k} of {n}"
        return None

    def _checkpoint(self, sync: bool = True) -> None:
        bad = self._nonfinite_state()        # every rank holds the same adapters: all stop alike
        if bad is not None:
            last = newest_checkpoint_name(self.dir / "checkpoints")
            raise TrainingStopped(
                f"step {self.step}: {bad} is not finite, so no checkpoint was written (the last one, {last}, "
                f"is whole). Resume from it with a lower rate: `fasttrain run --resume {self.dir} "
                f"--set optim.lr={self.cfg.optim.lr / 10:g}` (or try optim.grad_clip, policy.dtype=float32).")
        if self.main:
            save_checkpoint(self.dir / "checkpoints", self.step, self.model, self.named_params, self.optimizer,
                            self._state(), base_model=self.cfg.policy.model)
        self._checkpointed_step = self.step
        if sync:
            distributed.barrier()      # no rank runs ahead of the newest complete checkpoint

    def _ship(self) -> dict[str, Any] | None:
        best = select_shipped(self.probes)
        if best is None:
            return None
        src = self.dir / "probes" / f"step_{best['step']:06d}" / "adapter"
        dst = self.dir / "shipped"
        tmp = self.dir / "shipped.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp / "adapter")
        write_json(tmp / "shipped.json", {"run_id": self.run_id, **best})
        shutil.rmtree(dst, ignore_errors=True)
        tmp.rename(dst)
        return best

    # ---- resume -----------------------------------------------------------------------------
    @classmethod
    def resume(cls, run_dir: str | Path, overrides: list[str] | None = None, from_step: int | None = None,
               **kw) -> "Trainer":
        """The run in `run_dir`, continued from its newest whole checkpoint (each is checked
        against its manifest; a damaged one is passed over with a warning), or from checkpoint
        `from_step`. CheckpointError when none can be used."""
        run_dir = Path(run_dir)
        cfg_file = run_dir / "config.toml"
        if not cfg_file.exists():
            raise FileNotFoundError(f"--resume {run_dir}: no config.toml there (not a fasttrain run folder)")
        import tomllib
        saved = saved_run_data(tomllib.loads(cfg_file.read_text()))
        cfg = load_config(saved, overrides)
        changes = resume_changes(load_config(saved), cfg)                # refuses what may not change
        ckpt, notes = pick_checkpoint(run_dir / "checkpoints", from_step)   # before the model loads
        tr = cls(cfg, run_dir, **kw)
        tr._resume_from, tr._resume_notes = ckpt, notes
        tr._resume_changes = changes
        if ckpt is None:                       # no checkpoint yet: the run starts again, said once
            for note in notes:
                tr._warn(0, note)
        return tr

    def _restore(self, ckpt: Path) -> None:
        check_family(ckpt, self._family(), self.dir)
        meta = load_checkpoint(ckpt, self.named_params, self.optimizer)
        self.step = self._checkpointed_step = int(meta["step"])
        self.thermostat.load_state_dict(meta["thermostat"])
        self.nonfinite_in_row = meta["nonfinite_in_row"]
        self.low_share_in_row = meta["low_share_in_row"]
        self.warnings = list(meta["warnings"])
        self.zeta_log = list(meta["zeta_log"])
        self.sizes.update(meta.get("sizes", {}))
        self.prompt_cursor = int(meta.get("prompt_cursor", 0))
        set_rng_state(meta["rng"])
        for note in getattr(self, "_resume_notes", []):
            self._warn(self.step, f"{note}; resuming from {ckpt.name}")
        for g in self.optimizer.param_groups:      # the config's rate, which --set may have changed
            g["lr"] = self.cfg.optim.lr
        for key, (old, new) in getattr(self, "_resume_changes", {}).items():
            self._warn(self.step, f"resumed at step {self.step} with {key} = {new!r} (was {old!r})")
        keep = [r for r in read_jsonl(self.dir / "metrics.jsonl") if r["step"] <= self.step]
        samples = [r for r in read_jsonl(self.dir / "samples.jsonl") if r["step"] <= self.step]
        self.probes = [r for r in read_jsonl(self.dir / "probes.jsonl") if r["step"] <= self.step]
        distributed.barrier()                 # every rank has read the files before rank 0 cuts them
        if self.main:
            truncate_jsonl(self.dir / "metrics.jsonl", keep)
            truncate_jsonl(self.dir / "samples.jsonl", samples)
            truncate_jsonl(self.dir / "probes.jsonl", self.probes)
        if is_stateful(self.env):           # rebuild e.g. the novelty archive, in the same order
            by_id = {p.id: p for p in self.train_prompts}
            for r in samples:
                ps = [by_id[i] for i in r["prompt_ids"] for _ in range(self.cfg.rollout.group_size)]
                score_answers(self.env, ps, r["answers"], self.cfg.env.train_slice, record=True)
        if meta.get("env") is not None:     # after the replay, which would count its failures again
            self.env.load_state_dict(meta["env"])
        self.console.print(f"resumed {self.run_id} at step {self.step} from {ckpt.name}")

    # ---- the loop ---------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        """Train (or continue) with the ops of run.kernels; on CUDA the compiled kernels are checked
        against the reference first (fasttrain.train.kernel_check) and a failure stops the run."""
        from fasttrain.ops.kernels import use_kernels
        from fasttrain.train.kernel_check import check_kernels
        with use_kernels(self.cfg.run.kernels):
            problem = check_kernels(self.device, self.dir, self.console, write=self.main)
            if problem:
                raise TrainingStopped(problem)
            return self._train_loop()

    def _train_loop(self) -> dict[str, Any]:
        cfg = self.cfg
        if self.main:                                  # rank 0 alone writes the run folder
            self.dir.mkdir(parents=True, exist_ok=True)
        resume_from = getattr(self, "_resume_from", None)
        failure = None
        if self.main:                                  # rank 0 alone reports to trackers
            from fasttrain.train.trackers import start_trackers   # before the model: a bad tracker fails fast
            try:
                self.trackers = start_trackers(cfg, self.dir, self.run_id, resume_step=_checkpoint_step(resume_from),
                                               warn=lambda m: self._warn(self.step, m))
            except Exception as e:  # noqa: BLE001  (raised below, once every rank knows)
                failure = e
        # every rank learns whether rank 0's trackers started and stops with the reason (torchrun's
        # agent would kill them without one; another launcher might leave them in the first
        # collective until run.dist_timeout)
        why = distributed.broadcast_object(None if failure is None else str(failure))
        if failure is not None:
            raise failure
        if why is not None:
            raise ConfigError(f"rank 0 could not start its trackers: {why}")
        try:
            return self._run_steps(resume_from)
        finally:
            self.trackers.finish()

    def _run_steps(self, resume_from) -> dict[str, Any]:
        from fasttrain.train.report import write_outputs
        cfg = self.cfg
        self._setup()
        from fasttrain.train.run_files import write_text
        if self.main:
            write_text(self.dir / "config.toml", config_to_toml(cfg))   # resumed: with its overrides
        if resume_from is not None:
            self._restore(resume_from)
        elif self.main:
            for f in ("metrics.jsonl", "samples.jsonl", "probes.jsonl"):
                (self.dir / f).write_text("")
        if self.main:
            write_json(self.dir / "run.json", {"run_id": self.run_id, "device": str(self.device),
                                               "torch": torch.__version__, "started": time.time(),
                                               "world_size": distributed.world_size()})
        ckpt_every = cfg.run.checkpoint_every or cfg.probe.every or cfg.run.steps
        interrupted, preempted = False, None
        self._stop = StopSignals(cfg.run.stop_timeout, self._say)
        with self._stop, self._progress_bar() as bar:
            try:
                if self.step == 0 and not self.probes:
                    self._show(bar, None, self._probe(0))
                while self.step < cfg.run.steps:
                    step = self.step + 1
                    row, samples = self._train_step(step)
                    self.step = step
                    self.zeta_log.append(row["zeta"])
                    if self.main:
                        append_jsonl(self.dir / "metrics.jsonl", row)
                        append_jsonl(self.dir / "samples.jsonl", samples)
                        self.trackers.log_step(row, samples, {p.id: p.spec for p in self.train_prompts})
                    probe = None
                    if (cfg.probe.every and step % cfg.probe.every == 0) or step == cfg.run.steps:
                        probe = self._probe(step)
                    if step % ckpt_every == 0 or step == cfg.run.steps:
                        self._checkpoint()
                    self._show(bar, row, probe)
                    self._mid_step = False
                    if self.nonfinite_in_row >= cfg.optim.max_skipped_steps:
                        self._checkpoint()
                        raise TrainingStopped(
                            f"stopped at step {step}: {self.nonfinite_in_row} non-finite losses in a row "
                            f"(optim.max_skipped_steps = {cfg.optim.max_skipped_steps}). The adapters were not "
                            f"updated by those steps; try a lower rate or clipping, or policy.dtype=float32: "
                            f"`fasttrain run --resume {self.dir} --set optim.lr={cfg.optim.lr / 10:g}`.")
                    if self._stop.agreed(distributed.any_rank):        # every rank stops after this step
                        raise Preempted(self._stop.requested or signal.SIGTERM)
            except OSError as e:        # the run folder's disk is full, read-only or not ours
                if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM):
                    raise
                raise TrainingStopped(
                    f"step {self.step}: cannot write {e.filename or self.dir}: {e.strerror} "
                    f"(errno {errno.errorcode.get(e.errno, e.errno)}). The last checkpoint, "
                    f"{newest_checkpoint_name(self.dir / 'checkpoints')}, is intact and the run files stay "
                    f"readable (a line cut short is dropped on reading). Free space or fix the permissions, "
                    f"then `fasttrain run --resume {self.dir}`.") from None
            except Preempted as e:
                if self._checkpointed_step != self.step:
                    self._checkpoint()
                preempted = Preempted(e.signum, self.step)
            except KeyboardInterrupt:
                interrupted = True
                if self._mid_step:              # part of the next step is in the state: no checkpoint
                    self.console.print(
                        f"[yellow]interrupted during step {self.step + 1}[/yellow]: not checkpointed (it would "
                        f"hold part of that step); the last checkpoint, "
                        f"{newest_checkpoint_name(self.dir / 'checkpoints')}, stands; continue with "
                        f"`fasttrain run --resume {self.dir}`")
                else:
                    self._checkpoint(sync=False)    # ranks are interrupted at different points
                    self.console.print(f"[yellow]interrupted at step {self.step}[/yellow]: checkpoint saved; "
                                       f"continue with `fasttrain run --resume {self.dir}`")
        self._stop = None
        if preempted is not None:
            self._say(f"stopped by {preempted.name} after step {self.step}: its checkpoint is written; continue "
                      f"with `fasttrain run --resume {self.dir}`")
            raise preempted
        if not self.main:
            return {"run_id": self.run_id, "rank": distributed.rank(), "steps_done": self.step}
        shipped = self._ship()
        result = write_outputs(self, shipped, interrupted=interrupted)
        return result

    # ---- progress ---------------------------------------------------------------------------
    def _progress_bar(self):
        from contextlib import nullcontext
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
        if not self.progress:
            return nullcontext(None)
        p = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                     TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                     console=self.console, transient=False)
        self._task = p.add_task(self.cfg.run.name, total=self.cfg.run.steps, completed=self.step, info="starting")
        return p

    def _show(self, bar, row, probe) -> None:
        if bar is None:
            return
        info = getattr(self, "_info", "")
        if row is not None:
            info = (f"reward {row['reward']:+.3f} core {row['core']:+.3f} valid {row['valid']:.0%} "
                    f"nz {row['nonzero_adv_share']:.0%} KL {row['kl']:.4f} H {row['entropy']:.2f} "
                    f"ζ {row['zeta']:.1e} {row['seconds_step']:.1f}s/step")
        if probe is not None:
            bar.console.print(f"probe @ step {probe['step']}: train core {probe['train_core']:+.4f}  "
                              f"holdout core {probe['holdout_core']:+.4f}  valid {probe['train_valid']:.0%}")
        self._info = info
        bar.update(self._task, completed=self.step, info=info)
