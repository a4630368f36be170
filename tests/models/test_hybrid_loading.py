"""Loading Qwen3.5 hybrids: a qwen3_5_text folder, and the text tower only of a qwen3_5
(vision-language, Qwen3_5ForConditionalGeneration) checkpoint, with every text weight equal to the
checkpoint's and no vision module built."""
import pytest
import torch

from fasttrain.models import SUPPORTED_FAMILIES, load_policy
from fasttrain.models.families import family_of, family_of_type

from support.checkpoints import HYBRID_TEXT, word_tokenizer

def test_qwen3_5_is_a_supported_family():
    assert {"qwen3_5", "qwen3_5_text"} <= set(SUPPORTED_FAMILIES)
    assert family_of_type("qwen3_5_text").name == "qwen3_5"
    assert family_of_type("qwen3_5_moe").name == "qwen3_5_moe"          # the MoE family (test_moe_models.py)
    with pytest.raises(ValueError, match="qwen2_moe.*not supported.*qwen3_5"):
        family_of_type("qwen2_moe")


def test_text_folder_loads(tmp_path):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    torch.manual_seed(0)
    src = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**HYBRID_TEXT))
    src.save_pretrained(tmp_path)
    word_tokenizer(tmp_path)
    model, tok = load_policy(str(tmp_path))
    assert type(model).__name__ == "Qwen3_5ForCausalLM" and family_of(model).name == "qwen3_5"
    ref = src.state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())
    assert tok.pad_token_id == 0 and tok.padding_side == "left"


def test_vision_language_checkpoint_loads_its_text_tower_only(tmp_path):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    torch.manual_seed(1)
    cfg = Qwen3_5Config(text_config=HYBRID_TEXT, vision_config=dict(depth=1, hidden_size=16, intermediate_size=32,
                                                            num_heads=2, out_hidden_size=32))
    src = Qwen3_5ForConditionalGeneration(cfg)
    src.save_pretrained(tmp_path)
    word_tokenizer(tmp_path)
    model, _ = load_policy(str(tmp_path), dtype=torch.float64)
    assert type(model).__name__ == "Qwen3_5ForCausalLM" and model.config.model_type == "qwen3_5_text"
    assert not any("visual" in n for n, _ in model.named_modules())
    ref = src.state_dict()
    for k, v in model.state_dict().items():
        src_key = "model.language_model." + k[len("model."):] if k.startswith("model.") else k
        assert torch.equal(v, ref[src_key].double()), k
    with torch.no_grad():                                  # and it runs
        assert torch.isfinite(model(torch.tensor([[3, 4, 5]])).logits).all()
