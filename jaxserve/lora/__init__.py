"""Multi-LoRA serving (vLLM's ``--enable-lora``): PEFT adapters read from local folders
(peft.py), kept on the host and copied into fixed device slots on demand (manager.py),
applied inside the model step per token (models/quantization.py ``linear``).
Design: docs/lora.md."""
from jaxserve.lora.request import LoRARequest

__all__ = ["LoRARequest"]
