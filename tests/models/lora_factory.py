"""Random PEFT LoRA adapters for tiny HF models, saved as PEFT saves them, with the HF
model that has the adapter merged in (the reference a served adapter must equal)."""
from __future__ import annotations

import json
from pathlib import Path

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def make_peft_adapter(base: Path, out: Path, *, r: int = 8, alpha: int = 16, targets=ALL_LINEAR, seed: int = 0,
                      use_rslora: bool = False, std: float = 0.1, layers_to_transform=None):
    """Save a random LoRA adapter of ``base`` to ``out`` with peft (A and B both random:
    PEFT's own init zeroes B, which would change nothing); returns the base model with
    the adapter merged (``merge_and_unload``), float32, in eval mode."""
    import peft
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora,
                             lora_dropout=0.0, layers_to_transform=layers_to_transform)
    pm = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.normal_(0.0, std)
    pm.save_pretrained(out)
    return pm.merge_and_unload().eval()


def edit_adapter_config(folder: Path, **changes) -> Path:
    """Change fields of a saved adapter's adapter_config.json (None removes one)."""
    path = Path(folder) / "adapter_config.json"
    cfg = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    path.write_text(json.dumps(cfg))
    return Path(folder)
