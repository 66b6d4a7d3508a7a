"""Gemma 3 with images (issue 36), against HF transformers in float32.

A tiny random Gemma3ForConditionalGeneration: a 2-block SigLIP over 112 px (8 x 8
patches) pooled to 16 tokens per image, and a decoder of one sliding (window 8) and one
global layer, so an image's 16 tokens, which attend to each other both ways, outrun the
window: HF's AND(window, OR(causal, image)) mask on the sliding layer. HF gets
``token_type_ids`` (1 on image tokens), without which it falls back to a causal mask.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from tests.models.hf_factory import GEMMA_IMAGE_TOKEN, random_images as images

pytestmark = pytest.mark.slow

BOI, EOI = 501, 502  # <start_of_image>, <end_of_image>
TOKENS = 16  # per image


@pytest.fixture(scope="module")
def g3_model(tiny_models):
    return tiny_models("gemma3_vl")


@pytest.fixture(scope="module")
def hf(g3_model):
    import torch
    import transformers

    return transformers.Gemma3ForConditionalGeneration.from_pretrained(g3_model, torch_dtype=torch.float32).eval()


def hf_pixels(path, imgs):
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    cfg = json.loads((path / "preprocessor_config.json").read_text())
    proc = Gemma3ImageProcessorPil(**{k: v for k, v in cfg.items() if k != "image_processor_type"})
    return proc(imgs, return_tensors="pt")["pixel_values"]


def make_g3_llm(path, **kw):
    base = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=128, kv_cache_memory=8 << 20,
                compilation_cache=False, progress=False, enforce_eager=True, dtype="float32")
    return LLM(str(path), **{**base, **kw})


def hf_kwargs(path, ids, imgs) -> dict:
    import torch

    kw = dict(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    if imgs:
        kw |= dict(pixel_values=hf_pixels(path, imgs),
                   token_type_ids=torch.tensor([[int(t == GEMMA_IMAGE_TOKEN) for t in ids]]))
    return kw


def hf_greedy(hf, path, ids, imgs, n):
    import torch

    with torch.no_grad():
        out = hf.generate(**hf_kwargs(path, ids, imgs), max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def check_against_hf(hf, path, out, imgs, max_tokens):
    """Greedy tokens and prompt logprobs of one RequestOutput equal HF's."""
    import torch

    ids = list(out.prompt_token_ids)
    assert list(out.outputs[0].token_ids) == hf_greedy(hf, path, ids, imgs, max_tokens)
    with torch.no_grad():
        logits = hf(**hf_kwargs(path, ids, imgs)).logits[0].double().numpy()
    m = logits.max(-1, keepdims=True)
    ref = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
    got = np.array([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
    want = np.array([ref[i - 1, ids[i]] for i in range(1, len(ids))])
    np.testing.assert_allclose(got, want, atol=1e-4)


GREEDY = SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=0)


def test_processor_tower_and_prompt_match_hf(g3_model, hf, monkeypatch):
    """The numpy processor's patches equal HF's pixels (any input size is resized to the
    tower's square), the JAX tower + projector equal HF's image features, and a
    placeholder expands to <start_of_image>, 16 soft tokens, <end_of_image>."""
    import torch
    from flax import nnx

    imgs = images((90, 130), (112, 112), (300, 60))
    llm = make_g3_llm(g3_model)
    proc = llm.llm_engine.input_processor.mm_processor
    ours = [proc.image_processor(im) for im in imgs]
    ref = hf_pixels(g3_model, imgs).numpy()  # [B, 3, 112, 112]
    patches = ref.reshape(3, 3, 8, 14, 8, 14).transpose(0, 2, 4, 1, 3, 5).reshape(3, 64, -1)
    np.testing.assert_allclose(np.stack([o.pixel_values for o in ours]), patches, atol=1e-5)
    assert {o.num_tokens for o in ours} == {TOKENS}
    runner = llm.llm_engine.model_runner
    feats = np.asarray(nnx.merge(runner.graphdef, runner.state).encode_images(patches))
    with torch.no_grad():
        want = hf.model.get_image_features(torch.tensor(ref)).pooler_output.reshape(-1, feats.shape[-1]).numpy()
    assert np.abs(want).max() > 0.1  # the projector is not zero (HF initialises it so)
    np.testing.assert_allclose(feats, want, atol=1e-4, rtol=1e-4)
    # The tower's attention in blocks of queries (the Hub's 4096 patches: 4 blocks of 1024).
    import models.gemma3_vl as g3

    monkeypatch.setattr(g3, "QUERY_BLOCK", 24)  # 64 patches: blocks of 24, 24 and 16 (padded)
    blocked = np.asarray(nnx.merge(runner.graphdef, runner.state).encode_images(patches))
    np.testing.assert_allclose(blocked, want, atol=1e-4, rtol=1e-4)
    expanded, mm = proc.process([1, 5, BOI, 6], imgs[:1])
    assert expanded == [1, 5, BOI] + [GEMMA_IMAGE_TOKEN] * TOKENS + [EOI, 6]
    assert [(f.offset, f.length) for f in mm.features] == [(3, TOKENS)] and mm.mrope_positions is None


def test_one_two_and_no_images_match_hf(g3_model, hf):
    """Greedy tokens and prompt logprobs equal HF's with one image, with two (each a
    block of its own: the second does not see the first ahead), and for a text-only
    prompt, in one batch; long text before the image puts the sliding window's start
    inside the prompt."""
    llm = make_g3_llm(g3_model)
    one, two = images((90, 130)), images((60, 60), (200, 150), seed=1)
    prompts = [{"prompt_token_ids": [1] + list(range(5, 17)) + [BOI, 20, 21], "multi_modal_data": {"image": one}},
               {"prompt_token_ids": [1, BOI, 10, 11, BOI, 12], "multi_modal_data": {"image": two}},
               {"prompt_token_ids": [1, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29]}]
    outs = llm.generate(prompts, GREEDY)
    for out, imgs in zip(outs, (one, two, [])):
        check_against_hf(hf, g3_model, out, imgs, GREEDY.max_tokens)
    assert llm.llm_engine.model_runner.encoder.num_encoded == 3


def test_reference_attention_backend_matches_hf(g3_model, hf):
    """The plain-jnp attention (reference backend) takes keys_ahead too."""
    llm = make_g3_llm(g3_model, attention_backend="reference")
    imgs = images((80, 80), seed=2)
    out = llm.generate({"prompt_token_ids": [1, 5, 6, 7, 8, 9, 10, 11, 12, BOI, 13], "multi_modal_data": {"image": imgs}},
                       GREEDY)[0]
    check_against_hf(hf, g3_model, out, imgs, GREEDY.max_tokens)


def test_chunks_never_cut_an_image_and_prefix_cache_is_keyed_by_image(g3_model, hf):
    """Chunks of 20 tokens: the one that would end inside an image stops before it, and
    the image is prefilled whole in the next (HF's tokens); the same image again is not
    encoded again and hits the prefix cache, another image with the same tokens does
    not share the blocks that hold image tokens."""
    llm = make_g3_llm(g3_model, max_num_batched_tokens=20, max_num_encoder_input_tokens=32)
    sched = llm.llm_engine.engine_core.schedulers[0]
    assert sched.scheduler_config.disable_chunked_mm_input
    steps = []
    plan = sched._plan_encoder_inputs

    def spy(request, num_computed, num_new_tokens, budget):
        n, enc = plan(request, num_computed, num_new_tokens, budget)
        steps.append((num_computed, n))
        return n, enc

    sched._plan_encoder_inputs = spy
    x, y = images((112, 112), seed=3)[0], images((112, 112), seed=4)[0]
    ids = [1] + list(range(5, 15)) + [BOI] + list(range(20, 30))
    plain = SamplingParams(max_tokens=6, temperature=0.0)  # prompt logprobs would skip the prefix cache
    first = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": x}}, plain)[0]
    # 11 tokens, then <start_of_image> (its offset 11), then the image: [12, 28).
    assert steps[:2] == [(0, 12), (12, 20)], steps
    prompt = list(first.prompt_token_ids)
    assert list(first.outputs[0].token_ids) == hf_greedy(hf, g3_model, prompt, [x], 6)
    enc = llm.llm_engine.model_runner.encoder
    again = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": x}}, plain)[0]
    assert enc.num_encoded == 1 and again.num_cached_tokens == 32
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    other = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": y}}, plain)[0]
    assert enc.num_encoded == 2 and other.num_cached_tokens == 0  # block 0 holds the image's first tokens
    assert list(other.outputs[0].token_ids) == hf_greedy(hf, g3_model, list(other.prompt_token_ids), [y], 6)


def test_step_budget_below_an_image_is_refused(g3_model):
    with pytest.raises(ValueError, match="max_num_batched_tokens .* must be at least 16"):
        make_g3_llm(g3_model, max_num_batched_tokens=12)
    with pytest.raises(ValueError, match="long_prefill_token_threshold .* must be at least 16"):
        make_g3_llm(g3_model, long_prefill_token_threshold=8)


def test_chat_and_compiled_steps_without_recompiles(g3_model, hf):
    """LLM.chat with an image_url part (the template's <start_of_image>), compiled (not
    eager): the warm-up compiles the tower's image-count buckets and serving one and two
    images per step compiles nothing; HF's tokens."""
    import base64
    import io

    from compile_counter import count_compiles

    llm = make_g3_llm(g3_model, enforce_eager=False)
    runner = llm.llm_engine.model_runner
    assert runner.encoder.keys() and all(k in runner.compilation.executables for k in runner.encoder.keys())
    imgs = images((84, 84), (50, 90), (112, 70), seed=5)
    buf = io.BytesIO()
    imgs[0].save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    sp = SamplingParams(max_tokens=4, temperature=0.0)
    with count_compiles(runner) as compiled:
        chat = llm.chat([{"role": "user", "content": [{"type": "text", "text": "w7 w8"},
                                                      {"type": "image_url", "image_url": {"url": url}}]}], sp)[0]
        outs = llm.generate([{"prompt_token_ids": [1, 5, BOI, 6], "multi_modal_data": {"image": imgs[1]}},
                             {"prompt_token_ids": [1, BOI, 7, BOI, 8], "multi_modal_data": {"image": imgs[1:]}}], sp)
    assert compiled == [0, 0], f"(backend compiles, new variants) after warm-up: {compiled}"
    ids = list(chat.prompt_token_ids)
    assert ids.count(GEMMA_IMAGE_TOKEN) == TOKENS and BOI in ids and EOI in ids
    assert list(chat.outputs[0].token_ids) == hf_greedy(hf, g3_model, ids, imgs[:1], 4)
    for out, im in zip(outs, (imgs[1:2], imgs[1:])):
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, g3_model, list(out.prompt_token_ids), im, 4)


