"""How many draft tokens a step should verify: as many as raise the step's expected
output per second, judged from measured step times.

Verifying d drafts costs d more tokens in the step. Where the step is bound by memory
(small batches; GPUs and TPUs up to large batches) that is nearly free, and where it is
bound by compute (a CPU at batch 64) it can cost more than the accepted drafts give
back. So each step, the candidate drafts are ranked by their chance of being accepted
(draft j of a request with acceptance rate a: a^j, all of drafts 1..j must hold), and
the scheduler keeps the prefix that maximises

    (tokens the step emits without drafts + expected accepted drafts) / step time,

with the step time of a token count looked up in running averages of measured steps,
by token bucket and by whether drafts were verified (verification samples S = k + 1
rows per request). A bucket never measured is estimated from the nearest measured one,
linearly in tokens (as if compute-bound); every EXPLORE_EVERY steps the next bucket up
is tried as if it cost what the base does, and is then judged on its own measured time.
With nothing measured yet every draft is tried.
"""
from __future__ import annotations

from collections.abc import Callable

# Weight of a new measurement in a bucket's running average.
EMA_WEIGHT = 0.2
# Every this many steps with drafts, the next bucket up is tried as if it were free.
EXPLORE_EVERY = 64
# Acceptance rate assumed for a request with no history (pulled toward it with this
# many pseudo-drafts).
PRIOR_ACCEPTANCE = 0.5
PRIOR_WEIGHT = 2.0


class SpecDecodeBudget:
    def __init__(self, token_bucket: Callable[[int], int] | None) -> None:
        self.token_bucket = token_bucket
        self.costs: dict[tuple[int, bool], float] = {}  # (token bucket, verified drafts) -> seconds
        self._num_plans = 0

    def _next_bucket(self, b: int) -> int:
        return self._bucket(min(b + 1, self.token_bucket.max))

    def record(self, num_tokens: int, verified: bool, seconds: float) -> None:
        """One step's measured time (its largest rank's scheduled tokens)."""
        if self.token_bucket is None or num_tokens <= 0:
            return
        key = (self._bucket(num_tokens), verified)
        old = self.costs.get(key)
        self.costs[key] = seconds if old is None else (1 - EMA_WEIGHT) * old + EMA_WEIGHT * seconds

    def _bucket(self, n: int) -> int:
        try:
            return self.token_bucket(n)
        except ValueError:  # past the largest bucket: the largest
            return self.token_bucket(self.token_bucket.max)

    def cost(self, num_tokens: int, verified: bool) -> float | None:
        """Estimated seconds of a step with ``num_tokens`` tokens (None: nothing measured).
        An unmeasured bucket between two measured ones (of the same kind if any) is
        interpolated linearly in tokens; one outside them scales the nearest linearly in
        tokens, as a compute-bound step would. (Scaled from a small bucket, a CPU's
        steps of 2-16 tokens, whose time grows far slower than their tokens, looked too
        dear to ever try: with buckets 1, 2, 4, 8 a step verified one draft where it
        verified four in the 16 bucket.)"""
        b = self._bucket(num_tokens)
        if (b, verified) in self.costs:
            return self.costs[(b, verified)]
        for kind in (verified, not verified):
            known = sorted((k, c) for (k, v), c in self.costs.items() if v == kind)
            if not known:
                continue
            below = [kc for kc in known if kc[0] <= b]
            above = [kc for kc in known if kc[0] > b]
            if below and above:
                (k0, c0), (k1, c1) = below[-1], above[0]
                return c0 + (c1 - c0) * (b - k0) / (k1 - k0)
            k, c = below[-1] if below else above[0]
            return c * b / k
        return None

    @staticmethod
    def acceptance(request) -> float:
        return ((request.num_spec_accepted + PRIOR_WEIGHT * PRIOR_ACCEPTANCE)
                / (request.num_spec_drafted + PRIOR_WEIGHT))

    def plan(self, requests: list, base_tokens: int, base_outputs: int) -> int:
        """Trim the ``requests``' spec_token_ids to the best prefix; returns the drafts
        kept. base_tokens / base_outputs: the step's tokens and emitted tokens without
        drafts (its running requests)."""
        if self.token_bucket is None:
            return sum(len(r.spec_token_ids) for r in requests)
        # A seeded sampling request keeps all its drafts: which positions were drafted
        # decides its random draws, and measured times must not change its output.
        fixed, free = [], []
        for r in requests:
            sp = r.sampling_params
            (fixed if sp.seed is not None and sp.temperature > 0 else free).append(r)
        requests = free
        candidates = []  # (probability the draft is emitted, request)
        for r in requests:
            a = self.acceptance(r)
            p = 1.0
            for _ in r.spec_token_ids:
                p *= a
                candidates.append((p, id(r)))
        num_fixed = sum(len(r.spec_token_ids) for r in fixed)
        if not candidates:
            return num_fixed
        candidates.sort(key=lambda c: -c[0])
        base_cost = self.cost(base_tokens, False)
        if base_cost is None:  # nothing measured yet: try every draft once
            return sum(len(r.spec_token_ids) for r in requests) + num_fixed
        best_d, best_rate = 0, base_outputs / base_cost
        # Now and then the bucket above the base is assumed as cheap as the base's: tried,
        # measured, and kept only if it pays (memory-bound devices verify drafts nearly
        # for free, which the linear estimate would never find out).
        self._num_plans += 1
        base_bucket = self._bucket(base_tokens)
        explore_to = self._next_bucket(base_bucket) if self._num_plans % EXPLORE_EVERY == 0 else base_bucket
        expected = float(base_outputs)
        for d, (p, _) in enumerate(candidates, 1):
            expected += p
            tokens = base_tokens + d
            b = self._bucket(tokens)
            c = self.cost(base_tokens, True) if base_bucket < b <= explore_to else self.cost(tokens, True)
            rate = expected / c
            if rate > best_rate:
                best_d, best_rate = d, rate
        keep: dict[int, int] = {}
        for _, rid in candidates[:best_d]:
            keep[rid] = keep.get(rid, 0) + 1
        for r in requests:  # candidates of a request are ranked in draft order
            r.spec_token_ids = r.spec_token_ids[:keep.get(id(r), 0)]
        return best_d + num_fixed
