"""Qwen2.5-VL: images in, text out (issue 36), against HF transformers in float32.

A tiny random Qwen2_5_VLForConditionalGeneration (a 4-block tower with 4-patch windows
and two whole-image blocks, M-RoPE sections 2 / 3 / 3) and images of 56-300 px.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from tests.models.hf_factory import VL_IMAGE_TOKEN, random_images as images

pytestmark = pytest.mark.slow

START, END = 502, 503  # <|vision_start|>, <|vision_end|>
IMG = [START, VL_IMAGE_TOKEN, END]


@pytest.fixture(scope="module")
def vl_model(tiny_models):
    return tiny_models("qwen2_5_vl")


@pytest.fixture(scope="module")
def hf(vl_model):
    import torch
    import transformers

    return transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(vl_model, torch_dtype=torch.float32).eval()


def hf_processor(path):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    cfg = json.loads((path / "preprocessor_config.json").read_text())
    return Qwen2VLImageProcessorPil(**{k: v for k, v in cfg.items() if k != "image_processor_type"})


def make_vl_llm(path, **kw):
    base = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=128, kv_cache_memory=8 << 20,
                compilation_cache=False, progress=False, enforce_eager=True, dtype="float32")
    return LLM(str(path), **{**base, **kw})


def hf_inputs(path, ids, imgs) -> dict:
    """HF's image inputs, as its processor gives them (mm_token_type_ids: without them
    HF falls back to 1-D positions)."""
    import torch

    if not imgs:
        return {}
    ref = hf_processor(path)(imgs, return_tensors="pt")
    return dict(pixel_values=ref["pixel_values"], image_grid_thw=ref["image_grid_thw"],
                mm_token_type_ids=torch.tensor([[int(t == VL_IMAGE_TOKEN) for t in ids]]))


def hf_forward(hf, path, ids, imgs):
    """HF's logits [len(ids), V] for the expanded prompt ``ids`` with ``imgs``."""
    import torch

    kw = hf_inputs(path, ids, imgs)
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                  **kw).logits[0].double().numpy()


def hf_greedy(hf, path, ids, imgs, n):
    import torch

    kw = hf_inputs(path, ids, imgs)
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=n, do_sample=False, **kw)
    return out[0, len(ids):].tolist()


def check_against_hf(hf, path, out, imgs, max_tokens):
    """Greedy tokens and prompt logprobs of one RequestOutput equal HF's."""
    ids = list(out.prompt_token_ids)
    assert list(out.outputs[0].token_ids) == hf_greedy(hf, path, ids, imgs, max_tokens)
    logits = hf_forward(hf, path, ids, imgs)
    ref = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(
        -1, keepdims=True)
    ours = [next(iter(d.values())).logprob if d is not None else None for d in out.prompt_logprobs]
    got = np.array([ours[i] if len(out.prompt_logprobs[i]) == 1 else out.prompt_logprobs[i][ids[i]].logprob
                    for i in range(1, len(ids))])
    want = np.array([ref[i - 1, ids[i]] for i in range(1, len(ids))])
    np.testing.assert_allclose(got, want, atol=1e-4)


GREEDY = SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=0)


