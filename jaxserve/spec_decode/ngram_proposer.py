"""N-gram (prompt lookup) proposer: the context's last n tokens, for the longest n in
[prompt_lookup_min, prompt_lookup_max] that occurred earlier, predict the tokens that
followed that earlier occurrence (the earliest one, as vLLM picks it).

Pure numpy on the runner's token buffer: the earlier positions holding the last token
are the candidates, and their common suffix with the context (capped at
prompt_lookup_max) grows one offset at a time over the candidates only: one pass over
the context plus a few tiny arrays, ~10 us per request at 500 tokens.
"""
from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int,
                 max_model_len: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.max_model_len = max_model_len

    def propose_one(self, tokens: np.ndarray) -> np.ndarray:
        """tokens [N] (prompt + output so far) -> up to k draft tokens (may be empty)."""
        n = len(tokens)
        k = min(self.k, self.max_model_len - n)
        if k <= 0 or n <= self.min_n:
            return tokens[:0]
        max_n = min(self.max_n, n - 1)
        # Earlier occurrences end at i < n - 1 (a token must follow). Candidates share the
        # last token; each offset j keeps those that also match tokens[n - 1 - j]. They
        # stay in ascending order, so the first survivor is the earliest longest match.
        ends = np.flatnonzero(tokens[:n - 1] == tokens[n - 1])
        if len(ends) == 0:
            return tokens[:0]
        best_len, best_end = 1, ends[0]
        for j in range(1, max_n):
            ends = ends[ends >= j]
            ends = ends[tokens[ends - j] == tokens[n - 1 - j]]
            if len(ends) == 0:
                break
            best_len, best_end = j + 1, ends[0]
        if best_len < self.min_n:
            return tokens[:0]
        start = int(best_end) + 1
        return tokens[start:start + k]

    def propose(self, token_ids: np.ndarray, num_tokens: np.ndarray, rows) -> dict[int, list[int]]:
        """token_ids [Rmax, L] (the runner's buffer), num_tokens [Rmax]: the drafts of
        each of ``rows`` that has some, by row."""
        out = {}
        for r in rows:
            d = self.propose_one(token_ids[r, :num_tokens[r]])
            if len(d):
                out[int(r)] = d.tolist()
        return out
