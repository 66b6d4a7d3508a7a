"""Tensor parallelism is a change of mesh: 2 CPU devices give the single-device greedy tokens."""
import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 host devices (XLA_FLAGS in tests/conftest.py)")
@pytest.mark.parametrize("backend", ["reference", "pallas"])  # pallas: interpreted, under shard_map
def test_tp2_matches_tp1(tiny_models, backend):
    path = tiny_models("qwen2", kv_heads=2)
    ps = [{"prompt_token_ids": np.random.default_rng(i).integers(3, 500, 5 + 9 * i).tolist()} for i in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    res = []
    for tp in (1, 2):
        llm = LLM(str(path), max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, kv_cache_memory=4 << 20,
                  compilation_cache=False, progress=False, tensor_parallel_size=tp,
                  # reference: warm-up executables serve the steps; pallas (interpreted): jit on demand
                  enforce_eager=backend == "pallas", attention_backend=backend)
        runner = llm.llm_engine.model_runner
        if tp == 2:
            # KV heads and attention-head columns really are split over the 'model' axis.
            assert runner.kv_cache.sharding.spec[3] == "model"
            assert tuple(runner.state["layers"]["q_proj"][...].sharding.spec) == (None, None, "model")
            assert len(runner.kv_cache.sharding.device_set) == 2
            # Attention runs per device on its own heads (shard_map): nothing is gathered.
            hlo = runner.lower_model_step(16)
            assert "all-gather" not in hlo.compile().as_text()
        res.append([o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)])
    assert res[0] == res[1]
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(str(path), tensor_parallel_size=64, compilation_cache=False, progress=False, kv_cache_memory=4 << 20,
            max_model_len=128)