def test_processor_tower_and_positions_match_hf(vl_model, hf):
    """The numpy processor's patches and grids, the JAX tower's outputs and the M-RoPE
    positions equal HF's for three images of different shapes."""
    import torch

    from jaxserve.multimodal.processor import MultiModalProcessor
    from models.config import ModelArchConfig

    imgs = images((100, 150), (60, 60), (300, 90))
    arch = ModelArchConfig.from_pretrained(vl_model)
    proc = MultiModalProcessor.from_model(vl_model, arch)
    ref = hf_processor(vl_model)(imgs, return_tensors="np")
    ours = [proc.image_processor(im) for im in imgs]
    assert [list(o.grid) for o in ours] == ref["image_grid_thw"].tolist()
    np.testing.assert_allclose(np.concatenate([o.pixel_values for o in ours]), ref["pixel_values"], atol=1e-5)

    ids = [1, 5] + IMG + [6, 7] + IMG + IMG + [8]
    expanded, mm = proc.process(ids, imgs)
    assert [f.length for f in mm.features] == [o.num_tokens for o in ours]
    with torch.no_grad():
        pos, delta = hf.model.get_rope_index(
            torch.tensor([expanded]), mm_token_type_ids=torch.tensor([[int(t == VL_IMAGE_TOKEN) for t in expanded]]),
            image_grid_thw=torch.tensor(ref["image_grid_thw"]))
    np.testing.assert_array_equal(mm.mrope_positions, pos[:, 0].numpy())
    assert mm.mrope_delta == int(delta[0, 0])

    llm = make_vl_llm(vl_model)
    runner = llm.llm_engine.model_runner
    enc = runner.encoder
    from jaxserve.multimodal.qwen2_vl import vision_layout

    vc = arch.vision
    lay = vision_layout([o.grid for o in ours], vc.spatial_merge_size, vc.window_merged)
    pv = np.concatenate([o.pixel_values for o in ours])
    px = np.where(lay.patch_index[:, None] >= 0, pv[np.maximum(lay.patch_index, 0)], 0)
    from flax import nnx

    model = nnx.merge(runner.graphdef, runner.state)
    feats = np.asarray(model.encode_images(px, lay.image_id, lay.pos_hw, lay.window_len))[lay.out_index]
    with torch.no_grad():
        r = hf.model.get_image_features(torch.tensor(ref["pixel_values"]), torch.tensor(ref["image_grid_thw"]))
    want = torch.cat(list(r.pooler_output)).numpy()
    np.testing.assert_allclose(feats, want, atol=1e-4, rtol=1e-4)
    assert enc is not None


def test_one_two_and_no_images_match_hf(vl_model, hf):
    """Greedy tokens and prompt logprobs equal HF's with one image, with two, and for a
    text-only prompt, in one batch."""
    llm = make_vl_llm(vl_model)
    one, two = images((100, 150)), images((60, 60), (84, 112), seed=1)
    prompts = [{"prompt_token_ids": [1, 5, 6] + IMG + [7, 8, 9], "multi_modal_data": {"image": one[0]}},
               {"prompt_token_ids": [1] + IMG + [10, 11] + IMG + [12], "multi_modal_data": {"image": two}},
               {"prompt_token_ids": [1, 20, 21, 22, 23]}]
    outs = llm.generate(prompts, GREEDY)
    for out, imgs in zip(outs, (one, two, [])):
        check_against_hf(hf, vl_model, out, imgs, GREEDY.max_tokens)
    assert llm.llm_engine.model_runner.encoder.num_encoded == 3


def test_same_image_encoded_once_and_prefix_cache_keyed_by_image(vl_model, hf):
    """A second request with the same image is not encoded again (and hits the prefix
    cache); a request with the same tokens but another image hits no block that holds
    image tokens and gets HF's outputs for its own image."""
    llm = make_vl_llm(vl_model)
    enc, sched = llm.llm_engine.model_runner.encoder, llm.llm_engine.engine_core.schedulers[0]
    x, y = images((112, 112), seed=2)[0], images((112, 112), seed=3)[0]
    ids = [1, 5, 6, 7] + IMG + [8, 9, 10, 11, 12, 13]
    plain = SamplingParams(max_tokens=6, temperature=0.0)  # prompt logprobs would skip the prefix cache
    first = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": x}}, plain)[0]
    assert enc.num_encoded == 1
    # A later turn with the same image: its encoder output is still cached (the
    # prefix hit covers block 0; the image's last tokens are in block 1).
    again = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": x}}, plain)[0]
    assert enc.num_encoded == 1 and sched.encoder_cache.num_reused == 1
    assert again.num_cached_tokens == 16 and again.outputs[0].token_ids == first.outputs[0].token_ids
    other = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": y}}, plain)[0]
    assert enc.num_encoded == 2
    # Block 0 holds text and the image's first tokens: not shared with x's blocks.
    assert other.num_cached_tokens == 0
    assert list(other.outputs[0].token_ids) == hf_greedy(hf, vl_model, list(other.prompt_token_ids), [y], 6)
    # Two requests of one step share an image: encoded once.
    z = images((56, 84), seed=4)[0]
    both = llm.generate([{"prompt_token_ids": [1, 30] + IMG + [31], "multi_modal_data": {"image": z}},
                         {"prompt_token_ids": [1, 40, 41] + IMG + [42], "multi_modal_data": {"image": z}}], GREEDY)
    assert enc.num_encoded == 3
    assert llm.llm_engine.get_metrics()["encoder"] == {"num_encoded": 3, "num_reused": 2}
    for out in both:
        check_against_hf(hf, vl_model, out, [z], GREEDY.max_tokens)


