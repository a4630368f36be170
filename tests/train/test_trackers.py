"""Trackers: a tiny run logged to TensorBoard, W&B (offline), MLflow (file store) and Trackio (its
local database) is read back
from each tracker's own files and equals metrics.jsonl; a tracker that cannot start stops the run
before the model loads; one that fails later is switched off and the run goes on."""
import glob
import json
import math
import struct
import sys

import numpy as np
import pytest

from fasttrain.train import ConfigError, Trainer, load_config
from fasttrain.train.trackers import Trackers


@pytest.fixture
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    for name in [m for m in sys.modules if m == "trackio" or m.startswith("trackio.")]:
        monkeypatch.delitem(sys.modules, name)      # trackio reads TRACKIO_DIR once, at import (TRL imports it)


def _rows(path):
    return [json.loads(l) for l in path.read_text().splitlines()]


def _expected(row):
    """train/<key> -> value for every finite number of a metrics line (lists indexed)."""
    out = {}
    for k, v in row.items():
        if k == "step":
            continue
        for kk, x in ([(f"{k}/{i}", x) for i, x in enumerate(v)] if isinstance(v, list) else [(k, v)]):
            if isinstance(x, (bool, int, float)) and math.isfinite(float(x)):
                out[f"train/{kk}"] = float(x)
    return out


def _wandb_history(run_dir):
    """History rows of the offline run, read from its .wandb file (a LevelDB-style log of
    protobuf Records: 7-byte file header, 32 KiB blocks, 7-byte record headers)."""
    from wandb.proto import wandb_internal_pb2 as pb
    (path,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    data, pos, block, buf, rows = open(path, "rb").read(), 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and n == 0:
            break
        buf += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):                       # a full record, or the last piece of one
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            if rec.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    return rows


def test_every_metric_reaches_tensorboard_wandb_mlflow_and_trackio(tiny, tiny_recipe, offline):
    cfg = load_config(tiny_recipe(tiny / "runs", **{"run.steps": 2, "probe.every": 2,
                                                   "run.report_to": ["tensorboard", "wandb", "mlflow", "trackio"]}))
    tr = Trainer(cfg, progress=False)
    tr.train()
    rows = _rows(tr.dir / "metrics.jsonl")
    probes = _rows(tr.dir / "probes.jsonl")
    G = cfg.rollout.group_size * cfg.rollout.prompts_per_step
    assert tr.warnings == [] and tr.trackers.started == []          # all finished, none failed

    # TensorBoard: event files read back with its own EventAccumulator (values are float32 there)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tr.dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for row in rows:
        for key, v in _expected(row).items():
            (ev,) = [e for e in acc.Scalars(key) if e.step == row["step"]]
            assert ev.value == np.float32(v), key
        for c in ("core", "action_cost", "format"):             # the tiny env's channels
            (ev,) = [e for e in acc.Scalars(f"rewards/{c}/mean") if e.step == row["step"]]
            assert ev.value == np.float32(row[f"reward_{c}"])
    assert {k for r in rows for k in _expected(r)} <= tags
    assert [e.step for e in acc.Scalars("probe/train_core")] == [p["step"] for p in probes] == [0, 2]
    assert [e.value for e in acc.Scalars("probe/train_core")] == [np.float32(p["train_core"]) for p in probes]
    text = [e for e in acc.Tensors("completions/text_summary") if e.step == 2][0]
    md = text.tensor_proto.string_val[0].decode()
    assert md.startswith("| step | prompt_id | prompt | completion | valid | core | reward_core | "
                         "reward_action_cost | reward_format |")
    assert len(md.splitlines()) == 2 + G

    # W&B offline: the run folder's transaction log and table file
    hist = {h["_step"]: h for h in _wandb_history(tr.dir)}
    for row in rows:
        for key, v in _expected(row).items():
            assert hist[row["step"]][key] == v, key
    assert hist[0]["probe/train_core"] == probes[0]["train_core"]
    assert hist[2]["probe/holdout_core"] == probes[1]["holdout_core"]
    assert hist[2]["completions/_type"] == "table-file"
    (table_file,) = (tr.dir / "wandb").glob(f"offline-run-*/files/{hist[2]['completions/path']}")
    table = json.loads(table_file.read_text())
    samples = _rows(tr.dir / "samples.jsonl")
    assert [r[3] for r in table["data"]] == samples[1]["answers"]
    assert [r[-1] for r in table["data"]] == samples[1]["rewards"]["format"]

    # MLflow: the file store, read back with its own client
    from mlflow import MlflowClient
    client = MlflowClient()
    (run,) = client.search_runs([client.get_experiment_by_name("fasttrain").experiment_id])
    assert run.data.tags["mlflow.runName"] == tr.run_id and run.info.status == "FINISHED"
    assert run.data.params["rollout.group_size"] == str(cfg.rollout.group_size)
    for key in _expected(rows[0]):
        hist = client.get_metric_history(run.info.run_id, key)
        want = [(r["step"], _expected(r)[key]) for r in rows if key in _expected(r)]
        assert [(m.step, m.value) for m in hist] == want, key
    art = json.loads(open(client.download_artifacts(run.info.run_id, "completions/step_000002.json")).read())
    assert art["columns"][:4] == ["step", "prompt_id", "prompt", "completion"] and len(art["data"]) == G

    # Trackio: its local SQLite database (one JSON object of metrics per log call)
    import sqlite3
    db = sqlite3.connect(tiny / "trackio" / "fasttrain.db")
    logged = {}
    for step, blob in db.execute("select step, metrics from metrics where run_name = ?", (tr.run_id,)):
        logged.setdefault(step, {}).update(json.loads(blob))
    db.close()
    for row in rows:
        for key, v in _expected(row).items():
            assert logged[row["step"]][key] == v, key
    assert logged[0]["probe/train_core"] == probes[0]["train_core"]
    assert [r["completion"] for r in logged[2]["completions"]["_value"]] == samples[1]["answers"]


