"""SpecDecodeBudget: which drafts a step verifies, from measured step times."""
from types import SimpleNamespace

from jaxserve.core.sched.spec_budget import SpecDecodeBudget
from jaxserve.runner.bucketing import BucketTable


def req(drafts=4, accepted=0.0, drafted=0.0, seed=None, temperature=0.0):
    return SimpleNamespace(spec_token_ids=list(range(100, 100 + drafts)), num_spec_accepted=accepted,
                           num_spec_drafted=drafted, sampling_params=SimpleNamespace(seed=seed,
                                                                                     temperature=temperature))


def budget(costs):
    b = SpecDecodeBudget(BucketTable((16, 32, 64, 128, 256, 512)))
    for (tokens, verified), seconds in costs.items():
        b.record(tokens, verified, seconds)
    return b


def test_nothing_measured_tries_every_draft():
    rs = [req() for _ in range(4)]
    assert SpecDecodeBudget(BucketTable((16, 64))).plan(rs, 4, 4) == 16
    assert all(len(r.spec_token_ids) == 4 for r in rs)


def test_compute_bound_big_batch_drops_drafts():
    # 64 decodes fill bucket 64; drafts push to 256-512 tokens at 4x-8x the time.
    b = budget({(64, False): 0.5, (64, True): 0.6, (256, True): 2.0, (512, True): 4.0, (128, True): 1.2})
    rs = [req(accepted=7, drafted=10) for _ in range(64)]
    assert b.plan(rs, 64, 64) == 0 and all(r.spec_token_ids == [] for r in rs)


def test_free_padding_and_memory_bound_keep_drafts():
    # 60 decodes: bucket 64 has 4 free slots, and verifying costs about the same there.
    b = budget({(64, False): 0.5, (64, True): 0.52, (128, True): 1.5, (256, True): 3.0, (512, True): 6.0})
    rs = [req(accepted=9, drafted=10) for _ in range(60)]
    assert b.plan(rs, 60, 60) == 4
    assert sum(len(r.spec_token_ids) for r in rs) == 4 and max(len(r.spec_token_ids) for r in rs) == 1
    # One request (a batch of 1): its 4 drafts fit bucket 16's padding.
    b = budget({(16, False): 0.1, (16, True): 0.11})
    rs = [req()]
    assert b.plan(rs, 1, 1) == 4


def test_prefers_likely_drafts_and_explores_the_base_cost():
    b = budget({(16, False): 0.1, (16, True): 0.1, (32, True): 0.3})
    good, bad = req(accepted=9.5, drafted=10), req(accepted=0, drafted=10)
    # 2 decodes + up to 14 drafts stay in bucket 16: all kept (free). Past it, 3x the time.
    assert b.plan([good, bad], 2, 2) == 8
    good, bad = req(drafts=10, accepted=9.5, drafted=10), req(drafts=10, accepted=0, drafted=10)
    b.plan([good, bad], 2, 2)
    assert len(good.spec_token_ids) == 10 and len(bad.spec_token_ids) == 4  # 16 tokens: good first
    # Only (64, verified) measured: the base is estimated from it, bucket 128 linearly
    # (twice the time) for drafts accepted half the time: none.
    b = budget({(64, True): 0.5})
    rs = [req() for _ in range(64)]
    assert b.plan(rs, 64, 64) == 0


def test_explores_the_next_bucket_now_and_then():
    from jaxserve.core.sched.spec_budget import EXPLORE_EVERY

    b = budget({(64, False): 0.5, (64, True): 0.5})
    kept = []
    for _ in range(EXPLORE_EVERY):
        rs = [req(accepted=8, drafted=10) for _ in range(64)]
        kept.append(b.plan(rs, 64, 64))
    # Bucket 128 (unmeasured) is estimated at twice bucket 64: skipped, except on the
    # exploring step, where it counts as free and its 64 slots take the 64 likeliest drafts.
    assert kept[:-1] == [0] * (EXPLORE_EVERY - 1) and kept[-1] == 64
    b.record(128, True, 0.55)  # measured: nearly free (a memory-bound device), so drafts stay
    assert b.plan([req(accepted=8, drafted=10) for _ in range(64)], 64, 64) == 64


def test_seeded_sampling_keeps_its_drafts():
    b = budget({(64, False): 0.5, (512, True): 4.0})
    seeded, greedy = req(seed=1, temperature=0.8), req()
    b.plan([seeded, greedy] + [req() for _ in range(62)], 64, 64)
    assert len(seeded.spec_token_ids) == 4 and greedy.spec_token_ids == []


def test_an_unmeasured_bucket_between_measured_ones_is_interpolated():
    """Between two measurements the cost is interpolated in tokens; outside them it
    scales the nearest (a CPU's small buckets cost far less than linear between 1 and
    16 tokens, so scaling up from the smallest would never try the others)."""
    b = SpecDecodeBudget(BucketTable((1, 2, 4, 8, 16)))
    b.record(4, True, 0.04)
    b.record(16, True, 0.10)
    assert abs(b.cost(8, True) - 0.06) < 1e-12
    assert abs(b.cost(2, True) - 0.02) < 1e-12  # below every measurement: scaled
    assert abs(b.cost(16, False) - 0.10) < 1e-12  # the other kind's measurement of the bucket
    # Two requests, one draft each measured at bucket 4: bucket 8 (two drafts each) is
    # worth it at the interpolated cost when the drafts are likely.
    b.record(2, False, 0.035)
    rs = [req(accepted=9, drafted=10) for _ in range(2)]
    assert b.plan(rs, 2, 2) >= 4
