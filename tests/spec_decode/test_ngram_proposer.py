"""The n-gram proposer against a brute-force statement of its rule: the longest suffix
of length in [min, max] that occurred earlier, its earliest occurrence, the tokens that
followed it (at most k, and never past max_model_len)."""
import numpy as np
import pytest

from jaxserve.spec_decode.ngram_proposer import NgramProposer


def brute_force(tokens, k, lo, hi, max_model_len):
    n = len(tokens)
    k = min(k, max_model_len - n)
    if k <= 0:
        return []
    for length in range(min(hi, n - 1), lo - 1, -1):
        suffix = list(tokens[n - length:])
        for i in range(n - length):
            if list(tokens[i:i + length]) == suffix:
                return list(tokens[i + length:i + length + k])
    return []


def test_vllm_docstring_example():
    assert NgramProposer(4, 2, 3, 100).propose_one(np.array([1, 2, 3, 4, 2, 3])).tolist() == [4, 2, 3]


@pytest.mark.parametrize("seed", range(4))
def test_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    for _ in range(1500):
        n = int(rng.integers(1, 48))
        tokens = rng.integers(0, int(rng.integers(2, 6)), n)  # small alphabets: many matches
        lo = int(rng.integers(1, 4))
        hi = int(rng.integers(lo, 7))
        k = int(rng.integers(1, 6))
        max_len = int(rng.integers(n, n + 6))
        got = NgramProposer(k, lo, hi, max_len).propose_one(tokens).tolist()
        assert got == brute_force(tokens, k, lo, hi, max_len), (tokens.tolist(), k, lo, hi, max_len)


def test_batch_propose_by_row():
    buf = np.zeros((3, 16), np.int32)
    buf[0, :7] = [1, 2, 3, 9, 9, 1, 2]
    buf[2, :4] = [5, 6, 7, 8]
    p = NgramProposer(2, 2, 2, 16)
    assert p.propose(buf, np.array([7, 0, 4]), [0, 2]) == {0: [3, 9]}  # row 2: no earlier match
