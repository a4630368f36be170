"""Step 0, two trainers: what fasttrain and TRL 1.16's GRPOTrainer generate from and score, on the bundled
SmolLM2-135M-Instruct and the starter task's first rows.

The same dataset rows (the starter's prompts as TRL-conversational rows: the task's system message, then the
user turn) go to fasttrain's dataset environment and to a GRPOTrainer; TRL's own code produces its side:
- the prompt token ids: TRL's `_tokenize_prompts` (its chat template call, generation prompt, special tokens)
  against fasttrain's `prompt_token_ids`, the ids its sampler starts from;
- the stop: TRL's `eos_token_ids` (the tokenizer's EOS and the model's generation config's) against
  fasttrain's `eos_ids`, and TRL's generation config: temperature alone, no top-k / top-p / min-p /
  repetition penalty, so TRL draws each token from softmax(logits / T) over the whole vocabulary, as fasttrain's
  sampler does (its draws against that distribution: tests/rollout/test_sampler_distribution.py);
- the answer each reward function receives: fasttrain's sampled answers go to TRL through its `rollout_func`,
  and the keyword arguments TRL's reward step passes (prompts, completions in the chat layout, completion_ids with
  the EOS, the dataset's columns) equal those fasttrain's environment builds from its own decoded answer texts;
- the distribution at step 0: TRL's log-probs of those answers under the policy it trains
  (`_get_per_token_logps_and_entropies`, temperature applied) against the behaviour log-probs fasttrain's sampler
  recorded while drawing them. Bound (float32, u = 2^-24): a log-prob is reached through D nested sums of at most
  n terms, each side off by about D·n·u of the largest |logit / T| to first order; D = 32 (30 layers, the
  embedding and the head), n = 1536 (the MLP's inner sum; hidden 576 and the prompts' 60 positions are shorter):
  2·32·1536·u = 5.9e-3 of the largest |logit| / T, for the two sides. A different template, system prompt,
  temperature or truncation moves log-probs by far more (whole nats); the measured difference is ~1e-5.

The real model, unmarked (it runs in `make test`): one load per side and a float64 copy, 16 answers of at most
16 tokens, a few scoring forwards.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from fasttrain.envs.dataset import DatasetEnvironment  # noqa: E402
from fasttrain.models import chat_messages_ids, load_policy  # noqa: E402
from fasttrain.models.bundled import bundled_gguf, converted_dir_for  # noqa: E402
from fasttrain.train.answers import answer_token_ids, eos_ids, prompt_token_ids, sample_answers  # noqa: E402

STARTER = Path(__file__).resolve().parents[2] / "python" / "fasttrain" / "tasks" / "starter"
SYSTEM = "Answer with the number only."           # the learning benchmark's system prompt
G, NEW, TEMPERATURE = 4, 16, 0.7
U32 = 2.0 ** -24
TRL_ONLY = ("trainer_state", "log_extra", "log_metric")     # TRL's trainer hooks, not dataset inputs


def rows() -> list[dict]:
    """The starter's first 4 rows as TRL-conversational rows (system message, user turn)."""
    raw = [json.loads(x) for x in (STARTER / "data.jsonl").read_text().splitlines()[:4]]
    return [{**r, "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": r["prompt"]}]}
            for r in raw]


def recorded(fn, seen):
    @functools.wraps(fn)
    def wrapped(**kw):
        out = fn(**kw)
        seen[fn.__name__] = (kw, out)
        return out
    return wrapped


@torch.no_grad()
def plain_logprobs(model, seqs) -> list[torch.Tensor]:
    """Each (prompt ids, completion ids)'s completion log-probs at the temperature, from the model's own
    forward, in float64: the answers to one prompt in one batch, right-padded (a causal model's earlier
    positions never see the padding)."""
    out = []
    for a in range(0, len(seqs), G):
        group = seqs[a:a + G]
        P, L = len(group[0][0]), max(len(p) + len(c) for p, c in group)
        x = torch.tensor([list(p) + list(c) + [0] * (L - len(p) - len(c)) for p, c in group])
        logits = model(input_ids=x).logits.double() / TEMPERATURE
        for r, (_, c) in enumerate(group):
            z = logits[r, P - 1:P - 1 + len(c)]
            out.append(z.log_softmax(-1).gather(1, torch.tensor(c)[:, None])[:, 0])
    return out


