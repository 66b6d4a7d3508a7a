"""ModelRunner: the only host <-> device boundary. Per step: apply the scheduler's diff
to the InputBatches, build the padded inputs on the host, run the compiled programs
(one device_put, one device_get), record the sampled tokens.

A step's inputs are built with numpy (token bucket T, request bucket R) in two int32
buffers, the model step's and the sampler's (runner/step_inputs.py), put on the device
at once; then the model step (keyed by T alone; KV cache donated) and the sampler
(keyed by R alone) run (runner/programs.py), compiled ahead of time by the runner's
CompilationManager (runner/compilation_manager.py). Set-up policy is in
runner/setup.py, runner/dtypes.py, runner/bucketing.py and the attention spec
(pallas_kernels/backend.py).

Data parallelism (docs/design.md §5) is one SPMD program for all ranks: each rank has its
own InputBatch, scheduler and slice of the KV cache pages; a step's arrays are the
ranks' arrays one after the other on axis 0 (every rank padded to the same
buckets), split over the mesh's 'data' axis, so the compile count does not grow
with the number of ranks.
"""
from __future__ import annotations

import logging

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.config import EngineConfig
from jaxserve.core.kv_cache_utils import cdiv
from jaxserve.core.sched.output import SchedulerOutput
from jaxserve.distributed.arrays import global_array
from jaxserve.outputs import EMPTY_MODEL_RUNNER_OUTPUT, LogprobsLists, ModelRunnerOutput
from jaxserve.runner.bucketing import step_buckets
from jaxserve.runner.compilation_manager import CompilationManager
from jaxserve.runner.dense_forward import make_sequence_logprobs
from jaxserve.runner.dtypes import resolve_dtype, resolve_kv_cache_dtype, resolve_weight_dtype
from jaxserve.runner.input_batch import CachedRequestState, InputBatch
from jaxserve.runner.kv_cache import allocate_kv_cache, kv_cache_layout
from jaxserve.runner.packed_inputs import PackedLayout
from jaxserve.runner.program_key import DraftKey, EncoderKey, PoolKey, ProgramKey, PromptLogprobsKey, VerifyKey
from jaxserve.runner.programs import ProgramInputs, build_step_programs
from jaxserve.runner.setup import (kv_cache_blocks, load_draft_model, load_target_model, make_mesh,
                                   make_ngram_proposer)
from jaxserve.runner.step_inputs import InflightStep, PreparedStep, RankStep, StepInputBuilder
from jaxserve.runner.weight_update import WeightUpdater, check_sleep_level, device_bytes
from models.config import attention_settings
from models.quantization import GROUP_SCALED
from pallas_kernels.attention_metadata import AttentionMetadata
from pallas_kernels.backend import build_attention, resolve_attention_spec
from pallas_kernels.storage import stacked_weights_as_bits

__all__ = ["InflightStep", "ModelRunner", "PreparedStep", "RankStep", "make_mesh"]


