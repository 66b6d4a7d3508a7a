"""Multi-LoRA serving against HF with the adapter merged in (peft's merge_and_unload,
float32): greedy tokens and prompt logprobs for Llama (all seven projections, two
ranks, rslora, a subset of the targets), Qwen3 and a MoE model's attention; a batch of
the base model and three adapters under max_loras=2 gives each request its tokens
alone; loading / unloading adapters compiles nothing; tp 4 (KV heads replicated)
equals tp 1; an int8 base keeps float adapters; every bad adapter is a clear error."""
import json

import numpy as np
import pytest
import torch
from compile_counter import count_compiles
from hf_reference import HFReference, assert_greedy_match
from lora_factory import ATTENTION, edit_adapter_config, make_peft_adapter

from jaxserve import LLM, SamplingParams
from jaxserve.lora import LoRARequest

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPT_LP = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)


def prompts(seed, lengths):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, n).tolist() for n in lengths]


def make_llm(path, **kw):
    base = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, kv_cache_memory=4 << 20,
                compilation_cache=False, progress=False, dtype="float32", enable_lora=True, max_loras=2,
                max_lora_rank=8, enforce_eager=True)
    return LLM(str(path), **(base | kw))


def check_against_hf(llm, merged, lora, ps, what):
    """Greedy tokens and prompt logprobs of ``lora`` (None: the base) equal HF's ``merged``."""
    hf = HFReference(model=merged)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY, use_tqdm=False, lora_request=lora)
    for p, o in zip(ps, outs):
        ref, margins = hf.greedy(p, MAX_TOKENS)
        assert_greedy_match(o.outputs[0].token_ids, ref, margins, f"{what} len {len(p)}")
    out = llm.generate({"prompt_token_ids": ps[0]}, PROMPT_LP, use_tqdm=False, lora_request=lora)[0]
    ref = torch.log_softmax(torch.tensor(hf.logits(ps[0])), -1).numpy()
    ours = [out.prompt_logprobs[i][ps[0][i]].logprob for i in range(1, len(ps[0]))]
    np.testing.assert_allclose(ours, [ref[i - 1, ps[0][i]] for i in range(1, len(ps[0]))], atol=2e-4,
                               err_msg=what)


@pytest.fixture(scope="module")
def llama(tiny_models, tmp_path_factory):
    """The base model and three adapters (name -> (LoRARequest, merged HF model)):
    all projections at r 8; q / v at r 4 with rslora (padded to the slots' rank 8);
    the attention of layer 1 only."""
    base = tiny_models("llama", kv_heads=2)
    d = tmp_path_factory.mktemp("loras")
    specs = {"all8": dict(r=8, alpha=16, seed=1), "qv4": dict(r=4, alpha=8, targets=("q_proj", "v_proj"),
                                                               use_rslora=True, seed=2),
             "attn1": dict(r=8, alpha=8, targets=ATTENTION, layers_to_transform=[1], seed=3)}
    adapters = {}
    for i, (name, kw) in enumerate(specs.items(), start=1):
        adapters[name] = (LoRARequest(name, i, str(d / name)), make_peft_adapter(base, d / name, **kw))
    return base, adapters


@pytest.fixture(scope="module")
def llama_llm(llama):
    return make_llm(llama[0])


def test_each_adapter_equals_hf_merged(llama, llama_llm):
    base, adapters = llama
    ps = prompts(1, [5, 23, 40])
    check_against_hf(llama_llm, HFReference(base).model, None, ps, "base")
    for name, (lora, merged) in adapters.items():
        check_against_hf(llama_llm, merged, lora, ps, name)


def test_mixed_batch_gives_each_request_its_tokens_alone(llama, llama_llm):
    """The base and three adapters in one generate() with two slots: the scheduler
    runs at most two adapters at once, and nothing leaks between requests."""
    _, adapters = llama
    ps = prompts(2, [7, 30, 12, 19, 26, 9, 33, 4])
    loras = [None, *(adapters[n][0] for n in ("all8", "qv4", "attn1"))] * 2
    mixed = [o.outputs[0].token_ids for o in llama_llm.generate(
        [{"prompt_token_ids": p} for p in ps], GREEDY, use_tqdm=False, lora_request=loras)]
    alone = [llama_llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False, lora_request=lora)[0]
             .outputs[0].token_ids for p, lora in zip(ps, loras)]
    assert mixed == alone
    assert len({tuple(t) for t in mixed[:4]}) == 4  # the adapters do change the tokens


