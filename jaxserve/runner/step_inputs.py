"""One step's host inputs: the records a step travels in (RankStep, PreparedStep,
InflightStep) and StepInputBuilder, which turns the ranks' scheduler outputs into the
programs' padded, packed numpy buffers (token bucket T, request bucket R; nothing
touches the device here).
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxserve.core.sched.output import SchedulerOutput
from jaxserve.runner.bucketing import BucketTable
from jaxserve.runner.input_batch import CachedRequestState, InputBatch
from jaxserve.runner.program_key import ModelStepKey, SampleKey, VerifyKey
from jaxserve.runner.programs import ProgramInputs


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
    """One step's host inputs (numpy), from StepInputBuilder.prepare to the runner's
    bookkeeping. T = the token bucket, Rb = the request bucket, each per rank; arrays
    hold the DP ranks' slices one after the other."""

    ranks: list[RankStep]
    model_key: ModelStepKey
    # The model step's inputs packed (ProgramInputs.model_layout): input_ids [DP*T],
    # positions [DP*T], AttentionMetadata, logits_indices [DP*Rmax*S] and the prompt
    # logprobs targets [DP*T] (the token after each position)
    model_buffer: np.ndarray
    sample_key: SampleKey | VerifyKey  # VerifyKey when some request has drafts
    # The sampler's inputs packed (ProgramInputs.sampler_layout): SamplingMetadata [DP*Rb]
    # rows less its two wide arrays, then with a SampleKey the run-time flags [DP*2]
    # (every row greedy, plain) once per rank; with a VerifyKey the drafts [DP*Rb, k]
    # (-1 padded) and their counts [DP*Rb]
    sampler_buffer: np.ndarray
    token_history: np.ndarray | None  # [DP*Rb, L] int32 with penalties, else None
    # [DP*Rb, W] int32 when a row is constrained (a grammar, allowed_token_ids, bad_words), else None
    grammar_bitmask: np.ndarray | None
    logit_bias: tuple[np.ndarray, np.ndarray] | None  # ([DP*Rb, K] ids, -1 none; [DP*Rb, K] f32) or None
    prompt_logprobs: bool  # some row returns prompt logprobs: run their program


@dataclasses.dataclass(slots=True)
class InflightStep:
    """A dispatched step (ModelRunner.dispatch) whose results are not fetched yet."""

    step: PreparedStep
    sampled: tuple  # the sampler's outputs (device arrays)
    prompt_logprobs: tuple | None  # the prompt-logprobs program's outputs, if it ran


