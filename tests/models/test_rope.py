"""Rope scalings against HF's own (transformers' ROPE_INIT_FUNCTIONS): the inverse
frequencies and the attention factor on cos / sin."""
import numpy as np
import pytest
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from models.config import ModelArchConfig
from models.rope import rope_attention_factor, rope_inv_freq


@pytest.mark.parametrize("rope", [
    # GPT-OSS's: no truncation of the ramp's ends
    {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
     "original_max_position_embeddings": 4096, "rope_theta": 150000.0},
    # DeepSeek-V3's: mscale / mscale_all_dim set the attention factor
    {"rope_type": "yarn", "factor": 40.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
     "original_max_position_embeddings": 4096, "rope_theta": 10000.0},
    {"rope_type": "yarn", "factor": 4.0, "mscale": 0.707, "mscale_all_dim": 1.0,
     "original_max_position_embeddings": 32768, "rope_theta": 1000000.0},
    # Qwen's: defaults for the betas, the ramp's ends rounded
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1000000.0},
])
def test_yarn_matches_hf(rope):
    hf_cfg = transformers.LlamaConfig(hidden_size=1024, num_attention_heads=8, head_dim=128,
                                      max_position_embeddings=131072, rope_parameters=dict(rope))
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    arch = ModelArchConfig.from_hf_dict(dict(architectures=["LlamaForCausalLM"], vocab_size=16, hidden_size=1024,
                                             intermediate_size=64, num_hidden_layers=1, num_attention_heads=8,
                                             head_dim=128, max_position_embeddings=131072, rope_parameters=rope))
    ours = rope_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_scaling)
    np.testing.assert_allclose(ours, inv_freq.numpy(), rtol=1e-6)
    assert rope_attention_factor(arch.rope_scaling, arch.max_position_embeddings) == pytest.approx(factor, rel=1e-6)
