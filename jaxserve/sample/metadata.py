"""SamplingMetadata: every request's sampling parameters as arrays (R = request bucket)."""
from __future__ import annotations

from dataclasses import dataclass

import jax


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingMetadata:
    temperature: jax.Array  # [R] f32; 0 = greedy row
    top_k: jax.Array  # [R] int32; 0 = off
    top_p: jax.Array  # [R] f32; 1 = off
    min_p: jax.Array  # [R] f32; 0 = off
    presence_penalty: jax.Array  # [R] f32
    frequency_penalty: jax.Array  # [R] f32
    repetition_penalty: jax.Array  # [R] f32
    seeds: jax.Array  # [R] uint32: the request's seed (a random one when unseeded)
    output_pos: jax.Array  # [R] int32: output tokens so far; folded into the key
    stop_ids_masked: jax.Array  # [R, M] int32: ids banned this step (min_tokens), -1 = none
    token_history: jax.Array  # [R, Lh] int32: prompt + output ids (Lh = 1 when no penalties)
    prompt_lens: jax.Array  # [R] int32
    total_lens: jax.Array  # [R] int32
    # Packed grammar masks (structured outputs): bit t of word t // 32 set = token t
    # allowed; all ones (-1) for unconstrained rows.
    allowed_token_bitmask: jax.Array  # [R, ceil(V/32)] int32
    # logit_bias: [R, K] token ids (-1 = none) and the biases added to their logits [R, K] f32.
    logit_bias_ids: jax.Array | None = None
    logit_bias_values: jax.Array | None = None
