"""Fault injection for tests and drills: make a step raise or stall, or a request's
detokenizing fail, without touching the code under test.

    JAXSERVE_FAULTS="raise_at_step=5"             the 5th engine step raises (model / sampler failure)
    JAXSERVE_FAULTS="slow_step=3,slow_seconds=2"  the 3rd step stalls 2 s first
    JAXSERVE_FAULTS="fail_detokenize_token=42"    detokenizing token id 42 raises (that request only)

Several faults are comma-separated. ``LLMEngine.fault_injector`` holds the parsed
FaultInjector (None when the variable is unset); tests may set one directly.
"""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

ENV_VAR = "JAXSERVE_FAULTS"


class InjectedFault(RuntimeError):
    """An error raised on purpose by the FaultInjector."""


@dataclass
class FaultInjector:
    raise_at_step: int | None = None  # 1-based engine step (steps that run the model)
    slow_step: int | None = None
    slow_seconds: float = 0.0
    fail_detokenize_token: int | None = None

    @classmethod
    def from_env(cls, environ=os.environ) -> FaultInjector | None:
        spec = environ.get(ENV_VAR, "").strip()
        if not spec:
            return None
        kinds = {f.name: f.type for f in dataclasses.fields(cls)}
        values = {}
        for item in spec.split(","):
            key, sep, value = item.strip().partition("=")
            if not sep or key not in kinds:
                raise ValueError(f"{ENV_VAR}: unknown fault {item!r}; known: {', '.join(kinds)}")
            values[key] = float(value) if key == "slow_seconds" else int(value)
        return cls(**values)

    def before_step(self, step: int) -> None:
        """Called by EngineCore before running step number ``step`` (1-based)."""
        if self.slow_step == step and self.slow_seconds > 0:
            time.sleep(self.slow_seconds)
        if self.raise_at_step == step:
            raise InjectedFault(f"injected failure at step {step}")

    def before_detokenize(self, token_ids: list[int]) -> None:
        """Called by the OutputProcessor before detokenizing a request's new tokens."""
        if self.fail_detokenize_token is not None and self.fail_detokenize_token in token_ids:
            raise InjectedFault(f"injected failure detokenizing token {self.fail_detokenize_token}")
