"""InputBatch: the runner's persistent host state for the requests it holds.

Each request lives in a fixed row ("slot") of preallocated numpy arrays from the
step it is first scheduled until it finishes or is preempted, so a step only
writes what changed (the SchedulerOutput diff) and builds its device inputs with
vectorised numpy gathers over the scheduled rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from jaxserve.sample.metadata import SamplingMetadata
from jaxserve.sampling_params import MAX_LOGIT_BIAS, SamplingParams

if TYPE_CHECKING:
    from jaxserve.lora.request import LoRARequest

# Stop ids masked while a request is below min_tokens (EOS + stop_token_ids).
MAX_MASKED_STOP_IDS = 16


@dataclass(slots=True)
class CachedRequestState:
    """What the runner keeps about a request across preemption (its row may go away)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    output_token_ids: list[int] = field(default_factory=list)
    # Prompt positions whose logprobs were already returned: a request resumed after
    # preemption recomputes its prompt, and must not return them twice.
    num_prompt_logprobs_done: int = 0
    lora_request: LoRARequest | None = None  # the adapter it runs with (jaxserve/lora)
    mm: object = None  # its images (jaxserve.multimodal.inputs.MultiModalPrompt), None: text only


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_num_blocks_per_req: int, vocab_size: int,
                 num_kv_cache_groups: int = 1) -> None:
        self.max_num_reqs = max_num_reqs
        self.bitmask_words = (vocab_size + 31) // 32
        self.max_model_len = max_model_len
        n = max_num_reqs
        self.req_ids: list[str | None] = [None] * n
        self.req_id_to_index: dict[str, int] = {}
        self._free_slots = list(range(n - 1, -1, -1))
        # +1: the token sampled at the last position is stored although it gets no KV slot.
        self.token_ids = np.zeros((n, max_model_len + 1), np.int32)
        self.num_tokens = np.zeros(n, np.int32)
        self.num_prompt_tokens = np.zeros(n, np.int32)
        self.num_computed_tokens = np.zeros(n, np.int32)
        # Speculative decoding with a draft model: positions whose draft KV is written.
        self.draft_num_computed = np.zeros(n, np.int32)
        # [n, G, Pmax]: one block table per KV cache group (core/kv_cache_groups.py); the
        # groups' tables have the same length, so one count per request.
        self.block_table = np.zeros((n, num_kv_cache_groups, max_num_blocks_per_req), np.int32)
        self.num_blocks = np.zeros(n, np.int32)
        self.temperature = np.zeros(n, np.float32)
        self.top_k = np.zeros(n, np.int32)
        self.top_p = np.ones(n, np.float32)
        self.min_p = np.zeros(n, np.float32)
        self.presence_penalty = np.zeros(n, np.float32)
        self.frequency_penalty = np.zeros(n, np.float32)
        self.repetition_penalty = np.ones(n, np.float32)
        self.seeds = np.zeros(n, np.uint32)
        self.min_tokens = np.zeros(n, np.int32)
        self.stop_ids = np.full((n, MAX_MASKED_STOP_IDS), -1, np.int32)
        self.wants_prompt_logprobs = np.zeros(n, np.bool_)
        self.wants_logprobs = np.zeros(n, np.bool_)
        # logit_bias: [n, MAX_LOGIT_BIAS] ids (-1: none) and their biases.
        self.has_logit_bias = np.zeros(n, np.bool_)
        self.logit_bias_ids = np.full((n, MAX_LOGIT_BIAS), -1, np.int32)
        self.logit_bias_values = np.zeros((n, MAX_LOGIT_BIAS), np.float32)
        # Token masks of the rows that have one (allowed_token_ids, single-token bad
        # words): row -> packed [W] int32, as the grammar bitmask; and the multi-token
        # bad words, row -> sequences (their last token banned after the rest).
        self.token_masks: dict[int, np.ndarray] = {}
        self.bad_word_seqs: dict[int, list[tuple[int, ...]]] = {}
        self.vocab_size = vocab_size

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    def add_request(self, state: CachedRequestState, num_computed_tokens: int,
                    block_ids: tuple[list[int], ...]) -> int:
        if not self._free_slots:
            raise RuntimeError("InputBatch is full (more running requests than max_num_seqs)")
        i = self._free_slots.pop()
        self.req_ids[i] = state.req_id
        self.req_id_to_index[state.req_id] = i
        tokens = state.prompt_token_ids + state.output_token_ids
        self.token_ids[i, : len(tokens)] = tokens
        self.num_tokens[i] = len(tokens)
        self.num_prompt_tokens[i] = len(state.prompt_token_ids)
        self.num_computed_tokens[i] = num_computed_tokens
        self.draft_num_computed[i] = num_computed_tokens
        self.num_blocks[i] = 0
        self.append_block_ids(i, block_ids)
        sp = state.sampling_params
        self.temperature[i] = sp.temperature
        self.top_k[i] = sp.top_k
        self.top_p[i] = sp.top_p
        self.min_p[i] = sp.min_p
        self.presence_penalty[i] = sp.presence_penalty
        self.frequency_penalty[i] = sp.frequency_penalty
        self.repetition_penalty[i] = sp.repetition_penalty
        self.seeds[i] = state.seed
        self.min_tokens[i] = sp.min_tokens
        # Only needed (and masked) while min_tokens holds them back.
        stop = sorted(sp.all_stop_token_ids) if sp.min_tokens > 0 else []
        assert len(stop) <= MAX_MASKED_STOP_IDS  # InputProcessor rejects more when min_tokens > 0
        self.stop_ids[i] = -1
        self.stop_ids[i, : len(stop)] = stop
        self.wants_prompt_logprobs[i] = sp.prompt_logprobs is not None
        self.wants_logprobs[i] = sp.logprobs is not None
        self._set_token_controls(i, sp)
        return i

    def _set_token_controls(self, i: int, sp: SamplingParams) -> None:
        """Row i's logit_bias, allowed_token_ids and bad_words (SamplingParams)."""
        bias = sp.logit_bias or {}
        self.has_logit_bias[i] = bool(bias)
        self.logit_bias_ids[i] = -1
        self.logit_bias_values[i] = 0.0
        self.logit_bias_ids[i, :len(bias)] = list(bias)
        self.logit_bias_values[i, :len(bias)] = list(bias.values())
        self.token_masks.pop(i, None)
        self.bad_word_seqs.pop(i, None)
        if not sp.has_token_mask:
            return
        allowed = np.ones(self.vocab_size, np.bool_)
        if sp.allowed_token_ids is not None:
            allowed[:] = False
            allowed[sp.allowed_token_ids] = True
        single = [seq[0] for seq in sp._bad_words_token_ids if len(seq) == 1]
        allowed[single] = False
        self.token_masks[i] = pack_token_mask(allowed, self.bitmask_words)
        multi = [seq for seq in sp._bad_words_token_ids if len(seq) > 1]
        if multi:
            self.bad_word_seqs[i] = multi

    def token_mask(self, i: int) -> np.ndarray | None:
        """Row i's packed [W] mask for its next token, None when it has none: its static
        mask, less the last token of every multi-token bad word whose other tokens end
        its output so far."""
        mask = self.token_masks.get(i)
        seqs = self.bad_word_seqs.get(i)
        if not seqs:
            return mask
        out = self.token_ids[i, self.num_prompt_tokens[i]:self.num_tokens[i]]
        bits = (mask if mask is not None else np.full(self.bitmask_words, -1, np.int32)).view(np.uint32).copy()
        for seq in seqs:
            head = seq[:-1]
            if len(out) >= len(head) and tuple(out[len(out) - len(head):].tolist()) == head:
                bits[seq[-1] // 32] &= ~np.uint32(1 << (seq[-1] % 32))
        return bits.view(np.int32)

    def remove_request(self, req_id: str) -> int | None:
        i = self.req_id_to_index.pop(req_id, None)
        if i is None:
            return None
        self.req_ids[i] = None
        self.token_masks.pop(i, None)
        self.bad_word_seqs.pop(i, None)
        self.has_logit_bias[i] = False
        self._free_slots.append(i)
        return i

    def append_block_ids(self, i: int, block_ids: tuple[list[int], ...]) -> None:
        """Append one list of new block ids per KV cache group (all of one length)."""
        n = len(block_ids[0])
        if not n:
            return
        start = self.num_blocks[i]
        self.block_table[i, :, start : start + n] = block_ids
        self.num_blocks[i] = start + n

    def fill_ragged(self, rows: np.ndarray, start: np.ndarray, n: np.ndarray, block_size: int, cu: np.ndarray,
                    input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray):
        """Lay out ``n[i]`` tokens of ``rows[i]`` from position ``start[i]`` one request
        after the other (the ragged layout of a step): fills cu [Rmax+1] (query start
        offsets; past the requests, the total), and the first sum(n) entries of
        input_ids, positions and slot_mapping ([T, G]: each token's slot in every KV
        cache group) (views of the padded step arrays).
        Returns (tok_rows, pos): each token's row and position."""
        num_reqs, total = len(rows), int(n.sum())
        np.cumsum(n, out=cu[1:num_reqs + 1])
        cu[num_reqs + 1:] = total
        tok_req = np.repeat(np.arange(num_reqs), n)
        tok_rows = rows[tok_req]
        pos = (start[tok_req] + np.arange(total) - cu[tok_req]).astype(np.int32)
        input_ids[:total] = self.token_ids[tok_rows, pos]
        positions[:total] = pos
        pages = self.block_table[tok_rows, :, pos // block_size]  # [total, G]
        slot_mapping[:total] = pages * block_size + (pos % block_size)[:, None]
        return tok_rows, pos

    def output_token_ids(self, i: int) -> list[int]:
        return self.token_ids[i, self.num_prompt_tokens[i] : self.num_tokens[i]].tolist()

    def make_sampling_metadata(self, rows: np.ndarray, *, use_penalties: bool, bitmask: bool = True) -> SamplingMetadata:
        """The sampling arrays of ``rows`` ([R] row indices, padded to the request bucket
        with any row: padded rows' samples are dropped). The one place they are built,
        for serving and for the warm-up (whose rows are those of an empty batch).
        Without penalties the token history is a [R, 1] dummy (the penalty-free program
        never reads it). bitmask=False leaves the grammar bitmask out (None): the runner
        sends it only for steps with a constrained row."""
        num_out = self.num_tokens[rows] - self.num_prompt_tokens[rows]
        if use_penalties:
            history, total_lens = self.token_ids[rows], self.num_tokens[rows]
        else:
            history, total_lens = np.zeros((len(rows), 1), np.int32), np.zeros(len(rows), np.int32)
        return SamplingMetadata(
            temperature=self.temperature[rows], top_k=self.top_k[rows], top_p=self.top_p[rows],
            min_p=self.min_p[rows], presence_penalty=self.presence_penalty[rows],
            frequency_penalty=self.frequency_penalty[rows], repetition_penalty=self.repetition_penalty[rows],
            seeds=self.seeds[rows], output_pos=num_out.astype(np.int32),
            # Stop ids are banned only while a request is below min_tokens.
            stop_ids_masked=np.where((num_out < self.min_tokens[rows])[:, None], self.stop_ids[rows],
                                     -1).astype(np.int32),
            token_history=history, prompt_lens=self.num_prompt_tokens[rows], total_lens=total_lens.astype(np.int32),
            # Everything allowed; the runner writes the constrained rows' grammar masks.
            allowed_token_bitmask=np.full((len(rows), self.bitmask_words), -1, np.int32) if bitmask else None,
        )

    def is_greedy(self, rows: np.ndarray) -> bool:
        return bool(np.all(self.temperature[rows] == 0))

    def uses_penalties(self, rows: np.ndarray) -> bool:
        return bool(
            np.any(self.presence_penalty[rows] != 0)
            or np.any(self.frequency_penalty[rows] != 0)
            or np.any(self.repetition_penalty[rows] != 1)
        )


def pack_token_mask(allowed: np.ndarray, words: int) -> np.ndarray:
    """[V] bool -> [words] int32, the grammar bitmask's packing (bit t % 32 of word
    t // 32 set = token t allowed; the bits past V set)."""
    bits = np.ones(words * 32, np.bool_)
    bits[:len(allowed)] = allowed
    packed = np.packbits(bits.reshape(words, 32), axis=1, bitorder="little")  # [W, 4] uint8
    return packed.view("<u4").reshape(words).view(np.int32)
