"""Checkpoint manifests: a truncated or edited checkpoint is found on --resume, which says so and
continues from the previous whole one, or stops with a one-line error when none is whole;
--from picks an older kept checkpoint."""
import json
import shutil

import pytest
from typer.testing import CliRunner

from fasttrain.cli import app
from fasttrain.train import Trainer, load_config
from fasttrain.train.checkpoint import CheckpointError, pick_checkpoint, verify_checkpoint


def _metrics(run):
    return [{k: v for k, v in json.loads(l).items() if not k.startswith("seconds")}
            for l in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def finished_run(tiny, tiny_recipe):
    """A 4-step tiny run with checkpoints at steps 2 and 4."""
    tr = Trainer(load_config(tiny_recipe(tiny / "runs", **{"run.steps": 4, "run.checkpoint_every": 2,
                                                            "probe.every": 0})), progress=False)
    tr.train()
    return tr.dir


def _copy(run, name):
    dst = run.parent / name
    shutil.copytree(run, dst)
    return dst


def test_manifest_lists_every_file_with_size_and_sha256(finished_run):
    ck = finished_run / "checkpoints" / "step_000004"
    files = json.loads((ck / "manifest.json").read_text())["files"]
    assert {"trainer_state.json", "trainer_state.safetensors", "adapter/adapter_model.safetensors",
            "adapter/adapter_config.json"} <= set(files)
    import hashlib
    blob = (ck / "trainer_state.safetensors").read_bytes()
    assert files["trainer_state.safetensors"] == {"size": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    assert verify_checkpoint(ck) is None


def test_a_truncated_newest_checkpoint_resumes_from_the_previous_one(finished_run):
    before = _metrics(finished_run)
    f = finished_run / "checkpoints" / "step_000004" / "trainer_state.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    ckpt, notes = pick_checkpoint(finished_run / "checkpoints")
    assert ckpt.name == "step_000002"
    assert notes == [f"checkpoint step_000004 is damaged: trainer_state.safetensors has 100 bytes, the manifest "
                     f"says {json.loads((f.parent / 'manifest.json').read_text())['files'][f.name]['size']}"]
    tr = Trainer.resume(finished_run, progress=False)
    export = tr.train()
    assert _metrics(finished_run) == before                # steps 3 and 4 again, the same to the bit
    assert any("step_000004 is damaged" in w["message"] for w in export["warnings"])
    assert verify_checkpoint(finished_run / "checkpoints" / "step_000004") is None   # written whole again


def test_an_edited_state_is_damaged_and_none_whole_is_a_clear_error(finished_run):
    st = finished_run / "checkpoints" / "step_000004" / "trainer_state.json"
    st.write_text(st.read_text().replace('"nonfinite_in_row": 0', '"nonfinite_in_row": 2'))
    assert "trainer_state.json does not match its SHA-256" in verify_checkpoint(st.parent)
    (finished_run / "checkpoints" / "step_000002" / "adapter" / "adapter_model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="step_000004 is damaged.*step_000002 is damaged: "
                                              "adapter/adapter_model.safetensors is missing"):
        pick_checkpoint(finished_run / "checkpoints")
    res = CliRunner().invoke(app, ["run", "--resume", str(finished_run), "--no-progress"])
    assert res.exit_code == 2 and "no checkpoint can be resumed from" in res.output
    assert "Traceback" not in res.output and res.exception is None or isinstance(res.exception, SystemExit)


def test_from_resumes_an_older_kept_checkpoint(finished_run):
    before = _metrics(finished_run)
    res = CliRunner().invoke(app, ["run", "--resume", str(finished_run), "--from", "step_000002", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert "resumed" in res.output and "at step 2 from step_000002" in res.output
    assert _metrics(finished_run) == before
    res = CliRunner().invoke(app, ["run", "--resume", str(finished_run), "--from", "step_3", "--no-progress"])
    assert res.exit_code == 2 and "--from step_3: there is no such checkpoint" in res.output
    assert "kept: step_000002, step_000004" in res.output
