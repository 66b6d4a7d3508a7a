"""Small factories for core tests: requests, schedulers, a fake runner."""
from __future__ import annotations

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.core.kv_cache_utils import get_request_block_hasher
from jaxserve.core.sched.scheduler import Scheduler
from jaxserve.outputs import ModelRunnerOutput
from jaxserve.request import Request
from jaxserve.sampling_params import SamplingParams

EOS = 0


def make_request(req_id, prompt, *, block_size=16, max_tokens=16, hasher=True, priority=0,
                 arrival_time=None, cache_salt=None, lora_request=None, **sp_kwargs) -> Request:
    """prompt: a token list, or an int n for n distinct tokens 1000..1000+n-1."""
    if isinstance(prompt, int):
        prompt = [1000 + i for i in range(prompt)]
    sp = SamplingParams(max_tokens=max_tokens, **sp_kwargs)
    return Request(
        str(req_id), prompt, sp, EOS,
        block_hasher=get_request_block_hasher(block_size) if hasher else None,
        priority=priority, arrival_time=arrival_time, cache_salt=cache_salt, lora_request=lora_request,
    )


def make_scheduler(*, num_blocks=11, block_size=16, max_num_batched_tokens=8192, max_num_seqs=64,
                   max_model_len=8192, enable_prefix_caching=True, long_prefill_token_threshold=0,
                   enable_chunked_prefill=True, policy="fcfs", async_scheduling=False, max_loras=0) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
            max_model_len=max_model_len, long_prefill_token_threshold=long_prefill_token_threshold,
            enable_chunked_prefill=enable_chunked_prefill, policy=policy, async_scheduling=async_scheduling,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        num_blocks,
        check_invariants=True,
        max_loras=max_loras,
    )



def run_step(scheduler, token=7):
    so = scheduler.schedule()
    req_ids = list(so.num_scheduled_tokens)
    sampled = []
    for r in req_ids:
        req = scheduler.requests[r]
        # Partial prefill: the request has not caught up with its tokens yet.
        sampled.append([token] if req.num_computed_tokens >= req.num_tokens else [])
    out = ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)
    return so, scheduler.update_from_output(so, out)


def assert_scheduler_empty(scheduler) -> None:
    assert not scheduler.requests and not scheduler.running and len(scheduler.waiting) == 0
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert not scheduler.kv_cache_manager.req_to_blocks
