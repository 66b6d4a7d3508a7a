"""Greedy parity with HF transformers (f32) across architectures and engine modes."""
import numpy as np
import pytest
from hf_reference import HFReference, assert_greedy_match

from jaxserve import LLM, SamplingParams
from jaxserve.core.kv_cache_utils import cdiv

MAX_TOKENS = 12


def prompts(seed: int, lengths) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, n).tolist() for n in lengths]


def run(llm, ps, max_tokens=MAX_TOKENS):
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def make_llm(path, **kw):
    # float32 throughout: the oracle is HF in float32 (dtype=auto would take bf16 weights
    # on a CPU with AMX / AVX512-BF16; tests/e2e/test_dtype.py covers that).
    base = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=128, kv_cache_memory=8 << 20,
                compilation_cache=False, progress=False, enforce_eager=True, dtype="float32")
    base.update(kw)
    return LLM(str(path), **base)


ARCHS = [
    ("llama", dict(kv_heads=2)),  # GQA, untied
    ("llama", dict(kv_heads=4, tie=True)),  # MHA, tied
    ("llama3", dict(kv_heads=2)),  # llama3 rope scaling
    ("qwen2", dict(kv_heads=2)),  # qkv bias
    ("qwen3", dict(kv_heads=2, tie=True)),  # q/k norm
    ("llama", dict(kv_heads=2, attention_bias=True, mlp_bias=True)),  # q/k/v/o and MLP biases
    ("qwen3", dict(kv_heads=2, attention_bias=True)),  # q/k/v/o biases with q/k norm
    # Mixture of experts: 8 experts, top 2 (renormalised; Qwen2-MoE: not, plus a shared expert).
    ("qwen3_moe", dict(kv_heads=2, seed=1)),
    ("qwen2_moe", dict(kv_heads=2)),
    ("mixtral", dict(kv_heads=2)),
    # Gemma: sliding (window 8 < the prompts) and global layers, soft-capping (2), q/k norm (3).
    ("gemma2", dict(kv_heads=2)),
    ("gemma3", dict(kv_heads=2)),
]


@pytest.mark.parametrize("arch,kw", ARCHS, ids=[f"{a}-{'-'.join(f'{k}{v}' for k, v in kw.items())}" for a, kw in ARCHS])
def test_greedy_parity_mixed_batch(tiny_models, arch, kw):
    path = tiny_models(arch, **kw)
    hf = HFReference(path)
    ps = prompts(1, [5, 17, 40, 3])
    llm = make_llm(path)
    ours = run(llm, ps)  # one mixed batch
    for p, o in zip(ps, ours):
        ref, margins = hf.greedy(p, MAX_TOKENS)
        assert_greedy_match(o, ref, margins, f"{arch} len {len(p)}")
    single = run(llm, ps[:1])  # alone in the batch
    assert single[0] == ours[0]


@pytest.mark.parametrize("mode", ["chunked", "no_prefix_cache", "preemption", "unrolled"])
def test_engine_modes_give_same_tokens(tiny_models, mode):
    path = tiny_models("llama", kv_heads=2)
    hf = HFReference(path)
    shared = prompts(2, [48])[0]
    ps = [shared + q for q in prompts(3, [7, 20])] + prompts(4, [33, 9, 60])
    kw = {
        "chunked": dict(max_num_batched_tokens=16, long_prefill_token_threshold=8),
        "no_prefix_cache": dict(enable_prefix_caching=False),
        # 8 usable blocks of 16 tokens for 5 requests of up to 80 tokens: forces preemption.
        "preemption": dict(num_gpu_blocks_override=9, max_num_batched_tokens=256),
        "unrolled": dict(scan_layers=False),  # scan is the default; compare with the unrolled loop
    }[mode]
    llm = make_llm(path, **kw)
    if mode == "unrolled":
        from flax import nnx

        runner = llm.llm_engine.model_runner
        assert nnx.merge(runner.graphdef, runner.state).scan_layers is False  # the config reached the model
    ours = run(llm, ps)
    if mode == "preemption":
        assert llm.llm_engine.scheduler.num_preemptions > 0
    for p, o in zip(ps, ours):
        ref, margins = hf.greedy(p, MAX_TOKENS)
        assert_greedy_match(o, ref, margins, f"{mode} len {len(p)}")
    # Prefix-cache hits on a second pass give the same tokens.
    again = run(llm, ps)
    assert again == ours
    sched = llm.llm_engine.scheduler
    if mode != "no_prefix_cache":
        assert sched.kv_cache_manager.block_pool.cached_block_hash_to_block


@pytest.mark.parametrize("arch,kw", [("qwen3", dict(tie=True)), ("qwen3_moe", dict(seed=1)), ("qwen2_moe", {}),
                                     ("mixtral", {}), ("gemma2", {}), ("gemma3", {})])
