"""Images in, text out (issue 36): time to first token and images per second for one
request of N images of S x S pixels, jaxserve against HF transformers (torch CPU) on the
same random Qwen2.5-VL (or Gemma 3: --model gemma3) and the same pixels.

The model is random (no hub here): --size small is a reduced Qwen2.5-VL (an 8-block
tower of width 640 with Qwen's 112-pixel windows and two whole-image blocks, a 6-layer
decoder of width 896), --size tiny the tests' model. --model gemma3 --size small: a
reduced Gemma 3, an 8-block SigLIP of width 768 at the Hub's 896 px (4096 patches, 256
tokens an image, whatever S is), a 6-layer decoder of width 1152 (Gemma 3 1B's layer). Each cell is the median of
--repeats runs after one warm-up run; jaxserve's cells run after its warm-up (the
tower's window buckets compiled), HF's prefill is one forward with the pixels. Both
run in float32 (jaxserve also at its default dtype, a second row) on the same images.

    python benchmarks/bench_vision.py
    python benchmarks/bench_vision.py --size small --cells 1x224 1x448 1x896 4x448 8x224
    python benchmarks/bench_vision.py --model gemma3 --cells 1x224 1x896 4x448 8x224
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import commit_line, machine_line  # noqa: E402

SIZES = {
    "small": dict(vision=dict(depth=8, hidden_size=640, intermediate_size=1280, num_heads=10, out_hidden_size=896,
                              fullatt_block_indexes=[3, 7]),
                  text=dict(hidden_size=896, intermediate_size=2432, num_hidden_layers=6, num_attention_heads=14,
                            num_key_value_heads=2, vocab_size=4096), section=[16, 8, 8]),
}
CELLS = ("1x224", "1x448", "1x896", "4x448", "8x224")
GEMMA_SMALL = dict(vision=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=12,
                               image_size=896, patch_size=14, vision_use_head=False),
                   text=dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=6, num_attention_heads=4,
                             num_key_value_heads=1, head_dim=256, sliding_window=512, query_pre_attn_scalar=256,
                             vocab_size=4096, max_position_embeddings=16384,
                             layer_types=["sliding_attention"] * 5 + ["full_attention"]))


def make_gemma3(out: Path, size: str) -> Path:
    import torch
    import transformers

    from tests.models import hf_factory

    if size == "tiny":
        return hf_factory.make_tiny_hf_model(out, "gemma3_vl")
    torch.manual_seed(0)
    cfg = transformers.Gemma3Config(text_config=dict(GEMMA_SMALL["text"], bos_token_id=1, eos_token_id=2,
                                                     pad_token_id=0),
                                    vision_config=GEMMA_SMALL["vision"], mm_tokens_per_image=256,
                                    image_token_index=hf_factory.GEMMA_IMAGE_TOKEN, boi_token_index=501,
                                    eoi_token_index=502, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = transformers.Gemma3ForConditionalGeneration(cfg)
    with torch.no_grad():
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.02)  # zeros at init
    model.float().eval().save_pretrained(out)
    hf_factory._write_tokenizer(out, GEMMA_SMALL["text"]["vocab_size"], hf_factory.GEMMA_VL_TOKENS)
    (out / "preprocessor_config.json").write_text(json.dumps({
        "size": {"height": 896, "width": 896}, "resample": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}))
    return out


def make_model(out: Path, size: str, model: str = "qwen2_5_vl") -> Path:
    import torch
    import transformers

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.models import hf_factory

    if model == "gemma3":
        return make_gemma3(out, size)
    if size == "tiny":
        return hf_factory.make_tiny_hf_model(out, "qwen2_5_vl")
    s = SIZES[size]
    torch.manual_seed(0)
    vision = dict(patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112, hidden_act="silu",
                  **s["vision"])
    text = dict(max_position_embeddings=16384, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": s["section"]},
                **s["text"])
    cfg = transformers.Qwen2_5_VLConfig(vision_config=vision, text_config=text, image_token_id=hf_factory.VL_IMAGE_TOKEN,
                                        video_token_id=501, vision_start_token_id=502, vision_end_token_id=503)
    transformers.Qwen2_5_VLForConditionalGeneration(cfg).float().eval().save_pretrained(out)
    hf_factory._write_tokenizer(out, s["text"]["vocab_size"], hf_factory.VL_TOKENS)
    (out / "preprocessor_config.json").write_text(json.dumps({
        "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
        "size": {"shortest_edge": 56 * 56, "longest_edge": 1024 * 1024}}))
    return out


def images(n: int, side: int):
    from PIL import Image

    rng = np.random.default_rng(side + n)
    return [Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)) for _ in range(n)]


def fresh_images(n: int, side: int, run: int):
    """Run ``run``'s images: other pixels each run (their hashes miss jaxserve's encoder
    cache, so the tower runs every time), the same for both engines."""
    return [(im.rotate(90 * run) if run % 2 else im).point(lambda v: (v + run) % 256) for im in images(n, side)]


def prompt_ids(n: int, model: str = "qwen2_5_vl") -> list[int]:
    from tests.models.hf_factory import VL_IMAGE_TOKEN

    if model == "gemma3":
        return [1, 5, 6] + [501] * n + [7, 8]  # one <start_of_image> per image
    return [1, 5, 6] + [502, VL_IMAGE_TOKEN, 503] * n + [7, 8]


def time_jaxserve(path, cells, repeats, dtype, max_len, model="qwen2_5_vl") -> dict:
    from jaxserve import LLM, SamplingParams

    # A step of 2048 tokens; the encoder budget holds 4 images of 448 px or one of 896 (1024 tokens) at once.
    llm = LLM(str(path), dtype=dtype, max_model_len=max_len, max_num_batched_tokens=min(max_len, 2048),
              max_num_encoder_input_tokens=min(max_len, 4096), max_num_seqs=4, enable_prefix_caching=False,
              progress=False)
    assert llm.llm_engine.model_runner.encoder is not None
    sp = SamplingParams(max_tokens=1, temperature=0.0)

    def run(n, imgs):
        res = llm.generate({"prompt_token_ids": prompt_ids(n, model), "multi_modal_data": {"image": imgs}}, sp,
                           use_tqdm=False)
        return len(res[0].prompt_token_ids)

    return time_cells(cells, repeats, run)


def time_cells(cells, repeats, run) -> dict:
    """cell -> (the median seconds of ``run(n, images)`` over ``repeats`` runs after one
    warm-up run, the prompt's tokens)."""
    out = {}
    for cell in cells:
        n, side = map(int, cell.split("x"))
        times = []
        for r in range(repeats + 1):
            imgs = fresh_images(n, side, r)
            t0 = time.perf_counter()
            num_tokens = run(n, imgs)
            times.append(time.perf_counter() - t0)
        out[cell] = (statistics.median(times[1:]), num_tokens)
    return out


def time_hf_gemma3(path, cells, repeats) -> dict:
    import torch
    import transformers
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from jaxserve.multimodal.processor import MultiModalProcessor
    from models.config import ModelArchConfig
    from tests.models.hf_factory import GEMMA_IMAGE_TOKEN

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(path, torch_dtype=torch.float32).eval()
    cfg = json.loads((Path(path) / "preprocessor_config.json").read_text())
    proc = Gemma3ImageProcessorPil(**{k: v for k, v in cfg.items() if k != "image_processor_type"})
    expand = MultiModalProcessor.from_model(path, ModelArchConfig.from_pretrained(path))

    def run(n, imgs):
        ids, _ = expand.process(prompt_ids(n, "gemma3"), imgs)  # HF's processor expands the same way
        px = proc(imgs, return_tensors="pt")
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                  pixel_values=px["pixel_values"], logits_to_keep=1,
                  token_type_ids=torch.tensor([[int(t == GEMMA_IMAGE_TOKEN) for t in ids]]))
        return len(ids)

    return time_cells(cells, repeats, run)


