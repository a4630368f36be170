"""A dataset with a `prompt` column, scored by reward functions written as for TRL's GRPOTrainer.

    [env]
    name = "dataset"
    dataset = "data.jsonl"               # JSONL, Parquet, CSV, or a folder from `save_to_disk`
    rewards = ["rewards.py:correct", "my_pkg.rewards:concise"]
    probe_rows = 20                      # the last 20 rows are the probe, never trained on
    # probe_dataset = "probe.jsonl"      # ... or the probe's own file
    # system_prompt = "Think, then answer."
    # reward_timeout = 30.0              # seconds per reward call
    # core = "correct"                   # default: the first reward
    # tools = ["tools.py:calculate"]     # multi-turn answers with tool calls (fasttrain.envs.tools)
    # environment = "envs.py:Game"       # TRL's environment class protocol; get_reward is a channel
    # tool_timeout = 10.0                # seconds per tool call

Rows load with the `datasets` library. `prompt` holds text (one user turn) or a list of chat
messages ({"role", "content"}); the policy's chat template applies to both, with `system_prompt`
put first when the prompt has no system message of its own. Every other column reaches the
reward functions by name, as lists over the batch, exactly as TRL passes them (TRL leaves out
`prompt`, `completion` and `completion_ids`; so does this). verl's row layout loads as is: when
rows have a `reward_model` dict and no `ground_truth` column, `ground_truth` is added from
`reward_model["ground_truth"]` (and `reward_model` itself is passed too).

Each reward function is one GDPO channel named after the function (its priority comes from
`advantages.priorities`, default 1.0). It is called as TRL calls it:
`f(prompts=..., completions=..., completion_ids=..., **columns)`, where a prompt is the dataset's
value, a completion is the answer text as TRL decodes it (special tokens skipped, whitespace
kept; or `[{"role": "assistant", "content": text}]` when the prompt is a list of messages) and completion_ids are the sampled token ids up to and including
EOS. TRL's trainer-only hooks (`trainer_state`, `log_metric`, `log_extra`) are not passed: give
such functions `**kwargs`. Functions run in the environment's worker pool with a deadline and a
memory limit, `worker_memory_mb` (see fasttrain.envs.reward_functions and .worker_pool).

With tools or an environment class, answers are conversations: `completions` is each answer's
message list (assistant, tool, ..., assistant) as TRL passes it, and an environment's
`get_reward()` is one more channel named after its class, scored in the worker that holds the
row's instance (fasttrain.envs.tools).

Verdicts: `core` is the value of the `core` reward, `success` is core > 0. An answer is invalid
when any reward gives it None, a non-number or a non-finite value, raises on it, or times out;
`reason` says which and why. Its failed channels then take the lowest value that channel gave any
answer of the same call (0.0 if none did), its other channels keep their values, and its core is
min(-1, the lowest valid core of the call), so an invalid answer never scores above a valid one.
The floor guard keeps every invalid answer's advantage at or below zero.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Sequence

from .protocol import INVALID_CORE, Channel, DatasetError, Prompt, Score
from .reward_functions import RewardFunction, parse_reward_spec
from .worker_pool import WorkerPool

__all__ = ["DatasetEnvironment", "DatasetError", "load_rows"]

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
NOT_REWARD_COLUMNS = ("prompt", "completion", "completion_ids")     # as TRL's GRPOTrainer
log = logging.getLogger(__name__)


def load_rows(path: str, key: str = "env.dataset", skipped: list[str] | None = None) -> list[dict[str, Any]]:
    """Rows of a JSONL / JSON / Parquet / CSV file or a `save_to_disk` folder (its "train"
    split if it holds several), checked for a `prompt` column, at least one row and UTF-8 text
    (fasttrain.envs.row_checks; with `skipped` a list, rows that are not UTF-8 are left out and
    described there)."""
    if not path:
        raise DatasetError(f"{key} is not set: name a JSONL, Parquet or CSV file or a folder "
                           "written by datasets' save_to_disk")
    p = Path(path).expanduser()
    if not p.exists():
        raise DatasetError(f"{key}: {path!r} does not exist (relative paths are looked up next to "
                           "the recipe, then in the current folder)")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")                 # local files only
    import datasets

    try:
        if p.is_dir():
            if not any((p / f).exists() for f in ("state.json", "dataset_dict.json")):
                raise DatasetError(f"{key}: {path!r} is a folder but not one written by "
                                   "datasets' save_to_disk (no state.json or dataset_dict.json)")
            ds = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict):
                if "train" not in ds:
                    raise DatasetError(f"{key}: {path!r} holds the splits {sorted(ds)}; the 'train' split "
                                       "is used, and it has none (save the split you want on its own)")
                ds = ds["train"]
        else:
            fmt = FORMATS.get(p.suffix.lower())
            if fmt is None:
                raise DatasetError(f"{key}: {path!r}: unknown format {p.suffix!r}; use .jsonl, .json, "
                                   ".parquet, .csv or a save_to_disk folder")
            if _has_no_rows(p, fmt):
                raise DatasetError(f"{key}: {path!r} has no rows")
            from .row_checks import utf8_rows
            ds = datasets.load_dataset(fmt, data_files=str(utf8_rows(p, fmt, key, skipped)), split="train")
    except DatasetError:
        raise
    except Exception as e:   # the datasets library's parse errors, with its own explanation
        raise DatasetError(f"{key}: cannot read {path!r}: {type(e).__name__}: {e}") from None
    if len(ds) == 0:
        raise DatasetError(f"{key}: {path!r} has no rows")
    if "prompt" not in ds.column_names:
        raise DatasetError(f"{key}: {path!r} has no 'prompt' column; its columns are "
                           f"{', '.join(ds.column_names) or '(none)'}. Rename the one holding the prompts, "
                           "e.g. ds.rename_column('question', 'prompt')")
    rows = ds.to_list()
    for i, r in enumerate(rows):
        _check_prompt(r["prompt"], i, key, path)
    if "reward_model" in ds.column_names and "ground_truth" not in ds.column_names:   # verl's layout
        for r in rows:
            rm = r["reward_model"]
            r["ground_truth"] = rm.get("ground_truth") if isinstance(rm, dict) else None
    return rows


def _has_no_rows(p: Path, fmt: str) -> bool:
    """True for a file without data rows (the datasets library fails on those with unclear errors)."""
    if fmt == "parquet":
        import pyarrow.parquet as pq
        return pq.ParquetFile(p).metadata.num_rows == 0
    lines = 0
    with open(p, "rb") as f:
        for line in f:
            lines += bool(line.strip())
            if lines >= 2:
                break
    return lines == 0 or (fmt == "csv" and lines == 1)         # a CSV header alone


def _check_prompt(v: Any, i: int, key: str, path: str) -> None:
    if isinstance(v, str):
        if v.strip():
            return
        raise DatasetError(f"{key}: {path!r} row {i}: the prompt is empty")
    if isinstance(v, list) and v and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                         and isinstance(m.get("content"), str) for m in v):
        return
    raise DatasetError(f"{key}: {path!r} row {i}: 'prompt' must be text or a non-empty list of chat messages "
                       f"{{'role': str, 'content': str}}; got {v!r:.160}")


def _no_row_retry(out):
    """A raise of a reward function run with environments fails its answers (the one-at-a-time
    retry would run in the reward pool, which holds no instances)."""
    from .worker_pool import Outcome
    return Outcome(False, failure=out.failure, kind="crashed") if out.kind == "raised" else out


def _prompt_key(v: Any) -> str:
    return json.dumps(v, sort_keys=True, ensure_ascii=False, default=str)


def _show(v: Any) -> str:
    """The prompt as readable text (reports, probe examples)."""
    if isinstance(v, str):
        return v
    return "\n\n".join(f"{m['role']}: {m['content']}" for m in v)


class DatasetEnvironment:
    """The Environment protocol over a prompt dataset and reward functions (module docstring)."""

    data_slices = ("train",)
    answer_format = ""
    # Reward functions get each answer as TRL's GRPOTrainer passes it: the completion decoded with its
    # special tokens skipped, whitespace kept (fasttrain.train.answers.sample_answers).
    decoded_answers = True

    def __init__(self, dataset: str = "", rewards: Sequence[str] = (), probe_dataset: str = "",
                 probe_rows: int = 0, system_prompt: str = "", reward_timeout: float = 30.0, core: str = "",
                 worker_memory_mb: float = 0.0, skip_bad_rows: bool = False, tools: Sequence[str] = (),
                 environment: str = "", tool_timeout: float = 10.0):
        if not rewards and not environment:
            raise DatasetError('env.rewards is empty: list reward functions, e.g. '
                               'rewards = ["rewards.py:correct"] or ["my_pkg.rewards:correct"]')
        if probe_dataset and probe_rows:
            raise DatasetError("env.probe_dataset and env.probe_rows are both set: the probe is either its "
                               "own file or the last rows of env.dataset, not both")
        if not probe_dataset and not probe_rows:
            raise DatasetError("the probe needs prompts it never trains on: set env.probe_rows = N (the "
                               "last N rows of env.dataset are held out) or env.probe_dataset = PATH")
        self.tool_workers = None
        if tools or environment:
            from .tools import ToolWorkers
            self.tool_workers = ToolWorkers(tools, environment, tool_timeout, memory_mb=worker_memory_mb or None)
        self.env_reward = (self.tool_workers.environment_name
                           if self.tool_workers is not None and self.tool_workers.has_reward else None)
        names = [parse_reward_spec(spec).name for spec in rewards] + ([self.env_reward] if self.env_reward else [])
        if not names:
            self.close()
            raise DatasetError("env.rewards is empty and the environment class has no get_reward(): nothing "
                               "scores the answers")
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise DatasetError(f"env.rewards: two reward functions are named {dup[0]!r}; each is one "
                               "channel, so names must differ")
        if core and core not in names:
            raise DatasetError(f"env.core: {core!r} is not one of the rewards: {', '.join(names)}")
        # rows left out by env.skip_bad_rows, with the reason (the run's report lists them)
        self.skipped_rows: list[str] = []
        skipped = self.skipped_rows if skip_bad_rows else None
        rows = load_rows(dataset, "env.dataset", skipped)
        if probe_dataset:
            train_rows = list(enumerate(rows))
            probe_set = list(enumerate(load_rows(probe_dataset, "env.probe_dataset", skipped)))
            probe_tag = "probe_dataset"
        else:
            if probe_rows >= len(rows):
                raise DatasetError(f"env.probe_rows = {probe_rows} holds out every row of {dataset!r} "
                                   f"({len(rows)} rows); keep some for training")
            cut = len(rows) - probe_rows
            train_rows, probe_set = list(enumerate(rows))[:cut], list(enumerate(rows))[cut:]
            probe_tag = "dataset"
        self._check_overlap(train_rows, probe_set, probe_tag, whole_row=bool(environment))
        columns = [c for c in rows[0] if c not in NOT_REWARD_COLUMNS]
        if probe_dataset:
            probe_cols = set(probe_set[0][1])
            missing = [c for c in columns if c not in probe_cols]
            if missing:
                raise DatasetError(f"env.probe_dataset: {probe_dataset!r} lacks the column(s) {missing} that "
                                   f"the reward functions get from env.dataset")
        self.columns = columns
        self.system_prompt = system_prompt
        self.name = f"dataset:{Path(dataset).name}"
        self._sources = {"dataset": dataset, "probe_dataset": probe_dataset}
        self._raw: dict[str, Any] = {}
        self._messages: dict[str, list[dict[str, str]]] = {}
        self._prompts = {"train": [self._prompt("dataset", i, r) for i, r in train_rows],
                         "probe": [self._prompt(probe_tag, i, r) for i, r in probe_set]}

        self.rewards: list[RewardFunction] = []
        # one pool for every reward (and, later, tool) of this environment; a worker per reward
        self.pool = WorkerPool(memory_mb=worker_memory_mb or None, max_workers=max(2, len(rewards)))
        try:
            for spec in rewards:                      # import errors surface here
                self.rewards.append(RewardFunction(spec, reward_timeout, self.pool))
        except BaseException:
            self.close()
            raise
        self._check_reward_columns(dataset, probe_dataset, skipped)
        self.core = core or names[0]
        self.channels = [Channel(f.name, 1.0, f"reward function {f.spec.spec}") for f in self.rewards]
        if self.env_reward:
            self.channels.append(Channel(self.env_reward, 1.0, f"get_reward() of {environment}"))
        self.invalid_counts = {n: 0 for n in names}
        self._warned: set[str] = set()

    # ---- prompts --------------------------------------------------------------------------
    def _prompt(self, tag: str, i: int, row: dict[str, Any]) -> Prompt:
        pid = f"{tag}/{i}"
        raw = row["prompt"]
        msgs = ([{"role": "user", "content": raw}] if isinstance(raw, str)
                else [{k: v for k, v in m.items() if v is not None} for m in raw])
        if self.system_prompt and msgs[0]["role"] != "system":
            msgs = [{"role": "system", "content": self.system_prompt}] + msgs
        self._raw[pid], self._messages[pid] = raw, msgs
        return Prompt(pid, _show(raw), {c: row.get(c) for c in self.columns})

    def _check_reward_columns(self, dataset: str, probe_dataset: str, skipped: list[str] | None) -> None:
        """Every argument a reward function has no default for is a column with a value in every
        row (fasttrain.envs.row_checks.missing_columns); rows without one are an error or skipped."""
        from .row_checks import TRL_ARGS, missing_columns
        needs = {f.name: [n for n, has_default in f.signature["params"].items()
                          if not has_default and n not in TRL_ARGS and n != "environments"] for f in self.rewards}
        for split, where in (("train", f"env.dataset {dataset!r}"),
                             ("probe", f"env.probe_dataset {probe_dataset!r}" if probe_dataset
                              else f"env.dataset {dataset!r}")):
            bad = missing_columns([(p.id, p.fields) for p in self._prompts[split]], needs, self.columns, where, skipped)
            self._prompts[split] = [p for p in self._prompts[split] if p.id not in bad]
            if not self._prompts[split]:
                raise DatasetError(f"{where}: every {split} row was left out (env.skip_bad_rows); the first "
                                   f"reason: {self.skipped_rows[0]}")

    @staticmethod
    def _check_overlap(train, probe, probe_tag: str, whole_row: bool = False) -> None:
        """No probe prompt among the training prompts; with an environment class the whole row
        is the task (reset gets its columns), so rows, not prompts, must differ."""
        def key(r):
            return _prompt_key(r if whole_row else r["prompt"])
        seen = {}
        for i, r in train:
            seen.setdefault(key(r), i)
        clash = [(i, seen[key(r)]) for i, r in probe if key(r) in seen]
        if clash:
            (pi, ti), n = clash[0], len(clash)
            where = "env.probe_dataset" if probe_tag == "probe_dataset" else "the held-out rows (env.probe_rows)"
            raise DatasetError(f"{where}: {n} probe prompt(s) also appear in the training rows of env.dataset "
                               f"(first: probe row {pi} = training row {ti}); a probe must be unseen. "
                               "Remove the duplicates from one of the sets")

    def row_of(self, prompt_id: str) -> str:
        """Where a prompt comes from, for messages: "env.dataset 'data.jsonl' row 12"."""
        tag, _, i = prompt_id.rpartition("/")
        return f"env.{tag} {self._sources.get(tag, '')!r} row {i}"

    def prompts(self, split: str) -> list[Prompt]:
        if split not in self._prompts:
            raise ValueError(f"unknown split {split!r}; use 'train' or 'probe'")
        return list(self._prompts[split])

    def chat_messages(self, prompt: Prompt) -> list[dict[str, str]]:
        """The conversation the policy's chat template turns into the prompt's token ids."""
        return [dict(m) for m in self._messages[prompt.id]]

    # ---- scoring --------------------------------------------------------------------------
    def reward_inputs(self, prompts: Sequence[Prompt], answers: Sequence[str],
                      completion_ids: Sequence[Sequence[int]] | None = None,
                      conversations: Sequence[list] | None = None) -> dict[str, list]:
        """The keyword arguments every reward function gets for these answers; a multi-turn
        answer's completion is its conversation."""
        raws = [self._raw[p.id] for p in prompts]
        kw: dict[str, list] = {
            "prompts": raws,
            "completions": ([[dict(m) for m in c] for c in conversations] if conversations is not None else
                            [[{"role": "assistant", "content": a}] if isinstance(r, list) else a
                             for r, a in zip(raws, answers)]),
            "completion_ids": ([list(map(int, c)) for c in completion_ids] if completion_ids is not None
                               else [None] * len(answers)),
        }
        for c in self.columns:
            kw[c] = [p.fields.get(c) for p in prompts]
        return kw

    def score_many(self, prompts: Sequence[Prompt], answers: Sequence[str], data_slice: str = "train",
                   completion_ids: Sequence[Sequence[int]] | None = None,
                   conversations: Sequence[list] | None = None) -> list[Score]:
        """Scores of the answers; with an environment class, answer i is the one whose instance
        is slot i of the rollout just sampled (its get_reward reads that instance)."""
        n = len(answers)
        if len(prompts) != n or any(x is not None and len(x) != n for x in (completion_ids, conversations)):
            raise ValueError("prompts, answers, completion_ids and conversations differ in length")
        if n == 0:
            return []
        kw = self.reward_inputs(prompts, answers, completion_ids, conversations)
        here = [self._with_environments(f) for f in self.rewards]        # those run where the instances are
        jobs = [None if h else f.submit(kw) for f, h in zip(self.rewards, here)]   # every reward at once
        env_values = self.tool_workers.rewards(range(n)) if self.env_reward else None
        outs = [_no_row_retry(self.tool_workers.score(f.spec.spec, kw, n)) if h else job.result()
                for f, h, job in zip(self.rewards, here, jobs)]
        results = {f.name: f.finish(kw, n, out) for f, out in zip(self.rewards, outs)}
        if self.env_reward:
            results[self.env_reward] = [(v, None if why is None else f"reward {self.env_reward!r} {why}")
                                        for v, why in env_values]
        worst = {k: min((v for v, _ in res if v is not None), default=None) for k, res in results.items()}
        invalid_core = min(INVALID_CORE, worst[self.core]) if worst[self.core] is not None else INVALID_CORE
        scores = []
        for i in range(n):
            channels, reasons = {}, []
            for name in results:
                v, why = results[name][i]
                if v is None:
                    reasons.append(why)
                    self.invalid_counts[name] += 1
                    self._warn_once(name, why)
                    v = worst[name] if worst[name] is not None else 0.0
                channels[name] = v
            if reasons:
                scores.append(Score(channels, False, invalid_core, False, "; ".join(reasons)))
            else:
                core = channels[self.core]
                scores.append(Score(channels, True, core, core > 0, None))
        return scores

    def _with_environments(self, f: RewardFunction) -> bool:
        """A reward function that names `environments` runs in the tool workers, with the rows'
        environment instances (TRL passes them to every reward function; here only to those that
        ask, since the instances live in other processes)."""
        return ("environments" in f.signature["params"] and self.tool_workers is not None
                and self.tool_workers.has_environment)

    def score(self, prompt: Prompt, answer_text: str, data_slice: str = "train") -> Score:
        return self.score_many([prompt], [answer_text], data_slice)[0]

    def _warn_once(self, name: str, why: str) -> None:
        if name not in self._warned:
            self._warned.add(name)
            log.warning("%s (answers it cannot score are invalid; every reason is in samples.jsonl)", why)

    # ---- run state (checkpointed by the trainer) -------------------------------------------
    def counters(self) -> dict[str, int]:
        """Run totals for metrics.jsonl."""
        return {"reward_invalid": sum(self.invalid_counts.values()),
                "reward_worker_restarts": sum(f.restarts for f in self.rewards),
                "reward_workers_over_memory": self.pool.killed_for_memory}

    def state_dict(self) -> dict[str, Any]:
        return {"invalid_counts": dict(self.invalid_counts), "warned": sorted(self._warned),
                "restarts": {f.name: f.restarts for f in self.rewards}, "pool": self.pool.state_dict()}

    def load_state_dict(self, st: dict[str, Any]) -> None:
        self.invalid_counts = {n: int(st["invalid_counts"].get(n, 0)) for n in self.invalid_counts}
        self._warned = set(st["warned"])
        for f in self.rewards:
            f.restarts = int(st["restarts"].get(f.name, 0))
        self.pool.load_state_dict(st.get("pool", {}))

    def close(self) -> None:
        """Stop the reward and tool workers (they also stop when this object is collected or the run ends)."""
        if getattr(self, "pool", None) is not None:
            self.pool.close()
        if getattr(self, "tool_workers", None) is not None:
            self.tool_workers.close()