def test_logits_close_to_hf(tiny_models, arch, kw):
    """Prompt logprobs (log-softmax of every position's logits) match HF within f32 tolerance."""
    path = tiny_models(arch, kv_heads=2, **kw)
    hf = HFReference(path)
    p = prompts(5, [30])[0]
    llm = make_llm(path)
    out = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5,
                                                               logprobs=5), use_tqdm=False)[0]
    ref = hf.logits(p)
    ref_lp = ref - np.logaddexp.reduce(ref, axis=-1, keepdims=True)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(p)
    for i in range(1, len(p)):
        d = out.prompt_logprobs[i]
        assert p[i] in d
        assert d[p[i]].logprob == pytest.approx(ref_lp[i - 1, p[i]], abs=1e-4)
        top = np.argsort(-ref_lp[i - 1])[:5]
        for rank, t in enumerate(top, 1):
            if int(t) in d:
                assert d[int(t)].logprob == pytest.approx(ref_lp[i - 1, t], abs=1e-4)
    sample = out.outputs[0].logprobs[0]
    tok = out.outputs[0].token_ids[0]
    assert sample[tok].logprob == pytest.approx(ref_lp[-1, tok], abs=1e-4) and sample[tok].rank == 1


@pytest.mark.parametrize("arch,num_blocks", [("mixtral", 9), ("gemma3", 17)])
def test_chunked_prefill_and_preemption(tiny_models, arch, num_blocks):
    """MoE and interleaved sliding-window models under chunked prefill, prefix-cache hits
    and preemption: HF's tokens. (Gemma 3's two KV cache groups, local and global, hold
    one layer's pages per block, Mixtral's blocks both layers': the same bytes.)"""
    path = tiny_models(arch, kv_heads=2)
    hf = HFReference(path)
    shared = prompts(8, [40])[0]
    ps = [shared + q for q in prompts(9, [9, 21])] + prompts(10, [35, 6])
    llm = make_llm(path, max_num_batched_tokens=16, long_prefill_token_threshold=8,
                   num_gpu_blocks_override=num_blocks)
    ours = run(llm, ps, max_tokens=20)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    for p, o in zip(ps, ours):
        ref, margins = hf.greedy(p, 20)
        assert_greedy_match(o, ref, margins, f"{arch} len {len(p)}")


