"""The learning benchmark's one evaluator: scores adapters from any trainer on held-out rows.

What it is: a PEFT-format adapter (or none: the base model) loaded with `peft` on a base model
loaded with `transformers` from a safetensors folder, answers sampled with `model.generate` on
held-out dataset rows, and each answer scored by a reward function of the task's own reward
file. Every adapter is scored on the same rows, with the same chat template, sampling settings
and sampling seeds, so the scores compare trainers and not their evaluation code.
What it is not: part of either trainer. It imports neither fasttrain's trainer, rollout nor
environments, nor TRL; the reward function runs in this process (a benchmark of our own task
files, not of user code).

Score of an answer: the reward function's value (the starter's `correct` is 1 or 0, so a row's
score is its share of correct answers over `samples` answers). Result: per adapter, one score per
held-out row, in row order (fasttrain.train.intervals turns a seeds x rows table into an interval).

Run: python bench/learning_eval.py --dataset D.jsonl --probe-rows 100 --reward rewards.py:correct
     [--adapter DIR ...] [--json OUT]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence


@dataclass(frozen=True)
class EvalSettings:
    system_prompt: str = ""
    answer_prefix: str = ""
    temperature: float = 0.7
    max_new_tokens: int = 16
    samples: int = 1                 # answers per row
    seed: int = 1234                 # sampling seed: the same for every adapter
    batch: int = 50                  # rows per generate call
    dtype: str = "bfloat16"          # the base's precision (16-bit: the benchmark's base for both trainers)


def held_out_rows(dataset: str | Path, probe_rows: int = 0, probe_dataset: str | Path | None = None) -> list[dict]:
    """The held-out rows: the last `probe_rows` of the JSONL dataset, or a probe file of its own
    (the split both trainers hold out)."""
    if probe_dataset:
        return [json.loads(line) for line in Path(probe_dataset).read_text().splitlines() if line.strip()]
    rows = [json.loads(line) for line in Path(dataset).read_text().splitlines() if line.strip()]
    if not 0 < probe_rows < len(rows):
        raise ValueError(f"--probe-rows {probe_rows}: need 0 < N < {len(rows)} rows of {dataset}")
    return rows[-probe_rows:]


def load_file_module(file: str | Path, name: str) -> Any:
    """A rewards file run as the module `name`, registered in sys.modules first (a dataclass in the file
    looks its module up there, as countdown.py's does)."""
    mod_spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[name] = module
    mod_spec.loader.exec_module(module)
    return module


def load_reward(spec: str) -> Callable:
    """'path/to/file.py:function' or 'package.module:function' -> the function."""
    file, _, name = spec.rpartition(":")
    if not file or not name:
        raise ValueError(f"--reward {spec!r}: use file.py:function or module:function")
    if file.endswith(".py"):
        module = load_file_module(file, f"_eval_rewards_{abs(hash(file))}")
    else:
        module = importlib.import_module(file)
    return getattr(module, name)


def messages_of(row: dict, system_prompt: str) -> list[dict[str, str]]:
    raw = row["prompt"]
    msgs = [{"role": "user", "content": raw}] if isinstance(raw, str) else [dict(m) for m in raw]
    if system_prompt and msgs[0]["role"] != "system":
        msgs = [{"role": "system", "content": system_prompt}] + msgs
    return msgs


def load_base(model_dir: str | Path, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype), local_files_only=True,
                                                 use_safetensors=True).eval()
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok


def sample_answers(model, tok, rows: Sequence[dict], s: EvalSettings) -> list[list[tuple[str, list[int]]]]:
    """[row][sample] -> (completion text, completion ids); sampling seeded per (sample, batch)."""
    import torch
    texts = [tok.apply_chat_template(messages_of(r, s.system_prompt), tokenize=False, add_generation_prompt=True)
             + s.answer_prefix for r in rows]
    out: list[list[tuple[str, list[int]]]] = [[] for _ in rows]
    for k in range(s.samples):
        for b in range(0, len(rows), s.batch):
            enc = tok(texts[b:b + s.batch], return_tensors="pt", padding=True, add_special_tokens=False)
            torch.manual_seed(s.seed * 1_000_003 + k * 7919 + b)
            with torch.no_grad():
                gen = model.generate(**enc, do_sample=True, temperature=s.temperature, top_p=1.0, top_k=0,
                                     max_new_tokens=s.max_new_tokens, pad_token_id=tok.pad_token_id)
            new = gen[:, enc["input_ids"].shape[1]:]
            for i, ids in enumerate(new.tolist()):
                ids = _until_eos(ids, tok)
                out[b + i].append((s.answer_prefix + tok.decode(ids, skip_special_tokens=True), ids))
    return out


