"""Counting compilations: serving after the warm-up must compile nothing."""
import contextlib

import jax


BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def count_compiles(runner):
    """Yields a list that ends up holding [backend compiles, new lowered variants] made
    inside the block: a new variant means a stall even when the backend compile is then
    found in the compilation cache (jax's private per-function counter)."""
    compiles = []

    def listener(event, duration, **kwargs):
        if event == BACKEND_COMPILE_EVENT:
            compiles.append(duration)

    steps = tuple(runner._jitted.values())  # the model step, the sampler, prompt logprobs
    variants = sum(f._cache_size() for f in steps)
    result = []
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield result
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        result += [len(compiles), sum(f._cache_size() for f in steps) - variants]
