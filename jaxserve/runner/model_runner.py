"""ModelRunner: the only host <-> device boundary.

Per step: apply the SchedulerOutput diff to the InputBatch, build padded inputs
with numpy (token bucket T, request bucket R) in two int32 buffers (the model
step's and the sampler's, runner/packed_inputs.py), one device_put, the jitted model
step (keyed by T alone; KV cache donated), the jitted sampler (keyed by R alone),
one device_get. Programs are a sum over buckets, not a product: per-request
metadata of the model step has fixed maximum sizes (Rmax = max_num_seqs,
Pmax = pages of max_model_len).

Data parallelism (DESIGN §5) is one SPMD program for all ranks: each rank has its
own InputBatch, scheduler and slice of the KV cache pages; a step's arrays are the
ranks' arrays one after the other on axis 0 (every rank padded to the same
buckets), split over the mesh's 'data' axis, so the compile count does not grow
with the number of ranks.
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
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from jaxserve.config import EngineConfig
from jaxserve.core.kv_cache_utils import cdiv
from jaxserve.core.sched.output import SchedulerOutput
from jaxserve.distributed.arrays import global_array
from jaxserve.outputs import EMPTY_MODEL_RUNNER_OUTPUT, LogprobsLists, ModelRunnerOutput
from jaxserve.runner.bucketing import BucketTable, default_buckets
from jaxserve.runner.dtypes import resolve_dtype, resolve_weight_dtype
from jaxserve.runner.executable_cache import ExecutableCache, fingerprint
from jaxserve.runner.input_batch import CachedRequestState, InputBatch
from jaxserve.runner.packed_inputs import PackedLayout
from jaxserve.runner.kv_cache import allocate_kv_cache, determine_num_blocks, kv_cache_layout, kv_cache_sharding
from jaxserve.runner.program_key import DraftKey, ModelStepKey, ProgramKey, PromptLogprobsKey, SampleKey, VerifyKey
from jaxserve.sample.metadata import SamplingMetadata
from jaxserve.sample.rejection_sampler import rejection_sample
from jaxserve.sample.sampler import compute_logprobs, sample
from models.config import attention_settings
from models.loader import load_model
from pallas_kernels.attention_metadata import AttentionMetadata
from pallas_kernels.backend import build_attention, resolve_attention_spec

logger = logging.getLogger("jaxserve")

MIN_TOKEN_BUCKET = 16
JAX_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
MIN_REQUEST_BUCKET = 8


@dataclasses.dataclass(slots=True)
class RankStep:
    """One data-parallel rank's share of a step (R = its scheduled requests)."""

    req_ids: list[str]  # [R] in scheduling order
    rows: np.ndarray  # [R] int64: their rows in the rank's InputBatch
    num_scheduled: np.ndarray  # [R] int32: tokens scheduled this step
    num_computed: np.ndarray  # [R] int32: tokens computed before this step
    query_start_loc: np.ndarray  # [Rmax + 1] int32: offsets of each request's tokens in the rank's T
    num_drafts: np.ndarray  # [R] int32: draft tokens verified this step (speculative decoding)
    token_offset: int  # the rank's first token in the step's [DP * T] arrays
    row_offset: int  # the rank's first row in the sampler's [DP * Rb] arrays
    prompt_logprobs_rows: np.ndarray  # [R] bool: rows returning prompt logprobs this step
    prompt_logprobs_start: np.ndarray  # [R]: first prompt position returned
    prompt_logprobs_end: np.ndarray  # [R]: one past the last
    done: np.ndarray | None = None  # [R] bool, set by the bookkeeping: rows that emitted tokens


@dataclasses.dataclass(slots=True)
class PreparedStep:
    """One step's host inputs (numpy), from _prepare_inputs to _bookkeeping. T = the
    token bucket, Rb = the request bucket, each per rank; arrays hold the DP ranks'
    slices one after the other."""

    ranks: list[RankStep]
    model_key: ModelStepKey
    # The model step's inputs packed (ModelRunner._model_layout): input_ids [DP*T],
    # positions [DP*T], AttentionMetadata, logits_indices [DP*Rmax*S] and the prompt
    # logprobs targets [DP*T] (the token after each position)
    model_buffer: np.ndarray
    sample_key: SampleKey | VerifyKey  # VerifyKey when some request has drafts
    # The sampler's inputs packed (ModelRunner._sampler_layout): SamplingMetadata [DP*Rb]
    # rows less its two wide arrays, then with a SampleKey the run-time flags [DP*2]
    # (every row greedy, plain) once per rank; with a VerifyKey the drafts [DP*Rb, k]
    # (-1 padded) and their counts [DP*Rb]
    sampler_buffer: np.ndarray
    token_history: np.ndarray | None  # [DP*Rb, L] int32 with penalties, else None
    grammar_bitmask: np.ndarray | None  # [DP*Rb, W] int32 when a row is constrained, else None
    prompt_logprobs: bool  # some row returns prompt logprobs: run their program


@dataclasses.dataclass(slots=True)
class InflightStep:
    """A dispatched step (ModelRunner.dispatch) whose results are not fetched yet."""

    step: PreparedStep
    sampled: tuple  # the sampler's outputs (device arrays)
    prompt_logprobs: tuple | None  # the prompt-logprobs program's outputs, if it ran


def make_mesh(tensor_parallel_size: int, data_parallel_size: int = 1) -> Mesh:
    """The ('data', 'model') mesh over the first dp * tp devices (all processes' devices
    in a multi-host run; jax.make_mesh orders them by the TPU topology)."""
    devices = jax.devices()
    n = tensor_parallel_size * data_parallel_size
    if n > len(devices):
        raise ValueError(
            f"data_parallel_size * tensor_parallel_size = {data_parallel_size} * {tensor_parallel_size} = {n} "
            f"exceeds the {len(devices)} available devices"
        )
    # Auto axes: the partitioner propagates shardings (jax.make_mesh's default axis types
    # changed across versions; Explicit would demand an out_sharding on every gather).
    return jax.make_mesh((data_parallel_size, tensor_parallel_size), ("data", "model"),
                         axis_types=(AxisType.Auto, AxisType.Auto), devices=devices[:n])


class _WarmupStopped(Exception):
    """A background warm-up told to stop (ModelRunner.stop_warmup)."""


