"""LoRARequest: which adapter a request runs with (vLLM's ``vllm.lora.request.LoRARequest``)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(eq=False)
class LoRARequest:
    """An adapter by name, with a unique integer id (>= 1) and its local PEFT folder.

    As in vLLM, two requests are equal when their names are (the id is the engine's
    handle for the loaded copy: a name unloaded and loaded again gets a new id, so the
    prefix cache never serves KV computed under the old weights)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    load_inplace: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"id must be > 0, got {self.lora_int_id}")
        if not self.lora_path:
            raise ValueError("lora_path cannot be empty")

    def __eq__(self, other) -> bool:
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
