"""dtype is selectable: bf16 params and KV cache run end to end."""
import jax
import jax.numpy as jnp
from hf_reference import HFReference, assert_greedy_match

from jaxserve import LLM, SamplingParams

# A top-2 logit margin from which HF's float32 choice must be ours too. The narrowest
# variant here (fp8 KV) may move a logprob by up to 0.1 (the bound its test asserts), so a
# margin by up to 0.2; a narrower margin may flip, and so may all that follows it.
CLEAR_MARGIN = 0.3
# The tiny llama's choices are mostly close (median top-2 margin 0.14 over the prompts
# range(a, a + 30)): on those prompts the check compared nothing. On this one HF makes its
# first four greedy choices by 0.40, 0.59, 0.47 and 0.42.
CLEAR_PROMPT = list(range(279, 339, 2))


def assert_clear_choices_agree(tokens, path, prompt=CLEAR_PROMPT, what="dtype"):
    """Greedy tokens that HF in float32 picks by a clear margin are ours too, up to its first
    close choice, and at least four of them (hf_reference.assert_greedy_match): a narrower
    dtype may only flip a close choice (and what follows it)."""
    ref, margins = HFReference(path).greedy(prompt, len(tokens))
    assert_greedy_match(list(tokens), ref, margins, what, near_tie=CLEAR_MARGIN)


def run_variants(path, prompt, variants, **common):
    """Each variant's engine on ``prompt`` (6 greedy tokens, prompt logprobs), then on
    CLEAR_PROMPT (6 greedy tokens): name -> (runner, token ids, the prompt tokens' logprobs
    [len(prompt) - 1], CLEAR_PROMPT's token ids)."""
    import numpy as np

    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    res = {}
    for name, kw in variants:
        llm = LLM(str(path), max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory=4 << 20,
                  compilation_cache=False, progress=False, enforce_eager=True, **common, **kw)
        out = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0]
        clear = llm.generate({"prompt_token_ids": CLEAR_PROMPT}, greedy, use_tqdm=False)[0].outputs[0].token_ids
        res[name] = (llm.llm_engine.model_runner, out.outputs[0].token_ids,
                     np.array([out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))]), clear)
    return res

