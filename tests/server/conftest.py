"""Fixtures for the server tests: a tiny random HF Llama and one warmed-up AsyncLLM."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

# `tests.server.harness` and `tests.models.hf_factory` import from the repo root.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tests.server.harness import TINY_ENGINE_ARGS


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from tests.models.hf_factory import make_tiny_hf_model

    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny_llama_server"))


@pytest.fixture(scope="session")
def tiny_async_llm(tiny_model_dir):
    """One warmed-up AsyncLLM over the tiny model, shared by the tiny-model modules."""
    from jaxserve.engine.arg_utils import EngineArgs
    from jaxserve.engine.async_llm import AsyncLLM

    llm = AsyncLLM.from_engine_args(EngineArgs(model=str(tiny_model_dir), **TINY_ENGINE_ARGS), progress=False)
    yield llm
    llm.shutdown()