class StepInputBuilder:
    """Builds each step's PreparedStep from the ranks' persistent InputBatches (the
    runner's, updated by it before each step)."""

    def __init__(self, input_batches: list[InputBatch], requests: dict[str, CachedRequestState],
                 inputs: ProgramInputs, *, block_size: int) -> None:
        self.input_batches = input_batches
        self.requests = requests  # the runner's, by request id (prompt logprobs already returned)
        self.inputs = inputs
        self.block_size = block_size
        self.dp, self.max_num_reqs = len(input_batches), inputs.max_num_reqs
        self.rows_per_req, self.num_spec = inputs.rows_per_req, inputs.num_spec

    def prepare(self, outputs: list[SchedulerOutput], token_buckets: BucketTable,
                request_buckets: BucketTable, lora_slots: dict[str, int] | None = None) -> PreparedStep:
        """The step's padded host arrays (numpy), ``outputs[r]`` rank r's scheduler
        output. Every rank gets the same buckets: the largest rank's token count and
        request count, each padded to its smallest bucket that fits. ``lora_slots``:
        with LoRA, each scheduled request's adapter slot (0: none; LoRAManager.activate)."""
        t_pad = token_buckets(max(so.total_num_scheduled_tokens for so in outputs))
        r_pad = request_buckets(max(len(so.num_scheduled_tokens) for so in outputs))
        # Written in place: views of the packed buffer.
        model_buffer, (input_ids, positions, md, logits_indices, lp_targets, *extra) = \
            self.inputs.model_layout(t_pad).allocate()
        lora_inputs = extra[:1] if self.inputs.lora else []
        mm_inputs = extra[-3:] if self.inputs.mm else None
        rmax = self.max_num_reqs
        ranks = [list(so.num_scheduled_tokens) for so in outputs]
        rows = [np.fromiter((ib.req_id_to_index[r] for r in ids), np.int64, len(ids))
                for ib, ids in zip(self.input_batches, ranks)]
        greedy = all(ib.is_greedy(r) for ib, r in zip(self.input_batches, rows))
        use_penalties = any(ib.uses_penalties(r) for ib, r in zip(self.input_batches, rows))
        # Rows with a token mask of their own (allowed_token_ids, bad_words) use the bitmask as grammars do.
        token_masked = any(ib.token_masks and any(int(i) in ib.token_masks for i in r)
                           for ib, r in zip(self.input_batches, rows))
        plain = not any(ib.wants_logprobs[r].any() for ib, r in zip(self.input_batches, rows)) and \
            all(so.grammar_bitmask is None for so in outputs) and not token_masked
        rank_steps, smds, any_prompt_logprobs = [], [], False
        grammar = token_masked or any(so.grammar_bitmask is not None for so in outputs)
        biased = any(ib.has_logit_bias[r].any() for ib, r in zip(self.input_batches, rows))
        bias_rows = []
        bitmask = np.full((self.dp * r_pad, self.input_batches[0].bitmask_words), -1, np.int32) if grammar else None
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
            if lora_inputs and lora_slots:
                # Each request's tokens carry its adapter's slot (padding: 0, none).
                per_req = np.fromiter((lora_slots.get(r, 0) for r in req_ids), np.int32, len(req_ids))
                lora_inputs[0][tok][:step.num_scheduled.sum()] = np.repeat(per_req, step.num_scheduled)
            if mm_inputs is not None:
                self._fill_mm(so, req_ids, rws, ib, md.query_start_loc[rank * (rmax + 1):], positions[tok],
                              mm_inputs[0][tok], mm_inputs[1][tok], mm_inputs[2][tok])
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
            if token_masked:  # on top of any grammar's
                for i, row in enumerate(rws):
                    mask = ib.token_mask(int(row)) if int(row) in ib.token_masks else None
                    if mask is not None:
                        bitmask[rank * r_pad + i] &= mask
            if biased:
                bias_rows.append((ib, prow))
        smd = smds[0] if self.dp == 1 else jax.tree.map(lambda *xs: np.concatenate(xs), *smds)
        # Verification keeps its logprobs (one program set; drafts are a minority case).
        sample_key = VerifyKey(r_pad, greedy, use_penalties) if verify else SampleKey(r_pad, use_penalties)
        extra = (drafts, num_drafts) if verify else (np.array([greedy, plain] * self.dp, np.int32),)
        sampler_buffer = self.inputs.sampler_layout(sample_key).pack((dataclasses.replace(smd, token_history=None), extra))
        return PreparedStep(
            ranks=rank_steps, model_key=ModelStepKey(t_pad), model_buffer=model_buffer, sample_key=sample_key,
            sampler_buffer=sampler_buffer, token_history=smd.token_history if use_penalties else None,
            grammar_bitmask=bitmask, prompt_logprobs=any_prompt_logprobs,
            logit_bias=(np.concatenate([ib.logit_bias_ids[r] for ib, r in bias_rows]),
                        np.concatenate([ib.logit_bias_values[r] for ib, r in bias_rows])) if biased else None)

    def _fill_mm(self, so, req_ids, rows, ib: InputBatch, cu, positions, mm_rows, mrope, keys_ahead) -> None:
        """A vision-language model's extra inputs for one rank (views, written in place):
        each image token's encoder-output row + 1 (``so.encoder_rows``; text tokens keep
        0), every token's M-RoPE positions (text: its position on all three axes;
        a prompt's images: jaxserve.multimodal.qwen2_vl.mrope_positions; generated
        tokens: their position + the prompt's delta) and, each image token's count of
        later tokens of its image (Gemma 3's bidirectional images; the scheduler keeps
        an image in one chunk, so those keys are this step's; text keeps 0)."""
        total = int(cu[len(req_ids)])
        mrope[:total] = positions[:total, None]
        for i, req_id in enumerate(req_ids):
            mm = self.requests[req_id].mm
            if mm is None:
                continue
            start, n, base = int(ib.num_computed_tokens[rows[i]]), int(cu[i + 1] - cu[i]), int(cu[i])
            end = start + n
            if mm.mrope_positions is not None:
                table = mm.mrope_positions
                p = np.arange(start, end)
                inside = p < table.shape[1]
                mrope[base:base + n][inside] = table[:, p[inside]].T
                mrope[base:base + n][~inside] = (p[~inside] + mm.mrope_delta)[:, None]
            for f in mm.features:
                lo, hi = max(start, f.offset), min(end, f.end)
                if lo < hi:
                    img_rows = np.asarray(so.encoder_rows[f.mm_hash], np.int32)
                    mm_rows[base + lo - start:base + hi - start] = img_rows[lo - f.offset:hi - f.offset] + 1
                    keys_ahead[base + lo - start:base + hi - start] = f.end - 1 - np.arange(lo, hi)

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

