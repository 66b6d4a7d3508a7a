"""The step's programs: the jitted functions a program key names (the model step, the
sampler, speculative verification, prompt logprobs) and the packed layouts of their
inputs, which with the key make each program's static arguments.

Programs are a sum over buckets, not a product: the model step is keyed by the token
bucket T alone (its per-request metadata has fixed maximum sizes, Rmax = max_num_seqs,
Pmax = pages of max_model_len), the samplers by the request bucket alone. With data
parallelism every input is the ranks' arrays one after the other on axis 0, split over
the mesh's 'data' axis, so the program count does not grow with the ranks.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.runner.input_batch import InputBatch
from jaxserve.runner.kv_cache import kv_cache_sharding
from jaxserve.runner.packed_inputs import PackedLayout
from jaxserve.runner.program_key import ModelStepKey, PoolKey, ProgramKey, PromptLogprobsKey, SampleKey, VerifyKey
from jaxserve.sample.rejection_sampler import rejection_sample
from jaxserve.sample.sampler import compute_logprobs, sample_from
from models.lora import lora_mask
from models.quantization import native_products
from pallas_kernels import cpu_matmul
from pallas_kernels.attention_metadata import AttentionMetadata


def traced_products(mesh: Mesh | None, batch_invariant: bool) -> Callable:
    """A decorator: the function traced with the engine's products
    (models.quantization.native_products), for every program that runs the model (the
    step's, the draft model's, and with ``mesh`` None a one-device program: the
    sequence logprobs of runner/dense_forward.py).

    Small bf16 products go through the native CPU kernel: on one device (a custom call is
    not partitioned), where the CPU multiplies bf16 natively. Batch-invariant mode uses
    it for every product, and under data parallelism alone (tp = 1) runs it per rank, so
    that a request's rows are multiplied the same way on any rank."""
    one_device = mesh is None or mesh.size == 1
    dp_only = batch_invariant and not one_device and mesh.shape["model"] == 1
    native = (one_device or dp_only) and cpu_matmul.enabled()
    native_mesh = mesh if dp_only else None

    def products(fn):
        @functools.wraps(fn)
        def traced(*args, **kwargs):
            with native_products(native, batch_invariant, native_mesh):
                return fn(*args, **kwargs)
        return traced

    return products


