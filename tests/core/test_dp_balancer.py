"""Data-parallel routing (core/sched/dp_balancer.py): least loaded rank, prefix hits preferred."""
from factories import make_request, make_scheduler, run_step

from jaxserve.core.sched.dp_balancer import choose_rank, rank_load


def test_least_loaded_rank_wins_and_ties_go_low():
    ranks = [make_scheduler(num_blocks=64) for _ in range(3)]
    assert choose_rank(ranks, make_request("a", 40)) == 0  # all empty: the lowest rank
    ranks[0].add_request(make_request("a", 40))
    ranks[1].add_request(make_request("b", 10))
    assert [rank_load(s) for s in ranks] == [40, 10, 0]
    assert choose_rank(ranks, make_request("c", 5)) == 2
    ranks[2].add_request(make_request("c", 25))
    assert choose_rank(ranks, make_request("d", 5)) == 1  # 10 < 25 < 40


def test_prefix_hit_outweighs_a_small_load_difference():
    ranks = [make_scheduler(num_blocks=64) for _ in range(2)]
    shared = list(range(100, 164))  # 64 tokens: 4 full blocks
    ranks[1].add_request(make_request("warm", shared + [1], max_tokens=1))
    while ranks[1].requests:
        run_step(ranks[1])  # prefill, then finish: its blocks stay cached
    ranks[1].add_request(make_request("busy", 20))  # rank 1 is now busier by 20 tokens
    # Same 64-token prefix, cached on rank 1: 64 tokens saved there, more than its extra 20.
    assert choose_rank(ranks, make_request("x", shared + [2, 3])) == 1
    # A prompt that shares nothing goes to the idle rank.
    assert choose_rank(ranks, make_request("y", 30)) == 0
    # Much busier than the hit is worth: the idle rank wins after all.
    ranks[1].add_request(make_request("busier", 200))
    assert choose_rank(ranks, make_request("z", shared + [4])) == 0
