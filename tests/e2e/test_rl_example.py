"""examples/rl_grpo.py runs as documented: a short run's mean reward rises (GRPO with
jaxserve sampling, a JAX trainer on the engine's own params, update_weights each step)."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow
EXAMPLE = Path(__file__).parents[2] / "examples" / "rl_grpo.py"


def test_grpo_example_learns_the_toy_reward(capsys):
    spec = importlib.util.spec_from_file_location("rl_grpo", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    rewards = example.main(["--steps", "10"])
    assert len(rewards) == 10
    assert np.mean(rewards[:2]) < 0.15 and np.mean(rewards[-3:]) > 0.5, rewards
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step")]
    gaps = [float(ln.split("|trainer - engine logprob|")[1].split()[0]) for ln in lines]
    assert len(lines) == 10 and max(gaps) < 1e-4  # the trainer scores the engine's own policy
