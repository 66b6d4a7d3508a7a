"""HF ``architectures`` name -> decoder class."""
from __future__ import annotations

from models.llama import LlamaForCausalLM

# Qwen2 (qkv bias), Qwen3 (q/k norm) and Mistral (sliding window) are the Llama
# decoder with ModelArchConfig flags set from their config.json.
_MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def get_model_class(architecture: str):
    try:
        return _MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"Model architecture {architecture!r} is not supported; supported: {sorted(_MODEL_REGISTRY)}"
        ) from None


def supported_architectures() -> list[str]:
    return sorted(_MODEL_REGISTRY)
