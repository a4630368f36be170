"""The rollout on the real bundled model (slow: one load, module-scoped)."""

import pytest
import torch

from fasttrain.models import chat_prompt_ids, eos_token_ids, extract_answer
from fasttrain.rollout import sample

pytestmark = pytest.mark.slow


def test_greedy_matches_hf_generate_smollm2(smollm2):
    from fasttrain.tasks import load_env

    model, tok = smollm2
    env = load_env("signal-a")
    specs = [env.prompts("train")[0].spec, "What is 2 + 2?"]
    prompts = [chat_prompt_ids(tok, s, env.answer_format) for s in specs]
    eos = eos_token_ids(model, tok)
    r = sample(model, prompts, group_size=1, max_new_tokens=12, temperature=0,
               eos_token_ids=eos, seed=0, pad_token_id=tok.pad_token_id)
    P = r.prompt_len
    with torch.no_grad():
        ref = model.generate(r.input_ids[:, :P], attention_mask=r.attention_mask[:, :P],
                             do_sample=False, max_new_tokens=12, eos_token_id=eos,
                             pad_token_id=tok.pad_token_id)[:, P:]
    T = r.completion_ids.shape[1]
    assert torch.equal(r.completion_ids, ref[:, :T])
    texts = r.completion_texts(tok)
    assert all(isinstance(extract_answer(t), str) for t in texts)
    assert len(set(texts)) == 2
