"""JX-02 bucket helpers; KV-11/KV-12 cache sizing."""
import jax
import jax.numpy as jnp
import pytest

from jaxserve.runner.bucketing import BucketTable, default_buckets, power_of_two_buckets
from jaxserve.runner.kv_cache import bytes_per_block, determine_num_blocks
from models.config import ModelArchConfig


def test_request_buckets():
    table = BucketTable(power_of_two_buckets(8, 64))
    assert [table(n) for n in (1, 4, 8, 9, 17, 33, 64)] == [8, 8, 8, 16, 32, 64, 64]
    assert table.buckets == (8, 16, 32, 64)
    assert BucketTable(power_of_two_buckets(8, 100)).buckets[-1] == 100
    with pytest.raises(ValueError):
        table(65)


def test_default_buckets_lead_with_one_on_cpu():
    """A bucket of 1 ahead of the powers of two (CPU: one-token steps are matrix-vector
    products); never twice, and not without ``single``."""
    table = BucketTable(default_buckets(16, 2048, single=True))
    assert table.buckets == (1, 16, 32, 64, 128, 256, 512, 1024, 2048)
    assert [table(n) for n in (1, 2, 16, 17)] == [1, 16, 16, 32]
    assert default_buckets(1, 4, single=True) == (1, 2, 4)
    assert default_buckets(8, 64, single=False) == (8, 16, 32, 64)


def _arch(layers=32, kv_heads=32, head_dim=128):
    return ModelArchConfig(architecture="LlamaForCausalLM", vocab_size=32000, hidden_size=4096,
                           intermediate_size=11008, num_hidden_layers=layers, num_attention_heads=32,
                           num_key_value_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-5, rope_theta=1e4,
                           max_position_embeddings=32768, tie_word_embeddings=False)


def test_kv_cache_too_small_reports_max_len():  # KV-12
    arch = _arch()
    # 8 GiB of fp16 KV for 32 layers x 32 KV heads x 128 dim holds 16384 tokens (+ the null block).
    budget = 8 * 2**30 + bytes_per_block(arch, 16, jnp.float16)
    kw = dict(block_size=16, dtype=jnp.float16, gpu_memory_utilization=0.9, kv_cache_memory=budget,
              num_gpu_blocks_override=None, device=jax.devices()[0])
    assert determine_num_blocks(arch, max_model_len=16384, **kw) == 1025
    with pytest.raises(ValueError, match="16384"):
        determine_num_blocks(arch, max_model_len=16385, **kw)
    assert determine_num_blocks(arch, max_model_len=16383, **kw) == 1025
    assert determine_num_blocks(arch, max_model_len=10**6, **{**kw, "num_gpu_blocks_override": 7}) == 7


def test_user_buckets_are_checked_at_start_up():
    from jaxserve.config import EngineConfig, ModelConfig, SchedulerConfig

    sc = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16, max_model_len=256)
    mc = ModelConfig(model=".")
    with pytest.raises(ValueError, match=r"token_buckets: the largest \(128\) must be at least max_num_batched_tokens"):
        EngineConfig(model_config=mc, scheduler_config=sc, token_buckets=(64, 128))
    with pytest.raises(ValueError, match=r"request_buckets: the largest \(32\) must equal max_num_seqs \(16\)"):
        EngineConfig(model_config=mc, scheduler_config=sc, request_buckets=(8, 32))
    EngineConfig(model_config=mc, scheduler_config=sc, token_buckets=(64, 256), request_buckets=(4, 16))
