"""The tiny world with prompts of different lengths, so every micro-batch that spans two prompts
is left-padded (as real prompts are) and attention runs with a padding mask."""
from tiny_world import LetterEnv, tiny_policy  # noqa: F401
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
