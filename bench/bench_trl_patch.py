"""TRL GRPOTrainer with and without `fasttrain.integrations.trl.patch`: peak memory and time, side by side.

What it runs: TRL 1.16's own GRPOTrainer (bf16 autocast on, TRL's default and its fastest CPU setting) on a
SmolLM2-135M-shaped policy (hidden 576, 9 heads, 3 KV heads, MLP 1536; random seeded weights, fewer layers
than the real 30 so that the head, not the backbone, is what differs) with LoRA on q/v, and one fixed batch of
prompts + completions. Per implementation, in the same process and interleaved rep by rep:
  logprob/no-grad   `_get_per_token_logps_and_entropies` under no_grad (the old-policy and reference passes)
  policy/loss+bwd   `compute_loss` + backward (the policy's log-probs and entropies with gradient, TRL's loss)
  step              old pass + reference pass (adapters off) + loss + backward: a num_iterations>1, beta>0 TRL
                    step without generation (generation never reaches the LM head's fused path; unchanged).
Peak memory: the process's peak resident set during the phase minus its resident set before it (VmHWM after
resetting it via /proc/self/clear_refs, after malloc_trim so freed heap pages are not counted as live).
What it is not: a GPU number, or the real SmolLM2 weights (memory and time do not depend on them).
Floor: the patched head needs no [tokens, vocab] buffer at all; what remains is the backbone's activations.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import statistics
import sys
import time
from pathlib import Path

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine_name, row, versions, write_csv  # noqa: E402


_LIBC = ctypes.CDLL("libc.so.6")


def resident_kib() -> tuple[int, int]:
    rss = hwm = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1])
    return rss, hwm


def measure(fn) -> tuple[float, float]:
    """(seconds, peak resident growth in MiB) of fn()."""
    gc.collect()
    _LIBC.malloc_trim(0)  # hand freed heap pages back, so the baseline is what is really live
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before, _ = resident_kib()
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    _, peak = resident_kib()
    return seconds, (peak - before) / 1024


def build_trainer(vocab: int, layers: int, out_dir: str):
    from datasets import Dataset
    from peft import LoraConfig
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                         rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1)
    model = LlamaForCausalLM(config)
    tok = Tokenizer(models.WordLevel(vocab={"<pad>": 0, "<eos>": 1, "<unk>": 2}, unk_token="<unk>"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    args = GRPOConfig(output_dir=out_dir, use_cpu=True, bf16=True, per_device_train_batch_size=8,
                      num_generations=4, max_completion_length=128, report_to=[], save_strategy="no",
                      disable_tqdm=True, loss_type="dapo", beta=0.04, num_iterations=2, top_entropy_quantile=0.2,
                      temperature=0.7)
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                          train_dataset=Dataset.from_list([{"prompt": "x"}] * 8), processing_class=tokenizer,
                          peft_config=LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"]))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def make_inputs(trainer, vocab: int, batch: int, prompt: int, completion: int) -> dict:
    g = torch.Generator().manual_seed(1)
    completion_mask = torch.ones(batch, completion, dtype=torch.long)
    for b in range(batch):  # ragged completions, as sampling gives
        completion_mask[b, int(completion * (0.5 + 0.5 * (b + 1) / batch)):] = 0
    inputs = {
        "prompt_ids": torch.randint(3, vocab, (batch, prompt), generator=g),
        "prompt_mask": torch.ones(batch, prompt, dtype=torch.long),
        "completion_ids": torch.randint(3, vocab, (batch, completion), generator=g),
        "completion_mask": completion_mask,
        "advantages": torch.randn(batch, generator=g),
        "num_items_in_batch": completion_mask.sum().float(),
    }
    with torch.no_grad():
        old, _ = logprob_pass(trainer, inputs, reference=False)
        ref, _ = logprob_pass(trainer, inputs, reference=True)
    return {**inputs, "old_per_token_logps": old, "ref_per_token_logps": ref}


def logprob_pass(trainer, inputs, *, reference: bool):
    from trl.trainer.utils import use_adapter

    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    keep = inputs["completion_ids"].size(1)
    with torch.no_grad():
        if reference:
            with use_adapter(trainer.accelerator.unwrap_model(trainer.model), adapter_name=None):
                return trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, keep)[:2]
        return trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, keep, compute_entropy=True)[:2]


def loss_and_backward(trainer, inputs):
    trainer.model.zero_grad(set_to_none=True)
    trainer.compute_loss(trainer.model, inputs).backward()


def step(trainer, inputs):
    old, _ = logprob_pass(trainer, inputs, reference=False)
    ref, _ = logprob_pass(trainer, inputs, reference=True)
    loss_and_backward(trainer, {**inputs, "old_per_token_logps": old, "ref_per_token_logps": ref})


def run(vocab: int, label: str, a) -> list[dict]:
    import tempfile

    import fasttrain.integrations.trl as fasttrain_trl

    trainer = build_trainer(vocab, a.layers, tempfile.mkdtemp(prefix="bench_trl_"))
    inputs = make_inputs(trainer, vocab, a.batch, a.prompt, a.completion)
    phases = {"logprob/no-grad": lambda: logprob_pass(trainer, inputs, reference=False),
              "policy/loss+bwd": lambda: loss_and_backward(trainer, inputs),
              "step": lambda: step(trainer, inputs)}
    results = {(p, impl): [] for p in phases for impl in ("trl", "fasttrain")}
    for impl in ("trl", "fasttrain"):  # warm-up: one cheap pass each (thread pools, first-touch allocations)
        (fasttrain_trl.patch if impl == "fasttrain" else fasttrain_trl.unpatch)(trainer)
        phases["logprob/no-grad"]()
    for rep in range(a.reps):
        order = ("trl", "fasttrain") if rep % 2 == 0 else ("fasttrain", "trl")
        for impl in order:
            (fasttrain_trl.patch if impl == "fasttrain" else fasttrain_trl.unpatch)(trainer)
            for name, fn in phases.items():
                results[(name, impl)].append(measure(fn))
    scored = int(inputs["completion_mask"].sum())
    case = f"{label}, V={vocab}, {a.layers} layers, B={a.batch}, prompt {a.prompt}, completion {a.completion}"
    print(f"\n{case} ({scored} scored tokens; TRL's CPU head scores all {a.batch * (a.prompt + a.completion - 1)})")
    print(f"{'phase':18s} {'TRL ms':>9s} {'ours ms':>9s} {'time x':>7s} {'TRL MiB':>9s} {'ours MiB':>9s} {'mem x':>7s}")
    rows = []
    for name in phases:
        t_trl = statistics.median(s for s, _ in results[(name, "trl")])
        t_ft = statistics.median(s for s, _ in results[(name, "fasttrain")])
        m_trl = statistics.median(m for _, m in results[(name, "trl")])
        m_ft = statistics.median(m for _, m in results[(name, "fasttrain")])
        print(f"{name:18s} {t_trl * 1e3:9.0f} {t_ft * 1e3:9.0f} {t_ft / t_trl:7.2f} {m_trl:9.1f} {m_ft:9.1f} "
              f"{m_ft / max(m_trl, 1e-9):7.2f}")
        for impl, t, m in (("trl", t_trl, m_trl), ("fasttrain", t_ft, m_ft)):
            rows += [row("trl_patch", f"{case} {name}", impl, "time", t * 1e3, "ms"),
                     row("trl_patch", f"{case} {name}", impl, "peak_rss_growth", m, "MiB")]
        rows += [row("trl_patch", f"{case} {name}", "ratio", "ours/trl time", t_ft / t_trl, "x"),
                 row("trl_patch", f"{case} {name}", "ratio", "ours/trl peak memory", m_ft / max(m_trl, 1e-9), "x")]
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--csv", default="")
    ap.add_argument("--quick", action="store_true", help="one vocabulary, one rep")
    ap.add_argument("--vocab", default="49152,151936", help="comma-separated vocabulary sizes")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--completion", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.quick:
        a.reps = 1
    print(f"TRL GRPOTrainer with vs without fasttrain.integrations.trl.patch on {machine_name()} "
          f"({torch.get_num_threads()} threads; a shared machine: ratios are measured side by side, interleaved)")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions().items()))
    labels = {49152: "SmolLM2-135M head", 151936: "synthetic 151,936-vocab head"}
    vocabs = [int(v) for v in a.vocab.split(",")][: 1 if a.quick else None]
    cases = [(v, labels.get(v, "synthetic head")) for v in vocabs]
    rows = []
    for vocab, label in cases:
        rows += run(vocab, label, a)
    print("\nTargets: peak memory of the log-prob phases <= 0.3x TRL's, step time <= 1.0x TRL's.")
    if a.csv:
        write_csv(rows, Path(a.csv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
