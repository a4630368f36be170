"""A tiny offline GRPO setup for the TRL integration tests: seeded random Llama, word-level tokenizer."""
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

WORDS = [f"w{i}" for i in range(253)]  # + 3 specials = 256 tokens


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def tiny_llama(seed: int = 0, vocab_size: int = 256, hidden: int = 64, layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, pad_token_id=0, eos_token_id=1, bos_token_id=None,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # a sharper head than the default init, so entropies spread and ratios move
        model.lm_head.weight.mul_(8.0)
    return model


def prompts_dataset(n: int = 8, seed: int = 0) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, len(WORDS), (int(torch.randint(3, 7, (1,), generator=g)),), generator=g)
        rows.append({"prompt": " ".join(WORDS[i] for i in ids)})
    return Dataset.from_list(rows)


def reward_even_words(completions, **kwargs):
    # Toy verifiable reward: the share of completion words with an even index.
    out = []
    for text in completions:
        words = text.split()
        out.append(sum(int(w[1:]) % 2 == 0 for w in words if w.startswith("w")) / max(len(words), 1))
    return out
