"""Greedy decoding with HF transformers (torch, f32), recording the top-2 margin so
comparisons stop before a near-tie (where 1-ULP differences may legitimately flip argmax),
and never compare fewer than a minimum number of tokens."""
from __future__ import annotations

import numpy as np

NEAR_TIE = 1e-3


class HFReference:
    def __init__(self, path=None, *, model=None):
        """From a folder, or an HF model already built (e.g. one with a LoRA merged in)."""
        import torch
        import transformers

        self.torch = torch
        self.model = (model if model is not None else
                      transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)).eval()

    def greedy(self, prompt_ids: list[int], max_tokens: int, process=None) -> tuple[list[int], list[float]]:
        """``process(logits, output so far) -> logits``: applied before each choice (e.g. a
        sampling control's reference)."""
        torch = self.torch
        ids = list(prompt_ids)
        out, margins = [], []
        with torch.no_grad():
            for _ in range(max_tokens):
                logits = self.model(torch.tensor([ids])).logits[0, -1].numpy()
                if process is not None:
                    logits = process(logits.astype(np.float64), out)
                top2 = np.sort(logits)[-2:]
                tok = int(np.argmax(logits))
                out.append(tok)
                margins.append(float(top2[1] - top2[0]))
                ids.append(tok)
        return out, margins

    def logits(self, ids: list[int]) -> np.ndarray:
        with self.torch.no_grad():
            return self.model(self.torch.tensor([ids])).logits[0].numpy()


def comparable_prefix(ref: list[int], margins: list[float], near_tie: float = NEAR_TIE) -> int:
    """Number of leading tokens whose choice is not a near-tie in HF (top-2 margin >= near_tie)."""
    for i, m in enumerate(margins):
        if m < near_tie:
            return i
    return len(ref)


def assert_greedy_match(ours: list[int], ref: list[int], margins: list[float], what: str = "", *,
                        near_tie: float = NEAR_TIE, min_prefix: int = 4) -> None:
    """Our greedy tokens equal HF's up to its first near-tie; at least ``min_prefix`` tokens
    (or all of ``ref``) must come before it, so that the check never passes by comparing
    nothing. ``near_tie``: the top-2 logit margin below which a choice may legitimately flip
    (1-ULP noise in float32; a narrower dtype's rounding needs a wider one)."""
    n = comparable_prefix(ref, margins, near_tie)
    assert n >= min(min_prefix, len(ref)), (
        f"{what}: HF near-tie (margin < {near_tie}) after {n} tokens, too early to compare ({margins[:5]})")
    assert ours[:n] == ref[:n], f"{what}: jaxserve {ours[:n]} != HF {ref[:n]}"