def test_prefix_cache_is_per_adapter(llama, llama_llm):
    _, adapters = llama
    p = {"prompt_token_ids": prompts(3, [50])[0]}
    sp = SamplingParams(temperature=0.0, max_tokens=2)
    a, b = adapters["all8"][0], adapters["qv4"][0]
    first = llama_llm.generate(p, sp, use_tqdm=False, lora_request=a)[0]
    assert [llama_llm.generate(p, sp, use_tqdm=False, lora_request=x)[0].num_cached_tokens
            for x in (b, None, a)] == [0, 0, 48]
    assert llama_llm.generate(p, sp, use_tqdm=False, lora_request=a)[0].outputs[0].token_ids == \
        first.outputs[0].token_ids


def test_loading_and_unloading_at_run_time_compiles_nothing(llama, tmp_path):
    base, adapters = llama
    llm = make_llm(base, enforce_eager=False, max_loras=1)  # warmed up: every bucket compiled
    p = [{"prompt_token_ids": x} for x in prompts(4, [9, 33])]
    runner = llm.llm_engine.model_runner
    merged = make_peft_adapter(base, tmp_path / "new", r=8, alpha=16, seed=9)
    with count_compiles(runner) as compiles:
        base_out = llm.generate(p, GREEDY, use_tqdm=False)
        first = llm.generate(p, GREEDY, use_tqdm=False, lora_request=adapters["all8"][0])
        new = LoRARequest("new", 10, str(tmp_path / "new"))
        assert llm.add_lora(new) is True and llm.add_lora(new) is False
        # max_cpu_loras = max_loras = 1: the first adapter left host memory...
        assert llm.list_loras() == {10}
        with_new = llm.generate(p, GREEDY, use_tqdm=False, lora_request=new)
        assert llm.remove_lora(10) and llm.list_loras() == set()
        # ... and is read again from its folder when a request needs it.
        again = llm.generate(p, GREEDY, use_tqdm=False, lora_request=adapters["all8"][0])
        assert llm.list_loras() == {1}
    assert compiles == [0, 0], compiles
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
    assert [o.outputs[0].token_ids for o in with_new] != [o.outputs[0].token_ids for o in base_out]
    hf = HFReference(model=merged)
    ref, margins = hf.greedy(p[0]["prompt_token_ids"], MAX_TOKENS)
    assert_greedy_match(with_new[0].outputs[0].token_ids, ref, margins, "loaded at run time")
    assert runner.lora.num_slot_writes >= 4  # one slot: each switch of adapter copied one in


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_qwen3_and_moe_attention_equal_hf_merged(tiny_models, tmp_path, arch):
    base = tiny_models(arch, kv_heads=2, seed=1)
    targets = ATTENTION if arch == "qwen3_moe" else ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                      "up_proj", "down_proj")
    merged = make_peft_adapter(base, tmp_path / "a", r=8, alpha=16, targets=targets, seed=4)
    llm = make_llm(base)
    check_against_hf(llm, merged, LoRARequest("a", 1, str(tmp_path / "a")), prompts(5, [6, 31]), arch)
    # A MoE's experts are not adaptable: an adapter naming its MLP is refused.
    if arch == "qwen3_moe":
        edit_adapter_config(tmp_path / "a", target_modules=["q_proj", "gate_proj"])
        with pytest.raises(ValueError, match=r"target_modules \['gate_proj'\] are not supported"):
            llm.generate("w5 w6", GREEDY, use_tqdm=False, lora_request=LoRARequest("moe_mlp", 2, str(tmp_path / "a")))


@pytest.mark.devices(4)
def test_phi3_fused_projections_equal_hf_merged(tiny_models, tmp_path):
    """Phi-3's adapters target its fused modules (qkv_proj, gate_up_proj): one A per
    module, and each of q / k / v (gate / up) takes its block of B's rows."""
    base = tiny_models("phi3", kv_heads=2, seed=1)
    merged = make_peft_adapter(base, tmp_path / "a", r=8, alpha=16, seed=5,
                               targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    llm = make_llm(base)
    check_against_hf(llm, merged, LoRARequest("a", 1, str(tmp_path / "a")), prompts(5, [6, 31]), "phi3")


def test_tensor_parallel_equals_one_device(llama):
    """tp 4 over 2 KV heads (each replicated twice, and the adapters' K / V columns
    with them): the tokens and logprobs of the base and two adapters equal tp 1's."""
    base, adapters = llama
    ps = prompts(6, [8, 27, 15])
    loras = [None, adapters["all8"][0], adapters["qv4"][0]]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    res = []
    for tp in (1, 4):
        llm = make_llm(base, tensor_parallel_size=tp)
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False, lora_request=loras)
        res.append([(o.outputs[0].token_ids, [d[t].logprob for d, t in zip(o.outputs[0].logprobs,
                                                                          o.outputs[0].token_ids)]) for o in outs])
        if tp > 1:
            a, b = llm.llm_engine.model_runner.lora.buffers["k_proj"]
            assert b.sharding.spec[2] == "model" and a.sharding.is_fully_replicated
            a, b = llm.llm_engine.model_runner.lora.buffers["down_proj"]
            assert a.sharding.spec[1] == "model" and b.sharding.is_fully_replicated
    for (t1, lp1), (t4, lp4) in zip(*res):
        assert t1 == t4
        np.testing.assert_allclose(lp1, lp4, atol=1e-4)


