"""The tiny world with prompts of different lengths, so every micro-batch that spans two prompts
is left-padded (as real prompts are) and attention runs with a padding mask."""
from support.tiny_world import LetterEnv, tiny_policy  # noqa: F401
from fasttrain.envs import Prompt


PADDING = ""   # tools/plan_check.py lengthens every prompt to reach a target token count


class PaddedLetterEnv(LetterEnv):
    def prompts(self, split: str):
        n = 12 if split == "train" else 4
        return [Prompt(f"letters/{split}/{i}", f"Say a word number {i}." + " Please." * (i % 5) + PADDING) for i in range(n)]


def make_env():
    return PaddedLetterEnv()


def tiny_policy_as_loaded(dtype: str = "float32"):
    """tiny_world's model built in `dtype` the way from_pretrained builds a checkpoint: parameters
    in `dtype` from construction, so the rotary inverse frequencies (computed in fp32) stay fp32;
    `tiny_policy` casts a built fp32 model, which casts those buffers too."""
    import torch
    from transformers import LlamaForCausalLM

    model, tok = tiny_policy("float32")
    loaded = LlamaForCausalLM._from_config(model.config, dtype=getattr(torch, dtype))
    loaded.load_state_dict(model.state_dict())
    return loaded, tok


def _hybrid_as_loaded(dtype: str, **shape):
    """A random Qwen3.5 hybrid over tiny_world's bytes, built in `dtype` the way from_pretrained
    builds a checkpoint (as tiny_policy_as_loaded)."""
    import torch
    from transformers import Qwen3_5ForCausalLM

    from fasttrain.models import tiny_qwen3_5
    from support.tiny_world import ByteTokenizer

    model = tiny_qwen3_5(vocab_size=259, seed=0, **shape)
    loaded = Qwen3_5ForCausalLM._from_config(model.config, dtype=getattr(torch, dtype))
    loaded.load_state_dict(model.state_dict())
    return loaded.eval(), ByteTokenizer()


def tiny_hybrid_as_loaded(dtype: str = "float32"):
    """4 layers, 3 Gated DeltaNet + 1 gated attention (the 27B's 3:1), 2 q/k heads of 2 value heads."""
    return _hybrid_as_loaded(dtype, hidden=64, layers=4, interval=4, heads=4, kv_heads=2, head_dim=16,
                             linear_k_heads=2, value_heads_per_key=2, linear_head_dim=16)


def wide_hybrid_as_loaded(dtype: str = "float32"):
    """4 layers alternating (interval 2), 3 value heads per q/k head of 32 dims, wider MLP."""
    return _hybrid_as_loaded(dtype, hidden=96, layers=4, interval=2, heads=6, kv_heads=2, head_dim=16,
                             linear_k_heads=2, value_heads_per_key=3, linear_head_dim=32, intermediate=256)


# Small-width stand-ins of two bundled architectures for the plan's checks at long answers
# (tests/plan/test_long_answer_peaks.py): each keeps its model's layer layout, query heads per KV
# head and embedding tie, at widths where 4,096 new tokens cost seconds on a CPU; context 8,192.
CONTEXT = 8192


def smollm2_shape_as_loaded(dtype: str = "float32"):
    """SmolLM2-135M's layout (Llama, 3 query heads per KV head, tied embeddings) at 2 layers,
    hidden 96, head dim 32, MLP 256, over tiny_world's bytes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from support.tiny_world import ByteTokenizer

    cfg = LlamaConfig(vocab_size=259, hidden_size=96, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=3, num_key_value_heads=1, head_dim=32, max_position_embeddings=CONTEXT,
                      rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(cfg, dtype=getattr(torch, dtype))
    return model.eval(), ByteTokenizer()


def bench_hybrid_shape_as_loaded(dtype: str = "float32"):
    """The benchmark hybrid's layout (3 Gated DeltaNet + 1 gated attention, 4 query heads per KV
    head, 3 value heads per q/k head, untied head) at 4 layers, hidden 64, head dims 16, MLP 192."""
    model, tok = _hybrid_as_loaded(dtype, hidden=64, layers=4, interval=4, heads=4, kv_heads=1, head_dim=16,
                                   linear_k_heads=2, value_heads_per_key=3, linear_head_dim=16, intermediate=192)
    model.config.max_position_embeddings = CONTEXT     # default rope: the inverse frequencies do not depend on it
    return model, tok