def build_step_programs(graphdef, attention: Callable, mesh: Mesh, *, arch, dp: int, rows_per_req: int,
                        max_logprobs: int, batch_invariant: bool = False,
                        lora_slots: tuple[int, int] | None = None,
                        pooling_type: str | None = None) -> dict[type, Callable]:
    """The step's jitted functions by program key type (their static arguments:
    ProgramInputs.static_args). ``attention``: the per-layer attention
    (pallas_kernels.backend.build_attention); ``rows_per_req``: S = k + 1 logits rows per
    request with k speculative tokens, else 1; ``dp``: the data-parallel ranks;
    ``batch_invariant``: every product row-invariant (models.quantization.invariant_matmul);
    ``lora_slots``: (max_loras, max_lora_rank) with LoRA on (the model step then takes the
    adapters' buffers, jaxserve/lora/manager.py, and its inputs a slot per token);
    ``pooling_type``: the pooling runner's LAST / CLS / MEAN (its PoolKey program), None
    for a generative model; ``arch``: the model's ModelArchConfig (its KV cache's
    sharding: a latent cache is whole on every 'model' device)."""
    s = rows_per_req
    rows_sharding, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    products = traced_products(mesh, batch_invariant)

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
        return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, rows_sharding), layout.unpack(packed))

    def sampling_metadata(layout, packed, history, bitmask, bias):
        """(SamplingMetadata, the rest of the packed sampler inputs); ``bias``: the
        logit_bias (ids [rows, K], values [rows, K])."""
        smd, extra = unpack(layout, packed)
        return dataclasses.replace(smd, token_history=history, allowed_token_bitmask=bitmask,
                                   logit_bias_ids=bias[0], logit_bias_values=bias[1]), extra

    def model_step(state, kv_cache, packed, lora_buffers, encoder_buffer=None, *, layout):
        """lora_buffers: None, or the adapters' slots (jaxserve/lora/manager.py);
        encoder_buffer: a vision-language model's encoder outputs [E, D] (the runner's),
        its inputs then ending with each token's row + 1 (0: text), its M-RoPE
        positions [T, 3] and the keys past its own position it attends to [T] (Gemma 3:
        the rest of its image; AttentionMetadata.keys_ahead)."""
        input_ids, positions, md, logits_indices, _, *extra = unpack(layout, packed)
        model = nnx.merge(graphdef, state)
        lora = mm = None
        if lora_buffers is not None:
            slots = extra[0]
            lora = (lora_buffers, lora_mask(slots, *lora_slots, jnp.float32), jnp.any(slots > 0))
        if encoder_buffer is not None:
            mm_rows, mrope, keys_ahead = extra[-3:]
            mm = (encoder_buffer, mm_rows - 1)
            if arch is not None and arch.mrope_section:
                positions = mrope.T
            if arch is not None and arch.mm_bidirectional:
                md = dataclasses.replace(md, keys_ahead=keys_ahead)
        hidden, kv_cache = model(input_ids, positions, kv_cache, md, attention, lora=lora,
                                 **({"mm": mm} if mm is not None else {}))
        # Each rank's last-token rows, by its local indices [DP, Rmax] into its [T].
        by_rank = hidden.reshape(dp, -1, hidden.shape[-1])
        last = jnp.take_along_axis(by_rank, logits_indices.reshape(dp, -1, 1), axis=1)
        return hidden, last.reshape(-1, hidden.shape[-1]), kv_cache

    def sample_step(state, hidden_last, packed, history, bitmask, bias, *, layout, num_reqs, use_penalties):
        """flags: [DP*2], (greedy_only, plain) of the whole step once per rank."""
        smd, (flags,) = sampling_metadata(layout, packed, history, bitmask, bias)
        model, hidden = nnx.merge(graphdef, state), per_rank_rows(hidden_last, num_reqs)
        flags = flags.reshape(dp, 2) != 0
        return sample_from(lambda: model.compute_logits(hidden), smd, greedy_only=jnp.all(flags[:, 0]),
                           use_penalties=use_penalties, num_logprobs=max_logprobs, plain=jnp.all(flags[:, 1]))

    def verify_step(state, hidden_last, packed, history, bitmask, bias, *, layout, num_reqs, greedy_only,
                    use_penalties):
        smd, (draft_token_ids, num_draft_tokens) = sampling_metadata(layout, packed, history, bitmask, bias)
        logits = nnx.merge(graphdef, state).compute_logits(per_rank_rows(hidden_last, num_reqs, all_positions=True))
        return rejection_sample(logits, draft_token_ids, num_draft_tokens, smd, greedy_only=greedy_only,
                                use_penalties=use_penalties, num_logprobs=max_logprobs)

    def prompt_logprobs_step(state, hidden, packed, *, layout):
        targets = unpack(layout, packed)[4]
        logits = nnx.merge(graphdef, state).compute_logits(hidden)
        return compute_logprobs(logits, targets, max_logprobs)

    def pool_step(state, hidden, hidden_last, packed, carry, *, layout):
        """The pooled output of every request of the step (docs/pooling.md): hidden [DP*T,
        D], hidden_last [DP*Rmax, D] (each request's last token of the step), carry
        [DP*Rmax, D] float32 (what earlier chunks of a request pooled; zeros for a first
        chunk) -> (out [DP*Rmax, O] = pool_head(pooled), partial [DP*Rmax, D] float32, the
        carry of a request whose prompt goes on next step). Rows past a rank's requests
        are padding."""
        _, positions, md, *_ = unpack(layout, packed)
        model = nnx.merge(graphdef, state)
        d = hidden.shape[-1]
        carry = carry.reshape(dp, -1, d)
        rmax = carry.shape[1]
        if pooling_type == "LAST":
            partial = hidden_last.astype(jnp.float32).reshape(dp, rmax, d)
            pooled = partial
        else:
            h = hidden.astype(jnp.float32).reshape(dp, -1, d)
            cu = md.query_start_loc.reshape(dp, -1)  # [DP, Rmax + 1]; past the requests, the total
            if pooling_type == "CLS":
                starts = cu[:, :-1]
                first = jnp.take_along_axis(h, starts[..., None], axis=1)
                at_zero = jnp.take_along_axis(positions.reshape(dp, -1), starts, axis=1) == 0
                partial = jnp.where(at_zero[..., None], first, carry)
                pooled = partial
            else:  # MEAN: the sum so far over the tokens so far (seq_lens: computed + this step's)
                def sums(h_r, cu_r):
                    # Each token's request; padding tokens (past the total) get Rmax: dropped.
                    req = jnp.searchsorted(cu_r[1:], jnp.arange(h_r.shape[0]), side="right")
                    return jax.ops.segment_sum(h_r, req, num_segments=rmax)

                partial = carry + jax.vmap(sums)(h, cu)
                lens = jnp.maximum(md.seq_lens.reshape(dp, rmax), 1).astype(jnp.float32)
                pooled = partial / lens[..., None]
        out = model.pool_head(pooled.reshape(dp * rmax, d))
        return out, partial.reshape(dp * rmax, d)

    # The cache leaves with exactly the sharding it came in with. Left to itself, jit
    # returns an equivalent but differently spelled spec (P() instead of
    # P(None, 'data', None, 'model', None)), and the next call of a bucket compiled
    # with the old spelling lowers it again.
    model_step, sample_step, verify_step, prompt_logprobs_step, pool_step = map(
        products, (model_step, sample_step, verify_step, prompt_logprobs_step, pool_step))
    programs = {
        ModelStepKey: jax.jit(model_step, donate_argnums=(1,), static_argnames=("layout",),
                              out_shardings=(None, None, kv_cache_sharding(mesh, arch))),
        SampleKey: jax.jit(sample_step, static_argnames=("layout", "num_reqs", "use_penalties"),
                           out_shardings=replicated),
        PromptLogprobsKey: jax.jit(prompt_logprobs_step, static_argnames=("layout",), out_shardings=replicated),
        VerifyKey: jax.jit(verify_step, static_argnames=("layout", "num_reqs", "greedy_only", "use_penalties"),
                           out_shardings=replicated),
    }
    if pooling_type is not None:
        programs[PoolKey] = jax.jit(pool_step, static_argnames=("layout",), out_shardings=replicated)
    return programs