def test_int8_base_keeps_float_adapters(llama):
    base, adapters = llama
    lora, merged = adapters["all8"]
    llm = make_llm(base, quantization="int8")
    p = prompts(7, [20])[0]
    out = llm.generate({"prompt_token_ids": p}, PROMPT_LP, use_tqdm=False, lora_request=lora)[0]
    ref = torch.log_softmax(torch.tensor(HFReference(model=merged).logits(p)), -1).numpy()
    ours = np.array([out.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))])
    err = np.abs(ours - np.array([ref[i - 1, p[i]] for i in range(1, len(p))]))
    assert err.max() < 0.05, err  # int8 weight rounding only: the adapter is applied in float32
    assert llm.llm_engine.model_runner.lora.buffers["q_proj"][0].dtype == np.float32


def _write(folder, cfg=None, tensors=None):
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(cfg or {"r": 8, "lora_alpha": 16,
                                                                    "target_modules": ["q_proj"]}))
    if tensors is not None:
        save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def test_bad_adapters_are_clear_errors(llama, llama_llm, tmp_path):
    _, adapters = llama
    good = adapters["all8"][0].lora_path
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    rng = np.random.default_rng(0)
    ok_tensors = {f"{q}.lora_A.weight": rng.normal(size=(8, 64)).astype(np.float32),
                  f"{q}.lora_B.weight": rng.normal(size=(64, 8)).astype(np.float32)}
    cases = [
        (tmp_path / "missing", r"No adapter found for .*missing"),
        (_write(tmp_path / "rank", {"r": 16, "lora_alpha": 16, "target_modules": ["q_proj"]}),
         r"LoRA rank 16 is greater than max_lora_rank 8"),
        (_write(tmp_path / "embed", {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "embed_tokens"]}),
         r"target_modules \['embed_tokens'\] are not supported"),
        (_write(tmp_path / "save", {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"],
                                    "modules_to_save": ["lm_head"]}), r"modules_to_save is not supported"),
        (_write(tmp_path / "dora", {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "use_dora": True}),
         r"DoRA is not supported"),
        (_write(tmp_path / "noalpha", {"r": 8, "target_modules": ["q_proj"]}),
         r"Missing required configuration fields: \['lora_alpha'\]"),
        (_write(tmp_path / "shapes", tensors={f"{q}.lora_A.weight": np.zeros((8, 32), np.float32),
                                              f"{q}.lora_B.weight": np.zeros((64, 8), np.float32)}),
         r"does not fit this model: layer 0 self_attn.q_proj has lora_A \[8, 32\]"),
        (_write(tmp_path / "head", tensors={**ok_tensors, "base_model.model.lm_head.lora_A.weight":
                                            np.zeros((8, 64), np.float32)}),
         r"expected target modules in .* but received \['base_model.model.lm_head.lora_A.weight'\]"),
        (_write(tmp_path / "notensors"), r"No adapter found"),
    ]
    for i, (folder, message) in enumerate(cases):
        with pytest.raises(ValueError, match=message):
            llama_llm.generate("w5 w6", GREEDY, use_tqdm=False, lora_request=LoRARequest(f"bad{i}", 100 + i,
                                                                                        str(folder)))
    with pytest.raises(ValueError, match="got 2 lora_request for 1 prompts"):
        llama_llm.generate("w5", GREEDY, use_tqdm=False, lora_request=[None, None])
    with pytest.raises(ValueError, match="id must be > 0"):
        LoRARequest("x", 0, good)
    # The engine still serves, adapters and base.
    assert llama_llm.generate("w5 w6", GREEDY, use_tqdm=False, lora_request=adapters["all8"][0])[0].outputs[0].token_ids


def test_lora_request_without_enable_lora_is_refused(llama):
    base, adapters = llama
    llm = make_llm(base, enable_lora=False)
    with pytest.raises(ValueError, match="but LoRA is not enabled"):
        llm.generate("w5", GREEDY, use_tqdm=False, lora_request=adapters["all8"][0])


