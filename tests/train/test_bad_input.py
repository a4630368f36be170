"""Bad input at load: text that is not UTF-8, a row without a column a reward needs, a prompt
longer than rollout.max_prompt_tokens, a model fasttrain cannot load. Each is an error naming
the file and the row (or the model folder and what is supported), or, with env.skip_bad_rows,
rows left out and counted in the run's report."""
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

pytest.importorskip("datasets")
from fasttrain.cli import app  # noqa: E402
from fasttrain.envs.dataset import DatasetEnvironment, DatasetError  # noqa: E402
from fasttrain.tasks.starter import write_starter  # noqa: E402
from fasttrain.train import ConfigError, Trainer, load_config  # noqa: E402


def _task(tmp_path: Path, tweak) -> Path:
    """The starter task's first 20 rows (prompt, answer), its data.jsonl changed by tweak(lines)."""
    write_starter(tmp_path / "task")
    data = tmp_path / "task" / "data.jsonl"
    lines = data.read_bytes().splitlines()[:20]
    data.write_bytes(b"\n".join(tweak(lines)) + b"\n")
    return data


def _env(data: Path, **kw) -> DatasetEnvironment:
    return DatasetEnvironment(dataset=str(data), rewards=[f"{data.parent / 'rewards.py'}:correct"], probe_rows=4, **kw)


def test_text_that_is_not_utf8_names_its_row_or_is_skipped(tmp_path):
    def latin1(lines):
        lines[5] = lines[5].replace(b"What", "Wh\u00e4t".encode("latin-1"))
        return lines
    data = _task(tmp_path, latin1)
    with pytest.raises(DatasetError, match=r"env.dataset: '.*data.jsonl' row 5 \(line 6\) is not UTF-8 text "
                                           r"\(byte 14 of the line is 0xe4\). Re-save the file as UTF-8"):
        _env(data)
    env = _env(data, skip_bad_rows=True)
    assert len(env.prompts("train")) == 15 and len(env.skipped_rows) == 1
    assert "row 5 (line 6) is not UTF-8" in env.skipped_rows[0]
    env.close()


def test_a_row_without_a_column_a_reward_needs_names_the_row(tmp_path):
    def drop_answer(lines):
        row = json.loads(lines[3])
        del row["answer"]
        lines[3] = json.dumps(row).encode()
        return lines
    data = _task(tmp_path, drop_answer)
    with pytest.raises(DatasetError, match=r"env.dataset '.*data.jsonl' row 3: no value in column 'answer', which "
                                           r"reward 'correct' needs. Fill it in, or set env.skip_bad_rows"):
        _env(data)
    env = _env(data, skip_bad_rows=True)
    assert [p.id for p in env.prompts("train")] == [f"dataset/{i}" for i in range(16) if i != 3]
    env.close()
    no_column = _task(tmp_path / "b", lambda lines: [json.dumps({"prompt": json.loads(x)["prompt"]}).encode()
                                                     for x in lines])
    with pytest.raises(DatasetError, match=r"reward 'correct' takes the argument\(s\) \['answer'\], but env.dataset "
                                           r"'.*' has no such column"):
        _env(no_column, skip_bad_rows=True)


def test_a_prompt_over_max_prompt_tokens_names_its_row_or_is_counted(tiny, tiny_recipe):
    def long_row(lines):
        row = json.loads(lines[2])
        row["prompt"] = "Add these up: " + " + ".join(["1"] * 60)
        lines[2] = json.dumps(row).encode()
        return lines
    data = _task(tiny, long_row)
    recipe = tiny_recipe(tiny / "runs", **{
        "run.steps": 1, "probe.every": 0, "probe.prompts": 4, "env.name": "dataset", "env.dataset": str(data),
        "env.probe_rows": 4, "env.rewards": [f"{data.parent / 'rewards.py'}:correct"],
        "advantages.priorities": {"correct": 1.0}, "rollout.max_prompt_tokens": 120})
    tr = Trainer(load_config(recipe), progress=False)
    with pytest.raises(ConfigError, match=r"env.dataset '.*data.jsonl' row 2: the rendered prompt is \d+ tokens, "
                                          r"over rollout.max_prompt_tokens = 120. Shorten it"):
        tr.train()
    tr.env.close()
    recipe["env"]["skip_bad_rows"] = True
    tr = Trainer(load_config(recipe), progress=False)
    export = tr.train()
    tr.env.close()
    assert export["skipped_rows"]["count"] == 1 and "row 2: the rendered prompt" in export["skipped_rows"]["reasons"][0]
    assert "dataset/2" not in {i for s in (tr.dir / "samples.jsonl").read_text().splitlines()
                               for i in json.loads(s)["prompt_ids"]}
    assert "## Rows left out (env.skip_bad_rows): 1" in (tr.dir / "report.md").read_text()


@pytest.mark.parametrize("case", ["family", "no_weights", "no_tokenizer", "bad_weights"])
def test_a_model_fasttrain_cannot_load_is_one_paragraph(case, tmp_path, monkeypatch):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2" if case == "family" else "llama"}))
    if case != "no_weights":                   # 16 zero bytes: a file whose header cannot be read
        (folder / "model.safetensors").write_bytes(b"\0" * 16)
    if case != "no_tokenizer":
        (folder / "tokenizer.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["run", "--no-progress", "--set", f"policy.model={json.dumps(str(folder))}",
                                   "--set", "run.steps=1", "--set", "run.device=\"cpu\""])
    out = " ".join(res.output.split())
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    # the console breaks a path longer than its width anywhere (pytest-xdist's tmp paths are): compare without spaces
    assert f"policy.model='{folder}':fasttraincannotloadit:" in "".join(out.split())
    assert {"family": "model_type 'gpt2' is not supported", "no_weights": "no *.safetensors weights",
            "no_tokenizer": "has no tokenizer", "bad_weights": "header"}[case] in out
    assert "fasttrain trains llama, qwen2, qwen3, mistral" in out and "or a .gguf file" in out


def test_an_environment_with_tools_counts_the_tool_schemas(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert CliRunner().invoke(app, ["init", "calc", "--tools"]).exit_code == 0
    from support.agent_files import tiny_tool_policy
    from fasttrain.models import chat_messages_ids
    from fasttrain.train.prompt_length import _rendered_lengths
    cfg = load_config(str(tmp_path / "calc" / "recipe.toml"), ["policy.model=support.agent_files:tiny_tool_policy"])
    tr = Trainer(cfg, progress=False)
    _, tok = tiny_tool_policy()
    prompts = tr.train_prompts[:3]
    with_tools = _rendered_lengths(tok, tr.env, prompts, "")
    plain = [len(chat_messages_ids(tok, tr.env.chat_messages(p))) for p in prompts]     # without the schemas
    schema = json.dumps(tr.env.tool_workers.schemas[0])
    assert all(w > p + len(tok(schema)["input_ids"]) // 2 for w, p in zip(with_tools, plain)), (with_tools, plain)
    tr.env.close()