@dataclasses.dataclass
class _Warmup:
    """One warm-up's progress, shared by its stages (ModelRunner.warmup)."""

    cache: ExecutableCache | None
    blobs: dict | None  # the saved executables (ExecutableCache.read) while loading from them
    t0: float
    num_programs: int  # in all stages
    jax_cache_hits: int = 0  # programs that came from JAX's persistent cache
    partly_loaded: bool = False  # stages loaded before the cache failed (such a set is not saved)
    listener: Any = None  # the jax.monitoring listener counting the hits


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: str, *, progress: bool = True) -> None:
        self.config = config
        sc, cc, mc, pc = config.scheduler_config, config.cache_config, config.model_config, config.parallel_config
        self.platform = jax.default_backend()
        self.dtype = resolve_dtype(mc.dtype, self.platform)
        self.param_dtype = resolve_weight_dtype(mc.weight_dtype, mc.dtype, self.platform)
        # The KV pages' dtype: the model's, bf16, or float8 e4m3 (written saturating,
        # widened by the attention kernel as it loads them).
        kv_dtype = {"fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn,
                    "bfloat16": jnp.bfloat16}.get(cc.cache_dtype, self.dtype)
        # "auto" resolved once (on CPU it depends on whether the native kernel builds),
        # with how the pages are stored: the spec the kernels and the draft model take.
        self.attention_spec = resolve_attention_spec(mc.attention_backend, self.platform, kv_dtype)
        self.block_size = cc.block_size
        self.max_model_len = sc.max_model_len
        self.max_num_reqs = sc.max_num_seqs
        self.max_num_tokens = sc.max_num_batched_tokens
        self.max_blocks_per_req = cdiv(self.max_model_len, self.block_size)
        self.max_logprobs = max(mc.max_logprobs, 0)
        # Speculative decoding: S = k + 1 logits rows per request (its last token and
        # its k possible drafts); S = 1 without it, and every program is as before.
        spec = config.speculative_config
        self.num_spec = spec.num_speculative_tokens if spec is not None else 0
        self.rows_per_req = self.num_spec + 1
        self.proposer = None  # the n-gram proposer (host)
        self.draft = None  # the draft-model proposer (device), built after the target is loaded
        # A request keeps cdiv(num_computed + this, block_size) blocks between steps: the
        # draft model has also written the KV of the request's last token.
        self._blocks_past_computed = 0
        if spec is not None and spec.method == "ngram":
            from jaxserve.spec_decode.ngram_proposer import NgramProposer

            self.proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max,
                                          sc.max_model_len)
        self.progress = progress
        self.model_path = model_path
        self.warmup_from_cache = False  # set by warmup(): the programs came from the executable cache
        self._warmup_thread: threading.Thread | None = None  # a background warm-up (warmup(background=True))
        self._warmup_stop = threading.Event()
        self.dp = pc.data_parallel_size
        self.mesh = make_mesh(pc.tensor_parallel_size, self.dp)
        # Every step input is the ranks' arrays one after the other on axis 0, split over
        # 'data'; sampler outputs come back replicated, so each process (multi-host) can
        # read them from its own devices.
        self._rows_sharding = NamedSharding(self.mesh, P("data"))
        self._replicated = NamedSharding(self.mesh, P())
        self._multihost = jax.process_count() > 1

        t0 = time.perf_counter()
        self.arch, self.graphdef, self.state = load_model(model_path, mesh=self.mesh, dtype=self.dtype,
                                                          progress=progress, scan_layers=mc.scan_layers,
                                                          expert_parallel=pc.enable_expert_parallel,
                                                          quantization=mc.quantization,
                                                          param_dtype=self.param_dtype)
        if jnp.dtype(self.param_dtype) != jnp.dtype(self.dtype):
            logger.info("Matmul weights in %s, activations and KV cache in %s (weight_dtype=%s)",
                        jnp.dtype(self.param_dtype).name, jnp.dtype(self.dtype).name, mc.weight_dtype)
        self.vocab_size = self.arch.vocab_size
        logger.info("Loaded %s (%s) in %.1f s", model_path, self.arch.architecture, time.perf_counter() - t0)
        # On a CPU, a step of one token (and the sampler of one request) gets a bucket of
        # its own: its matmuls are then matrix-vector products, which XLA:CPU streams at
        # memory speed, where [16, K] @ [K, N] goes through Eigen's GEMM, which packs the
        # weights first. On the 2-core CI VM: a [576, 3072] matmul over 30 weight sets took
        # 12 ms with 1 row against 59-70 ms with 16; SmolLM2 at batch 1, 68-84 ms per
        # decode step against 280-326 ms. Below 16 rows the GEMM's time still grows with
        # the rows, so the CPU's token buckets are every power of two from 1: SmolLM2
        # decode steps of 2 / 8 requests 72 / 79 ms in the 16 bucket, 45 / 59 ms in their
        # own. Accelerators pad small shapes anyway.
        self._single_buckets = self.platform == "cpu"
        self.token_buckets = BucketTable(config.token_buckets or default_buckets(
            1 if self._single_buckets else MIN_TOKEN_BUCKET, self.max_num_tokens, single=self._single_buckets))
        if spec is not None and spec.method == "draft_model":
            from jaxserve.spec_decode.draft_model import DraftModelProposer

            t0 = time.perf_counter()
            self.draft = DraftModelProposer(self, spec.model, spec.num_speculative_tokens, progress=progress)
            self._blocks_past_computed = 1
            logger.info("Loaded the draft model %s (%s) in %.1f s", spec.model, self.draft.arch.architecture,
                        time.perf_counter() - t0)

        # KV cache groups: Gemma's local layers give back the blocks behind their window
        # while its global layers keep the context (not with a draft model: it shares the
        # pages, and its layers do not slide).
        self.kv_cache_layout = kv_cache_layout(self.arch, free_window_blocks=self.draft is None)
        # Blocks per rank: each rank's scheduler hands out ids in [0, num_blocks).
        self.num_blocks = determine_num_blocks(
            self.arch, block_size=self.block_size, dtype=self.kv_dtype, max_model_len=self.max_model_len,
            gpu_memory_utilization=cc.gpu_memory_utilization, kv_cache_memory=cc.kv_cache_memory,
            num_gpu_blocks_override=cc.num_gpu_blocks_override, device=self._local_device(),
            tensor_parallel_size=pc.tensor_parallel_size, num_devices=self.mesh.size,
            draft=self.draft.arch if self.draft is not None else None,
            layout=self.kv_cache_layout, max_num_batched_tokens=self.max_num_tokens,
        )
        self.kv_cache = allocate_kv_cache(self.arch, self.num_blocks, self.block_size, self.kv_storage_dtype, self.mesh,
                                          slots=self.kv_cache_layout.slots_per_block)
        if self.draft is not None:
            self.draft.allocate_kv_cache(self.num_blocks)

        self.request_buckets = BucketTable(
            config.request_buckets or default_buckets(min(MIN_REQUEST_BUCKET, self.max_num_reqs), self.max_num_reqs,
                                                      single=self._single_buckets)
        )
        # The buckets steps are padded to now: all of them, except during a background
        # warm-up (those compiled so far; a size takes the smallest of them that fits).
        self._step_buckets: tuple[BucketTable, BucketTable] = (self.token_buckets, self.request_buckets)
        self.input_batches = [InputBatch(self.max_num_reqs, self.max_model_len, self.max_blocks_per_req,
                                         self.vocab_size, self.kv_cache_layout.num_groups) for _ in range(self.dp)]
        self.requests: dict[str, CachedRequestState] = {}
        self._seed_rng = np.random.default_rng(mc.seed)
        # A float8 cache uses the checkpoint's KV scales (kv_cache_scheme) when it has them.
        self.attention_spec = self.attention_spec.with_kv_scales(self.arch.kv_cache_scales)
        if self.arch.kv_cache_scales and not self.attention_spec.quantized_kv:
            logger.info("The checkpoint's KV cache scales are unused: kv_cache_dtype is not fp8")
        self._attention = build_attention(self.attention_spec, self.mesh, **attention_settings(self.arch),
                                          layer_group=self.kv_cache_layout.layer_group,
                                          layer_slot=self.kv_cache_layout.layer_slot)
        self._build_step_functions()
        if self.draft is not None:
            self._jitted[DraftKey] = self.draft.jitted

    def _local_device(self) -> jax.Device:
        """A mesh device of this process (multi-host: only those report memory stats)."""
        return next(d for d in self.mesh.devices.flat if d.process_index == jax.process_index())

    @property
    def attention_backend(self) -> str:
        """The attention kernel in use ("auto" resolved): reference, native or pallas."""
        return self.attention_spec.backend

    @property
    def kv_dtype(self):
        """The K/V values' dtype (the model's, bfloat16 or float8 e4m3)."""
        return self.attention_spec.kv_dtype

    @property
    def kv_storage_dtype(self):
        """The KV cache arrays' dtype (pallas_kernels/storage.py: bf16 as bit patterns on CPU)."""
        return self.attention_spec.kv_storage_dtype

    @property
    def kv_cache_scales(self) -> tuple[float, float]:
        """(k_scale, v_scale) of an 8-bit cache; (1.0, 1.0) otherwise."""
        return self.attention_spec.k_scale, self.attention_spec.v_scale

    @property
    def ready_tokens(self) -> int:
        """The most tokens a step may hold now: all of them, except during a background
        warm-up (the largest step compiled so far; the engine caps its schedulers' token
        budgets at it)."""
        return self._step_buckets[0].max

    @property
    def input_batch(self) -> InputBatch:
        """Rank 0's batch (the only one without data parallelism)."""
        return self.input_batches[0]

    # ------------------------------------------------------------------ setup
    def _build_step_functions(self) -> None:
        graphdef, dp, s = self.graphdef, self.dp, self.rows_per_req

        def per_rank_rows(x, rows, all_positions=False):
            """x [DP*Rmax*S, H] (S rows per request) -> each rank's first ``rows``
            requests: their first row [DP*rows, H], or all S rows [DP*rows*S, H].
            Reshaped, not indexed with global offsets, so the partitioner keeps every
            rank local."""
            x = x.reshape(dp, -1, s, x.shape[-1])[:, :rows]
            return x.reshape(-1, x.shape[-1]) if all_positions else x[:, :, 0].reshape(-1, x.shape[-1])

        def unpack(layout: PackedLayout, packed):
            """The packed buffer's arrays, each split over 'data' on axis 0 as the
            ranks' slices (the buffer itself comes in replicated)."""
            return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, self._rows_sharding),
                                layout.unpack(packed))

        def sampling_metadata(layout, packed, history, bitmask):
            """(SamplingMetadata, the rest of the packed sampler inputs)."""
            smd, extra = unpack(layout, packed)
            return dataclasses.replace(smd, token_history=history, allowed_token_bitmask=bitmask), extra

        def model_step(state, kv_cache, packed, *, layout):
            input_ids, positions, md, logits_indices, _ = unpack(layout, packed)
            model = nnx.merge(graphdef, state)
            hidden, kv_cache = model(input_ids, positions, kv_cache, md, self._attention)
            # Each rank's last-token rows, by its local indices [DP, Rmax] into its [T].
            by_rank = hidden.reshape(dp, -1, hidden.shape[-1])
            last = jnp.take_along_axis(by_rank, logits_indices.reshape(dp, -1, 1), axis=1)
            return hidden, last.reshape(-1, hidden.shape[-1]), kv_cache

        def sample_step(state, hidden_last, packed, history, bitmask, *, layout, num_reqs, use_penalties):
            """flags: [DP*2], (greedy_only, plain) of the whole step once per rank."""
            smd, (flags,) = sampling_metadata(layout, packed, history, bitmask)
            model = nnx.merge(graphdef, state)
            logits = model.compute_logits(per_rank_rows(hidden_last, num_reqs))
            flags = flags.reshape(dp, 2) != 0
            return sample(logits, smd, greedy_only=jnp.all(flags[:, 0]), use_penalties=use_penalties,
                          num_logprobs=self.max_logprobs, plain=jnp.all(flags[:, 1]))

        def verify_step(state, hidden_last, packed, history, bitmask, *, layout, num_reqs, greedy_only,
                        use_penalties):
            smd, (draft_token_ids, num_draft_tokens) = sampling_metadata(layout, packed, history, bitmask)
            model = nnx.merge(graphdef, state)
            logits = model.compute_logits(per_rank_rows(hidden_last, num_reqs, all_positions=True))
            return rejection_sample(logits, draft_token_ids, num_draft_tokens, smd, greedy_only=greedy_only,
                                    use_penalties=use_penalties, num_logprobs=self.max_logprobs)

        def prompt_logprobs_step(state, hidden, packed, *, layout):
            targets = unpack(layout, packed)[-1]
            model = nnx.merge(graphdef, state)
            logits = model.compute_logits(hidden)
            return compute_logprobs(logits, targets, self.max_logprobs)

        # The cache leaves with exactly the sharding it came in with. Left to itself, jit
        # returns an equivalent but differently spelled spec (P() instead of
        # P(None, 'data', None, 'model', None)), and the next call of a bucket compiled
        # with the old spelling lowers it again.
        self._jitted = {
            ModelStepKey: jax.jit(model_step, donate_argnums=(1,), static_argnames=("layout",),
                                  out_shardings=(None, None, kv_cache_sharding(self.mesh))),
            SampleKey: jax.jit(sample_step, static_argnames=("layout", "num_reqs", "use_penalties"),
                               out_shardings=self._replicated),
            PromptLogprobsKey: jax.jit(prompt_logprobs_step, static_argnames=("layout",),
                                       out_shardings=self._replicated),
            VerifyKey: jax.jit(verify_step, static_argnames=("layout", "num_reqs", "greedy_only", "use_penalties"),
                               out_shardings=self._replicated),
        }
        # Executables compiled ahead of time by warmup(), by program key; the jitted
        # functions above serve any key not in here (enforce_eager).
        self._executables: dict[ProgramKey, jax.stages.Compiled] = {}
        # Device constants standing in for the sampler's wide inputs when a step does not
        # use them, by rows (DP*Rb): (token history [rows, 1], all-allowed grammar bitmask).
        self._unused_wide: dict[int, tuple[jax.Array, jax.Array]] = {}
        self._layouts: dict = {}  # packed-input layouts, by token bucket / (request bucket, verify)

    def _model_layout(self, t: int) -> PackedLayout:
        """Where the model step's inputs of token bucket ``t`` sit in its packed buffer."""
        layout = self._layouts.get(t)
        if layout is None:
            layout = self._layouts[t] = PackedLayout.of(self._model_inputs(t))
        return layout

    def _sampler_layout(self, key: SampleKey | VerifyKey) -> PackedLayout:
        """Where the sampler's inputs of ``key`` sit in its packed buffer: the request
        bucket's SamplingMetadata less its two wide arrays (passed on their own), then
        the flags (SampleKey) or the drafts and their counts (VerifyKey)."""
        lkey = (key.num_reqs, isinstance(key, VerifyKey))
        layout = self._layouts.get(lkey)
        if layout is None:
            n = self.dp * key.num_reqs
            smd = self.input_batch.make_sampling_metadata(np.zeros(n, np.int64), use_penalties=False, bitmask=False)
            smd = dataclasses.replace(smd, token_history=None)
            extra = ((np.zeros((n, self.num_spec), np.int32), np.zeros(n, np.int32)) if lkey[1]
                     else (np.zeros(2 * self.dp, np.int32),))
            layout = self._layouts[lkey] = PackedLayout.of((smd, extra))
        return layout

    def _static_args(self, key: ProgramKey) -> dict:
        """A program's static arguments: its key's and its inputs' packed layout."""
        if isinstance(key, (ModelStepKey, PromptLogprobsKey)):
            return {**key.static_args(), "layout": self._model_layout(key.num_tokens)}
        if isinstance(key, (SampleKey, VerifyKey)):
            return {**key.static_args(), "layout": self._sampler_layout(key)}
        return key.static_args()

    def _unused_wide_inputs(self, rows: int) -> tuple[jax.Array, jax.Array]:
        """(token history [rows, 1] zeros, grammar bitmask [rows, W] all ones) on the
        device, made once: a step without penalties or grammars sends neither (the
        bitmask alone is 1.5 MB at 256 rows)."""
        wide = self._unused_wide.get(rows)
        if wide is None:
            wide = self._unused_wide[rows] = self._put((
                np.zeros((rows, 1), np.int32), np.full((rows, self.input_batch.bitmask_words), -1, np.int32)))
        return wide

    def _put_packed(self, *buffers: np.ndarray) -> tuple[jax.Array, ...]:
        """Packed input buffers -> device, replicated (each program slices its ranks'
        arrays out of it and splits them over 'data')."""
        if self._multihost:
            return tuple(global_array(b, self._replicated) for b in buffers)
        return jax.device_put(buffers, self._replicated)

    def _put(self, tree):
        """Host arrays -> device, each split over 'data' on axis 0 (its ranks' slices).
        Multi-host: every process holds the same arrays and places only its own
        devices' slices (jax.device_put would first check equality with a hidden
        cross-process collective, ~5 ms per array)."""
        if self._multihost:
            return jax.tree.map(lambda x: global_array(x, self._rows_sharding), tree)
        return jax.device_put(tree, jax.tree.map(lambda _: self._rows_sharding, tree))

    def _run(self, key: ProgramKey, *args):
        """Run the program ``key`` names: the warm-up's executable (its static arguments
        baked in), else the jitted function."""
        exe = self._executables.get(key)
        return exe(*args) if exe is not None else self._jitted[type(key)](*args, **self._static_args(key))

    # ------------------------------------------------------------------ warm-up
    def warmup(self, *, background: bool = False) -> float:
        """Compile every program the step can use, ahead of time; returns the seconds
        spent before the engine can serve.

        Programs are lowered and compiled without running them (running the big
        prefill buckets on dummy inputs cost more than compiling them on a CPU, and
        nothing with the persistent compilation cache), from the abstract types of
        what serving passes them (the packed buffers' layouts, the live weights' and
        KV cache's shardings, the model step's own output types for the hidden states).

        Programs compile on a pool of one thread per core while this thread traces and
        lowers the next ones (the model steps first: their outputs type the samplers'
        inputs). XLA:CPU already spreads one compile over the cores, so the gain is the
        Python side hidden behind the compiles: warm-up with every program in JAX's
        cache 10.8 -> 8.2 s on the 2-core CI VM, cold 67 -> 60 s.
        With JAX's persistent cache on, the executables are also saved whole
        (runner/executable_cache.py) and a later start with the same fingerprint loads
        them without tracing anything.

        background=True (``--background-warmup``, serve's default): only the first
        stage of _warmup_stages (the smallest token bucket and MIN_TOKEN_BUCKET's)
        compiles before this returns; the other stages compile on a thread while the
        engine serves. Steps are padded to the buckets compiled so far (the smallest
        that fits), and ``ready_tokens``, the largest, caps each step's token budget
        (long prompts take more chunks meanwhile), so no step waits for a compile or
        starts one. Every program compiles before serving with speculative decoding,
        multi-host or without chunked prefill (a whole prompt must fit in a step)."""
        t0 = time.perf_counter()
        stages = self._warmup_stages()
        keys = [k for stage in stages for k in stage]
        sc = self.config.scheduler_config
        if not background or self.num_spec or self._multihost or not sc.enable_chunked_prefill:
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
                    "background", done, len(stages[0]), dt, self.ready_tokens, sum(map(len, rest)), todo)
        self._warmup_thread = threading.Thread(target=self._warm_up_rest, args=(rest, w), name="jaxserve-warmup",
                                               daemon=True)
        # A process that exits meanwhile stops it first (a daemon thread frozen in the
        # middle of an XLA compile can crash the interpreter's exit).
        atexit.register(self.stop_warmup)
        self._warmup_thread.start()
        return dt

    def _warm_up_stage(self, stage: list[ProgramKey], w: _Warmup, desc: str | None) -> None:
        """Load a stage's programs from the executable cache, else compile them; then
        allow its steps."""
        if w.blobs is not None:
            try:
                self._executables.update(w.cache.deserialize(w.blobs, stage))
            except Exception as e:  # an incompatible file: compile this stage and the rest
                logger.warning("Executable cache %s unusable (%s: %s); compiling", w.cache.path, type(e).__name__, e)
                w.blobs, w.partly_loaded = None, bool(self._executables)
        if w.blobs is None:
            self._compile_stage(stage, desc)
        if len(self._executables) == w.num_programs:
            self._step_buckets = (self.token_buckets, self.request_buckets)
        else:
            self._step_buckets = (
                BucketTable([k.num_tokens for k in self._executables if isinstance(k, ModelStepKey)]),
                BucketTable([k.num_reqs for k in self._executables if isinstance(k, SampleKey)]))

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
                logger.exception("Background warm-up failed; steps stay at most %d tokens", self.ready_tokens)
            return
        finally:
            jax.monitoring.unregister_event_listener(w.listener)
            atexit.unregister(self.stop_warmup)
        self._warmup_done(w)

    def stop_warmup(self) -> None:
        """Stop a background warm-up: the compiles under way finish, no other starts."""
        self._warmup_stop.set()
        if self._warmup_thread is not None:
            self._warmup_thread.join()

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
            w.cache.save(self._executables)
        logger.info("Warm-up compiled %d programs in %.1f s", n, dt)

    def wait_for_warmup(self, timeout: float | None = None) -> bool:
        """Block until a background warm-up has compiled everything; True when done."""
        if self._warmup_thread is not None:
            self._warmup_thread.join(timeout)
            return not self._warmup_thread.is_alive()
        return True

    def _warmup_stages(self) -> list[list[ProgramKey]]:
        """Every program, in stages a step can be served by: the stage of token bucket T
        holds what a step of at most T tokens needs beyond the earlier stages: the model
        step and prompt logprobs of T, the samplers of the request buckets up to the
        one of min(T, Rmax) requests (a step has at most one request per token), and in
        the first stage the draft model's programs. The first stage is the smallest
        bucket and MIN_TOKEN_BUCKET's; the buckets between them (a CPU's 2, 4, 8) come
        last: until then their steps take the next compiled bucket."""
        buckets = list(self.token_buckets)
        fillers = [t for t in buckets[1:] if t < MIN_TOKEN_BUCKET]
        first = [buckets[0]] + [t for t in buckets[1:] if t == MIN_TOKEN_BUCKET]
        groups = [first] + [[t] for t in buckets if t not in first and t not in fillers] + ([fillers] if fillers else [])
        stages: list[list[ProgramKey]] = []
        covered = 0  # request buckets up to this one are in an earlier stage
        for group in groups:
            stage: list[ProgramKey] = []
            for t in group:
                top = self.request_buckets(min(t, self.max_num_reqs))
                stage += [ModelStepKey(t), PromptLogprobsKey(t)]
                for r in self.request_buckets:
                    if covered < r <= top:
                        stage += [SampleKey(r, p) for p in (False, True)]
                        if self.num_spec:
                            stage += [VerifyKey(r, g, p) for g in (True, False) for p in (False, True)]
                covered = max(covered, top)
            stages.append(stage)
        if self.draft is not None:
            stages[0] += [DraftKey(t) for t in self.draft.buckets]
        return stages

    def _compile_stage(self, keys: list[ProgramKey], desc: str | None) -> None:
        """Compile ``keys`` (ahead of time, into _executables) on a pool of one thread
        per core; a progress bar when ``desc`` is given."""
        by_kind: dict[type, list] = {}
        for key in keys:
            by_kind.setdefault(type(key), []).append(key)
        workers = max(1, min(len(os.sched_getaffinity(0)), len(keys)))
        with ThreadPoolExecutor(workers, thread_name_prefix="jaxserve-compile") as pool, \
                tqdm(total=len(keys), desc=desc, disable=desc is None or not self.progress) as bar:

            def compile_async(key: ProgramKey, lowered: jax.stages.Lowered) -> Future:
                def run():
                    if self._warmup_stop.is_set():
                        raise _WarmupStopped
                    exe = self._executables[key] = lowered.compile()
                    bar.update()
                    return exe
                return pool.submit(run)

            steps = {key.num_tokens: compile_async(key, self.lower_model_step(key.num_tokens))
                     for key in by_kind.get(ModelStepKey, [])}
            pending = list(steps.values())
            pending += [compile_async(key, self._lower(key, self.draft.state, self.draft.kv_cache,
                                                       *self._put(self.draft.inputs(key.num_tokens))))
                        for key in by_kind.get(DraftKey, [])]
            for key in by_kind.get(PromptLogprobsKey, []):
                hidden = steps[key.num_tokens].result().out_info[0]
                pending.append(compile_async(key, self._lower(key, self.state, hidden,
                                                              self._abstract_packed(self._model_layout(key.num_tokens)))))
            samplers = by_kind.get(SampleKey, []) + by_kind.get(VerifyKey, [])
            if samplers:
                hidden_last = next(iter(steps.values())).result().out_info[1]
            for key in samplers:
                rows = self.dp * key.num_reqs
                history = jax.ShapeDtypeStruct(
                    (rows, self.input_batch.token_ids.shape[1] if key.use_penalties else 1), jnp.int32,
                    sharding=self._rows_sharding)
                bitmask = jax.ShapeDtypeStruct((rows, self.input_batch.bitmask_words), jnp.int32,
                                               sharding=self._rows_sharding)
                pending.append(compile_async(key, self._lower(key, self.state, hidden_last,
                                                              self._abstract_packed(self._sampler_layout(key)),
                                                              history, bitmask)))
            for f in pending:
                f.result()  # re-raises a failed compile here

    def _executable_cache(self) -> ExecutableCache | None:
        """The saved-executables cache, next to JAX's persistent cache (None when that is
        off, and in multi-process runs, whose programs span other processes' devices)."""
        directory = jax.config.jax_compilation_cache_dir
        if not directory or self._multihost:
            return None
        spec = self.config.speculative_config
        arrays = [self.state, self.kv_cache]
        if self.draft is not None:
            arrays += [self.draft.state, self.draft.kv_cache]
        # How the warm-up runs does not shape the programs: one file serves both ways.
        config = dataclasses.replace(self.config, background_warmup=False)
        # "auto" resolves by what this machine has (the CPU kernel builds or not): key by the result.
        digest = fingerprint((config, self.attention_backend),
                             [self.model_path, spec.model if spec is not None else None], arrays)
        return ExecutableCache(os.path.join(directory, "jaxserve-executables"), digest)

    def _abstract_packed(self, layout: PackedLayout) -> jax.ShapeDtypeStruct:
        """The type of a packed buffer on the device (what _put_packed makes of it)."""
        return jax.ShapeDtypeStruct((layout.size,), jnp.int32, sharding=self._replicated)

    @property
    def num_compiled_programs(self) -> int:
        """Programs compiled ahead of time (0 with enforce_eager)."""
        return len(self._executables)

    def lower_model_step(self, num_tokens: int) -> jax.stages.Lowered:
        """The model step of token bucket ``num_tokens``, lowered with serving's input
        types (for the warm-up, and to inspect a bucket's HLO)."""
        # Abstract: a background warm-up lowers while serving donates the live cache.
        kv_cache = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.kv_cache)
        return self._lower(ModelStepKey(num_tokens), self.state, kv_cache,
                           self._abstract_packed(self._model_layout(num_tokens)))

    def _lower(self, key: ProgramKey, *args) -> jax.stages.Lowered:
        return self._jitted[type(key)].lower(*args, **self._static_args(key))

    def _model_inputs(self, t: int):
        """Zeroed model-step inputs for token bucket ``t``, every rank's one after the
        other: (input_ids [DP*T], positions [DP*T], AttentionMetadata, logits_indices
        [DP*Rmax*S], prompt logprobs targets [DP*T]). Per-request arrays have the fixed
        maximum sizes (Rmax, Pmax), so the backbone's programs depend on T alone; zeros
        are safe padding (slot 0 is the null block, num_seqs 0 masks every row)."""
        r, dp = self.max_num_reqs, self.dp
        return (np.zeros(dp * t, np.int32), np.zeros(dp * t, np.int32), self.empty_attention_metadata(t),
                np.zeros(dp * r * self.rows_per_req, np.int32), np.zeros(dp * t, np.int32))

    def empty_attention_metadata(self, t: int) -> AttentionMetadata:
        """Zeroed AttentionMetadata of token bucket ``t``, every rank's one after the other
        (G = the KV cache groups)."""
        r, dp, g = self.max_num_reqs, self.dp, self.kv_cache_layout.num_groups
        return AttentionMetadata(
            slot_mapping=np.zeros((dp * t, g), np.int32), seq_lens=np.zeros(dp * r, np.int32),
            query_start_loc=np.zeros(dp * (r + 1), np.int32),
            block_tables=np.zeros((dp * r, g, self.max_blocks_per_req), np.int32), num_seqs=np.zeros(dp, np.int32),
        )

    # ------------------------------------------------------------------ the step
    def execute_model(self, outputs: list[SchedulerOutput]) -> list[ModelRunnerOutput]:
        """One step over every data-parallel rank (``outputs[r]``: rank r's scheduler
        output): apply the diffs, build the padded inputs, run the programs (one
        device_put, one device_get), record the sampled tokens. One output per rank."""
        return self.collect(self.dispatch(outputs))

    def dispatch(self, outputs: list[SchedulerOutput]) -> InflightStep | None:
        """The first half of execute_model: apply the diffs, build the inputs and start
        the programs; returns without waiting for the device (JAX dispatches
        asynchronously). None when no rank has tokens to run. The step in flight must
        be collected before the next dispatch: the next diff may reuse its rows."""
        assert len(outputs) == self.dp, f"{len(outputs)} scheduler outputs for {self.dp} ranks"
        for rank, so in enumerate(outputs):
            self._update_states(rank, so)
        if all(so.total_num_scheduled_tokens == 0 for so in outputs):
            return None
        step = self._prepare_inputs(outputs)
        return InflightStep(step, *self._dispatch(step))

    def collect(self, inflight: InflightStep | None) -> list[ModelRunnerOutput]:
        """The second half of execute_model: wait for the step's results (one
        device_get), append the sampled tokens to the batch, propose the next drafts."""
        if inflight is None:
            return [EMPTY_MODEL_RUNNER_OUTPUT] * self.dp
        step = inflight.step
        sampled, logprobs, prompt_logprobs = self._fetch(inflight)
        results = [self._bookkeeping(rank, step.ranks[rank], sampled, logprobs, prompt_logprobs)
                   for rank in range(self.dp)]
        if self.draft is not None:
            for out, drafts in zip(results, self.draft.propose(step.ranks)):
                if drafts:
                    out.draft_token_ids = drafts
        return results

    def _update_states(self, rank: int, so: SchedulerOutput) -> None:
        """Apply a rank's SchedulerOutput diff to its persistent InputBatch."""
        ib = self.input_batches[rank]
        for req_id in so.finished_req_ids:
            ib.remove_request(req_id)
            self.requests.pop(req_id, None)
        for req_id in so.preempted_req_ids:
            i = ib.req_id_to_index.get(req_id)
            if i is not None:
                # Keep the generated tokens: the request recomputes them when it resumes.
                self.requests[req_id].output_token_ids = ib.output_token_ids(i)
                ib.remove_request(req_id)
        for new in so.scheduled_new_reqs:
            sp = new.sampling_params
            seed = sp.seed if sp.seed is not None else int(self._seed_rng.integers(0, 2**31))
            state = CachedRequestState(new.req_id, list(new.prompt_token_ids), sp, seed & 0xFFFFFFFF)
            self.requests[new.req_id] = state
            ib.add_request(state, new.num_computed_tokens, new.block_ids)
        cached = so.scheduled_cached_reqs
        for req_id, resumed, block_ids, num_computed in zip(
            cached.req_ids, cached.resumed_from_preemption, cached.new_block_ids, cached.num_computed_tokens
        ):
            if resumed:
                # Its old row went with the preemption (preempted_req_ids of an earlier step).
                assert req_id not in ib.req_id_to_index, f"resumed request {req_id} still holds a row"
                ib.add_request(self.requests[req_id], num_computed, block_ids)
            else:
                i = ib.req_id_to_index[req_id]
                ib.num_computed_tokens[i] = num_computed
                # A request holds cdiv(num_computed, block_size) blocks before this step's:
                # the scheduler gave back those held only for rejected drafts.
                ib.num_blocks[i] = min(ib.num_blocks[i], cdiv(num_computed + self._blocks_past_computed,
                                                              self.block_size))
                ib.append_block_ids(i, block_ids)
        for req_id, drafts in so.scheduled_spec_decode_tokens.items():
            # After the request's tokens (num_tokens stays: they are not its tokens yet).
            i = ib.req_id_to_index[req_id]
            ib.token_ids[i, ib.num_tokens[i]:ib.num_tokens[i] + len(drafts)] = drafts

    def _prepare_inputs(self, outputs: list[SchedulerOutput]) -> PreparedStep:
        """The step's padded host arrays (numpy; nothing touches the device here). Every
        rank gets the same buckets: the largest rank's token count and request count."""
        token_buckets, request_buckets = self._step_buckets
        t_pad = token_buckets(max(so.total_num_scheduled_tokens for so in outputs))
        r_pad = request_buckets(max(len(so.num_scheduled_tokens) for so in outputs))
        # Written in place: views of the packed buffer.
        model_buffer, (input_ids, positions, md, logits_indices, lp_targets) = self._model_layout(t_pad).allocate()
        rmax = self.max_num_reqs
        ranks = [list(so.num_scheduled_tokens) for so in outputs]
        rows = [np.fromiter((ib.req_id_to_index[r] for r in ids), np.int64, len(ids))
                for ib, ids in zip(self.input_batches, ranks)]
        greedy = all(ib.is_greedy(r) for ib, r in zip(self.input_batches, rows))
        use_penalties = any(ib.uses_penalties(r) for ib, r in zip(self.input_batches, rows))
        plain = not any(ib.wants_logprobs[r].any() for ib, r in zip(self.input_batches, rows)) and \
            all(so.grammar_bitmask is None for so in outputs)
        rank_steps, smds, any_prompt_logprobs = [], [], False
        grammar = any(so.grammar_bitmask is not None for so in outputs)
        bitmask = np.full((self.dp * r_pad, self.input_batch.bitmask_words), -1, np.int32) if grammar else None
        s = self.rows_per_req
        verify = any(so.scheduled_spec_decode_tokens for so in outputs)
        drafts = np.full((self.dp * r_pad, self.num_spec), -1, np.int32) if verify else None
        num_drafts = np.zeros(self.dp * r_pad, np.int32) if verify else None
        for rank, (so, ib, req_ids, rws) in enumerate(zip(outputs, self.input_batches, ranks, rows)):
            tok, row = slice(rank * t_pad, (rank + 1) * t_pad), slice(rank * rmax, (rank + 1) * rmax)
            step, targets = self._prepare_rank(
                so, ib, req_ids, rws, input_ids[tok], positions[tok], md.slot_mapping[tok], md.seq_lens[row],
                md.query_start_loc[rank * (rmax + 1):(rank + 1) * (rmax + 1)], md.block_tables[row],
                logits_indices[rank * rmax * s:(rank + 1) * rmax * s])
            if verify:
                for i, req_id in enumerate(req_ids):
                    d = so.scheduled_spec_decode_tokens.get(req_id)
                    if d:
                        drafts[rank * r_pad + i, :len(d)] = d
                num_drafts[rank * r_pad:rank * r_pad + len(req_ids)] = step.num_drafts
            step.token_offset, step.row_offset = rank * t_pad, rank * r_pad
            md.num_seqs[rank] = len(req_ids)
            rank_steps.append(step)
            if targets is not None:
                any_prompt_logprobs = True
                lp_targets[rank * t_pad:rank * t_pad + len(targets)] = targets
            # Sampling rows, padded to the request bucket (padded rows repeat row 0; dropped).
            prow = np.zeros(r_pad, np.int64)
            prow[:len(rws)] = rws
            smds.append(ib.make_sampling_metadata(prow, use_penalties=use_penalties, bitmask=False))
            if so.grammar_bitmask is not None:
                # Each constrained request's mask goes to its sampling row (its index in req_ids).
                index = {r: i for i, r in enumerate(req_ids)}
                at = np.fromiter((index[r] for r in so.structured_output_request_ids), np.int64,
                                 len(so.structured_output_request_ids))
                bitmask[rank * r_pad + at] = so.grammar_bitmask
        smd = smds[0] if self.dp == 1 else jax.tree.map(lambda *xs: np.concatenate(xs), *smds)
        # Verification keeps its logprobs (one program set; drafts are a minority case).
        sample_key = VerifyKey(r_pad, greedy, use_penalties) if verify else SampleKey(r_pad, use_penalties)
        extra = (drafts, num_drafts) if verify else (np.array([greedy, plain] * self.dp, np.int32),)
        sampler_buffer = self._sampler_layout(sample_key).pack((dataclasses.replace(smd, token_history=None), extra))
        return PreparedStep(
            ranks=rank_steps, model_key=ModelStepKey(t_pad), model_buffer=model_buffer, sample_key=sample_key,
            sampler_buffer=sampler_buffer, token_history=smd.token_history if use_penalties else None,
            grammar_bitmask=bitmask, prompt_logprobs=any_prompt_logprobs)

    def _prepare_rank(self, so, ib: InputBatch, req_ids, rows, input_ids, positions, slot_mapping, seq_lens, cu,
                      block_tables, logits_indices) -> tuple[RankStep, np.ndarray | None]:
        """Fill one rank's slices of the step arrays (views: written in place); returns
        its RankStep and, if a row wants prompt logprobs, the targets of its tokens."""
        num_reqs = len(req_ids)
        n = np.fromiter(so.num_scheduled_tokens.values(), np.int32, num_reqs)
        computed = ib.num_computed_tokens[rows]
        # Padding past the tokens stays 0: the null block's slot.
        tok_rows, pos = ib.fill_ragged(rows, computed, n, self.block_size, cu, input_ids, positions, slot_mapping)
        seq_lens[:num_reqs] = computed + n
        block_tables[:num_reqs] = ib.block_table[rows]
        # S rows per request: its last d + 1 positions (the token before its drafts, then
        # each draft), the last one repeated past d. Without drafts: its last position.
        spec = so.scheduled_spec_decode_tokens
        num_drafts = (np.fromiter((len(spec.get(r, ())) for r in req_ids), np.int32, num_reqs) if spec
                      else np.zeros(num_reqs, np.int32))
        last = cu[1:num_reqs + 1] - 1
        s = self.rows_per_req
        if s == 1:
            logits_indices[:num_reqs] = last
        else:
            j = np.minimum(np.arange(s, dtype=np.int32)[None, :], num_drafts[:, None])
            logits_indices[:num_reqs * s] = ((last - num_drafts)[:, None] + j).reshape(-1)

        # Prompt logprobs: positions p in [start, end) give the entries for tokens p + 1.
        # start skips what an earlier pass returned (the prompt is recomputed after preemption).
        lp_end = np.minimum(computed + n, ib.num_prompt_tokens[rows] - 1)
        lp_start = computed.copy()
        lp_rows = ib.wants_prompt_logprobs[rows] & (computed < lp_end)
        for i in np.flatnonzero(lp_rows):
            lp_start[i] = max(computed[i], self.requests[req_ids[i]].num_prompt_logprobs_done)
        lp_rows &= lp_start < lp_end
        targets = None
        if lp_rows.any():
            # Target of position p is the token at p + 1 (within the prompt).
            targets = ib.token_ids[tok_rows, np.minimum(pos + 1, ib.token_ids.shape[1] - 1)]
        return RankStep(
            req_ids=req_ids, rows=rows, num_scheduled=n, num_computed=computed, query_start_loc=cu,
            num_drafts=num_drafts, token_offset=0, row_offset=0, prompt_logprobs_rows=lp_rows, prompt_logprobs_start=lp_start,
            prompt_logprobs_end=lp_end), targets

    def _dispatch(self, step: PreparedStep):
        """Start the step's programs: one device_put of the two packed buffers (and of the
        token history / grammar bitmask when the step uses them), the model step (the KV
        cache donated and replaced), the sampler, prompt logprobs if any row wants them
        -> (sampled, prompt logprobs or None), device arrays still being computed."""
        model_buffer, sampler_buffer = self._put_packed(step.model_buffer, step.sampler_buffer)
        history, bitmask = self._unused_wide_inputs(self.dp * step.sample_key.num_reqs)
        if step.token_history is not None or step.grammar_bitmask is not None:
            history, bitmask = (x if h is None else self._put(h) for x, h in
                                ((history, step.token_history), (bitmask, step.grammar_bitmask)))
        hidden, hidden_last, self.kv_cache = self._run(step.model_key, self.state, self.kv_cache, model_buffer)
        sampled = self._run(step.sample_key, self.state, hidden_last, sampler_buffer, history, bitmask)
        prompt_lp = None
        if step.prompt_logprobs:
            prompt_lp = self._run(PromptLogprobsKey(step.model_key.num_tokens), self.state, hidden, model_buffer)
        return sampled, prompt_lp

    @staticmethod
    def _fetch(inflight: InflightStep):
        """Device -> host (one device_get) of a dispatched step's results, unpacked:
        ((tokens [DP*Rb, S], num_emitted [DP*Rb]), (logprob ids, logprobs, ranks),
        prompt logprobs or None)."""
        sampled, prompt_lp = jax.device_get((inflight.sampled, inflight.prompt_logprobs))
        if isinstance(inflight.step.sample_key, VerifyKey):
            tokens, num_emitted, lp_ids, lps, ranks = sampled
        else:  # one token per request: the same shapes with S = 1
            tokens, lp_ids, lps, ranks = sampled
            tokens, num_emitted = tokens[:, None], np.ones(len(tokens), np.int32)
        return (tokens, num_emitted), (lp_ids, lps, ranks), prompt_lp

    def _bookkeeping(self, rank: int, step: RankStep, sampled, logprobs, prompt_logprobs) -> ModelRunnerOutput:
        """Append a rank's emitted tokens to its batch, propose the next drafts
        (speculative decoding) and build its ModelRunnerOutput. ``sampled``: (tokens
        [DP*Rb, S] with -1 past each row's emitted ones, num_emitted [DP*Rb])."""
        ib, rows, num_reqs = self.input_batches[rank], step.rows, len(step.req_ids)
        if num_reqs == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        mine = slice(step.row_offset, step.row_offset + num_reqs)
        tokens, num_emitted = sampled[0][mine], sampled[1][mine]
        # Requests whose scheduled tokens reach their end produce tokens; the rest are
        # mid-prefill and their sample is discarded. Rejected drafts are uncomputed.
        new_computed = step.num_computed + step.num_scheduled
        done = new_computed >= ib.num_tokens[rows] + step.num_drafts
        num_emitted = np.where(done, num_emitted, 0)
        new_computed -= step.num_drafts - np.maximum(num_emitted - 1, 0)
        ib.num_computed_tokens[rows] = new_computed
        if tokens.shape[1] == 1:
            done_rows = rows[done]
            ib.token_ids[done_rows, ib.num_tokens[done_rows]] = tokens[done, 0]
            sampled_list = [[int(t)] if d else [] for t, d in zip(tokens[:, 0].tolist(), done.tolist())]
        else:
            sampled_list = [tokens[i, :num_emitted[i]].tolist() for i in range(num_reqs)]
            for i in np.flatnonzero(done):
                start = ib.num_tokens[rows[i]]
                ib.token_ids[rows[i], start:start + num_emitted[i]] = tokens[i, :num_emitted[i]]
        ib.num_tokens[rows] += num_emitted
        step.done = done
        draft_token_ids = {}
        if self.proposer is not None:
            by_row = self.proposer.propose(ib.token_ids, ib.num_tokens, rows[done])
            draft_token_ids = {ib.req_ids[r]: d for r, d in by_row.items()}

        prompt_logprobs_dict = {}
        if prompt_logprobs is not None:
            p_ids, p_lps, p_ranks = prompt_logprobs
            for i in np.flatnonzero(step.prompt_logprobs_rows):
                # token index of position 0, in the step's [DP*T] arrays
                offset = step.token_offset + step.query_start_loc[i] - step.num_computed[i]
                start = int(offset + step.prompt_logprobs_start[i])
                stop = int(offset + step.prompt_logprobs_end[i])
                req_id = step.req_ids[i]
                prompt_logprobs_dict[req_id] = LogprobsLists(p_ids[start:stop], p_lps[start:stop], p_ranks[start:stop])
                self.requests[req_id].num_prompt_logprobs_done = int(step.prompt_logprobs_end[i])

        lp_ids, lps, ranks = logprobs
        stride = len(lp_ids) // len(sampled[0])  # S with a VerifyKey, else 1
        lp_rows = slice(step.row_offset * stride, (step.row_offset + num_reqs) * stride)
        return ModelRunnerOutput(
            req_ids=step.req_ids,
            req_id_to_index={r: i for i, r in enumerate(step.req_ids)},
            sampled_token_ids=sampled_list,
            logprobs=LogprobsLists(lp_ids[lp_rows], lps[lp_rows], ranks[lp_rows]),
            prompt_logprobs_dict=prompt_logprobs_dict,
            logprobs_stride=stride,
            draft_token_ids=draft_token_ids,
        )