def test_slot_victims_prefer_adapters_no_request_holds(llama, llama_llm):
    """With every slot taken, a new adapter replaces the least recently used one that no
    live request (e.g. one preempted, or not scheduled this step) still needs."""
    _, adapters = llama
    a, b, c = (adapters[n][0] for n in ("all8", "qv4", "attn1"))
    manager = llama_llm.llm_engine.model_runner.lora  # two slots
    manager.activate({"x": a})
    manager.activate({"y": b})  # a is now the least recently used
    slots = manager.activate({"z": c}, live={a.lora_int_id})
    assert set(manager._slot_of) == {a.lora_int_id, c.lora_int_id} and slots["z"] >= 1
    manager.activate({"w": b})  # nothing live: the least recently used (a) goes
    assert set(manager._slot_of) == {b.lora_int_id, c.lora_int_id}


def test_async_scheduling_with_adapters(llama, llama_llm):
    """Step N + 1's adapters are copied into their slots while step N runs (the copy
    donates the slot buffers the running step reads): the tokens are the synchronous
    engine's."""
    base, adapters = llama
    ps = prompts(8, [9, 21, 14, 30, 5, 17])
    loras = [adapters["all8"][0], adapters["qv4"][0], adapters["attn1"][0], None] * 2
    loras = loras[:len(ps)]
    sync = [o.outputs[0].token_ids for o in llama_llm.generate(
        [{"prompt_token_ids": p} for p in ps], GREEDY, use_tqdm=False, lora_request=loras)]
    llm = make_llm(base, async_scheduling=True, max_loras=1)  # one slot: a copy almost every step
    out = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in ps], GREEDY, use_tqdm=False, lora_request=loras)]
    assert out == sync
    assert llm.llm_engine.model_runner.lora.num_slot_writes > 4


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2"])
def test_deepseek_mla_projections_equal_hf_merged(tiny_models, tmp_path, arch):
    """DeepSeek's MLA: adapters of the products before the latent (V3: q_a_proj and
    q_b_proj; V2-Lite's shape: q_proj; both: kv_a_proj_with_mqa), of kv_b_proj (applied
    absorbed: into the queries and the output) and of o_proj equal HF merged, at tp 1
    and (V3) tp 2, where q_a_proj and kv_a_proj are whole on every device and so are
    their A and B. kv_b_proj alone, next to a request without adapter in the same
    batch. The MLP (the dense layers' and the experts' gate_proj) is refused."""
    base = tiny_models(arch)
    targets = (("q_a_proj", "q_b_proj") if arch == "deepseek_v3" else ("q_proj",)) + ("kv_a_proj_with_mqa",
                                                                                     "kv_b_proj", "o_proj")
    merged = make_peft_adapter(base, tmp_path / "a", r=8, alpha=16, targets=targets, seed=4)
    lora = LoRARequest("a", 1, str(tmp_path / "a"))
    llm = make_llm(base)
    check_against_hf(llm, merged, lora, prompts(5, [6, 31]), arch)
    kv_b = make_peft_adapter(base, tmp_path / "kvb", r=4, alpha=16, targets=("kv_b_proj",), seed=5)
    kv_b_req = LoRARequest("kvb", 2, str(tmp_path / "kvb"))
    check_against_hf(llm, kv_b, kv_b_req, prompts(6, [12, 20]), arch + " kv_b")
    ps = [{"prompt_token_ids": p} for p in prompts(6, [12, 20])]
    alone = [llm.generate(p, GREEDY, use_tqdm=False, lora_request=r)[0].outputs[0].token_ids
             for p, r in zip(ps, [kv_b_req, None])]
    mixed = llm.generate(ps, GREEDY, use_tqdm=False, lora_request=[kv_b_req, None])
    assert [o.outputs[0].token_ids for o in mixed] == alone
    edit_adapter_config(tmp_path / "a", target_modules=["gate_proj", "o_proj"])
    with pytest.raises(ValueError, match=r"target_modules \['gate_proj'\] are not supported"):
        llm.generate("w5 w6", GREEDY, use_tqdm=False, lora_request=LoRARequest("mlp", 3, str(tmp_path / "a")))


@pytest.mark.devices(2)
def test_deepseek_adapters_tensor_parallel(tiny_models, tmp_path):
    base = tiny_models("deepseek_v3")
    merged = make_peft_adapter(base, tmp_path / "a", r=8, alpha=16, seed=6,
                               targets=("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"))
    llm = make_llm(base, tensor_parallel_size=2)
    check_against_hf(llm, merged, LoRARequest("a", 1, str(tmp_path / "a")), prompts(7, [9, 25]), "deepseek tp2")
