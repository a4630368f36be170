"""Small checkpoints on disk and what the loading tests measure of them (tests/models, the export
tests in tests/train and tests/nn): the hybrid's text config, a word-level tokenizer, the same-bytes check of two loaded
models and the peak of live tensor bytes during a call."""
import torch
from torch.profiler import ProfilerActivity, profile

from fasttrain.plan.run_shape import RunShape

# A load's planned peak is at most this much above the measured one (the plan's `load` phase).
LOAD_PEAK_TOL = 0.15
LOAD_SHAPE = RunShape(prompts=1, group=2, prompt_tokens=8, new_tokens=4, micro_batch=2)

# A Qwen3.5 text tower with every piece present (gated attention, Gated DeltaNet layers), 64 words.
HYBRID_TEXT = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                   linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, eos_token_id=2,
                   pad_token_id=0, tie_word_embeddings=False)


def word_tokenizer(path):
    """Saves to `path` a word-level tokenizer over <pad>, <unk>, <eos> and w3..w63."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2, **{f"w{i}": i for i in range(3, 64)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(path)


def assert_same_bytes(a, b) -> int:
    """Two loaded models hold the same tensors, byte for byte, the same tying and generation config;
    returns the number of tensors."""
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and sa[k].shape == sb[k].shape, k
        assert torch.equal(sa[k].view(torch.uint8) if sa[k].dtype == torch.bool else sa[k], sb[k]), k
    tied = [(n, m) for n, m in (("lm_head", a), ("lm_head", b)) if hasattr(m, "lm_head")]
    assert len({m.lm_head.weight is m.get_input_embeddings().weight for _, m in tied}) == 1
    assert a.generation_config.to_dict() == b.generation_config.to_dict()
    return len(sa)


def allocated_peak(fn):
    """(result, peak live bytes, live bytes at the end) of fn(), counted from 0 at its start."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nb in events:
        live += nb
        peak = max(peak, live)
    return out, peak, live
