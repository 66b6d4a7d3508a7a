"""ModelRunner: the only host <-> device boundary.

Per step: apply the SchedulerOutput diff to the InputBatch, build padded inputs
with numpy (token bucket T, request bucket R), one device_put, the jitted model
step (keyed by T alone; KV cache donated), the jitted sampler (keyed by R alone),
one device_get. Programs are a sum over buckets, not a product: per-request
metadata of the model step has fixed maximum sizes (Rmax = max_num_seqs,
Pmax = pages of max_model_len).
"""
from __future__ import annotations

import contextlib
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from jaxserve.config import EngineConfig
from jaxserve.core.sched.output import SchedulerOutput
from jaxserve.outputs import EMPTY_MODEL_RUNNER_OUTPUT, LogprobsLists, ModelRunnerOutput
from jaxserve.runner.bucketing import BucketTable, power_of_two_buckets
from jaxserve.runner.input_batch import CachedRequestState, InputBatch
from jaxserve.runner.kv_cache import allocate_kv_cache, determine_num_blocks, kv_cache_sharding
from jaxserve.sample.metadata import SamplingMetadata
from jaxserve.sample.sampler import compute_logprobs, sample
from models.attention_metadata import AttentionMetadata
from models.config import ModelArchConfig
from models.registry import get_model_class
from models.weights import load_hf_weights
from pallas_kernels.reference import write_kv_cache

logger = logging.getLogger("jaxserve")

MIN_TOKEN_BUCKET = 16
MIN_REQUEST_BUCKET = 8


def resolve_dtype(dtype: str, platform: str):
    if dtype in ("auto", None):
        return jnp.float32 if platform == "cpu" else jnp.bfloat16
    table = {"float32": jnp.float32, "float": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16,
             "half": jnp.float16}
    if dtype not in table:
        raise ValueError(f"dtype must be one of auto, {', '.join(table)}; got {dtype!r}")
    return table[dtype]


def make_mesh(tensor_parallel_size: int) -> Mesh:
    devices = jax.devices()
    if tensor_parallel_size > len(devices):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} exceeds the {len(devices)} available devices"
        )
    return Mesh(np.array(devices[:tensor_parallel_size]).reshape(1, tensor_parallel_size), ("data", "model"))


def check_tensor_parallel(arch: ModelArchConfig, tp: int) -> None:
    """Every dimension sharded over 'model' must split evenly (ValueError naming it)."""
    dims = {"num_attention_heads": arch.num_attention_heads, "num_key_value_heads": arch.num_key_value_heads,
            "intermediate_size": arch.intermediate_size}
    if not arch.tie_word_embeddings:
        dims["vocab_size"] = arch.vocab_size  # lm_head is split by vocabulary
    for name, value in dims.items():
        if value % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide {name}={value}")