def test_a_tracker_that_cannot_start_stops_the_run_before_the_model_loads(tiny, tiny_recipe, monkeypatch):
    monkeypatch.setitem(sys.modules, "trackio", None)              # "not installed"
    tr = Trainer(load_config(tiny_recipe(tiny, **{"run.report_to": ["tensorboard", "trackio"]})), progress=False)
    with pytest.raises(ConfigError, match=r"run.report_to: 'trackio' needs the trackio package.*fasttrain\[trackio\]"):
        tr.train()
    assert not tr._setup_done and not (tr.dir / "metrics.jsonl").exists()

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://nowhere")
    tr = Trainer(load_config(tiny_recipe(tiny, **{"run.report_to": ["mlflow"]})), progress=False)
    with pytest.raises(ConfigError, match=r"run.report_to: 'mlflow' failed to start .*MLFLOW_TRACKING_URI"):
        tr.train()
    assert not tr._setup_done


def test_unknown_tracker_names_are_a_config_error():
    with pytest.raises(ConfigError, match=r'run.report_to.*"tensorboard", "wandb", "mlflow", "trackio"'):
        load_config({"run": {"report_to": ["tensorbored"]}})


class _Recorder:
    def __init__(self, name, fail_at=None):
        self.name, self.fail_at, self.logged = name, fail_at, []

    def log(self, values, step):
        if step == self.fail_at:
            raise ConnectionError("server went away")
        self.logged.append((step, values))

    def table(self, columns, rows, step):
        pass

    def flush(self):
        pass

    def finish(self):
        pass


def test_a_tracker_that_fails_later_is_switched_off_and_the_rest_go_on():
    warnings = []
    bad, good = _Recorder("wandb", fail_at=2), _Recorder("tensorboard")
    t = Trackers([bad, good], warnings.append)
    samples = {"step": 0, "prompt_ids": ["p"], "answers": ["a", "b"], "core": [1.0, 0.0], "valid": [True, True],
               "rewards": {"answer": [1.0, 0.0]}}
    for s in (1, 2, 3):
        t.log_step({"step": s, "loss": 0.5, "skipped": False, "kl": float("nan"), "pass_losses": [1.0, 2.0]},
                   {**samples, "step": s})
    assert [s for s, _ in bad.logged] == [1] and [s for s, _ in good.logged] == [1, 2, 3]
    assert good.logged[0][1] == {"train/loss": 0.5, "train/skipped": 0.0, "train/pass_losses/0": 1.0,
                                 "train/pass_losses/1": 2.0, "rewards/answer/mean": 0.5, "rewards/answer/std": 0.5}
    (w,) = warnings
    assert "tracker wandb failed to log (ConnectionError: server went away)" in w and t.names == ["tensorboard"]


def test_the_completions_table_has_one_row_per_answer_and_chat_prompts_as_text():
    from fasttrain.train.trackers import completions_table
    samples = {"step": 3, "prompt_ids": ["a", "b"], "answers": ["x1", "x2", "y1", "y2"], "core": [1.0, 0.0, 0.0, 1.0],
               "valid": [True, False, True, True],
               "rewards": {"answer": [1.0, 0.0, 0.0, 1.0], "format": [1, 1, 0.5, 1]}}
    cols, rows = completions_table(samples, {"a": "plain", "b": [{"role": "system", "content": "s"},
                                                                 {"role": "user", "content": "hi"}]})
    assert cols == ["step", "prompt_id", "prompt", "completion", "valid", "core", "reward_answer", "reward_format"]
    assert rows[1] == [3, "a", "plain", "x2", False, 0.0, 0.0, 1.0]
    assert rows[2] == [3, "b", "system: s\nuser: hi", "y1", True, 0.0, 0.0, 0.5]
