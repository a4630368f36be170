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

import signal
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fasttrain.ops.logprob import logprob_pack_cache
from fasttrain.train import distributed
from fasttrain.train.advantages import low_share_warning, step_advantages
from fasttrain.train.answers import answer_token_ids, group_seeds, sample_chunks, score_step
from fasttrain.train.checkpoint import (check_family, load_checkpoint, model_family, newest_checkpoint_name,
                                        nonfinite_state, pick_checkpoint, rng_state, save_checkpoint, set_rng_state)
from fasttrain.train.config import Config, ConfigError, config_hash, config_to_toml
from fasttrain.train.environment import load_run_env
from fasttrain.train.errors import (TrainingStopped, disk_stop, interrupted_message, nonfinite_losses_stop,
                                    nonfinite_state_stop)
from fasttrain.train.out_of_memory import OutOfMemoryBackoff, undo_update
from fasttrain.train.policy import build_policy, pick_device, rollout_weights
from fasttrain.train.policy_update import NonFiniteLoss, score_batch, update_policy
from fasttrain.train.preemption import Preempted, StopSignals
from fasttrain.train.preflight import (check_channels, plan_after_load, plan_before_load, refuse_unfit,
                                       resolve_checkpointing, select_train_prompts)
from fasttrain.train.probe import run_probe, ship_best
from fasttrain.train.progress import ProgressBar
from fasttrain.train.resume import checkpoint_step, cut_run_files, replay_answers, resume_config
from fasttrain.train.run_files import append_jsonl, new_run_id, write_json
from fasttrain.train.step_rows import metrics_row, samples_row, update_stats
from fasttrain.train.trackers import Trackers, start_on_rank0

