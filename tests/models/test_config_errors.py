"""Unsupported model variants fail with one clear error, before any weights load."""
import json

import jax
import numpy as np
import pytest

from models.config import ModelArchConfig

BASE = dict(architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def cfg(**kw):
    return ModelArchConfig.from_hf_dict({**BASE, **kw})


@pytest.mark.parametrize("kw,message", [
    (dict(architectures=["DeepseekV32ForCausalLM"]), "Model architecture 'DeepseekV32ForCausalLM' is not supported"),
    (dict(architectures=["Phi3ForCausalLM"], partial_rotary_factor=0.3), "partial_rotary_factor"),
    (dict(architectures=["Phi3ForCausalLM"], rope_scaling={"type": "su", "short_factor": [1.0] * 4,
                                                           "long_factor": [1.0] * 4}), "longrope factors have 4"),
    (dict(architectures=["GPT2LMHeadModel"], num_attention_heads=None), "'GPT2LMHeadModel' is not supported"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (dict(architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=4),
     "use_sliding_window=true"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "yarn needs original_max_position_embeddings"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 4.0}), "rope_type 'dynamic' is not supported"),
    (dict(architectures=["GptOssForCausalLM"], num_local_experts=4, num_experts_per_tok=2,
          quantization_config={"quant_method": "bitsandbytes"}), "'bitsandbytes'-quantized checkpoints are not supported"),
])
def test_unsupported_variants(kw, message):
    with pytest.raises(ValueError, match=message):
        cfg(**kw)


def test_bias_flags_follow_hf():
    assert (cfg().attention_bias, cfg().o_bias, cfg().mlp_bias) == (False, False, False)
    llama = cfg(attention_bias=True, mlp_bias=True)
    assert (llama.attention_bias, llama.o_bias, llama.mlp_bias) == (True, True, True)
    qwen2 = cfg(architectures=["Qwen2ForCausalLM"])  # q/k/v biases always, never o_proj
    assert (qwen2.attention_bias, qwen2.o_bias) == (True, False)
    mistral = cfg(architectures=["MistralForCausalLM"], sliding_window=4096)
    assert mistral.sliding_window == 4096
    # Phi-3's old "su" rope name is longrope, with the trained length from the top level
    phi3 = cfg(architectures=["Phi3ForCausalLM"], original_max_position_embeddings=64,
               rope_scaling={"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8})
    assert phi3.rope_scaling["rope_type"] == "longrope"
    assert phi3.rope_scaling["original_max_position_embeddings"] == 64


def test_tensor_parallel_sizes():
    """tp must divide the attention heads and the MLP width; the vocabulary is padded and
    KV heads are replicated, so those need not divide."""
    from models.sharding import arch_for_tensor_parallel, valid_tensor_parallel_sizes

    assert valid_tensor_parallel_sizes(cfg()) == [1, 2, 4]  # 4 heads, 2 KV heads
    assert arch_for_tensor_parallel(cfg(), 4).num_key_value_heads == 4
    assert arch_for_tensor_parallel(cfg(vocab_size=129), 2).padded_vocab_size == 130
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide num_attention_heads=4; "
                                         "valid sizes for this model: 1, 2, 4"):
        arch_for_tensor_parallel(cfg(), 3)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide num_key_value_heads=3"):
        arch_for_tensor_parallel(cfg(num_attention_heads=6, num_key_value_heads=3, head_dim=16), 2)
    with pytest.raises(ValueError, match="tensor_parallel_size=4 is not a multiple of num_key_value_heads=3"):
        arch_for_tensor_parallel(cfg(num_attention_heads=12, num_key_value_heads=3, head_dim=16), 4)
    with pytest.raises(ValueError, match="does not divide intermediate_size=130"):
        arch_for_tensor_parallel(cfg(intermediate_size=130), 4)


def test_checkpoint_tensors_the_config_would_ignore(tmp_path):
    """A checkpoint with MLP biases whose config.json says mlp_bias=false is refused."""
    from hf_factory import make_tiny_hf_model
    from jax.sharding import Mesh

    from models.loader import load_model

    path = make_tiny_hf_model(tmp_path / "m", "llama", mlp_bias=True)
    config = json.loads((path / "config.json").read_text())
    config["mlp_bias"] = False
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"6 checkpoint tensor\(s\) that LlamaForCausalLM as configured does not use"):
        load_model(path, mesh=Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model")),
                   dtype=np.float32, progress=False)
