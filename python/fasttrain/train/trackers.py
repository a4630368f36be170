"""Experiment trackers: every line of metrics.jsonl, each reward's mean and spread, every probe
and a table of the step's completions, sent through each tracker's own client.

    run.report_to = ["tensorboard", "wandb", "mlflow", "trackio"]      # none by default

    trackers = start_trackers(cfg, run_dir, run_id, resume_step, warn)  # ConfigError if one can't start
    trackers.log_step(row, samples, prompt_texts)                       # after metrics.jsonl's line
    trackers.log_probe(probe)
    trackers.finish()

What is sent, per optimizer step (the tracker's step = the trainer's step):
- `train/<key>` for every number of the metrics.jsonl row (lists as `train/<key>/<i>`, booleans
  as 0/1); non-finite values stay in metrics.jsonl only (some trackers refuse them).
- `rewards/<channel>/mean` and `rewards/<channel>/std` over the step's answers (TRL's names).
- `probe/<key>` for every number of a probe (at the probe's step).
- a table `completions` (step, prompt id, prompt, completion (every turn of a multi-turn answer),
  valid, core, one column per reward channel): a W&B / Trackio table, a TensorBoard text (markdown table), an MLflow JSON artifact
  `completions/step_NNNNNN.json`. Reward columns are `reward_<channel>`, as in metrics.jsonl.

Where it goes: TensorBoard event files in <run>/tensorboard; W&B, MLflow and Trackio where their
own settings say (WANDB_PROJECT, WANDB_MODE, MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME, TRACKIO_DIR
...); the project or experiment is "fasttrain" unless those set another. A resumed run continues
the same W&B / MLflow / Trackio run (ids kept in <run>/trackers.json) and TensorBoard drops the
events after the checkpoint's step.

Every tracker starts before the model loads, so a missing package or bad setting is a
ConfigError naming `run.report_to` and the fix, not a crash at step 40. A tracker whose client
fails later (network, disk) is switched off with one warning; training goes on.
"""
from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from fasttrain.train.config import Config, ConfigError

__all__ = ["TRACKERS", "Trackers", "start_trackers", "start_on_rank0", "scalars", "completions_table"]

TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")
_INSTALL = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}
MAX_TABLE_TEXT = 2000          # characters of a prompt or completion shown in a table cell


def _number(v: Any) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)) and math.isfinite(v):
        return float(v)
    return None


def scalars(prefix: str, row: dict[str, Any], skip: Sequence[str] = ("step",)) -> dict[str, float]:
    """`prefix/key` -> finite number for every number of `row` (lists indexed: `prefix/key/i`)."""
    out: dict[str, float] = {}
    for k, v in row.items():
        if k in skip:
            continue
        if isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                if (n := _number(x)) is not None:
                    out[f"{prefix}/{k}/{i}"] = n
        elif (n := _number(v)) is not None:
            out[f"{prefix}/{k}"] = n
    return out


def reward_stats(samples: dict[str, Any]) -> dict[str, float]:
    out = {}
    for name, values in (samples.get("rewards") or {}).items():
        vals = [float(v) for v in values if _number(v) is not None]
        if not vals:
            continue
        mean = sum(vals) / len(vals)
        out[f"rewards/{name}/mean"] = mean
        out[f"rewards/{name}/std"] = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))
    return out


def _text(v: Any) -> str:
    """A prompt as one string: text as is, chat messages as "role: content" lines."""
    if isinstance(v, str):
        return v
    if isinstance(v, (list, tuple)):
        return "\n".join(f"{m.get('role', '')}: {m.get('content', '')}" if isinstance(m, dict) else str(m) for m in v)
    return str(v)