__all__ = ["Trainer", "TrainingStopped", "Preempted"]


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
        self.channel_names, self.weights = check_channels(cfg, self.env)
        self.train_prompts = select_train_prompts(cfg, self.env)
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
        self.stop_signals: StopSignals | None = None     # while train() runs: SIGTERM / SIGUSR1
        # each phase's batch, halved on out-of-memory (saved in checkpoints)
        self.sizes: dict[str, int | None] = {"rollout": None, "scores": cfg.optim.micro_batch,
                                             "update": cfg.optim.micro_batch}
        # prompts prefilled at once in the rollout and the probe, and the probe's wave (prompts
        # decoded at once); 0: all. The recipe's, or the plan's picks (_apply_plan)
        self.prefill = {"rollout": cfg.rollout.prefill_prompts, "probe": cfg.probe.prefill_prompts}
        self.probe_wave = cfg.probe.wave_prompts
        if cfg.rollout.wave_prompts:
            self.sizes["rollout"] = cfg.rollout.wave_prompts
        self._oom = OutOfMemoryBackoff(self.sizes, cfg.rollout.prompts_per_step // distributed.world_size(),
                                       self.warn, lambda: newest_checkpoint_name(self.dir / "checkpoints"))
        self._checkpointed_step = -1
        self.mid_step = False                     # a step's scoring, update and logging under way

    # ---- set-up ---------------------------------------------------------------------------
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
            self.warn(0, f"env.skip_bad_rows: {len(self.skipped_rows)} row(s) left out; the first: "
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
        try:
            p = plan_before_load(self.cfg, self.env, self.train_prompts, self.device, world=distributed.world_size())
        except Exception:       # a folder the plan cannot read: the load that follows says why, in one paragraph
            p = None
        refuse_unfit(self.cfg, p)
        if p is not None:
            self._apply_plan(p.shape)           # refuses a run that needs gradient checkpointing turned on

    def _print_plan(self) -> None:
        """The plan's one-line summary before the first step, and with run.plan = "apply" its
        picks applied (rollout waves and prefill chunks, the probe's, the micro-batch); a warning
        when it will not fit (run.plan = "warn") or a refusal (run.plan = "apply")."""
        p, line, ok = plan_after_load(self.cfg, self.tokenizer, self.env, self.train_prompts, self.model.config,
                                      self.device, world=distributed.world_size())
        if distributed.is_main():
            self.console.print(line, markup=False, highlight=False)
        said = resolve_checkpointing(self.cfg, self.model, p)
        if said is not None and distributed.is_main():
            self.console.print(said, markup=False, highlight=False)
        if p is not None and self.cfg.run.plan == "apply":
            refuse_unfit(self.cfg, p)
            self._apply_plan(p.shape)
        elif not ok:
            self.warn(0, f"{line}; see `fasttrain plan` for the largest micro_batch, group_size and max_new_tokens that fit")

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
    def batch_advantages(self, scores) -> tuple[torch.Tensor, dict[str, float]]:
        return step_advantages(scores, self.channel_names, self.weights, self.cfg.rollout.group_size,
                               self.cfg.advantages)

    def _train_step(self, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Step `step`: rollout, scores, advantages, update. Returns (its metrics row, its samples
        record), the two lines it adds to metrics.jsonl and samples.jsonl."""
        cfg, R = self.cfg, self.cfg.rollout
        times: dict[str, float] = {}
        t = time.perf_counter()
        distributed.collective_seconds(reset=True)
        torch.manual_seed(step_seed(cfg.run.seed, step, 1))
        if getattr(self.env, "train_version", None) != self._train_version:     # a curriculum moved a level
            self.train_prompts = select_train_prompts(cfg, self.env)
            self._train_version = self.env.train_version
        self._oom.retries = 0
        dyn = None
        if R.dynamic_sampling:              # rounds of sampling and scoring (fasttrain.train.dynamic_sampling)
            from fasttrain.train.dynamic_sampling import dynamic_advantages, dynamic_step
            dyn = dynamic_step(self, step)
            roll, prompts, texts, scores, turns = dyn["roll"], dyn["prompts"], dyn["texts"], dyn["scores"], dyn["turns"]
            times["rollout"] = dyn["rollout_seconds"]
            times["verify"] = time.perf_counter() - t - times["rollout"]
        else:
            prompts = self._prompts_for_step(step)
            lo, hi = distributed.shard_bounds(len(prompts))        # this rank's whole groups
            # a stop signal during the rollout drops the step (nothing of it is recorded yet; one process)
            with self.stop_signals.abortable(distributed.world_size() == 1) if self.stop_signals else nullcontext():
                roll, texts = self.with_oom_retry(step, "rollout", lambda n: self.sample_step(step, prompts, lo, hi, n))
            times["rollout"] = time.perf_counter() - t
            t = time.perf_counter()
            self.mid_step = True           # from here on the step changes state (environment, adapters)
            scores, texts, turns = self.score_answers(prompts, lo, hi, texts, answer_token_ids(roll),
                                                    roll.conversations)       # whole step, every rank
            times["verify"] = time.perf_counter() - t
        t = time.perf_counter()
        if dyn is None:
            adv, adv_info = self.batch_advantages(scores)
            adv = adv[lo * R.group_size:hi * R.group_size].to(self.device)
        else:                               # the kept groups: the live ones standardised over the batch
            adv, adv_info = dynamic_advantages(self, dyn, step)
        times["advantages"] = time.perf_counter() - t

        t = time.perf_counter()
        L = cfg.loss
        top_entropy = L.token_mask == "top_entropy"
        # the entropy mask needs the entropies before the update; otherwise pass 1 of the update
        # gives the old log-probs and entropy from its own forward (one forward less per step).
        # The head's packed copies (fasttrain.ops.logprob_pack_cache) are kept over the scoring and
        # the update, one packing a step. A head that trains is written by the optimizer in place,
        # which bumps its version: its packed copies are then made again, never reused stale.
        with logprob_pack_cache():
            batch = self.with_oom_retry(step, "scores", lambda mb: score_batch(
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
                result = self.with_oom_retry(step, "update", lambda mb: update_policy(
                    self.model, self.params, self.optimizer, roll, batch, adv, loss_mask, L, zeta, mb,
                    cfg.optim.grad_clip, R.temperature, routing_replay=cfg.moe.routing_replay == "rollout",
                    router_aux_loss_coef=cfg.moe.router_aux_loss_coef),
                    undo=undo_update(self.model, self.params, self.optimizer) if L.passes > 1 else None)
                self.nonfinite_in_row = 0
            except NonFiniteLoss as e:
                skipped, result = True, e.result
                self.nonfinite_in_row += 1
                self.warn(step, f"non-finite loss at step {step} ({e}): update skipped "
                                 f"({self.nonfinite_in_row} in a row)")
        # the pre-update policy's entropy and KL to the base, over every rank's tokens
        gap, n_tok, n_loss, mean_entropy, kl = update_stats(roll, batch, result, mask, loss_mask)
        if L.repo_r:
            self.thermostat.update(mean_entropy)
        times["update"] = time.perf_counter() - t

        row = metrics_row(step, self.env, self.channel_names, scores, roll, passes=result.passes, kl=kl,
                          entropy=mean_entropy, adv_info=adv_info, zeta=zeta,
                          zeta_next=float(self.thermostat.zeta) if L.repo_r else 0.0, gap=gap, tokens=n_tok,
                          loss_tokens=n_loss, answers=len(scores) if dyn is None else len(dyn["kept_scores"]),
                          skipped=skipped, lr=self.optimizer.param_groups[0]["lr"], oom_retries=self._oom.retries,
                          sizes=self.sizes, prompts=len(prompts), times=times)
        samples = samples_row(step, prompts, texts, scores, self.channel_names, turns,
                              None if dyn is None else dyn["kept"])
        end_step = getattr(self.env, "end_step", None)     # a curriculum sees every answer's score
        if callable(end_step):
            row.update(end_step([p for p in prompts for _ in range(R.group_size)], scores))
        self._check_share(step, adv_info.get("nonzero_adv_share_before", adv_info["nonzero_adv_share"]))
        return row, samples

    # ---- the step's phases and messages ------------------------------------------------------
    def sample_step(self, step: int, prompts, lo: int, hi: int, per_chunk: int | None, key=None):
        """This rank's answers, sampled `per_chunk` prompts at a time (each group's generator is
        seeded by its place in the step, so chunks draw the answers of one batch; `key`: the
        seed key, default (run.seed, step))."""
        seeds = group_seeds(key or [self.cfg.run.seed, step], lo, hi)
        return sample_chunks(self.model, self.tokenizer, self.env, self.cfg, prompts[lo:hi], seeds, per_chunk,
                             weights=self.rollout_weights, prefill_chunk=self.prefill["rollout"])

    def with_oom_retry(self, step: int, phase: str, run, undo=None):
        """run(size) with the phase's size, halved on out-of-memory (fasttrain.train.out_of_memory)."""
        return self._oom.run(step, phase, run, self.model, undo)

    def score_answers(self, prompts, lo: int, hi: int, texts: list[str], ids: list[list[int]], turns=None):
        """The whole step's (scores, texts, conversations), on every rank (fasttrain.train.answers.score_step)."""
        return score_step(self.env, prompts, lo, hi, texts, ids, turns, self.cfg.rollout.group_size,
                          self.cfg.env.train_slice)

    def _say(self, msg: str) -> None:
        """A line on the console (every rank under torchrun: a stop concerns each)."""
        if distributed.world_size() > 1:
            print(f"[rank {distributed.rank()}] {msg}", file=sys.stderr, flush=True)
        else:
            self.console.print(msg, markup=False, highlight=False)

    def warn(self, step: int, msg: str) -> None:
        self.warnings.append({"step": step, "message": msg})
        self.console.print(f"[yellow]warning:[/yellow] {msg}")

    def _check_share(self, step: int, share: float) -> None:
        self.low_share_in_row, warning = low_share_warning(self.cfg.advantages, share, self.low_share_in_row)
        if warning is not None:
            self.warn(step, warning)

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

    def _state(self) -> dict[str, Any]:
        return {"run_id": self.run_id, **model_family(self.model), "thermostat": self.thermostat.state_dict(), "rng": rng_state(),
                "nonfinite_in_row": self.nonfinite_in_row, "low_share_in_row": self.low_share_in_row,
                "warnings": self.warnings, "zeta_log": self.zeta_log, "sizes": self.sizes,
                "prompt_cursor": self.prompt_cursor,
                # the environment's counters and state (plug-in wrapper, dataset rewards), if any
                "env": self.env.state_dict() if callable(getattr(self.env, "state_dict", None)) else None}

    def _checkpoint(self, sync: bool = True) -> None:
        bad = nonfinite_state(self.named_params, self.optimizer)        # every rank holds the same adapters: all stop alike
        if bad is not None:
            raise nonfinite_state_stop(bad, self.step, self.dir, self.cfg.optim.lr)
        if self.main:
            save_checkpoint(self.dir / "checkpoints", self.step, self.model, self.named_params, self.optimizer,
                            self._state(), base_model=self.cfg.policy.model)
        self._checkpointed_step = self.step
        if sync:
            distributed.barrier()      # no rank runs ahead of the newest complete checkpoint

    # ---- resume -----------------------------------------------------------------------------
    @classmethod
    def resume(cls, run_dir: str | Path, overrides: list[str] | None = None, from_step: int | None = None,
               **kw) -> "Trainer":
        """The run in `run_dir`, continued from its newest whole checkpoint (each is checked
        against its manifest; a damaged one is passed over with a warning), or from checkpoint
        `from_step`. CheckpointError when none can be used."""
        run_dir = Path(run_dir)
        cfg, changes = resume_config(run_dir, overrides)
        ckpt, notes = pick_checkpoint(run_dir / "checkpoints", from_step)   # before the model loads
        tr = cls(cfg, run_dir, **kw)
        tr._resume_from, tr._resume_notes = ckpt, notes
        tr._resume_changes = changes
        if ckpt is None:                       # no checkpoint yet: the run starts again, said once
            for note in notes:
                tr.warn(0, note)
        return tr

    def _restore(self, ckpt: Path) -> None:
        check_family(ckpt, model_family(self.model), self.dir)
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
            self.warn(self.step, f"{note}; resuming from {ckpt.name}")
        for g in self.optimizer.param_groups:      # the config's rate, which --set may have changed
            g["lr"] = self.cfg.optim.lr
        for key, (old, new) in getattr(self, "_resume_changes", {}).items():
            self.warn(self.step, f"resumed at step {self.step} with {key} = {new!r} (was {old!r})")
        samples, self.probes = cut_run_files(self.dir, self.step, self.main)
        replay_answers(self.cfg, self.env, self.train_prompts, samples)    # e.g. the novelty archive
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
        # rank 0 alone reports to trackers, started before the model: a bad tracker fails fast
        self.trackers = start_on_rank0(cfg, self.dir, self.run_id, checkpoint_step(resume_from),
                                       lambda m: self.warn(self.step, m), self.main)
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
        self.stop_signals = StopSignals(cfg.run.stop_timeout, self._say)
        bar = ProgressBar(self.console, cfg.run.name, cfg.run.steps, self.step, shown=self.progress)
        with self.stop_signals, bar:
            try:
                if self.step == 0 and not self.probes:
                    bar.show(self.step, None, self._probe(0))
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
                    bar.show(self.step, row, probe)
                    self.mid_step = False
                    if self.nonfinite_in_row >= cfg.optim.max_skipped_steps:
                        self._checkpoint()
                        raise nonfinite_losses_stop(step, self.nonfinite_in_row, cfg.optim, self.dir)
                    if self.stop_signals.agreed(distributed.any_rank):        # every rank stops after this step
                        raise Preempted(self.stop_signals.requested or signal.SIGTERM)
            except OSError as e:        # the run folder's disk is full, read-only or not ours
                stop = disk_stop(e, self.step, self.dir)
                if stop is None:
                    raise
                raise stop from None
            except Preempted as e:
                if self._checkpointed_step != self.step:
                    self._checkpoint()
                preempted = Preempted(e.signum, self.step)
            except KeyboardInterrupt:
                interrupted = True
                if not self.mid_step:          # mid-step, part of the next step is in the state: no checkpoint
                    self._checkpoint(sync=False)    # ranks are interrupted at different points
                self.console.print(interrupted_message(self.step, self.mid_step, self.dir))
        self.stop_signals = None
        if preempted is not None:
            self._say(f"stopped by {preempted.name} after step {self.step}: its checkpoint is written; continue "
                      f"with `fasttrain run --resume {self.dir}`")
            raise preempted
        if not self.main:
            return {"run_id": self.run_id, "rank": distributed.rank(), "steps_done": self.step}
        shipped = ship_best(self.dir, self.probes, self.run_id)
        result = write_outputs(self, shipped, interrupted=interrupted)
        return result