def time_hf(path, cells, repeats) -> dict:
    import torch
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from jaxserve.multimodal.processor import MultiModalProcessor
    from models.config import ModelArchConfig
    from tests.models.hf_factory import VL_IMAGE_TOKEN

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(path, torch_dtype=torch.float32).eval()
    cfg = json.loads((Path(path) / "preprocessor_config.json").read_text())
    proc = Qwen2VLImageProcessorPil(**cfg)
    expand = MultiModalProcessor.from_model(path, ModelArchConfig.from_pretrained(path))

    def run(n, imgs):
        ids, _ = expand.process(prompt_ids(n), imgs)  # HF's processor expands the same way
        px = proc(imgs, return_tensors="pt")
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                  pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"],
                  mm_token_type_ids=torch.tensor([[int(t == VL_IMAGE_TOKEN) for t in ids]]), logits_to_keep=1)
        return len(ids)

    return time_cells(cells, repeats, run)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2_5_vl", choices=["qwen2_5_vl", "gemma3"])
    ap.add_argument("--size", default="small", choices=[*SIZES, "tiny"])
    ap.add_argument("--cells", nargs="+", default=list(CELLS), help="NxS: N images of S x S pixels in one request")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-default-dtype", action="store_true")
    args = ap.parse_args()
    print(machine_line())
    print(commit_line())
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(Path(tmp) / "vl", args.size, args.model)
        name = "Gemma 3" if args.model == "gemma3" else "Qwen2.5-VL"
        print(f"model: random {name}, --size {args.size}; cells: {' '.join(args.cells)}", flush=True)
        hf_timer = time_hf_gemma3 if args.model == "gemma3" else time_hf
        rows = {"HF transformers float32": hf_timer(path, args.cells, args.repeats)}
        max_len = 512 if args.size == "tiny" else 8192
        rows["jaxserve float32"] = time_jaxserve(path, args.cells, args.repeats, "float32", max_len, args.model)
        if not args.skip_default_dtype:
            rows["jaxserve default dtype"] = time_jaxserve(path, args.cells, args.repeats, "auto", max_len,
                                                           args.model)
    print("\n| engine | " + " | ".join(f"{c}: TTFT s (img/s)" for c in args.cells) + " |")
    print("|---|" + "---|" * len(args.cells))
    for name, cells in rows.items():
        print(f"| {name} | " + " | ".join(
            f"{cells[c][0]:.3f} ({int(c.split('x')[0]) / cells[c][0]:.2f})" for c in args.cells) + " |")
    hf = rows["HF transformers float32"]
    for name, cells in rows.items():
        if name.startswith("jaxserve"):
            print(f"{name} vs HF: " + ", ".join(f"{c} {hf[c][0] / cells[c][0]:.2f}x" for c in args.cells))
    print("prompt tokens per cell:", {c: v[1] for c, v in hf.items()})


if __name__ == "__main__":
    main()
