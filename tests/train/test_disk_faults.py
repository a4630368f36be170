"""A full, read-only or forbidden disk while a checkpoint or a run file is written: the previous
checkpoint stays whole and resumable, the run stops with the path and the error, and
metrics.jsonl / samples.jsonl written so far stay readable."""
import errno
import json
import os

import pytest

from fasttrain.train import Trainer, TrainingStopped, load_config
from fasttrain.train.checkpoint import CheckpointError, pick_checkpoint


def _steps(path):
    return [json.loads(l)["step"] for l in path.read_text().splitlines()]


def _run(tiny, tiny_recipe):
    return Trainer(load_config(tiny_recipe(tiny / "runs", **{"run.steps": 4, "run.checkpoint_every": 2,
                                                              "probe.every": 0})), progress=False)


@pytest.mark.parametrize("code,where", [(errno.ENOSPC, "safetensors"), (errno.EROFS, "manifest"),
                                        (errno.EACCES, "rename")])
def test_a_failed_checkpoint_write_leaves_the_previous_one_and_stops_clearly(code, where, tiny, tiny_recipe,
                                                                             monkeypatch):
    import fasttrain.train.checkpoint as ckpt_mod
    tr = _run(tiny, tiny_recipe)
    err = OSError(code, os.strerror(code))

    def failing(real, pick):
        def f(*a, **kw):
            target = str(pick(*a))
            if "step_000004" in target:
                raise OSError(code, os.strerror(code), target)
            return real(*a, **kw)
        return f
    if where == "safetensors":
        monkeypatch.setattr(ckpt_mod, "save_file", failing(ckpt_mod.save_file, lambda t, path: path))
    elif where == "manifest":
        monkeypatch.setattr(ckpt_mod, "write_manifest", failing(ckpt_mod.write_manifest, lambda folder: folder))
    else:
        real_rename = type(tr.dir).rename
        monkeypatch.setattr(type(tr.dir), "rename", failing(real_rename, lambda self, dst: dst))
    with pytest.raises(CheckpointError) as info:
        tr.train()
    msg = str(info.value)
    assert msg.startswith("could not write the checkpoint of step 4: ") and err.strerror in msg
    assert f"errno {errno.errorcode[code]}" in msg and "step_000004" in msg
    assert "The previous checkpoint, step_000002, is intact" in msg
    ckpts = tr.dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step_")) == ["step_000002"]
    assert pick_checkpoint(ckpts) == (ckpts / "step_000002", [])
    assert _steps(tr.dir / "metrics.jsonl") == [1, 2, 3, 4] and _steps(tr.dir / "samples.jsonl") == [1, 2, 3, 4]
    monkeypatch.undo()
    Trainer.resume(tr.dir, progress=False).train()
    assert _steps(tr.dir / "metrics.jsonl") == [1, 2, 3, 4]


def test_a_full_disk_while_logging_a_step_stops_with_the_file(tiny, tiny_recipe, monkeypatch):
    import fasttrain.train.trainer as trainer_mod
    tr = _run(tiny, tiny_recipe)
    real = trainer_mod.append_jsonl

    def append(path, row):
        if row["step"] == 3 and str(path).endswith("samples.jsonl"):
            with open(path, "a") as f:                  # half a line made it to the disk
                f.write('{"step": 3, "prompt_ids": [')
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real(path, row)
    monkeypatch.setattr(trainer_mod, "append_jsonl", append)
    with pytest.raises(TrainingStopped, match=r"step 3: cannot write .*samples.jsonl: No space left on device "
                                              r"\(errno ENOSPC\). The last checkpoint, step_000002, is intact"):
        tr.train()
    with pytest.warns(UserWarning, match="line 3 was cut short"):
        from fasttrain.train.run_files import read_jsonl
        assert [r["step"] for r in read_jsonl(tr.dir / "samples.jsonl")] == [1, 2]
    monkeypatch.undo()
    with pytest.warns(UserWarning, match="cut short"):              # the resume reads it too
        Trainer.resume(tr.dir, progress=False).train()
    assert _steps(tr.dir / "samples.jsonl") == [1, 2, 3, 4]