def test_step0_prompts_stop_reward_inputs_and_distribution_equal_trls(tmp_path):
    import importlib.util
    spec = importlib.util.spec_from_file_location("starter_rewards", STARTER / "rewards.py")
    rewards = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rewards)
    data = rows()
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    (tmp_path / "probe.jsonl").write_text(json.dumps({"prompt": "What is 1 plus 1?", "answer": 2}) + "\n")
    env = DatasetEnvironment(dataset=str(tmp_path / "data.jsonl"), probe_dataset=str(tmp_path / "probe.jsonl"),
                             rewards=[f"{STARTER / 'rewards.py'}:{n}" for n in ("correct", "concise")])
    try:
        # fasttrain's side: its policy loader, prompt ids, stop ids and sampler, as its Trainer runs them
        model, tok = load_policy()
        prompts = env.prompts("train")
        ft_prompt_ids = prompt_token_ids(tok, env, prompts)
        roll, texts = sample_answers(model, tok, env, prompts, group_size=G, max_new_tokens=NEW,
                                     temperature=TEMPERATURE, seed=3)
        ids = answer_token_ids(roll)
        eos = eos_ids(model, tok)
        assert any(c[-1] in eos for c in ids) and any(len(c) == NEW and c[-1] not in eos for c in ids)
        assert all(not set(c[:-1]) & set(eos) for c in ids)          # a row ends at its first EOS

        # TRL's side: the model and tokenizer as a TRL user loads them, TRL's own code from there
        path = converted_dir_for(bundled_gguf())
        trl_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
        trl_tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        seen: dict = {}
        by_user = {}
        for b, p in enumerate(prompts):
            by_user.setdefault(env.chat_messages(p)[-1]["content"], []).extend(ids[b * G:(b + 1) * G])

        def rollout_func(trl_prompts, trainer):
            taken: dict[str, int] = {}
            out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
            own_ids = trainer._tokenize_prompts(trl_prompts)[0]           # TRL's own chat templating
            for msgs, pid in zip(trl_prompts, own_ids):
                user = msgs[-1]["content"]
                i = taken[user] = taken.get(user, -1) + 1
                out["prompt_ids"].append(list(pid))
                out["completion_ids"].append(by_user[user][i])
                out["logprobs"].append([0.0] * len(by_user[user][i]))
            seen["trl_prompt_ids"] = [list(x) for x in own_ids]
            return out

        args = GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False,    # TRL's default: True
                          num_generations=G, max_completion_length=NEW, temperature=TEMPERATURE, top_p=1.0, top_k=0,
                          per_device_train_batch_size=G * len(data), shuffle_dataset=False, beta=0.0, seed=0,
                          report_to=[], save_strategy="no", disable_tqdm=True)
        trainer = GRPOTrainer(model=trl_model, args=args, train_dataset=Dataset.from_list(data),
                              processing_class=trl_tok, rollout_func=rollout_func,
                              reward_funcs=[recorded(rewards.correct, seen), recorded(rewards.concise, seen)])
        trainer.model.train()
        batch = [r for r in data for _ in range(G)]
        out = trainer._generate_and_score_completions(batch)

        # the prompt ids each trainer generates from
        assert seen["trl_prompt_ids"] == [p for p in ft_prompt_ids for _ in range(G)]
        assert tok.decode(ft_prompt_ids[0]).startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n")
        assert tok.decode(ft_prompt_ids[0]).endswith("<|im_end|>\n<|im_start|>assistant\n")
        user_only = [[m for m in r["prompt"] if m["role"] == "user"] for r in data]   # the template's own system turn
        assert [list(x) for x in trainer._tokenize_prompts(user_only)[0]] == [chat_messages_ids(tok, m)
                                                                               for m in user_only]
        # the stop, and a sampling distribution of temperature alone
        assert sorted(trainer.eos_token_ids) == sorted(eos)
        gc = trainer.generation_config
        assert gc.do_sample and gc.temperature == TEMPERATURE and gc.max_new_tokens == NEW
        assert gc.top_k in (0, None) and gc.top_p in (1.0, None) and gc.min_p is None
        assert gc.repetition_penalty in (1.0, None)

        # the answer each reward function receives
        prompts_rep = [p for p in prompts for _ in range(G)]
        mine = env.reward_inputs(prompts_rep, texts, ids)
        for name in ("correct", "concise"):
            trl_kw = {k: v for k, v in seen[name][0].items() if k not in TRL_ONLY}
            assert trl_kw == mine, name
        scores = env.score_many(prompts_rep, texts, completion_ids=ids)
        assert [s.channels["correct"] for s in scores] == [float(x) for x in seen["correct"][1]]
        assert 0 < sum(seen["correct"][1]) < len(ids)                 # some right, some wrong: the check has teeth

        # the distribution at step 0: TRL's log-probs of the same answers and fasttrain's behaviour log-probs,
        # each against the exact (float64) model, no further from it than twice a plain float32 forward
        p_ids, c_ids = out["prompt_ids"], out["completion_ids"]
        with torch.no_grad():
            trl_logp = trainer._get_per_token_logps_and_entropies(
                trainer.model, torch.cat([p_ids, c_ids], 1), torch.cat([out["prompt_mask"], out["completion_mask"]], 1),
                c_ids.shape[1])[0].double()
        mask = out["completion_mask"].bool()
        T = min(mask.shape[1], roll.logprobs.shape[1])
        assert torch.equal(mask[:, :T], roll.completion_mask[:, :T].bool()) and not mask[:, T:].any()
        seqs = [(ft_prompt_ids[b // G], ids[b]) for b in range(len(ids))]
        exact = plain_logprobs(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, local_files_only=True),
                               seqs)
        fp32 = plain_logprobs(trl_model, seqs)                  # the model's own forward, without TRL's head
        ft = [roll.logprobs[b, :len(c)].double() for b, c in enumerate(ids)]
        trl = [trl_logp[b, :len(c)] for b, c in enumerate(ids)]
        err = {k: max(float((a - x).abs().max()) for a, x in zip(v, exact)) for k, v in
               (("fp32", fp32), ("fasttrain", ft), ("trl", trl))}
        bound = 2 * err["fp32"] + 8 * U32 * max(float(x.abs().max()) for x in exact)
        assert err["fasttrain"] <= bound and err["trl"] <= bound, (err, bound)
        print(f"\nstep-0 log-prob error against float64: {err} (bound {bound:.2e}), {sum(map(len, ids))} tokens")
    finally:
        env.close()
