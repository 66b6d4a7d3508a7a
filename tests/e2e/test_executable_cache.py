"""Saved executables (runner/executable_cache.py): a second engine with the same
fingerprint loads the warm-up's programs instead of tracing them, serves the same
tokens, compiles nothing; anything that shapes the programs differently misses."""
import jax
import numpy as np
import pytest
from compile_counter import count_compiles

from jaxserve import LLM, SamplingParams
from jaxserve.runner.executable_cache import ExecutableCache

# A vocabulary no other test uses: no program here is in JAX's compilation cache already
# (JAX's cache is set up once per process; a set with programs read from it is not saved).
VOCAB = 384
ARGS = dict(max_model_len=96, max_num_seqs=4, max_num_batched_tokens=32, kv_cache_memory=2 << 20,
            compilation_cache=False, progress=False)


@pytest.fixture
def cache_dir(tmp_path):
    """Point the executable cache (it follows JAX's cache folder setting) at an empty folder."""
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    yield tmp_path / "jaxserve-executables"
    jax.config.update("jax_compilation_cache_dir", before)


def run(llm):
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, VOCAB, n).tolist()} for n in (5, 40, 17)]
    sps = [SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True),
           SamplingParams(temperature=0.9, top_p=0.8, seed=3, max_tokens=6, ignore_eos=True),
           SamplingParams(temperature=0.7, presence_penalty=0.5, seed=4, max_tokens=6, ignore_eos=True,
                          prompt_logprobs=1)]
    outs = llm.generate(prompts, sps, use_tqdm=False)
    return [(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs or []]) for o in outs]


def test_second_start_loads_the_programs_and_serves_the_same(tiny_models, cache_dir):
    path = str(tiny_models("llama", vocab=VOCAB))
    first = LLM(path, **ARGS)
    runner = first.llm_engine.model_runner
    assert not runner.warmup_from_cache and len(list(cache_dir.glob("*.pkl"))) == 1
    expected = run(first)
    del first

    second = LLM(path, **ARGS)
    runner = second.llm_engine.model_runner
    assert runner.warmup_from_cache and runner.num_compiled_programs > 0
    with count_compiles(runner) as compiled:
        assert run(second) == expected
    assert compiled == [0, 0], f"(backend compiles, new variants) after loading: {compiled}"
    programs = runner.num_compiled_programs
    del second

    # A background warm-up loads the same file: its first stage before serving, the others
    # on its thread.
    third = LLM(path, background_warmup=True, **ARGS)
    runner = third.llm_engine.model_runner
    assert runner.warmup_from_cache
    assert runner.wait_for_warmup(120) and runner.num_compiled_programs == programs
    with count_compiles(runner) as compiled:
        assert run(third) == expected
    assert compiled == [0, 0], f"(backend compiles, new variants) after loading: {compiled}"
    del third

    # Another shape of the engine: other programs, not the saved ones.
    other = LLM(path, **{**ARGS, "max_num_seqs": 2})
    assert not other.llm_engine.model_runner.warmup_from_cache


def test_a_damaged_file_is_a_miss(tmp_path):
    cache = ExecutableCache(tmp_path, "abc")
    assert cache.read(["k"]) is None  # no file
    cache.path.write_bytes(b"not a pickle")
    assert cache.read(["k"]) is None
