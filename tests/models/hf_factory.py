"""Tiny random HF checkpoints built on the fly (torch is a test-only dependency)."""
from __future__ import annotations

from pathlib import Path


MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral")
_MOE_KEYS = ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
             "shared_expert_intermediate_size")


def make_tiny_hf_model(path: Path, arch: str = "llama", *, tie: bool = False, kv_heads: int = 2,
                       seed: int = 0, vocab: int = 512, layers: int = 2, max_pos: int = 512, heads: int = 4,
                       tokenizer: str = "words", **config_kw) -> Path:
    """config_kw go to the HF config (e.g. attention_bias=True, mlp_bias=True).
    tokenizer: "words" (w3 w4 ...: text round-trips) or "bytes" (a byte-level BPE
    that can spell any text, e.g. JSON, as grammar-constrained decoding needs)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
                  tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=0, **config_kw)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common, head_dim=16, rms_norm_eps=1e-5)
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "llama3":
        cfg = transformers.LlamaConfig(**common, head_dim=16, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif arch == "mistral":
        cfg = transformers.MistralConfig(**common, head_dim=16)  # sliding_window via config_kw
        model = transformers.MistralForCausalLM(cfg)
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=16)
        model = transformers.Qwen3ForCausalLM(cfg)
    elif arch == "phi3":  # fused qkv / gate_up; LongRoPE and partial rotary via config_kw
        cfg = transformers.Phi3Config(**common)
        model = transformers.Phi3ForCausalLM(cfg)
    elif arch in ("gemma2", "gemma3"):
        # A window of 8 tokens (shorter than the test prompts), one sliding and one global layer.
        gemma = dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                     layer_types=["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] * (
                         layers % 2))
        gemma.update({k: v for k, v in common.items() if k not in gemma})
        if arch == "gemma2":
            # Caps small enough to bite on a tiny model's scores (the defaults, 50 / 30, never would).
            cfg = transformers.Gemma2Config(**{"attn_logit_softcapping": 0.5, "final_logit_softcapping": 5.0,
                                               **gemma})
            model = transformers.Gemma2ForCausalLM(cfg)
        else:
            cfg = transformers.Gemma3TextConfig(**gemma)
            model = transformers.Gemma3ForCausalLM(cfg)
    elif arch == "gpt_oss":
        # 8 experts, top 2, a window of 8 on the even layers, YaRN (trained length 64);
        # the eager attention (HF's sdpa path has no sinks).
        gpt = dict(head_dim=16, num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, sliding_window=8,
                   rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                                    "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})
        gpt.update({k: v for k, v in common.items() if k not in gpt})
        cfg = transformers.GptOssConfig(**gpt)
        cfg._attn_implementation = "eager"
        model = transformers.GptOssForCausalLM(cfg)
    elif arch in ("deepseek_v2", "deepseek_v3"):
        # MLA (latent 32, rope 8, nope 16, v 16: v unlike nope, as V3's 128 / 128 is not
        # forced), the first layer dense, 8 routed experts (top 2) plus one shared.
        # V2-Lite's shape by default (q in one matrix, greedy softmax routing); V3's: q
        # low-rank, sigmoid scores in 4 groups (best 2), the correction bias, YaRN.
        ds = dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=24, n_routed_experts=8,
                  num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                  num_key_value_heads=heads)
        if arch == "deepseek_v3":
            ds |= dict(q_lora_rank=24, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                       rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "beta_fast": 32.0,
                                        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                        "original_max_position_embeddings": 64})
        else:
            ds |= dict(q_lora_rank=None, topk_method="greedy")
        ds.update({k: v for k, v in config_kw.items()})
        ds.update({k: v for k, v in common.items() if k not in ds})
        cls = "DeepseekV3" if arch == "deepseek_v3" else "DeepseekV2"
        cfg = getattr(transformers, cls + "Config")(**ds)
        cfg._attn_implementation = "eager"
        model = getattr(transformers, cls + "ForCausalLM")(cfg)
    elif arch in MOE_ARCHS:
        # 8 experts, top 2 (MoE parity needs >= 8 experts); small expert mlp dims.
        moe = dict(num_experts_per_tok=2, **{k: v for k, v in config_kw.items() if k in _MOE_KEYS})
        rest = {k: v for k, v in common.items() if k not in _MOE_KEYS}
        if arch == "qwen3_moe":
            cfg = transformers.Qwen3MoeConfig(**rest, head_dim=16, **{"num_experts": 8, "moe_intermediate_size": 32,
                                                                       "norm_topk_prob": True, **moe})
            model = transformers.Qwen3MoeForCausalLM(cfg)
        elif arch == "qwen2_moe":
            cfg = transformers.Qwen2MoeConfig(**rest, **{"num_experts": 8, "moe_intermediate_size": 32,
                                                         "shared_expert_intermediate_size": 48, **moe})
            model = transformers.Qwen2MoeForCausalLM(cfg)
        else:
            cfg = transformers.MixtralConfig(**rest, **{"num_local_experts": 8, **moe})
            model = transformers.MixtralForCausalLM(cfg)
    elif arch == "qwen2_5_vl":
        # A 4-block tower (blocks 1 and 3 whole-image) with 4-patch windows (56 px), M-RoPE
        # sections 2 / 3 / 3 of head_dim 16; ids 500-503 are the vision tokens.
        vision = dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                      fullatt_block_indexes=[1, 3], hidden_act="silu")
        text = {k: v for k, v in common.items() if k != "tie_word_embeddings"}
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
        cfg = transformers.Qwen2_5_VLConfig(vision_config=vision, text_config=text, image_token_id=VL_IMAGE_TOKEN,
                                            video_token_id=501, vision_start_token_id=502, vision_end_token_id=503,
                                            tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=0)
        model = transformers.Qwen2_5_VLForConditionalGeneration(cfg)
    elif arch == "gemma3_vl":
        # A 2-block SigLIP over 112 px (8 x 8 patches of 14) pooled to 16 tokens (4 x 4):
        # an image's 16 tokens outrun the decoder's window of 8, so the sliding layers'
        # AND(window, OR(causal, image)) mask is exercised; ids 500-502 are the image tokens.
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      image_size=112, patch_size=14, vision_use_head=False)
        text = dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                    layer_types=["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] * (
                        layers % 2))
        text.update({k: v for k, v in common.items() if k not in text and k != "tie_word_embeddings"})
        cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=16,
                                        image_token_index=GEMMA_IMAGE_TOKEN, boi_token_index=501,
                                        eoi_token_index=502, tie_word_embeddings=tie, bos_token_id=1,
                                        eos_token_id=2, pad_token_id=0)
        model = transformers.Gemma3ForConditionalGeneration(cfg)
    else:
        raise ValueError(arch)
    # Random init in HF is small (std 0.02): scale up so logits are not near-uniform and
    # greedy choices have margins worth comparing.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):  # HF initialises biases to zero: a mapping bug would hide
                p.normal_(0, 0.5)
            elif name.endswith("sinks"):  # GPT-OSS: one logit per head, about the scores' size
                p.normal_(0, 1.0)
            elif name.endswith("mm_input_projection_weight"):  # Gemma 3's projector: zeros at init
                p.normal_(0, 0.3)
            elif p.dim() >= 2:
                p.mul_(4.0)
            elif arch.startswith("gemma") and name.endswith(("norm.weight", "mm_soft_emb_norm.weight")):  # (1 + w) norms start at w = 0
                p.normal_(0, 0.3)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3: zeros at init would hide its use
                b.normal_(0, 0.3)
    model = model.float().eval()
    model.save_pretrained(path)
    if tokenizer == "bytes":
        _write_byte_tokenizer(path, vocab)
    else:
        _write_tokenizer(path, vocab, {"qwen2_5_vl": VL_TOKENS, "gemma3_vl": GEMMA_VL_TOKENS}.get(arch, {}))
    if arch == "qwen2_5_vl":
        import json
        # Small images: 56-448 px a side (4-32 patches), so that tests stay fast.
        (Path(path) / "preprocessor_config.json").write_text(json.dumps({
            "image_processor_type": "Qwen2VLImageProcessor", "patch_size": 14, "temporal_patch_size": 2,
            "merge_size": 2, "size": {"shortest_edge": 56 * 56, "longest_edge": 224 * 224},
            "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
            "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_resize": True,
            "do_convert_rgb": True, "resample": 3}))
    if arch == "gemma3_vl":
        import json
        (Path(path) / "preprocessor_config.json").write_text(json.dumps({
            "image_processor_type": "Gemma3ImageProcessor", "size": {"height": 112, "width": 112}, "resample": 2,
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_rescale": True,
            "rescale_factor": 1 / 255, "do_normalize": True, "do_resize": True, "do_convert_rgb": True,
            "do_pan_and_scan": None}))
    return path


def random_images(*sizes, seed=0):
    """PIL images of random pixels, one per (height, width)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