def _until_eos(ids: list[int], tok) -> list[int]:
    eos = {tok.eos_token_id, tok.pad_token_id}
    for j, t in enumerate(ids):
        if t in eos:
            return ids[:j + 1]
    return ids


def score_rows(reward: Callable, rows: Sequence[dict], answers: list[list[tuple[str, list[int]]]],
               system_prompt: str) -> list[float]:
    """Each row's mean reward over its answers (TRL's reward-function call: chat completions,
    completion_ids and the dataset's columns by name); a None or non-finite reward counts 0."""
    cols = [c for c in rows[0] if c != "prompt"]
    flat = [(r, a) for r, ans in zip(rows, answers) for a in ans]
    kwargs: dict[str, Any] = {c: [r.get(c) for r, _ in flat] for c in cols}
    values = reward(prompts=[messages_of(r, system_prompt) for r, _ in flat],
                    completions=[[{"role": "assistant", "content": a[0]}] for _, a in flat],
                    completion_ids=[a[1] for _, a in flat], **kwargs)
    clean = [float(v) if v is not None and math.isfinite(float(v)) else 0.0 for v in values]
    k = len(answers[0])
    return [sum(clean[i * k:(i + 1) * k]) / k for i in range(len(rows))]


def evaluate(model_dir: str | Path, adapters: Sequence[str | None], rows: Sequence[dict], reward: Callable,
             settings: EvalSettings, log=print) -> list[dict]:
    """Score each adapter (None: the base alone) on `rows`: [{adapter, scores, mean, seconds}]."""
    from peft import PeftModel
    base, tok = load_base(model_dir, settings.dtype)
    results = []
    for a in adapters:
        t0 = time.perf_counter()
        model = PeftModel.from_pretrained(base, str(a)).eval() if a else base
        answers = sample_answers(model, tok, rows, settings)
        scores = score_rows(reward, rows, answers, settings.system_prompt)
        if a:
            base = model.unload()
        res = {"adapter": str(a) if a else None, "scores": scores, "mean": sum(scores) / len(scores),
               "seconds": time.perf_counter() - t0, "first_answers": [a[0][0] for a in answers]}
        log(f"eval {res['adapter'] or 'base'}: {res['mean']:.3f} over {len(rows)} rows ({res['seconds']:.0f} s)")
        results.append(res)
    return results


def bundled_model_dir() -> Path:
    """The safetensors folder of the bundled SmolLM2-135M-Instruct (converted on first use)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
    from fasttrain.models.bundled import bundled_gguf, converted_dir_for
    from fasttrain.models.gguf_conversion import convert_gguf, is_converted
    d = converted_dir_for(bundled_gguf())
    if not is_converted(d):
        convert_gguf(bundled_gguf(), d)
    return d


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", default=None, help="base model folder (default: the bundled SmolLM2-135M)")
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--probe-rows", type=int, default=0)
    ap.add_argument("--probe-dataset", default=None)
    ap.add_argument("--reward", required=True, help="file.py:function or module:function (the core reward)")
    ap.add_argument("--adapter", action="append", default=[], help="PEFT adapter folder (repeatable); none: the base")
    ap.add_argument("--system-prompt", default="")
    ap.add_argument("--answer-prefix", default="")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--samples", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.threads:
        import torch
        torch.set_num_threads(a.threads)
    rows = held_out_rows(a.dataset, a.probe_rows, a.probe_dataset)
    s = EvalSettings(a.system_prompt, a.answer_prefix, a.temperature, a.max_new_tokens, a.samples, a.seed, dtype=a.dtype)
    res = evaluate(a.model_dir or bundled_model_dir(), a.adapter or [None], rows, load_reward(a.reward), s)
    if a.json:
        Path(a.json).write_text(json.dumps({"settings": s.__dict__, "rows": len(rows), "results": res}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