logger = logging.getLogger("jaxserve")


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: str, *, progress: bool = True) -> None:
        self.config, self.model_path, self.progress = config, model_path, progress
        sc, cc, mc, pc = config.scheduler_config, config.cache_config, config.model_config, config.parallel_config
        self.platform = jax.default_backend()
        self.dtype = resolve_dtype(mc.dtype, self.platform)
        self.param_dtype = resolve_weight_dtype(mc.weight_dtype, mc.dtype, self.platform)
        # "auto" resolved once (on CPU it depends on whether the native kernel builds),
        # with how the pages are stored: the spec the kernels and the draft model take.
        self.attention_spec = resolve_attention_spec(mc.attention_backend, self.platform,
                                                     resolve_kv_cache_dtype(cc.cache_dtype, self.dtype),
                                                     batch_invariant=mc.batch_invariant)
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
        self.dp = pc.data_parallel_size
        self.mesh = make_mesh(pc.tensor_parallel_size, self.dp)
        # Every step input is the ranks' arrays one after the other on axis 0, split over
        # 'data'; sampler outputs come back replicated, so each process (multi-host) can
        # read them from its own devices.
        self._rows_sharding = NamedSharding(self.mesh, P("data"))
        self._replicated = NamedSharding(self.mesh, P())
        self._multihost = jax.process_count() > 1

        self.arch, self.graphdef, self.state = load_target_model(config, model_path, self.mesh, self.dtype,
                                                                 self.param_dtype, progress=progress)
        self.vocab_size = self.arch.vocab_size
        # LoRA adapters: host copies and the device slots a step's adapters use (jaxserve/lora).
        self.lora = None
        if config.lora_config is not None:
            from jaxserve.lora.manager import LoRAManager
            from models.registry import get_model_class

            # In the weights' dtype (the activations' under a quantized base).
            lora_dtype = self.dtype if self.arch.quantization else (self.param_dtype or self.dtype)
            self.lora = LoRAManager(config.lora_config, get_model_class(self.arch.architecture), self.arch,
                                    self.mesh, lora_dtype,
                                    as_bits=stacked_weights_as_bits(self.platform, mc.scan_layers, lora_dtype,
                                                                    self.dtype))
        # A vision-language model's tower program and encoder-output buffer (runner/encoder.py).
        self.encoder = None
        if self.arch.vision is not None:
            from jaxserve.runner.encoder import EncoderRunner

            if config.speculative_config is not None and config.speculative_config.method == "draft_model":
                raise ValueError("a draft model does not take images: speculative decoding with a "
                                 "vision-language model supports method 'ngram' only")
            if mc.pooler_config is not None:
                raise ValueError("a vision-language model is served with runner 'generate', not 'pooling'")
            # One encoder-output buffer, whose rows one scheduler hands out.
            if self.dp > 1 or self._multihost:
                raise ValueError("a vision-language model runs with data_parallel_size 1 on one host for now")
            self.encoder = EncoderRunner(self, config.scheduler_config.encoder_cache_rows)
        self.weights = WeightUpdater(self)  # live updates, sleep / wake (runner/weight_update.py)
        self.sleep_level = 0  # 0 awake; 1 the KV cache freed; 2 the weights too
        if mc.batch_invariant and (self.arch.num_experts or pc.tensor_parallel_size > 1):
            logger.warning("batch_invariant: %s not covered: a row's result can still depend on its batch there "
                           "(docs/batch_invariance.md)",
                           "MoE expert grouping" if self.arch.num_experts else "tensor parallelism across tp sizes")
        # The pooling runner (docs/pooling.md): a PoolKey program instead of the samplers;
        # what a chunked request's earlier chunks pooled, by request id, until its last chunk.
        self.pooler = mc.pooler_config
        self._pool_carry: dict[str, np.ndarray] = {}
        self._zero_carry = None  # device zeros [DP*Rmax, D], made once
        self.token_buckets, self.request_buckets = step_buckets(config, self.platform)
        self.proposer = make_ngram_proposer(config)  # the n-gram proposer (host)
        self.draft = load_draft_model(self, progress=progress)  # the draft-model proposer (device)
        # A request keeps cdiv(num_computed + this, block_size) blocks between steps: the
        # draft model has also written the KV of the request's last token.
        self._blocks_past_computed = 1 if self.draft is not None else 0
        self._init_kv_cache()
        self.input_batches = [InputBatch(self.max_num_reqs, self.max_model_len, self.max_blocks_per_req,
                                         self.vocab_size, self.kv_cache_layout.num_groups) for _ in range(self.dp)]
        self.requests: dict[str, CachedRequestState] = {}
        self._seed_rng = np.random.default_rng(mc.seed)
        self._sequence_logprobs = None  # built on first use (dense_forward.py)
        self._init_programs()

    def _init_kv_cache(self) -> None:
        """The KV cache groups, the blocks that fit, the pages (the draft model's too)."""
        # KV cache groups: Gemma's local layers give back the blocks behind their window
        # while its global layers keep the context (not with a draft model: it shares the
        # pages, and its layers do not slide).
        self.kv_cache_layout = kv_cache_layout(self.arch, free_window_blocks=self.draft is None)
        self.num_blocks = kv_cache_blocks(self.config, self.arch, self.mesh, self.kv_dtype, self.kv_cache_layout,
                                          draft_arch=self.draft.arch if self.draft is not None else None)
        self.kv_cache = allocate_kv_cache(self.arch, self.num_blocks, self.block_size, self.kv_storage_dtype, self.mesh,
                                          slots=self.kv_cache_layout.slots_per_block)
        if self.draft is not None:
            self.draft.allocate_kv_cache(self.num_blocks)

    def _init_programs(self) -> None:
        """The per-layer attention, the step's jitted programs, their input layouts, and
        the CompilationManager that compiles them ahead of time."""
        # A float8 cache uses the checkpoint's KV scales (kv_cache_scheme) when it has them.
        self.attention_spec = self.attention_spec.with_kv_scales(self.arch.kv_cache_scales)
        if self.arch.kv_cache_scales and not self.attention_spec.quantized_kv:
            logger.info("The checkpoint's KV cache scales are unused: kv_cache_dtype is not fp8")
        self._attention = build_attention(self.attention_spec, self.mesh, **attention_settings(self.arch),
                                          layer_group=self.kv_cache_layout.layer_group,
                                          layer_slot=self.kv_cache_layout.layer_slot)
        self.inputs = ProgramInputs(self.input_batch, self._replicated, dp=self.dp, max_num_reqs=self.max_num_reqs,
                                    rows_per_req=self.rows_per_req, max_blocks_per_req=self.max_blocks_per_req,
                                    num_kv_groups=self.kv_cache_layout.num_groups, lora=self.lora is not None,
                                    mm=self.encoder is not None)
        self._step_inputs = StepInputBuilder(self.input_batches, self.requests, self.inputs,
                                             block_size=self.block_size)
        self._jitted = build_step_programs(self.graphdef, self._attention, self.mesh, dp=self.dp,
                                           rows_per_req=self.rows_per_req, max_logprobs=self.max_logprobs,
                                           batch_invariant=self.config.model_config.batch_invariant,
                                           lora_slots=(self.lora.num_slots, self.lora.rank) if self.lora else None,
                                           pooling_type=self.pooler.pooling_type if self.pooler else None,
                                           arch=self.arch)
        if self.draft is not None:
            self._jitted[DraftKey] = self.draft.jitted
        if self.encoder is not None:
            self._jitted[EncoderKey] = self.encoder.jitted
        # Device constants standing in for the sampler's wide inputs when a step does not
        # use them, by rows (DP*Rb): (token history [rows, 1], all-allowed grammar bitmask).
        self._unused_wide: dict[int, tuple[jax.Array, jax.Array]] = {}
        self.compilation = CompilationManager(self)

    # ------------------------------------------------------------------ properties
    @property
    def input_batch(self) -> InputBatch:
        """Rank 0's batch (the only one without data parallelism)."""
        return self.input_batches[0]

    def sequence_logprobs(self, token_ids: list[int], state=None) -> np.ndarray:
        """Logprobs [T - 1] of tokens 1..T-1 of one sequence given the ones before, in one
        forward with this engine's model and ``state`` (default: its own params;
        runner/dense_forward.py). Bitwise the engine's sampled logprobs in batch-invariant mode."""
        if self.weights.weights_freed and state is None:
            raise RuntimeError("sequence_logprobs: the weights are freed (sleep level 2); wake_up() first")
        if len(token_ids) < 2 or len(token_ids) > self.max_model_len:
            raise ValueError(f"token_ids: a sequence of 2 to max_model_len={self.max_model_len} tokens, "
                             f"got {len(token_ids)}")
        bad = [t for t in token_ids if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise ValueError(f"token_ids: ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        if self._sequence_logprobs is None:
            self._sequence_logprobs = make_sequence_logprobs(self)
        ids = jax.device_put(np.asarray(token_ids, np.int32), self._replicated)
        return np.asarray(self._sequence_logprobs(self.state if state is None else state, ids))

    # ------------------------------------------------------------------ weights, sleep / wake
    def update_weights(self, weights) -> dict:
        """New values for some or all params, with no recompile (runner/weight_update.py);
        the caller makes sure no request holds KV. Returns {"version", "num_params",
        "seconds", "source"}."""
        return self.weights.update(weights)

    def get_params(self):
        """The served params as an nnx.State (the engine's own arrays, no copy)."""
        return self.weights.get_params()

    @property
    def weights_version(self) -> int:
        """Bumped by every update_weights (0: the weights loaded at start)."""
        return self.weights.version

    def memory_usage(self) -> dict:
        """Bytes on the devices now: {"weights", "kv_cache"} (every shard of each array)."""
        kv = [self.kv_cache] + ([self.draft.kv_cache] if self.draft is not None else [])
        return {"weights": self.weights.total_bytes(),
                "kv_cache": sum(device_bytes(c) for c in kv if c is not None)}

    def check_sleep(self, level) -> None:
        """ValueError for a sleep this runner cannot come back from."""
        check_sleep_level(level)
        if level == 2 and self.arch.quantization in GROUP_SCALED:
            # Waking reads the folder as floats (runner/weight_update.py), not as packed parts.
            raise ValueError(f"sleep level 2: the model's packed weights are kept as stored "
                             f"({self.arch.quantization}), which wake_up cannot reload; use level 1")

    def sleep(self, level: int = 1) -> dict:
        """Free the KV cache (level 1) and the weights too (level 2); the caller makes
        sure no request holds KV. Returns the bytes freed {"weights", "kv_cache"}."""
        self.check_sleep(level)
        freed = {"weights": 0, "kv_cache": 0}
        if self.kv_cache is not None:
            freed["kv_cache"] = self.memory_usage()["kv_cache"]
            self.kv_cache.delete()
            self.kv_cache = None
            if self.draft is not None:
                self.draft.kv_cache.delete()
                self.draft.kv_cache = None
        if level == 2 and not self.weights.weights_freed:
            freed["weights"] = self.weights.free_weights()
        self.sleep_level = max(self.sleep_level, level)
        return freed

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what sleep freed: ``tags`` "weights" and / or "kv_cache" (vLLM's;
        None: both). The weights are reloaded from the folder they last came from
        unless update_weights gave them while asleep (runner/weight_update.py)."""
        tags = ["weights", "kv_cache"] if tags is None else list(tags)
        bad = [t for t in tags if t not in ("weights", "kv_cache")]
        if bad:
            raise ValueError(f"tags: 'weights' and / or 'kv_cache', got {bad}")
        if "weights" in tags:
            self.weights.reload_weights()
        if "kv_cache" in tags and self.kv_cache is None:
            self.kv_cache = allocate_kv_cache(self.arch, self.num_blocks, self.block_size, self.kv_storage_dtype,
                                              self.mesh, slots=self.kv_cache_layout.slots_per_block)
            if self.draft is not None:
                self.draft.allocate_kv_cache(self.num_blocks)
        awake_kv, awake_weights = self.kv_cache is not None, not self.weights.weights_freed
        self.sleep_level = 0 if awake_kv and awake_weights else (2 if not awake_weights else 1)

    @property
    def is_sleeping(self) -> bool:
        return self.sleep_level > 0

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
        return self.compilation.ready_buckets[0].max

    # ------------------------------------------------------------------ compilation (CompilationManager)
    def warmup(self, *, background: bool = False) -> float:
        """Compile every program the step can use, ahead of time; returns the seconds
        spent before the engine can serve (CompilationManager.warmup: with
        ``background``, only the first stage before serving)."""
        return self.compilation.warmup(background=background)

    def stop_warmup(self) -> None:
        """Stop a background warm-up: the compiles under way finish, no other starts."""
        self.compilation.stop()

    def wait_for_warmup(self, timeout: float | None = None) -> bool:
        """Block until a background warm-up has compiled everything; True when done."""
        return self.compilation.wait(timeout)

    @property
    def warmup_from_cache(self) -> bool:
        """Whether warmup() loaded the programs from the executable cache."""
        return self.compilation.warmup_from_cache

    @property
    def num_compiled_programs(self) -> int:
        """Programs compiled ahead of time (0 with enforce_eager)."""
        return self.compilation.num_compiled_programs

    def lower_model_step(self, num_tokens: int) -> jax.stages.Lowered:
        """The model step of token bucket ``num_tokens``, lowered with serving's input
        types (for the warm-up, and to inspect a bucket's HLO)."""
        return self.compilation.lower_model_step(num_tokens)

    # ------------------------------------------------------------------ device transfers and runs
    def empty_attention_metadata(self, t: int) -> AttentionMetadata:
        """Zeroed AttentionMetadata of token bucket ``t``, every rank's one after the other."""
        return self.inputs.empty_attention_metadata(t)

    def _model_layout(self, t: int) -> PackedLayout:
        """Where the model step's inputs of token bucket ``t`` sit in its packed buffer."""
        return self.inputs.model_layout(t)

    def _unused_wide_inputs(self, rows: int) -> tuple:
        """(token history [rows, 1] zeros, grammar bitmask [rows, W] all ones, logit bias
        ([rows, K] ids -1, [rows, K] zeros)) on the device, made once: a step without
        penalties, grammars or biases sends none of them (the bitmask alone is 1.5 MB at 256 rows)."""
        wide = self._unused_wide.get(rows)
        if wide is None:
            k = self.input_batch.logit_bias_ids.shape[1]
            wide = self._unused_wide[rows] = self._put((
                np.zeros((rows, 1), np.int32), np.full((rows, self.input_batch.bitmask_words), -1, np.int32),
                (np.full((rows, k), -1, np.int32), np.zeros((rows, k), np.float32))))
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

    def _encoder_args(self) -> tuple:
        """The model step's encoder-output buffer argument: (buffer,) for a
        vision-language model, () otherwise."""
        return (self.encoder.buffer,) if self.encoder is not None else ()

    def _run(self, key: ProgramKey, *args):
        """Run the program ``key`` names: the warm-up's executable (its static arguments
        baked in), else the jitted function."""
        exe = self.compilation.executables.get(key)
        return exe(*args) if exe is not None else self._jitted[type(key)](*args, **self.inputs.static_args(key))

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
        if self.encoder is not None:
            self.encoder.run({h: v for so in outputs for h, v in so.scheduled_encoder_inputs.items()})
        step = self._prepare_inputs(outputs)
        return InflightStep(step, *self._dispatch(step))

    def collect(self, inflight: InflightStep | None) -> list[ModelRunnerOutput]:
        """The second half of execute_model: wait for the step's results (one
        device_get), append the sampled tokens to the batch, propose the next drafts."""
        if inflight is None:
            return [EMPTY_MODEL_RUNNER_OUTPUT] * self.dp
        step = inflight.step
        if self.pooler is not None:
            out, partial = jax.device_get(inflight.sampled)
            return [self._pool_bookkeeping(rank, step.ranks[rank], out, partial) for rank in range(self.dp)]
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
            self._pool_carry.pop(req_id, None)
        for req_id in so.preempted_req_ids:
            self._pool_carry.pop(req_id, None)  # its prompt is computed again from the start
            i = ib.req_id_to_index.get(req_id)
            if i is not None:
                # Keep the generated tokens: the request recomputes them when it resumes.
                self.requests[req_id].output_token_ids = ib.output_token_ids(i)
                ib.remove_request(req_id)
        for new in so.scheduled_new_reqs:
            sp = new.sampling_params
            seed = sp.seed if sp.seed is not None else int(self._seed_rng.integers(0, 2**31))
            state = CachedRequestState(new.req_id, list(new.prompt_token_ids), sp, seed & 0xFFFFFFFF,
                                       lora_request=new.lora_request, mm=new.mm)
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
        """The step's padded host arrays (numpy; nothing touches the device here but the
        copy of an adapter into its slot), in the buckets compiled so far
        (StepInputBuilder.prepare)."""
        lora_slots = None
        if self.lora is not None:
            live = {s.lora_request.lora_int_id for s in self.requests.values() if s.lora_request is not None}
            lora_slots = self.lora.activate({rid: self.requests[rid].lora_request
                                             for so in outputs for rid in so.num_scheduled_tokens}, live)
        return self._step_inputs.prepare(outputs, *self.compilation.ready_buckets, lora_slots=lora_slots)

    def _dispatch(self, step: PreparedStep):
        """Start the step's programs: one device_put of the two packed buffers (and of the
        token history / grammar bitmask when the step uses them), the model step (the KV
        cache donated and replaced), the sampler, prompt logprobs if any row wants them
        -> (sampled, prompt logprobs or None), device arrays still being computed."""
        if self.pooler is not None:
            return self._dispatch_pooling(step)
        model_buffer, sampler_buffer = self._put_packed(step.model_buffer, step.sampler_buffer)
        history, bitmask, bias = self._unused_wide_inputs(self.dp * step.sample_key.num_reqs)
        if step.token_history is not None or step.grammar_bitmask is not None or step.logit_bias is not None:
            history, bitmask, bias = (x if h is None else self._put(h) for x, h in (
                (history, step.token_history), (bitmask, step.grammar_bitmask), (bias, step.logit_bias)))
        hidden, hidden_last, self.kv_cache = self._run(step.model_key, self.state, self.kv_cache, model_buffer,
                                                       self.lora.buffers if self.lora is not None else None,
                                                       *self._encoder_args())
        sampled = self._run(step.sample_key, self.state, hidden_last, sampler_buffer, history, bitmask, bias)
        prompt_lp = None
        if step.prompt_logprobs:
            prompt_lp = self._run(PromptLogprobsKey(step.model_key.num_tokens), self.state, hidden, model_buffer)
        return sampled, prompt_lp

    def _dispatch_pooling(self, step: PreparedStep):
        """The pooling runner's step: the model step, then its PoolKey program with the
        carry of the requests whose earlier chunks ran -> ((out, partial), None)."""
        (model_buffer,) = self._put_packed(step.model_buffer)
        hidden, hidden_last, self.kv_cache = self._run(step.model_key, self.state, self.kv_cache, model_buffer, None)
        rmax, d = self.max_num_reqs, self.arch.hidden_size
        carried = [(rank * rmax + i, self._pool_carry[rid]) for rank, rs in enumerate(step.ranks)
                   for i, rid in enumerate(rs.req_ids) if rid in self._pool_carry]
        if carried:
            carry = np.zeros((self.dp * rmax, d), np.float32)
            for row, value in carried:
                carry[row] = value
            carry = self._put(carry)
        else:
            if self._zero_carry is None:
                self._zero_carry = self._put(np.zeros((self.dp * rmax, d), np.float32))
            carry = self._zero_carry
        pooled = self._run(PoolKey(step.model_key.num_tokens), self.state, hidden, hidden_last, model_buffer, carry)
        return pooled, None

    def _pool_bookkeeping(self, rank: int, step: RankStep, out: np.ndarray, partial: np.ndarray) -> ModelRunnerOutput:
        """A rank's pooling results: the pooled output of each request whose prompt ended
        this step (``out`` [DP*Rmax, O]); the carry of the others (``partial``)."""
        ib, rows, num_reqs = self.input_batches[rank], step.rows, len(step.req_ids)
        if num_reqs == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        new_computed = step.num_computed + step.num_scheduled
        ib.num_computed_tokens[rows] = new_computed
        step.done = new_computed >= ib.num_tokens[rows]
        pooled, base = {}, rank * self.max_num_reqs
        for i, (req_id, done) in enumerate(zip(step.req_ids, step.done.tolist())):
            if done:
                pooled[req_id] = out[base + i]
                self._pool_carry.pop(req_id, None)
            else:
                self._pool_carry[req_id] = partial[base + i]
        return ModelRunnerOutput(req_ids=step.req_ids, req_id_to_index={r: i for i, r in enumerate(step.req_ids)},
                                 sampled_token_ids=[[] for _ in step.req_ids], pooler_output=pooled)

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
