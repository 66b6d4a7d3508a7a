"""CompilationManager: every program a step can run, compiled ahead of time (program
keys -> lowered -> compiled on a thread pool), in warm-up stages, the later ones
optionally in the background, loaded from and saved to the executable cache.

Programs are lowered and compiled without running them (running the big prefill
buckets on dummy inputs cost more than compiling them on a CPU, and nothing with the
persistent compilation cache), from the abstract types of what serving passes them
(the packed buffers' layouts, the live weights' and KV cache's shardings, the model
step's own output types for the hidden states). The runner owns one manager; serving
runs the manager's executables, or the jitted functions for a key it has none of
(enforce_eager).
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

from jaxserve.runner.bucketing import MIN_TOKEN_BUCKET, BucketTable
from jaxserve.runner.executable_cache import ExecutableCache, fingerprint
from jaxserve.runner.program_key import (DraftKey, EncoderKey, ModelStepKey, PoolKey, ProgramKey, PromptLogprobsKey,
                                         SampleKey, VerifyKey)

logger = logging.getLogger("jaxserve")

JAX_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


class _WarmupStopped(Exception):
    """A background warm-up told to stop (CompilationManager.stop)."""


@dataclasses.dataclass
class _Warmup:
    """One warm-up's progress, shared by its stages (CompilationManager.warmup)."""

    cache: ExecutableCache | None
    blobs: dict | None  # the saved executables (ExecutableCache.read) while loading from them
    t0: float
    num_programs: int  # in all stages
    jax_cache_hits: int = 0  # programs that came from JAX's persistent cache
    partly_loaded: bool = False  # stages loaded before the cache failed (such a set is not saved)
    listener: Any = None  # the jax.monitoring listener counting the hits