def completions_table(samples: dict[str, Any], prompt_texts: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """(columns, rows) of the step's answers; row b answers prompt_ids[b // G]."""
    answers = samples["answers"]
    ids = samples["prompt_ids"]
    G = max(1, len(answers) // max(1, len(ids)))
    rewards = samples.get("rewards") or {}
    columns = ["step", "prompt_id", "prompt", "completion", "valid", "core", *(f"reward_{c}" for c in rewards)]
    turns = samples.get("conversations")
    rows = []
    for b, text in enumerate(answers):
        if turns is not None:                       # a multi-turn answer shows every turn
            text = turns_text(turns[b])
        pid = ids[min(b // G, len(ids) - 1)]
        rows.append([samples["step"], pid, _text(prompt_texts.get(pid, ""))[:MAX_TABLE_TEXT], text[:MAX_TABLE_TEXT],
                     bool(samples["valid"][b]), float(samples["core"][b]),
                     *[float(v[b]) for v in rewards.values()]])
    return columns, rows


def turns_text(messages: list[dict[str, Any]]) -> str:
    """A conversation as text, one block per turn: "assistant: ...", "[tool name] ...", with an
    assistant turn's calls as name(arguments)."""
    out = []
    for m in messages:
        if m.get("role") == "tool":
            out.append(f"[tool {m.get('name', '')}] {m.get('content', '')}")
            continue
        calls = "".join(f" -> {c.get('function', c).get('name')}({c.get('function', c).get('arguments')})"
                        for c in m.get("tool_calls") or [] if isinstance(c, dict))
        out.append(f"{m.get('role', 'assistant')}: {m.get('content', '')}{calls}")
    return "\n".join(out)


def _markdown(columns: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        s = f"{v:.4g}" if isinstance(v, float) else str(v)
        return " ".join(s.splitlines()).replace("|", "\\|")     # every kind of line break
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


# ---- one class per tracker, each with its own client ------------------------------------------

class _TensorBoard:
    name = "tensorboard"

    def __init__(self, cfg: Config, run_dir: Path, run_id: str, resume_step: int, ids: dict):
        from torch.utils.tensorboard import SummaryWriter   # needs the tensorboard package
        self.log_dir = run_dir / "tensorboard"
        self.w = SummaryWriter(log_dir=str(self.log_dir), purge_step=resume_step + 1 if resume_step else None)
        if not resume_step:
            from fasttrain.train.config import config_to_toml
            self.w.add_text("config", "```toml\n" + config_to_toml(cfg) + "```", 0)

    def log(self, values: dict[str, float], step: int) -> None:
        for k, v in values.items():
            self.w.add_scalar(k, v, step)

    def table(self, columns, rows, step: int) -> None:
        self.w.add_text("completions", _markdown(columns, rows), step)

    def flush(self) -> None:
        self.w.flush()

    def finish(self) -> None:
        self.w.close()


class _WandB:
    name = "wandb"

    def __init__(self, cfg: Config, run_dir: Path, run_id: str, resume_step: int, ids: dict):
        import wandb
        self.wandb = wandb
        run_key = ids.get("wandb", re.sub(r"[^A-Za-z0-9_.-]", "-", run_id)[-64:])   # W&B's id alphabet
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "fasttrain"), name=run_id, id=run_key,
                              dir=str(run_dir), config=cfg.to_dict(), resume="allow", reinit="create_new")
        ids["wandb"] = self.run.id

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def table(self, columns, rows, step: int) -> None:
        self.run.log({"completions": self.wandb.Table(columns=columns, data=rows)}, step=step)

    def flush(self) -> None:
        pass

    def finish(self) -> None:
        self.run.finish()


class _MLflow:
    name = "mlflow"

    def __init__(self, cfg: Config, run_dir: Path, run_id: str, resume_step: int, ids: dict):
        from mlflow import MlflowClient
        self.client = c = MlflowClient()        # MLFLOW_TRACKING_URI, or MLflow's default store
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "fasttrain")
        exp = c.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp is not None else c.create_experiment(name)
        if "mlflow" in ids:
            self.run_id = ids["mlflow"]
            c.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = c.create_run(exp_id, run_name=run_id).info.run_id
            ids["mlflow"] = self.run_id
            from mlflow.entities import Param
            params = [Param(f"{sec}.{k}", str(v)[:500]) for sec, vals in cfg.to_dict().items() for k, v in vals.items()]
            for i in range(0, len(params), 100):            # MLflow takes at most 100 params a request
                c.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def table(self, columns, rows, step: int) -> None:
        self.client.log_dict(self.run_id, {"columns": columns, "data": rows}, f"completions/step_{step:06d}.json")

    def flush(self) -> None:
        pass

    def finish(self) -> None:
        self.client.set_terminated(self.run_id)


class _Trackio:
    name = "trackio"

    def __init__(self, cfg: Config, run_dir: Path, run_id: str, resume_step: int, ids: dict):
        import trackio
        self.trackio = trackio
        self.run = trackio.init(project=os.environ.get("TRACKIO_PROJECT", "fasttrain"), name=run_id,
                                config=cfg.to_dict(), resume="allow", embed=False)

    def log(self, values: dict[str, float], step: int) -> None:
        self.trackio.log(values, step=step)

    def table(self, columns, rows, step: int) -> None:
        self.trackio.log({"completions": self.trackio.Table(columns=columns, data=rows)}, step=step)

    def flush(self) -> None:
        pass

    def finish(self) -> None:
        self.trackio.finish()


_CLASSES = {c.name: c for c in (_TensorBoard, _WandB, _MLflow, _Trackio)}


class Trackers:
    """The started trackers; an empty one (report_to = []) does nothing."""

    def __init__(self, started: list, warn: Callable[[str], None]):
        self.started = started
        self.warn = warn

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.started]

    def _each(self, what: str, fn: Callable[[Any], None]) -> None:
        for t in list(self.started):
            try:
                fn(t)
            except Exception as e:          # a tracker's outage must not end the run
                self.started.remove(t)
                self.warn(f"tracker {t.name} failed to {what} ({type(e).__name__}: {str(e)[:200]}); "
                          f"it is off for the rest of the run (metrics.jsonl has everything)")

    def log_step(self, row: dict[str, Any], samples: dict[str, Any] | None = None,
                 prompt_texts: dict[str, Any] | None = None) -> None:
        step = int(row["step"])
        values = {**scalars("train", row), **(reward_stats(samples) if samples else {})}
        self._each("log", lambda t: t.log(values, step))
        if samples:
            columns, rows = completions_table(samples, prompt_texts or {})
            self._each("log the completions table", lambda t: t.table(columns, rows, step))
        self._each("flush", lambda t: t.flush())

    def log_probe(self, probe: dict[str, Any]) -> None:
        values = scalars("probe", probe)
        self._each("log a probe", lambda t: t.log(values, int(probe["step"])))

    def finish(self) -> None:
        self._each("finish", lambda t: t.finish())
        self.started = []


def start_trackers(cfg: Config, run_dir: Path, run_id: str, resume_step: int = 0,
                   warn: Callable[[str], None] = print) -> Trackers:
    """Start every tracker of `cfg.run.report_to`, or raise ConfigError (naming the tracker and
    the fix) after finishing the ones already started."""
    run_dir = Path(run_dir)
    ids_file = run_dir / "trackers.json"
    ids: dict[str, Any] = json.loads(ids_file.read_text()) if resume_step and ids_file.exists() else {}
    started: list = []
    for name in cfg.run.report_to:
        try:
            started.append(_CLASSES[name](cfg, run_dir, run_id, resume_step, ids))
        except Exception as e:
            for t in started:
                try:
                    t.finish()
                except Exception:
                    pass
            if isinstance(e, ImportError):
                raise ConfigError(f"run.report_to: {name!r} needs the {_INSTALL[name]} package, which is not "
                                  f"installed ({e}); install it with `pip install 'fasttrain[{name}]'` or "
                                  f"remove {name!r} from run.report_to") from None
            raise ConfigError(f"run.report_to: {name!r} failed to start ({type(e).__name__}: {str(e)[:300]}). "
                              f"{_HINTS[name]}") from None
    if started:
        from fasttrain.train.run_files import write_json
        write_json(ids_file, ids)
    return Trackers(started, warn)



def start_on_rank0(cfg: Config, run_dir: Path, run_id: str, resume_step: int, warn: Callable[[str], None],
                   main: bool) -> Trackers:
    """Rank 0 (`main`) starts the trackers (start_trackers), the other ranks report to none. Every
    rank learns whether rank 0's started and stops with the reason (torchrun's agent would kill
    them without one; another launcher might leave them in the first collective until
    run.dist_timeout)."""
    from fasttrain.train import distributed
    trackers, failure = Trackers([], print), None
    if main:
        try:
            trackers = start_trackers(cfg, run_dir, run_id, resume_step=resume_step, warn=warn)
        except Exception as e:  # noqa: BLE001  (raised below, once every rank knows)
            failure = e
    why = distributed.broadcast_object(None if failure is None else str(failure))
    if failure is not None:
        raise failure
    if why is not None:
        raise ConfigError(f"rank 0 could not start its trackers: {why}")
    return trackers

_HINTS = {
    "tensorboard": "Check that the run folder is writable.",
    "wandb": "Log in with `wandb login` (or set WANDB_API_KEY), or log locally with WANDB_MODE=offline.",
    "mlflow": "Point MLFLOW_TRACKING_URI at a tracking server (http://host:5000) or a store MLflow accepts.",
    "trackio": "Check TRACKIO_DIR / TRACKIO_PROJECT and that trackio can write its local database.",
}