GEMMA_IMAGE_TOKEN = 500
GEMMA_VL_TOKENS = {500: "<image_soft_token>", 501: "<start_of_image>", 502: "<end_of_image>"}
VL_IMAGE_TOKEN = 500
VL_TOKENS = {500: "<|image_pad|>", 501: "<|video_pad|>", 502: "<|vision_start|>", 503: "<|vision_end|>"}


def _write_tokenizer(path: Path, vocab: int, named: dict[int, str] | None = None) -> None:
    """A word-level tokenizer over a synthetic vocabulary, so text round-trips;
    ``named``: ids spelled otherwise than ``w<id>`` (a VLM's vision tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(3, vocab):
        words[(named or {}).get(i, f"w{i}")] = i
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                          "{% if add_generation_prompt %}w3 {% endif %}")
    if named and "<start_of_image>" in named.values():  # Gemma 3: an image part is <start_of_image>
        fast.chat_template = (
            "{% for m in messages %}{{ m['role'] }} {% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<start_of_image>"
            "{% else %}{{ p['text'] }}{% endif %} {% endfor %}"
            "{% endif %} {% endfor %}{% if add_generation_prompt %}w3 {% endif %}")
    elif named:  # a VLM: content parts, an image as Qwen's <|vision_start|><|image_pad|><|vision_end|>
        fast.chat_template = (
            "{% for m in messages %}{{ m['role'] }} {% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}"
            "<|vision_start|> <|image_pad|> <|vision_end|>{% else %}{{ p['text'] }}{% endif %} {% endfor %}"
            "{% endif %} {% endfor %}{% if add_generation_prompt %}w3 {% endif %}")
    fast.save_pretrained(path)


def _write_byte_tokenizer(path: Path, vocab: int) -> None:
    """A byte-level BPE (GPT-2 style) trained on a little JSON-ish text: the 256 bytes,
    <s> / </s> / <unk> and merges up to ``vocab``; ids 0-2 are <unk>, <s>, </s> as in
    the word tokenizer, so the model config's bos / eos ids hold."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ['{"name": "value", "id": 12, "items": [1, 2, 3], "ok": true, "x": null}',
              "the quick brown fox jumps over the lazy dog 0123456789",
              '<tool_call> {"arguments": {}} </tool_call> yes no maybe']
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}assistant: {% endif %}")
    fast.save_pretrained(path)