def param_partition_spec(path: tuple, ndim: int) -> P:
    """Logical partitioning: attention heads and MLP columns over 'model'."""
    name = str(path[-2] if path and str(path[-1]) == "value" else path[-1])
    column = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
    row = {"o_proj", "down_proj"}
    if name in column:
        return P(None, None, "model")
    if name in row:
        return P(None, "model", None)
    if name in {"q_bias", "k_bias", "v_bias", "gate_bias", "up_bias"}:
        return P(None, "model")
    if name == "lm_head":
        return P(None, "model")
    return P(*([None] * ndim))


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: str, *, progress: bool = True) -> None:
        self.config = config
        sc, cc, mc = config.scheduler_config, config.cache_config, config.model_config
        self.platform = jax.default_backend()
        self.dtype = resolve_dtype(mc.dtype, self.platform)
        self.block_size = cc.block_size
        self.max_model_len = sc.max_model_len
        self.max_num_reqs = sc.max_num_seqs
        self.max_num_tokens = sc.max_num_batched_tokens
        self.max_blocks_per_req = -(-self.max_model_len // self.block_size)
        self.max_logprobs = max(mc.max_logprobs, 0)
        self.progress = progress
        self.mesh = make_mesh(config.parallel_config.tensor_parallel_size)

        t0 = time.perf_counter()
        self.arch = ModelArchConfig.from_pretrained(model_path)
        check_tensor_parallel(self.arch, config.parallel_config.tensor_parallel_size)
        weights = load_hf_weights(model_path, self.arch, progress=progress)
        model_cls = get_model_class(self.arch.architecture)
        # Build on the host, then place each param with its sharding (no full copy per device).
        with jax.default_device(jax.devices("cpu")[0]) if self.platform != "cpu" else contextlib.nullcontext():
            model = model_cls(self.arch, weights, dtype=jnp.float32)
        del weights
        self.graphdef, state = nnx.split(model)
        self.state = self._shard_params(state)
        self.vocab_size = self.arch.vocab_size
        logger.info("Loaded %s (%s) in %.1f s", model_path, self.arch.architecture, time.perf_counter() - t0)

        self.num_blocks = determine_num_blocks(
            self.arch, block_size=self.block_size, dtype=self.dtype, max_model_len=self.max_model_len,
            gpu_memory_utilization=cc.gpu_memory_utilization, kv_cache_memory=cc.kv_cache_memory,
            num_gpu_blocks_override=cc.num_gpu_blocks_override, device=jax.devices()[0],
        )
        self.kv_cache = allocate_kv_cache(self.arch, self.num_blocks, self.block_size, self.dtype, self.mesh)

        self.token_buckets = BucketTable(config.token_buckets or power_of_two_buckets(MIN_TOKEN_BUCKET, self.max_num_tokens))
        self.request_buckets = BucketTable(
            config.request_buckets or power_of_two_buckets(min(MIN_REQUEST_BUCKET, self.max_num_reqs), self.max_num_reqs)
        )
        self.input_batch = InputBatch(self.max_num_reqs, self.max_model_len, self.max_blocks_per_req)
        self.requests: dict[str, CachedRequestState] = {}
        self._seed_rng = np.random.default_rng(mc.seed)
        self._attention_impl = self._select_attention(mc.attention_backend)
        self._build_step_functions()

    # ------------------------------------------------------------------ setup
    def _shard_params(self, state):
        def place(path, x):
            keys = tuple(str(getattr(p, "key", getattr(p, "name", p))) for p in path)
            spec = param_partition_spec(keys, x.ndim)
            dtype = self.dtype if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim >= 1 and "inv_freq" not in str(path) else x.dtype
            return jax.device_put(x.astype(dtype), NamedSharding(self.mesh, spec))

        return jax.tree_util.tree_map_with_path(place, state)

    def _select_attention(self, backend: str):
        from pallas_kernels.backend import get_attention_fn, resolve_backend

        self.attention_backend, _ = resolve_backend(backend, self.platform)
        # On CPU the pallas kernels run under the Pallas interpreter (tests, debugging).
        return get_attention_fn(backend, self.platform, interpret=self.platform == "cpu")

    def _attention(self, q, k, v, kv_cache, layer, md: AttentionMetadata):
        """Write this step's K/V, then attend (per layer, so a request later in the batch
        sees blocks an earlier one of the same step just filled: prefix dedup, PC-15).

        With tensor parallelism both run under shard_map, each device on its own heads
        and its own slice of the cache (DESIGN §5): a Pallas kernel has no partitioning
        rule, and left to GSPMD its operands, the whole stacked cache included, would be
        gathered onto every device."""
        def local(q, k, v, kv_cache, layer, md):
            kv_cache = write_kv_cache(kv_cache, k, v, md.slot_mapping, layer=layer)
            o = self._attention_impl(q, kv_cache, md.seq_lens, md.block_tables, md.query_start_loc, md.num_seqs,
                                     sm_scale=self.arch.head_dim ** -0.5, sliding_window=self.arch.sliding_window,
                                     layer=layer)
            return o, kv_cache

        if self.mesh.shape["model"] == 1:
            return local(q, k, v, kv_cache, layer, md)
        heads = P(None, "model", None)  # [T, heads, H]
        cache = kv_cache_sharding(self.mesh).spec
        return jax.shard_map(local, mesh=self.mesh, in_specs=(heads, heads, heads, cache, P(), P()),
                             out_specs=(heads, cache), check_vma=False)(q, k, v, kv_cache, layer, md)

    def _build_step_functions(self) -> None:
        graphdef = self.graphdef
        kv_sharding = kv_cache_sharding(self.mesh)

        def model_step(state, kv_cache, input_ids, positions, md, logits_indices):
            model = nnx.merge(graphdef, state)
            hidden, kv_cache = model(input_ids, positions, kv_cache, md, self._attention)
            return hidden, hidden[logits_indices], kv_cache

        def sample_step(state, hidden_last, smd, *, num_reqs, greedy_only, use_penalties):
            model = nnx.merge(graphdef, state)
            logits = model.compute_logits(hidden_last[:num_reqs])
            return sample(logits, smd, greedy_only=greedy_only, use_penalties=use_penalties,
                          num_logprobs=self.max_logprobs)

        def prompt_logprobs_step(state, hidden, targets):
            model = nnx.merge(graphdef, state)
            logits = model.compute_logits(hidden)
            return compute_logprobs(logits, targets, self.max_logprobs)

        # The cache leaves with exactly the sharding it came in with. Left to itself, jit
        # returns an equivalent but differently spelled spec (P() instead of
        # P(None, None, None, 'model', None)), and the next call of a bucket compiled
        # with the old spelling lowers it again.
        self._model_step = jax.jit(model_step, donate_argnums=(1,), out_shardings=(None, None, kv_sharding))
        self._sample_step = jax.jit(sample_step, static_argnames=("num_reqs", "greedy_only", "use_penalties"))
        self._prompt_logprobs_step = jax.jit(prompt_logprobs_step)
        # Executables compiled ahead of time by warmup(), by program key; the jitted
        # functions above serve any key not in here (enforce_eager).
        self._executables: dict[tuple, jax.stages.Compiled] = {}

    def _run(self, key: tuple, jitted, *args, **static):
        """The warm-up's executable for ``key`` (static arguments are baked into it),
        else the jitted function."""
        exe = self._executables.get(key)
        return exe(*args) if exe is not None else jitted(*args, **static)

    # ------------------------------------------------------------------ warm-up
    def warmup(self) -> float:
        """Compile every program the step can use, ahead of time; returns seconds spent.

        Programs are lowered and compiled without running them (running the big
        prefill buckets on dummy inputs cost more than compiling them on a CPU, and
        nothing with the persistent compilation cache). Inputs come from the same
        places as in execute_model (numpy through device_put, the model step's own
        output types for the hidden states), so shapes, dtypes and shardings match
        what serving passes to the executables."""
        t0 = time.perf_counter()
        jobs = [("model", t) for t in self.token_buckets]
        jobs += [("sample", r, g, p) for r in self.request_buckets for g in (True, False) for p in (False, True)]
        last = None
        for job in tqdm(jobs, desc="Warm-up (compiling buckets)", disable=not self.progress):
            if job[0] == "model":
                t = job[1]
                exe = self._model_step.lower(self.state, self.kv_cache, *self._dummy_model_inputs(t)).compile()
                self._executables[job] = exe
                hidden, last, _ = exe.out_info
                self._executables[("prompt_logprobs", t)] = self._prompt_logprobs_step.lower(
                    self.state, hidden, jax.device_put(np.zeros(t, np.int32))).compile()
            else:
                _, r, g, p = job
                self._executables[job] = self._sample_step.lower(
                    self.state, last, self._dummy_sampling_metadata(r, p), num_reqs=r, greedy_only=g,
                    use_penalties=p).compile()
        dt = time.perf_counter() - t0
        self.num_compiled_programs = len(self._executables)
        logger.info("Warm-up compiled %d programs in %.1f s", self.num_compiled_programs, dt)
        return dt

    def _dummy_model_inputs(self, t: int):
        r = self.max_num_reqs
        md = AttentionMetadata(
            slot_mapping=np.zeros(t, np.int32), seq_lens=np.zeros(r, np.int32),
            query_start_loc=np.zeros(r + 1, np.int32), block_tables=np.zeros((r, self.max_blocks_per_req), np.int32),
            num_seqs=np.int32(0),
        )
        return jax.device_put((np.zeros(t, np.int32), np.zeros(t, np.int32), md, np.zeros(r, np.int32)))

    def _dummy_sampling_metadata(self, r: int, use_penalties: bool) -> SamplingMetadata:
        hist = self.max_model_len + 1 if use_penalties else 1
        f = lambda v, dt=np.float32: np.full(r, v, dt)  # noqa: E731
        return jax.device_put(SamplingMetadata(
            temperature=f(0.0), top_k=f(0, np.int32), top_p=f(1.0), min_p=f(0.0), presence_penalty=f(0.0),
            frequency_penalty=f(0.0), repetition_penalty=f(1.0), seeds=f(0, np.uint32), output_pos=f(0, np.int32),
            stop_ids_masked=np.full((r, self.input_batch.stop_ids.shape[1]), -1, np.int32),
            token_history=np.zeros((r, hist), np.int32), prompt_lens=f(0, np.int32), total_lens=f(0, np.int32),
        ))

    # ------------------------------------------------------------------ state updates
    def _update_states(self, so: SchedulerOutput) -> None:
        ib = self.input_batch
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
                ib.append_block_ids(i, block_ids)

    # ------------------------------------------------------------------ the step
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        ib = self.input_batch
        req_ids = list(so.num_scheduled_tokens)
        num_reqs = len(req_ids)
        rows = np.fromiter((ib.req_id_to_index[r] for r in req_ids), np.int64, num_reqs)
        n = np.fromiter(so.num_scheduled_tokens.values(), np.int32, num_reqs)
        total = int(n.sum())
        t_pad = self.token_buckets(total)
        r_pad = self.request_buckets(num_reqs)
        rmax, bs = self.max_num_reqs, self.block_size

        computed = ib.num_computed_tokens[rows]
        cu = np.zeros(rmax + 1, np.int32)
        np.cumsum(n, out=cu[1 : num_reqs + 1])
        cu[num_reqs + 1 :] = total
        tok_req = np.repeat(np.arange(num_reqs), n)
        tok_rows = rows[tok_req]
        pos = (computed[tok_req] + np.arange(total) - cu[tok_req]).astype(np.int32)
        input_ids = np.zeros(t_pad, np.int32)
        input_ids[:total] = ib.token_ids[tok_rows, pos]
        positions = np.zeros(t_pad, np.int32)
        positions[:total] = pos
        slot_mapping = np.zeros(t_pad, np.int32)  # padding writes into the null block
        slot_mapping[:total] = ib.block_table[tok_rows, pos // bs] * bs + pos % bs
        seq_lens = np.zeros(rmax, np.int32)
        seq_lens[:num_reqs] = computed + n
        block_tables = np.zeros((rmax, self.max_blocks_per_req), np.int32)
        block_tables[:num_reqs] = ib.block_table[rows]
        logits_indices = np.zeros(rmax, np.int32)
        logits_indices[:num_reqs] = cu[1 : num_reqs + 1] - 1
        md = AttentionMetadata(slot_mapping, seq_lens, cu, block_tables, np.int32(num_reqs))

        # Sampling arrays, padded to the request bucket.
        prow = np.zeros(r_pad, np.int64)
        prow[:num_reqs] = rows
        num_out = ib.num_tokens[prow] - ib.num_prompt_tokens[prow]
        use_penalties = ib.uses_penalties(rows)
        greedy_only = bool(np.all(ib.temperature[rows] == 0))
        stop_masked = np.where((num_out < ib.min_tokens[prow])[:, None], ib.stop_ids[prow], -1)
        if use_penalties:
            history, total_lens = ib.token_ids[prow], ib.num_tokens[prow]
        else:
            history, total_lens = np.zeros((r_pad, 1), np.int32), np.zeros(r_pad, np.int32)
        smd = SamplingMetadata(
            temperature=ib.temperature[prow], top_k=ib.top_k[prow], top_p=ib.top_p[prow], min_p=ib.min_p[prow],
            presence_penalty=ib.presence_penalty[prow], frequency_penalty=ib.frequency_penalty[prow],
            repetition_penalty=ib.repetition_penalty[prow], seeds=ib.seeds[prow], output_pos=num_out.astype(np.int32),
            stop_ids_masked=stop_masked.astype(np.int32), token_history=history,
            prompt_lens=ib.num_prompt_tokens[prow], total_lens=total_lens.astype(np.int32),
        )
        dev = jax.device_put((input_ids, positions, md, logits_indices, smd))
        hidden, hidden_last, self.kv_cache = self._run(("model", t_pad), self._model_step, self.state,
                                                       self.kv_cache, *dev[:4])
        sampled, lp_ids, lps, ranks = self._run(
            ("sample", r_pad, greedy_only, use_penalties), self._sample_step, self.state, hidden_last, dev[4],
            num_reqs=r_pad, greedy_only=greedy_only, use_penalties=use_penalties)

        # Prompt logprobs: positions p in [start, end) give the entries for tokens p + 1.
        # start skips what an earlier pass returned (the prompt is recomputed after preemption).
        prompt_lp_end = np.minimum(computed + n, ib.num_prompt_tokens[rows] - 1)
        prompt_lp_start = computed.copy()
        prompt_lp_rows = ib.wants_prompt_logprobs[rows] & (computed < prompt_lp_end)
        for i in np.flatnonzero(prompt_lp_rows):
            prompt_lp_start[i] = max(computed[i], self.requests[req_ids[i]].num_prompt_logprobs_done)
        prompt_lp_rows &= prompt_lp_start < prompt_lp_end
        prompt_lp_dev = None
        if prompt_lp_rows.any():
            # Target of position p is the token at p + 1 (within the prompt).
            targets = np.zeros(t_pad, np.int32)
            nxt = np.minimum(pos + 1, ib.token_ids.shape[1] - 1)
            targets[:total] = ib.token_ids[tok_rows, nxt]
            prompt_lp_dev = self._run(("prompt_logprobs", t_pad), self._prompt_logprobs_step, self.state, hidden,
                                      jax.device_put(targets))

        sampled, lp_ids, lps, ranks = jax.device_get((sampled, lp_ids, lps, ranks))
        sampled = sampled[:num_reqs]

        # Requests whose scheduled tokens reach their end produce a token; the rest are
        # mid-prefill and their sample is discarded.
        ib.num_computed_tokens[rows] = computed + n
        done = computed + n >= ib.num_tokens[rows]
        done_rows = rows[done]
        ib.token_ids[done_rows, ib.num_tokens[done_rows]] = sampled[done]
        ib.num_tokens[done_rows] += 1
        sampled_list = [[int(t)] if d else [] for t, d in zip(sampled.tolist(), done.tolist())]

        prompt_logprobs_dict = {}
        if prompt_lp_dev is not None:
            p_ids, p_lps, p_ranks = jax.device_get(prompt_lp_dev)
            for i in np.flatnonzero(prompt_lp_rows):
                start = int(cu[i] + prompt_lp_start[i] - computed[i])
                stop = int(cu[i] + prompt_lp_end[i] - computed[i])
                prompt_logprobs_dict[req_ids[i]] = LogprobsLists(p_ids[start:stop], p_lps[start:stop], p_ranks[start:stop])
                self.requests[req_ids[i]].num_prompt_logprobs_done = int(prompt_lp_end[i])

        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled_list,
            logprobs=LogprobsLists(lp_ids[:num_reqs], lps[:num_reqs], ranks[:num_reqs]),
            prompt_logprobs_dict=prompt_logprobs_dict,
        )