class ProgramInputs:
    """The packed layouts of the programs' inputs (one per token bucket, one per request
    bucket and kind of sampler), made once each, and zeroed inputs of their shapes."""

    def __init__(self, input_batch: InputBatch, replicated: NamedSharding, *, dp: int, max_num_reqs: int,
                 rows_per_req: int, max_blocks_per_req: int, num_kv_groups: int, lora: bool = False,
                 mm: bool = False) -> None:
        self.input_batch = input_batch  # rank 0's: the sampling metadata's shapes
        self.lora = lora  # the model step's inputs end with each token's adapter slot
        self.mm = mm  # ... then with each token's encoder-output row + 1 and its M-RoPE positions
        self.replicated = replicated
        self.dp, self.max_num_reqs, self.rows_per_req = dp, max_num_reqs, rows_per_req
        self.num_spec = rows_per_req - 1
        self.max_blocks_per_req, self.num_kv_groups = max_blocks_per_req, num_kv_groups
        self._layouts: dict = {}  # by token bucket / (request bucket, verify)

    def model_layout(self, t: int) -> PackedLayout:
        """Where the model step's inputs of token bucket ``t`` sit in its packed buffer."""
        layout = self._layouts.get(t)
        if layout is None:
            layout = self._layouts[t] = PackedLayout.of(self.model_inputs(t))
        return layout

    def sampler_layout(self, key: SampleKey | VerifyKey) -> PackedLayout:
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

    def static_args(self, key: ProgramKey) -> dict:
        """A program's static arguments: its key's and its inputs' packed layout."""
        if isinstance(key, (ModelStepKey, PromptLogprobsKey, PoolKey)):
            return {**key.static_args(), "layout": self.model_layout(key.num_tokens)}
        if isinstance(key, (SampleKey, VerifyKey)):
            return {**key.static_args(), "layout": self.sampler_layout(key)}
        return key.static_args()

    def abstract_packed(self, layout: PackedLayout) -> jax.ShapeDtypeStruct:
        """The type of a packed buffer on the device (replicated: ModelRunner._put_packed)."""
        return jax.ShapeDtypeStruct((layout.size,), jnp.int32, sharding=self.replicated)

    def model_inputs(self, t: int):
        """Zeroed model-step inputs for token bucket ``t``, every rank's one after the
        other: (input_ids [DP*T], positions [DP*T], AttentionMetadata, logits_indices
        [DP*Rmax*S], prompt logprobs targets [DP*T]), with LoRA the tokens' adapter
        slots [DP*T], and for a vision-language model each token's encoder-output row + 1
        [DP*T] (0: a text token) and its M-RoPE positions [DP*T, 3]. Per-request arrays have the fixed
        maximum sizes (Rmax, Pmax), so the backbone's programs depend on T alone; zeros
        are safe padding (slot 0 is the null block, num_seqs 0 masks every row, adapter
        slot 0 is none)."""
        r, dp = self.max_num_reqs, self.dp
        inputs = (np.zeros(dp * t, np.int32), np.zeros(dp * t, np.int32), self.empty_attention_metadata(t),
                  np.zeros(dp * r * self.rows_per_req, np.int32), np.zeros(dp * t, np.int32))
        if self.lora:
            inputs += (np.zeros(dp * t, np.int32),)
        if self.mm:
            inputs += (np.zeros(dp * t, np.int32), np.zeros((dp * t, 3), np.int32), np.zeros(dp * t, np.int32))
        return inputs

    def empty_attention_metadata(self, t: int) -> AttentionMetadata:
        """Zeroed AttentionMetadata of token bucket ``t``, every rank's one after the other
        (G = the KV cache groups)."""
        r, dp, g = self.max_num_reqs, self.dp, self.num_kv_groups
        return AttentionMetadata(
            slot_mapping=np.zeros((dp * t, g), np.int32), seq_lens=np.zeros(dp * r, np.int32),
            query_start_loc=np.zeros(dp * (r + 1), np.int32),
            block_tables=np.zeros((dp * r, g, self.max_blocks_per_req), np.int32), num_seqs=np.zeros(dp, np.int32),
        )