def test_prompt_logprobs_returned_once_despite_preemption(tiny_models):
    """A preempted request recomputes its prompt; its prompt logprobs still come back
    once per prompt token, with HF's values."""
    path = tiny_models("llama", kv_heads=2)
    hf = HFReference(path)
    ps = prompts(6, [40, 40])
    # 7 usable blocks of 16 tokens, two requests of 100 tokens: one is preempted.
    llm = make_llm(path, num_gpu_blocks_override=8, max_num_batched_tokens=256, enable_prefix_caching=False)
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    for p, out in zip(ps, outs):
        assert len(out.prompt_logprobs) == len(p) and out.prompt_logprobs[0] is None
        ref = hf.logits(p)
        ref_lp = ref - np.logaddexp.reduce(ref, axis=-1, keepdims=True)
        for i in range(1, len(p)):
            assert out.prompt_logprobs[i][p[i]].logprob == pytest.approx(ref_lp[i - 1, p[i]], abs=1e-4)
    # A request that could not fit even alone would be preempted and recomputed forever.
    with pytest.raises(ValueError, match=r"needs 113 KV cache slots \(8 blocks\), but the whole KV cache holds 7 blocks"):
        llm.generate({"prompt_token_ids": ps[0]}, SamplingParams(max_tokens=74), use_tqdm=False)
    # 40 + 73 tokens fit: the last sampled token is never written to the cache.
    out = llm.generate({"prompt_token_ids": ps[0]}, SamplingParams(max_tokens=73, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 73


def test_priority_preemption_step_with_no_tokens(tiny_models):
    """Priority policy: the low-priority request A runs first and, once B holds the
    blocks, preempts itself in a step that schedules nothing. The runner must still
    see that step (to drop A's row and keep its tokens), or A resumes on wrong inputs."""
    path = tiny_models("llama", kv_heads=2)
    hf = HFReference(path)
    a, b = prompts(7, [40, 28])
    llm = make_llm(path, scheduling_policy="priority", num_gpu_blocks_override=11)
    engine, sched = llm.llm_engine, llm.llm_engine.scheduler
    empty_preempting_steps = []
    schedule = sched.schedule

    def spy():
        so = schedule()
        if so.preempted_req_ids and so.total_num_scheduled_tokens == 0:
            empty_preempting_steps.append(so)
        return so

    sched.schedule = spy
    sp = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    engine.add_request("A", {"prompt_token_ids": a}, sp, priority=5)
    finished = {o.request_id: o for o in engine.step() if o.finished}
    engine.add_request("B", {"prompt_token_ids": b}, sp, priority=0)
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert empty_preempting_steps, "the scenario must contain a preempt-only step"
    for rid, p in (("A", a), ("B", b)):
        ref, margins = hf.greedy(p, 100)
        assert_greedy_match(finished[rid].outputs[0].token_ids, ref, margins, rid)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # gemma2: per-layer windows and soft-capping in the kernel
def test_pallas_backend_in_interpret_mode_matches_reference(tiny_models, arch):
    """The engine end to end with attention_backend="pallas" (TPU kernel, interpreted on CPU)."""
    path = tiny_models(arch, kv_heads=2)
    ps = prompts(6, [5, 40, 17]) + [prompts(6, [5])[0] + [7, 8, 9]]
    kw = dict(max_num_batched_tokens=32)  # chunked prefill + decode mixes
    ref = run(make_llm(path, attention_backend="reference", **kw), ps)
    llm = make_llm(path, attention_backend="pallas", **kw)
    assert llm.llm_engine.model_runner.attention_backend == "pallas"
    assert run(llm, ps) == ref


def decode_holding(llm, prompt, max_tokens):
    """Decode one greedy request alone, step by step: (blocks it holds in each KV cache
    group after every step, its final output)."""
    engine, kvm = llm.llm_engine, llm.llm_engine.scheduler.kv_cache_manager
    engine.add_request("long", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    held, out = [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o if o.finished else out
        if "long" in kvm.req_to_blocks:
            held.append(tuple(kvm.num_held_blocks("long", g) for g in range(kvm.num_groups)))
    return held, out


def test_sliding_window_frees_blocks_and_matches_hf(tiny_models):
    """Mistral with a 24-token window on every layer: one long request decodes past
    several windows, holds at most window + 2 blocks' worth of KV at any step (the rest
    go back to the pool), and still gives HF's tokens; its KV would not even fit in the
    cache whole."""
    path = tiny_models("mistral", kv_heads=2, sliding_window=24)
    hf = HFReference(path)
    p = prompts(11, [30])[0]
    llm = make_llm(path, num_gpu_blocks_override=12, max_num_batched_tokens=16)  # 11 blocks = 176 tokens
    engine = llm.llm_engine
    assert [g.sliding_window for g in engine.model_runner.kv_cache_layout.groups] == [24]
    held, out = decode_holding(llm, p, 200)
    assert max(h[0] for h in held) <= (24 + 16) // 16 + 2, held
    ref, margins = hf.greedy(p, 200)
    assert_greedy_match(out.outputs[0].token_ids, ref, margins, "mistral window 24")


def test_gemma_local_layers_free_blocks_and_match_hf(tiny_models):
    """Gemma 3 with local (window 8) and global layers interleaved: two KV cache groups.
    One long request decodes 200 tokens; its global group keeps the whole context, its
    local group at most the window's blocks plus a step's, and the tokens are HF's. With
    whole-context KV in every layer the cache (20 blocks of 2 layers) could not hold it."""
    path = tiny_models("gemma3", kv_heads=2, layers=4)
    hf = HFReference(path)
    p = prompts(12, [30])[0]
    llm = make_llm(path, num_gpu_blocks_override=21, max_num_batched_tokens=16)
    engine = llm.llm_engine
    layout = engine.model_runner.kv_cache_layout
    assert [(g.layers, g.sliding_window) for g in layout.groups] == [((1, 3), None), ((0, 2), 8)]
    assert engine.model_runner.kv_cache.shape[0] == 2  # a block is 2 layers' pages
    held, out = decode_holding(llm, p, 200)
    assert max(h[1] for h in held) <= (8 + 16) // 16 + 2, held
    assert max(h[0] for h in held) == cdiv(30 + 199, 16)
    ref, margins = hf.greedy(p, 200)
    assert_greedy_match(out.outputs[0].token_ids, ref, margins, "gemma3 local window 8")


@pytest.mark.slow
def test_no_compilation_after_warmup_moe_int8_fp8_kv(tiny_models):
    """The new paths keep the warm-up's promise: a MoE model (the CPU tile loop's trip
    count is dynamic) with int8 weights and an fp8 KV cache compiles nothing while it serves."""
    from compile_counter import count_compiles

    path = tiny_models("qwen3_moe", kv_heads=2, seed=1)
    # Few buckets keep the warm-up short; chunked prefill and every bucket are still exercised.
    llm = LLM(str(path), max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory=8 << 20,
              compilation_cache=False, progress=False, quantization="int8", kv_cache_dtype="fp8",
              token_buckets=[16, 64], request_buckets=[2, 4])
    with count_compiles(llm.llm_engine.model_runner) as compiled:
        for lengths in ([5], [1, 60, 7], [30] * 4, [100, 3]):
            run(llm, prompts(len(lengths), lengths), max_tokens=6)
    assert compiled == [0, 0], f"(backend compiles, new variants) after warm-up: {compiled}"