def test_bfloat16_runs_and_agrees_on_clear_choices(tiny_models):
    path = tiny_models("llama", kv_heads=2)
    llm = LLM(str(path), dtype="bfloat16", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
              kv_cache_memory=4 << 20, compilation_cache=False, progress=False, enforce_eager=True)
    runner = llm.llm_engine.model_runner
    # bf16 pages, kept as their bit patterns by the CPU attention kernels (reference and native).
    assert runner.kv_dtype == jnp.bfloat16 and runner.kv_cache.dtype == jnp.uint16
    assert runner.state["layers"]["q_proj"][...].dtype == jnp.bfloat16
    out = llm.generate({"prompt_token_ids": CLEAR_PROMPT},
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert_clear_choices_agree(out.token_ids, path, what="bfloat16")


def test_fp8_kv_cache_end_to_end(tiny_models):
    """kv_cache_dtype=fp8: e4m3 pages (4x the f32 pages in the same memory), the reference,
    the pallas kernel (interpreted) and the native CPU kernel give the same tokens, and clear
    choices agree with the f32 cache; prompt logprobs stay close."""
    import numpy as np

    path = tiny_models("llama", kv_heads=2)
    prompt = list(range(10, 40))
    res = run_variants(path, prompt, (("f32", {}), ("fp8", dict(kv_cache_dtype="fp8", attention_backend="reference")),
                                      ("fp8-pallas", dict(kv_cache_dtype="fp8", attention_backend="pallas")),
                                      ("fp8-native", dict(kv_cache_dtype="fp8", attention_backend="native"))))
    for name, (runner, _, _, _) in res.items():
        assert runner.kv_cache.dtype == (jnp.float8_e4m3fn if "fp8" in name else jnp.float32)
    assert res["fp8"][0].num_blocks >= 4 * (res["f32"][0].num_blocks - 1)
    assert res["fp8"][1] == res["fp8-pallas"][1] == res["fp8-native"][1]
    np.testing.assert_allclose(res["fp8"][2], res["fp8-pallas"][2], atol=1e-4)
    # The native kernel's float32 arithmetic differs from the reference's in the last bit
    # (its own exp, another summation order; with an f32 cache this model's logprobs come
    # out equal). The next layer's K/V are rounded to e4m3 (a quantum of 1/8 relative),
    # and one such rounding flipped by that last bit moved one prompt logprob by 1e-3
    # here. The kernel reads fp8 exactly as the reference does (tests/pallas_kernels/test_cpu.py).
    np.testing.assert_allclose(res["fp8"][2], res["fp8-native"][2], atol=5e-3)
    assert 0 < np.abs(res["fp8"][2] - res["f32"][2]).max() < 0.1
    assert_clear_choices_agree(res["fp8"][3], path, what="fp8 KV cache")


def test_bf16_weights_under_f32_activations(tiny_models):
    """weight_dtype=bfloat16 with dtype=float32 (what dtype=auto picks on a CPU with AMX /
    AVX512-BF16): the matmul weights are the f32 ones rounded to bf16 (stored as their
    bit patterns under the CPU layer scan, bf16 arrays when unrolled, the same tokens
    either way), norms / activations / KV cache stay f32, and the result stays close to
    the f32 model's. The compiled step never widens a stacked weight to f32 (XLA:CPU
    would, once per step, for a bf16 array the layer loop slices)."""
    import re

    import numpy as np

    from models.quantization import scan_safe

    path = tiny_models("llama", kv_heads=2)
    prompt = list(range(10, 40))
    res = run_variants(path, prompt, (("f32", {}), ("bf16w", dict(weight_dtype="bfloat16")),
                                      ("bf16w-unrolled", dict(weight_dtype="bfloat16", scan_layers=False))),
                       dtype="float32")
    runners = {name: r[0] for name, r in res.items()}
    res = {name: r[1:] for name, r in res.items()}
    f32, bits = runners["f32"].state, runners["bf16w"].state
    assert runners["bf16w"].dtype == jnp.float32 and runners["bf16w"].kv_cache.dtype == jnp.float32
    assert bits["layers"]["q_proj"][...].dtype == jnp.uint16
    np.testing.assert_array_equal(np.asarray(scan_safe(bits["layers"]["q_proj"][...], restore=True), np.float32),
                                  np.asarray(f32["layers"]["q_proj"][...].astype(jnp.bfloat16), np.float32))
    assert bits["embed_tokens"][...].dtype == jnp.bfloat16
    assert bits["layers"]["input_layernorm"][...].dtype == jnp.float32 and bits["norm"][...].dtype == jnp.float32
    assert runners["bf16w-unrolled"].state["layers"][0]["q_proj"][...].dtype == jnp.bfloat16
    assert res["bf16w"][0] == res["bf16w-unrolled"][0]
    np.testing.assert_allclose(res["bf16w"][1], res["bf16w-unrolled"][1], atol=1e-4)
    assert 0 < np.abs(res["bf16w"][1] - res["f32"][1]).max() < 0.1
    assert_clear_choices_agree(res["bf16w"][2], path, what="bf16 weights")
    hlo = runners["bf16w"].lower_model_step(16).compile().as_text()
    stacked = [tuple(a.shape) for a in jax.tree.leaves(bits["layers"]) if a.dtype == jnp.uint16]
    for shape in stacked:
        dims = ",".join(map(str, shape))
        assert not re.search(rf"(f32|bf16)\[{dims}\]", hlo), f"a stacked weight {shape} is widened or copied"


def test_bf16_kv_cache_under_f32_activations(tiny_models):
    """kv_cache_dtype=bfloat16 with float32 activations: twice the pages in the same
    memory, kept as bf16 bit patterns by the CPU reference attention (XLA:CPU would widen
    a bf16 cache per layer); the tokens of clear choices stay HF's and the prompt
    logprobs stay close to a float32 cache's; the pallas kernel (interpreted) reads a real
    bf16 cache and gives the same tokens."""
    import numpy as np

    path = tiny_models("llama", kv_heads=2)
    prompt = list(range(10, 40))
    res = run_variants(path, prompt, (("f32", {}), ("bf16", dict(kv_cache_dtype="bfloat16")),
                                      ("bf16-pallas", dict(kv_cache_dtype="bfloat16", attention_backend="pallas"))),
                       dtype="float32")
    for name, want in (("f32", jnp.float32), ("bf16", jnp.uint16), ("bf16-pallas", jnp.bfloat16)):
        assert res[name][0].kv_cache.dtype == want
    assert res["bf16"][0].num_blocks >= 2 * (res["f32"][0].num_blocks - 1)
    assert res["bf16"][1] == res["bf16-pallas"][1]
    # The kernels round different operands to bf16 (the pallas kernel q for its products,
    # the reference's prefill path none): bf16-level differences (2^-8 relative).
    np.testing.assert_allclose(res["bf16"][2], res["bf16-pallas"][2], atol=2e-2)
    assert 0 < np.abs(res["bf16"][2] - res["f32"][2]).max() < 0.05
    assert_clear_choices_agree(res["bf16"][3], path, what="bf16 KV cache")
