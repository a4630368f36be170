"""The plan against measured allocator bytes at long answers: every phase's planned peak within 15%
of the peak measured during a real training step, at 1,024, 2,048 and 4,096 new tokens, for
SmolLM2's layout and the benchmark hybrid's.

How it stays cheap (seconds, not the 18-20 minutes one 1,024-token step of the real widths took):
- Widths. Each model keeps its layout (SmolLM2: Llama, 3 query heads per KV head, tied embeddings,
  2 layers; the hybrid: 3 Gated DeltaNet layers and 1 gated attention layer, 4 query heads per KV
  head, 3 value heads per q/k head, untied head) at small widths and a byte vocabulary
  (tests/support/padded_world.py). The plan's formulas take every width and the layer count as
  inputs; what long answers add are the terms that grow with the tokens (the KV cache with
  prompt + answer, the update's inputs and logits head with the answer, attention with its
  square), and those are what this checks. The real widths at 1,024 new tokens are in
  bench/results (tools/plan_check.py, the same measurement).
- The rollout's decode. A step's bytes do not grow with its column except the attention scores
  over the written keys (rows x heads x columns x 4 bytes: 2 x 4 x 4,150 x 4 = 133 KB here, a few
  per cent of the phase), and the static cache, the token buffers and the rotary tables are
  allocated at full width (prompt + max_new_tokens) before the first token. So the rollout runs
  for real at max_new_tokens with answers ending within a few tokens (half the vocabulary ends a
  row): the bytes of a full-length rollout without its 4,096 decode steps.
  tests/plan/test_run_at_4k.py decodes every answer to 4,096 tokens and checks that run's phases:
  it is this table's 4,096-token row of SmolLM2's layout.
- The scores and the update need full-length answers: the rollout's answers are extended to
  max_new_tokens with random tokens (their values do not change any byte) before the phase ends,
  as a full-length rollout returns them. The warm-up step (the AdamW moments, the kernels' scratch)
  updates on 8-token answers.
- One prompt, two answers, one micro-batch of both, fp32, NF4 + LoRA r 4, gradient checkpointing.
"""
import dataclasses

import pytest
import torch

TOL = 0.15
WARM_UP_TOKENS = 8
VOCAB = 259                                 # tiny_world's bytes, both models


def _full_length_answers(monkeypatch, vocab: int):
    """fasttrain.rollout.sample as the trainer calls it, with rows ending early (every odd id is an
    end) and its answers then extended to max_new_tokens (step 1: WARM_UP_TOKENS)."""
    import fasttrain.rollout as rollout

    real, calls = rollout.sample, [0]
    ends = list(range(3, vocab, 2))

    def sample(model, prompt_ids, *, max_new_tokens, eos_token_ids, **kw):
        calls[0] += 1
        r = real(model, prompt_ids, max_new_tokens=max_new_tokens, eos_token_ids=ends, **kw)
        T = max_new_tokens if calls[0] > 1 else WARM_UP_TOKENS
        B, P = r.input_ids.shape[0], r.prompt_len
        gen = torch.Generator().manual_seed(calls[0])
        ids = torch.randint(4, vocab, (B, T), generator=gen).mul_(2).remainder_(vocab)   # even ids: no end
        live = torch.ones(B, T, dtype=torch.bool)
        mask = torch.cat([r.attention_mask[:, :P], live.long()], 1)
        return dataclasses.replace(
            r, input_ids=torch.cat([r.input_ids[:, :P], ids], 1), attention_mask=mask,
            position_ids=(mask.cumsum(1) - 1).clamp_(min=0), completion_ids=ids, completion_mask=live,
            action_mask=live, lengths=torch.full((B,), T), logprobs=torch.full((B, T), -3.0),
            finished=torch.zeros(B, dtype=torch.bool))
    monkeypatch.setattr(rollout, "sample", sample)
    return calls


# SmolLM2's layout at 4,096 tokens: tests/plan/test_run_at_4k.py, every answer decoded in full
CASES = [(T, m) for T in (1024, 2048, 4096) for m in ("smollm2_shape_as_loaded", "bench_hybrid_shape_as_loaded")
         if (T, m) != (4096, "smollm2_shape_as_loaded")]


@pytest.mark.parametrize("T,model", CASES)
def test_phases_match_measured_peaks_at_long_answers(tmp_path, monkeypatch, model, T):
    from support.recipes import tiny_recipe
    from support.measured_step import planned_and_measured
    from fasttrain.train import Trainer, load_config

    r = tiny_recipe(tmp_path, 1, 2, T, 2)
    r["policy"]["model"] = f"support.padded_world:{model}"
    r["probe"]["every"] = 100                   # no probe in the two steps
    trainer = Trainer(load_config(r), progress=False)
    calls = _full_length_answers(monkeypatch, VOCAB)
    got = planned_and_measured(trainer, monkeypatch)
    assert calls[0] == 2                        # both steps' rollouts went through the stand-in
    for phase, (planned, measured) in got.items():
        assert abs(planned - measured) <= TOL * measured, (phase, planned, measured)