def test_chunked_prefill_through_an_image(vl_model, hf):
    """Chunks of 8 tokens cut through a 20-token image (encoded once, in the first chunk
    that reaches it): HF's tokens and prompt logprobs."""
    llm = make_vl_llm(vl_model, max_num_batched_tokens=8, max_num_encoder_input_tokens=64)
    imgs = images((112, 140), seed=5)
    out = llm.generate({"prompt_token_ids": [1, 5, 6, 7, 8] + IMG + [9, 10, 11], "multi_modal_data": {"image": imgs}},
                       GREEDY)[0]
    assert len(out.prompt_token_ids) > 20
    check_against_hf(hf, vl_model, out, imgs, GREEDY.max_tokens)
    assert llm.llm_engine.model_runner.encoder.num_encoded == 1


def test_bad_image_inputs_are_value_errors(vl_model, tiny_models):
    llm = make_vl_llm(vl_model, limit_mm_per_prompt={"image": 2})
    img = images((60, 60))[0]
    sp = SamplingParams(max_tokens=2)
    bad = [
        ({"prompt_token_ids": [1] + IMG, "multi_modal_data": {"image": "data:image/png;base64,!!!"}}, "base64"),
        ({"prompt_token_ids": [1] + IMG, "multi_modal_data": {"image": b"not an image"}}, "could not be decoded"),
        ({"prompt_token_ids": [1, 5], "multi_modal_data": {"image": img}}, "placeholder"),
        ({"prompt_token_ids": [1] + IMG * 3, "multi_modal_data": {"image": [img] * 3}}, "at most 2 images"),
        ({"prompt_token_ids": [1] + IMG, "multi_modal_data": {"video": img}}, "only 'image'"),
    ]
    for prompt, msg in bad:
        with pytest.raises(ValueError, match=msg):
            llm.generate(prompt, sp)
    assert llm.generate({"prompt_token_ids": [1] + IMG, "multi_modal_data": {"image": img}}, sp)[0].outputs
    from jaxserve.beam_search import BeamSearchParams

    with pytest.raises(ValueError, match="beam search does not take images"):
        llm.beam_search({"prompt_token_ids": [1] + IMG, "multi_modal_data": {"image": img}},
                        BeamSearchParams(beam_width=2, max_tokens=2))
    text_only = make_vl_llm(tiny_models("llama"))
    with pytest.raises(ValueError, match="text only"):
        text_only.generate({"prompt_token_ids": [1, 5], "multi_modal_data": {"image": img}}, sp)


def test_chat_with_image_parts(vl_model, hf):
    """LLM.chat: an image_url part (base64 PNG) and an offline image part give the
    chat template's placeholders, and HF's tokens for the rendered prompt."""
    import base64
    import io

    llm = make_vl_llm(vl_model)
    img = images((84, 84), seed=6)[0]
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    sp = SamplingParams(max_tokens=5, temperature=0.0)
    by_url, by_image = (llm.chat([{"role": "user", "content": [{"type": "text", "text": "w7 w8"}, part]}], sp)[0]
                        for part in ({"type": "image_url", "image_url": {"url": url}}, {"type": "image", "image": img}))
    assert by_url.prompt_token_ids == by_image.prompt_token_ids
    assert by_url.outputs[0].token_ids == by_image.outputs[0].token_ids
    ids = list(by_url.prompt_token_ids)
    assert ids.count(VL_IMAGE_TOKEN) == 9 and START in ids and END in ids
    assert list(by_url.outputs[0].token_ids) == hf_greedy(hf, vl_model, ids, [img], 5)
    assert llm.llm_engine.model_runner.encoder.num_encoded == 1