class CompilationManager:
    """The runner's compiled programs and their warm-up (see the module docstring)."""

    def __init__(self, runner) -> None:
        # The ModelRunner that owns it (not imported: the runner imports this module):
        # its programs, weights, KV cache, buckets and input layouts.
        self.runner = runner
        # Executables compiled ahead of time, by program key (their static arguments baked in).
        self.executables: dict[ProgramKey, jax.stages.Compiled] = {}
        # The buckets steps are padded to now: all of them, except during a background
        # warm-up (those compiled so far; a size takes the smallest of them that fits).
        self.ready_buckets: tuple[BucketTable, BucketTable] = (runner.token_buckets, runner.request_buckets)
        self.warmup_from_cache = False  # set by warmup(): the programs came from the executable cache
        self._thread: threading.Thread | None = None  # a background warm-up (warmup(background=True))
        self._stop = threading.Event()

    @property
    def num_compiled_programs(self) -> int:
        """Programs compiled ahead of time (0 with enforce_eager)."""
        return len(self.executables)

    def warmup(self, *, background: bool = False) -> float:
        """Compile every program the step can use, ahead of time; returns the seconds
        spent before the engine can serve.

        Programs compile on a pool of one thread per core while this thread traces and
        lowers the next ones (the model steps first: their outputs type the samplers'
        inputs). XLA:CPU already spreads one compile over the cores, so the gain is the
        Python side hidden behind the compiles. With JAX's persistent cache on, the
        executables are also saved whole (runner/executable_cache.py) and a later start
        with the same fingerprint loads them without tracing anything.

        background=True (``--background-warmup``, serve's default): only the first
        stage of warmup_stages (the smallest token bucket and MIN_TOKEN_BUCKET's)
        compiles before this returns; the other stages compile on a thread while the
        engine serves. Steps are padded to the buckets compiled so far (the smallest
        that fits), and ``ModelRunner.ready_tokens``, the largest, caps each step's
        token budget (long prompts take more chunks meanwhile), so no step waits for a
        compile or starts one. Every program compiles before serving with speculative
        decoding, multi-host or without chunked prefill (a whole prompt must fit in a step)."""
        r = self.runner
        t0 = time.perf_counter()
        stages = self.warmup_stages()
        keys = [k for stage in stages for k in stage]
        if not background or r.num_spec or r._multihost or not r.config.scheduler_config.enable_chunked_prefill:
            stages = [keys]
        cache = self._executable_cache()
        w = _Warmup(cache, cache.read(keys) if cache is not None else None, t0, len(keys))

        def on_event(event, **kwargs):
            if event == JAX_CACHE_HIT_EVENT:
                w.jax_cache_hits += 1

        w.listener = on_event
        jax.monitoring.register_event_listener(on_event)
        try:
            self._warm_up_stage(stages[0], w, "Warm-up (compiling buckets)")
        except BaseException:
            jax.monitoring.unregister_event_listener(on_event)
            raise
        self.warmup_from_cache = w.blobs is not None
        if len(stages) == 1:
            jax.monitoring.unregister_event_listener(on_event)
            self._warmup_done(w)
            return time.perf_counter() - t0
        dt = time.perf_counter() - t0
        rest = stages[1:]
        done, todo = ("loaded", "load") if w.blobs is not None else ("compiled", "compile")
        logger.info("Warm-up %s %d programs in %.1f s: serving steps of up to %d tokens while %d more %s in the "
                    "background", done, len(stages[0]), dt, self.ready_buckets[0].max, sum(map(len, rest)), todo)
        self._thread = threading.Thread(target=self._warm_up_rest, args=(rest, w), name="jaxserve-warmup",
                                        daemon=True)
        # A process that exits meanwhile stops it first (a daemon thread frozen in the
        # middle of an XLA compile can crash the interpreter's exit).
        atexit.register(self.stop)
        self._thread.start()
        return dt

    def _warm_up_stage(self, stage: list[ProgramKey], w: _Warmup, desc: str | None) -> None:
        """Load a stage's programs from the executable cache, else compile them; then
        allow its steps."""
        if w.blobs is not None:
            try:
                self.executables.update(w.cache.deserialize(w.blobs, stage))
            except Exception as e:  # an incompatible file: compile this stage and the rest
                logger.warning("Executable cache %s unusable (%s: %s); compiling", w.cache.path, type(e).__name__, e)
                w.blobs, w.partly_loaded = None, bool(self.executables)
        if w.blobs is None:
            self._compile_stage(stage, desc)
        if len(self.executables) == w.num_programs:
            self.ready_buckets = (self.runner.token_buckets, self.runner.request_buckets)
        else:
            self.ready_buckets = (
                BucketTable([k.num_tokens for k in self.executables if isinstance(k, ModelStepKey)]),
                BucketTable([k.num_reqs for k in self.executables if isinstance(k, SampleKey)])
                if self.runner.pooler is None else self.runner.request_buckets)  # pooling has no samplers

    def _warm_up_rest(self, stages: list[list[ProgramKey]], w: _Warmup) -> None:
        """The background warm-up thread: each stage in turn, then its steps allowed."""
        try:
            for stage in stages:
                self._warm_up_stage(stage, w, None)
        except _WarmupStopped:
            return
        except BaseException as e:  # the engine goes on serving with the stages it has
            # (unless the process is exiting: thread pools then refuse work)
            if not (isinstance(e, RuntimeError) and "interpreter shutdown" in str(e)):
                logger.exception("Background warm-up failed; steps stay at most %d tokens", self.ready_buckets[0].max)
            return
        finally:
            jax.monitoring.unregister_event_listener(w.listener)
            atexit.unregister(self.stop)
        self._warmup_done(w)

    def stop(self) -> None:
        """Stop a background warm-up: the compiles under way finish, no other starts."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a background warm-up has compiled everything; True when done."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def _warmup_done(self, w: _Warmup) -> None:
        """Every program is in: log it, and save the set if it was compiled from scratch."""
        dt, n = time.perf_counter() - w.t0, self.num_compiled_programs
        if w.blobs is not None:
            logger.info("Warm-up loaded %d compiled programs from %s in %.1f s", n, w.cache.path, dt)
            return
        if w.cache is not None and w.jax_cache_hits:
            # An executable read from JAX's persistent cache serializes without its
            # kernels' object code (XLA:CPU, jax 0.10: loading it fails at the first
            # run with "Function ... not found"), so only a set compiled from scratch
            # is saved.
            logger.info("Executable cache not written: %d programs came from JAX's compilation cache",
                        w.jax_cache_hits)
        elif w.cache is not None and not w.partly_loaded:
            w.cache.save(self.executables)
        logger.info("Warm-up compiled %d programs in %.1f s", n, dt)

    def warmup_stages(self) -> list[list[ProgramKey]]:
        """Every program, in stages a step can be served by: the stage of token bucket T
        holds what a step of at most T tokens needs beyond the earlier stages: the model
        step and prompt logprobs of T, the samplers of the request buckets up to the
        one of min(T, Rmax) requests (a step has at most one request per token), and in
        the first stage the draft model's programs. The first stage is the smallest
        bucket and MIN_TOKEN_BUCKET's; the buckets between them (a CPU's 2, 4, 8) come
        last: until then their steps take the next compiled bucket."""
        r = self.runner
        buckets = list(r.token_buckets)
        fillers = [t for t in buckets[1:] if t < MIN_TOKEN_BUCKET]
        first = [buckets[0]] + [t for t in buckets[1:] if t == MIN_TOKEN_BUCKET]
        groups = [first] + [[t] for t in buckets if t not in first and t not in fillers] + ([fillers] if fillers else [])
        stages: list[list[ProgramKey]] = []
        covered = 0  # request buckets up to this one are in an earlier stage
        for group in groups:
            stage: list[ProgramKey] = []
            for t in group:
                if r.pooler is not None:  # the pooling runner: the model step and its pooling head
                    stage += [ModelStepKey(t), PoolKey(t)]
                    continue
                top = r.request_buckets(min(t, r.max_num_reqs))
                stage += [ModelStepKey(t), PromptLogprobsKey(t)]
                for n in r.request_buckets:
                    if covered < n <= top:
                        stage += [SampleKey(n, p) for p in (False, True)]
                        if r.num_spec:
                            stage += [VerifyKey(n, g, p) for g in (True, False) for p in (False, True)]
                covered = max(covered, top)
            stages.append(stage)
        if r.draft is not None:
            stages[0] += [DraftKey(t) for t in r.draft.buckets]
        if r.encoder is not None:
            stages[0] += r.encoder.keys()
        return stages

    def _compile_stage(self, keys: list[ProgramKey], desc: str | None) -> None:
        """Compile ``keys`` (ahead of time, into executables) on a pool of one thread
        per core; a progress bar when ``desc`` is given."""
        r = self.runner
        by_kind: dict[type, list] = {}
        for key in keys:
            by_kind.setdefault(type(key), []).append(key)
        workers = max(1, min(len(os.sched_getaffinity(0)), len(keys)))
        with ThreadPoolExecutor(workers, thread_name_prefix="jaxserve-compile") as pool, \
                tqdm(total=len(keys), desc=desc, disable=desc is None or not r.progress) as bar:

            def compile_async(key: ProgramKey, lowered: jax.stages.Lowered) -> Future:
                def run():
                    if self._stop.is_set():
                        raise _WarmupStopped
                    exe = self.executables[key] = lowered.compile()
                    bar.update()
                    return exe
                return pool.submit(run)

            steps = {key.num_tokens: compile_async(key, self.lower_model_step(key.num_tokens))
                     for key in by_kind.get(ModelStepKey, [])}
            pending = list(steps.values())
            pending += [compile_async(key, self._lower(key, r.draft.state, r.draft.kv_cache,
                                                       *r._put(r.draft.inputs(key.num_tokens))))
                        for key in by_kind.get(DraftKey, [])]
            for key in by_kind.get(PromptLogprobsKey, []):
                hidden = steps[key.num_tokens].result().out_info[0]
                packed = r.inputs.abstract_packed(r.inputs.model_layout(key.num_tokens))
                pending.append(compile_async(key, self._lower(key, r.state, hidden, packed)))
            for key in by_kind.get(PoolKey, []):
                hidden, hidden_last = steps[key.num_tokens].result().out_info[:2]
                packed = r.inputs.abstract_packed(r.inputs.model_layout(key.num_tokens))
                carry = jax.ShapeDtypeStruct((r.dp * r.max_num_reqs, r.arch.hidden_size), jnp.float32,
                                             sharding=r._rows_sharding)
                pending.append(compile_async(key, self._lower(key, r.state, hidden, hidden_last, packed, carry)))
            samplers = by_kind.get(SampleKey, []) + by_kind.get(VerifyKey, [])
            if samplers:
                hidden_last = next(iter(steps.values())).result().out_info[1]
            for key in samplers:
                pending.append(compile_async(key, self._lower(key, r.state, hidden_last,
                                                              *self._abstract_sampler_inputs(key))))
            pending += [compile_async(key, self._lower(key, r.state, *r.encoder.abstract_inputs(key)))
                        for key in by_kind.get(EncoderKey, [])]
            for f in pending:
                f.result()  # re-raises a failed compile here

    def _abstract_sampler_inputs(self, key: SampleKey | VerifyKey) -> tuple[jax.ShapeDtypeStruct, ...]:
        """The types of a sampler's inputs after the hidden states: (packed buffer, token
        history [rows, L or 1], grammar bitmask [rows, W], logit bias ([rows, K] ids, values)), rows = DP * the request bucket."""
        r = self.runner
        rows = r.dp * key.num_reqs
        history = jax.ShapeDtypeStruct((rows, r.input_batch.token_ids.shape[1] if key.use_penalties else 1),
                                       jnp.int32, sharding=r._rows_sharding)
        bitmask = jax.ShapeDtypeStruct((rows, r.input_batch.bitmask_words), jnp.int32, sharding=r._rows_sharding)
        k = r.input_batch.logit_bias_ids.shape[1]
        bias = (jax.ShapeDtypeStruct((rows, k), jnp.int32, sharding=r._rows_sharding),
                jax.ShapeDtypeStruct((rows, k), jnp.float32, sharding=r._rows_sharding))
        return r.inputs.abstract_packed(r.inputs.sampler_layout(key)), history, bitmask, bias

    def _executable_cache(self) -> ExecutableCache | None:
        """The saved-executables cache, next to JAX's persistent cache (None when that is
        off, and in multi-process runs, whose programs span other processes' devices)."""
        r = self.runner
        directory = jax.config.jax_compilation_cache_dir
        if not directory or r._multihost:
            return None
        spec = r.config.speculative_config
        arrays = [r.state, r.kv_cache]
        if r.lora is not None:
            arrays.append(r.lora.buffers)
        if r.draft is not None:
            arrays += [r.draft.state, r.draft.kv_cache]
        # How the warm-up runs does not shape the programs: one file serves both ways.
        config = dataclasses.replace(r.config, background_warmup=False)
        # "auto" resolves by what this machine has (the CPU kernel builds or not): key by the result.
        digest = fingerprint((config, r.attention_backend),
                             [r.model_path, spec.model if spec is not None else None], arrays)
        return ExecutableCache(os.path.join(directory, "jaxserve-executables"), digest)

    def lower_model_step(self, num_tokens: int) -> jax.stages.Lowered:
        """The model step of token bucket ``num_tokens``, lowered with serving's input
        types (for the warm-up, and to inspect a bucket's HLO)."""
        r = self.runner
        # Abstract: a background warm-up lowers while serving donates the live cache.
        abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)  # noqa: E731
        kv_cache = jax.tree.map(abstract, r.kv_cache)
        # The adapters' slots too: an adapter copied in donates them.
        lora = jax.tree.map(abstract, r.lora.buffers) if r.lora is not None else None
        encoder = (abstract(r.encoder.buffer),) if r.encoder is not None else ()
        return self._lower(ModelStepKey(num_tokens), r.state, kv_cache,
                           r.inputs.abstract_packed(r.inputs.model_layout(num_tokens)), lora, *encoder)

    def _lower(self, key: ProgramKey, *args) -> jax.stages.Lowered:
        return self.runner._jitted[type(key)].lower(*args, **self.runner.inputs.static_args(key))
