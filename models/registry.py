"""HF ``architectures`` name -> model class.

A table of (module, class) imported on first use: models/config.py asks the registry
before reading a config, and the model files import models/config.py, so nothing
here imports a model at import time. Adding an architecture is one line here.
"""
from __future__ import annotations

import importlib

_MODEL_REGISTRY = {
    "Gemma2ForCausalLM": ("models.gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("models.gemma3", "Gemma3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("models.gemma3_vl", "Gemma3ForConditionalGeneration"),
    "GptOssForCausalLM": ("models.gpt_oss", "GptOssForCausalLM"),
    "DeepseekV2ForCausalLM": ("models.deepseek", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("models.deepseek", "DeepseekV3ForCausalLM"),
    "LlamaForCausalLM": ("models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("models.mistral", "MistralForCausalLM"),
    "MixtralForCausalLM": ("models.mixtral", "MixtralForCausalLM"),
    "Phi3ForCausalLM": ("models.phi3", "Phi3ForCausalLM"),
    "Qwen2ForCausalLM": ("models.qwen2", "Qwen2ForCausalLM"),
    "Qwen2MoeForCausalLM": ("models.qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3ForCausalLM": ("models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "Qwen2_5_VLForConditionalGeneration": ("models.qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    # Pooling models (models/adapters.py): served with --runner pooling.
    **{name: ("models.adapters", name) for name in (
        "LlamaForSequenceClassification", "Qwen2ForSequenceClassification", "Qwen3ForSequenceClassification",
        "LlamaModel", "Qwen2Model", "Qwen3Model")},
    **{name: ("models.bert", name) for name in (
        "BertModel", "BertForSequenceClassification", "XLMRobertaModel", "XLMRobertaForSequenceClassification")},
}


# What each pooling-only architecture is for when --runner / --convert are "auto" (vLLM
# infers it from the name; models/adapters.py, models/bert.py).
POOLING_ARCHITECTURES = {
    **{a: "classify" for a in ("LlamaForSequenceClassification", "Qwen2ForSequenceClassification",
                               "Qwen3ForSequenceClassification", "BertForSequenceClassification",
                               "XLMRobertaForSequenceClassification")},
    **{a: "embed" for a in ("LlamaModel", "Qwen2Model", "Qwen3Model", "BertModel", "XLMRobertaModel")},
}
# Encoders (models/bert.py): bidirectional, a whole prompt per step, no KV cache use, first-token pooling by default.
ENCODER_ARCHITECTURES = ("BertModel", "BertForSequenceClassification", "XLMRobertaModel",
                         "XLMRobertaForSequenceClassification")


def get_model_class(architecture: str):
    try:
        module, name = _MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"Model architecture {architecture!r} is not supported; supported: {sorted(_MODEL_REGISTRY)}"
        ) from None
    cls = getattr(importlib.import_module(module), name)
    assert architecture in cls.architectures, f"{module}.{name} does not declare {architecture!r}"
    return cls