def test_hub_tower_names(g3_model, hf, tmp_path):
    """The Hub's checkpoints nest the tower in vision_tower.vision_model.*: same tokens."""
    import shutil

    from safetensors.numpy import load_file, save_file

    hub = tmp_path / "hub"
    shutil.copytree(g3_model, hub)
    tensors = load_file(str(hub / "model.safetensors"))
    renamed = {("vision_tower.vision_model." + n[len("vision_tower."):] if n.startswith("vision_tower.") else n): t
               for n, t in tensors.items()}
    assert any(n.startswith("vision_tower.vision_model.") for n in renamed)
    save_file(renamed, str(hub / "model.safetensors"), metadata={"format": "pt"})
    img = images((64, 64), seed=6)
    prompt = {"prompt_token_ids": [1, 5, BOI, 6, 7], "multi_modal_data": {"image": img}}
    sp = SamplingParams(max_tokens=5, temperature=0.0)
    new, old = (make_g3_llm(p).generate(prompt, sp)[0] for p in (g3_model, hub))
    assert new.outputs[0].token_ids == old.outputs[0].token_ids


@pytest.mark.devices(2)
def test_tensor_parallel_matches_one_device(g3_model):
    """tp 2: the tower's heads and MLP columns split over 'model', and the decoder's as
    usual, give the one-device tokens and prompt logprobs, with two images."""
    import jax

    imgs = images((100, 150), (84, 56), seed=9)
    prompt = {"prompt_token_ids": [1, 5, BOI, 6, BOI, 7, 8], "multi_modal_data": {"image": imgs}}
    res = []
    for tp in (1, 2):
        llm = make_g3_llm(g3_model, tensor_parallel_size=tp)
        if tp == 2:
            runner = llm.llm_engine.model_runner
            assert runner.arch.vision.tensor_parallel
            q = runner.state["vision_tower"]["params"]["0_q_proj"][...]
            assert q.sharding.spec == jax.sharding.PartitionSpec(None, "model")
        out = llm.generate(prompt, GREEDY)[0]
        res.append((out.outputs[0].token_ids, [list(d.values())[0].logprob for d in out.prompt_logprobs[1:]]))
    assert res[0][0] == res[1][0]
    np.testing.assert_allclose(res[0][1], res[1][1], atol=1e-4)


def test_hub_config_reads_as_transformers_does():
    """gemma-3-4b-it's config.json as the Hub ships it (transformers 4: a text_config of
    a few sizes, rope_scaling linear 8, eos at the top): the defaults and the rope are
    transformers'."""
    from models.config import ModelArchConfig

    hub = {"architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
           "eos_token_id": [1, 106], "image_token_index": 262144, "mm_tokens_per_image": 256, "model_type": "gemma3",
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                           "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024},
           "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                             "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                             "patch_size": 14, "vision_use_head": False}}
    arch = ModelArchConfig.from_hf_dict(hub)
    assert (arch.vocab_size, arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == (262208, 8, 4, 256)
    assert arch.rope_scaling == {"rope_type": "linear", "factor": 8.0} and arch.rope_local_theta == 10000.0
    assert arch.sliding_window == 1024 and arch.sliding_window_layers[:6] == (True,) * 5 + (False,)
    assert arch.eos_token_id == [1, 106] and arch.image_token_id == 262144 and arch.mm_bidirectional
    vc = arch.vision
    assert (vc.depth, vc.hidden_size, vc.tokens_per_image, vc.boi_token_id) == (27, 1152, 256, 255999)
