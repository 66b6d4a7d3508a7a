import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "models"))

from hf_factory import make_tiny_hf_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """arch name -> folder of a tiny random HF checkpoint (built once per session)."""
    cache = {}

    def get(arch: str, **kw):
        key = (arch, repr(sorted(kw.items())))  # repr: values may be dicts (rope_scaling)
        if key not in cache:
            cache[key] = make_tiny_hf_model(tmp_path_factory.mktemp(arch), arch.split("-")[0], **kw)
        return cache[key]

    return get