def test_no_compiles_after_warmup_with_images(vl_model, hf):
    """Compiled steps (not eager): the warm-up compiles the tower's window buckets, and
    serving images of several sizes, one and several per step, compiles nothing; the
    compiled programs give HF's tokens."""
    from compile_counter import count_compiles

    llm = make_vl_llm(vl_model, enforce_eager=False)
    runner = llm.llm_engine.model_runner
    assert runner.encoder.keys() and all(k in runner.compilation.executables for k in runner.encoder.keys())
    imgs = images((224, 224), (56, 56), (100, 150), (60, 200), seed=7)
    sp = SamplingParams(max_tokens=4, temperature=0.0)
    with count_compiles(runner) as compiled:
        outs = llm.generate([{"prompt_token_ids": [1, 5] + IMG + [6], "multi_modal_data": {"image": im}}
                             for im in imgs] + [{"prompt_token_ids": [1] + IMG + IMG + [7],
                                                 "multi_modal_data": {"image": imgs[1:3]}}], sp)
    assert compiled == [0, 0], f"(backend compiles, new variants) after warm-up: {compiled}"
    for out, im in zip(outs, imgs):
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, vl_model, list(out.prompt_token_ids), [im], 4)


def test_hub_config_layout(vl_model, tmp_path):
    """The Hub's Qwen2.5-VL folders (written by transformers 4): the decoder's fields at
    the top of config.json with rope_scaling {"type": "mrope", "mrope_section"}, and
    min_pixels / max_pixels in preprocessor_config.json. The same weights give the
    same tokens as transformers 5's layout."""
    import shutil

    hub = tmp_path / "hub"
    shutil.copytree(vl_model, hub)
    cfg = json.loads((hub / "config.json").read_text())
    text = cfg.pop("text_config")
    rope = text.pop("rope_parameters")
    legacy = {**text, **cfg, "rope_theta": rope["rope_theta"],
              "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}
    legacy["vision_config"].pop("rope_parameters", None)
    (hub / "config.json").write_text(json.dumps(legacy))
    pre = json.loads((hub / "preprocessor_config.json").read_text())
    size = pre.pop("size")
    pre.update(min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"],
               image_processor_type="Qwen2_5_VLImageProcessor")
    (hub / "preprocessor_config.json").write_text(json.dumps(pre))
    img = images((140, 100), seed=8)
    prompt = {"prompt_token_ids": [1, 5] + IMG + [6, 7], "multi_modal_data": {"image": img}}
    sp = SamplingParams(max_tokens=5, temperature=0.0, prompt_logprobs=0)
    new, old = (make_vl_llm(p).generate(prompt, sp)[0] for p in (vl_model, hub))
    assert new.prompt_token_ids == old.prompt_token_ids and new.outputs[0].token_ids == old.outputs[0].token_ids
    assert [list(d.values())[0].logprob if d else None for d in new.prompt_logprobs] == \
        [list(d.values())[0].logprob if d else None for d in old.prompt_logprobs]


@pytest.mark.devices(2)
def test_tensor_parallel_matches_one_device(vl_model):
    """tp 2: the tower's heads and MLP columns split over 'model' (q / k / v read as row
    blocks of the fused qkv) and the decoder's as usual give the one-device tokens and
    prompt logprobs, with two images."""
    import jax

    imgs = images((100, 150), (84, 56), seed=9)
    prompt = {"prompt_token_ids": [1, 5] + IMG + [6] + IMG + [7, 8], "multi_modal_data": {"image": imgs}}
    sp = SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=0)
    res = []
    for tp in (1, 2):
        llm = make_vl_llm(vl_model, tensor_parallel_size=tp)
        if tp == 2:
            runner = llm.llm_engine.model_runner
            assert runner.arch.vision.tensor_parallel
            q = runner.state["visual"]["params"]["0_q"][...]
            assert q.sharding.spec == jax.sharding.PartitionSpec(None, "model")
        out = llm.generate(prompt, sp)[0]
        res.append((out.outputs[0].token_ids,
                    [list(d.values())[0].logprob for d in out.prompt_logprobs[1:]]))
    assert res[0][0] == res[1][0]
    np.testing.assert_allclose(res[0][1], res[1][1], atol=1e-4)