def write_mxfp4_gpt_oss(src: Path, float_dst: Path, mxfp4_dst: Path) -> None:
    """From a float GPT-OSS folder, two folders of the same model: its experts rounded
    to MXFP4 and stored as floats (``float_dst``, HF's reference) and as OpenAI ships
    them (``mxfp4_dst``: ``*_blocks`` / ``*_scales`` and quantization_config mxfp4)."""
    import json
    import shutil

    import numpy as np
    from safetensors.numpy import load_file, save_file

    from models.packed_formats import pack_mxfp4

    tensors = load_file(str(src / "model.safetensors"))
    floats, packed = dict(tensors), dict(tensors)
    for name, w in tensors.items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):  # [E, in, out]
            blocks, scales, values = pack_mxfp4(np.swapaxes(w, 1, 2))
            floats[name] = np.ascontiguousarray(np.swapaxes(values, 1, 2))
            del packed[name]
            packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
    for dst, ts in ((float_dst, floats), (mxfp4_dst, packed)):
        shutil.copytree(src, dst, dirs_exist_ok=True)
        save_file(ts, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((mxfp4_dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (mxfp4_dst / "config.json").write_text(json.dumps(cfg, indent=2))


INT4_FORMATS = ("awq", "gptq", "w4a16")


def write_int4_checkpoint(src: Path, fmt: str, float_dst: Path, packed_dst: Path) -> None:
    """From a float folder, the same model with every decoder projection rounded to int4
    (groups of 32 input rows) twice: stored as floats (``float_dst``, HF's reference)
    and in ``fmt`` (AutoAWQ GEMM, GPTQ v1 with act-order, compressed-tensors
    pack-quantized), written by models/packed_formats.py's reference packers."""
    from models.packed_formats import write_int4_folder

    write_int4_folder(src, packed_dst, fmt, group_size=32, float_dst=float_dst)
