"""SA-13 / SA-14: validation ranges, named in the error."""
import pytest

from jaxserve.sampling_params import SamplingParams


@pytest.mark.parametrize("kwargs,field", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.1}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"repetition_penalty": 1e300}, "repetition_penalty"),  # inf as float32
    ({"repetition_penalty": 1e-300}, "repetition_penalty"),  # 0 as float32
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.1}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2**31}, "top_k"),  # the sampler's top_k is int32
    ({"min_p": 1.5}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"logprobs": -2}, "logprobs"),
    ({"prompt_logprobs": -3}, "prompt_logprobs"),
    ({"stop": [""]}, "stop"),
    ({"stop": ["x"], "detokenize": False}, "stop"),
    ({"n": 0}, "n"),
    ({"n": 2, "temperature": 0.0}, "n"),
])
def test_invalid(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_normalisation():
    with pytest.warns(UserWarning):
        assert SamplingParams(temperature=0.001).temperature == 0.01
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="x").stop == ["x"]
    sp = SamplingParams(stop_token_ids=[5]).with_eos({2})
    assert sp.all_stop_token_ids == {2, 5}
    g = SamplingParams(temperature=0.0, top_k=5, top_p=0.5)
    assert (g.top_k, g.top_p) == (0, 1.0)
    SamplingParams(temperature=1.2, presence_penalty=1.2, frequency_penalty=1.2,
                   repetition_penalty=1.2, min_p=0.5, top_p=0.5, top_k=3)  # SA-15


def test_core_never_imports_jax():
    import subprocess
    import sys
    code = ("import sys, jaxserve.core.sched.scheduler, jaxserve.request, jaxserve.outputs; "
            "assert 'jax' not in sys.modules, 'core imported jax'")
    subprocess.run([sys.executable, "-c", code], check=True)
