"""A Qwen3-MoE / Qwen3.5-MoE folder loaded with policy.quantize = "nf4" streams its experts: each
expert's slices are quantized as they are read, and the result holds the same bytes (codes and
scales of every expert) and gives the same logits as loading the 16-bit model whole and quantizing
it afterwards (fasttrain.models.moe.moe_surgery)."""

import pytest
import torch

from fasttrain.models import load_policy
from fasttrain.models.moe import moe_surgery
from fasttrain.models.moe_tiny import tiny_qwen3_5_moe, tiny_qwen3_moe
from fasttrain.nn import quantize_model
from fasttrain.nn.moe_experts import moe_expert_layers

from support.qwen3_style import qwen3_style_tokenizer

FAMILIES = {"qwen3_moe": tiny_qwen3_moe, "qwen3_5_moe": tiny_qwen3_5_moe}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_streamed_nf4_experts_equal_quantizing_the_whole_model(family, tmp_path):
    tok = qwen3_style_tokenizer()
    model = FAMILIES[family](vocab_size=len(tok), dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    streamed, _ = load_policy(tmp_path, dtype=torch.bfloat16, quantize="nf4")
    from transformers import AutoModelForCausalLM
    whole = moe_surgery(AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16), nf4=True)
    from fasttrain.models.families import family_of
    f = family_of(whole)
    quantize_model(whole, targets=tuple(t for t in f.projections if t not in f.keep_16bit))
    assert moe_expert_layers(streamed) and all(m.nf4 for _, m in moe_expert_layers(streamed))
    sa, sb = streamed.state_dict(), whole.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    ids = torch.tensor([[5, 9, 11, 40, 3, 7, 8, 60]])
    with torch.no_grad():
        assert torch.equal(streamed.eval()(ids).logits, whole.eval()(ids).logits)
