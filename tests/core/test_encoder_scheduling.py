"""Images in the scheduler (issue 36): the encoder budget per step, the encoder-output
cache's reuse and eviction, and image hashes in the prefix cache's block hashes."""
from __future__ import annotations

import numpy as np

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.core.encoder_cache_manager import EncoderCacheManager
from jaxserve.core.kv_cache_utils import get_request_block_hasher
from jaxserve.core.sched.scheduler import Scheduler
from jaxserve.multimodal.inputs import MultiModalFeature, MultiModalPrompt
from jaxserve.request import Request
from jaxserve.sampling_params import SamplingParams
from tests.core.factories import assert_scheduler_empty, run_step

IMG = 900


def image_request(req_id, layout, *, hashes, block_size=16, tail_base=1000):
    """layout: text token counts and image lengths alternating, e.g. [3, 20, 2]: 3 text
    tokens, a 20-token image, 2 text tokens; ``hashes``: one per image; ``tail_base``:
    the first id of the text after the first image is tail_base + its index."""
    ids, feats, h = [], [], iter(hashes)
    for k, n in enumerate(layout):
        if k % 2:
            feats.append(MultiModalFeature(len(ids), n, next(h), np.zeros((4 * n, 1), np.float32), (1, 2, 2 * n)))
            ids += [IMG] * n
        else:
            base = 1000 if k == 0 else tail_base
            ids += list(range(base + len(ids), base + len(ids) + n))
    return Request(str(req_id), ids, SamplingParams(max_tokens=2), 0, block_hasher=get_request_block_hasher(block_size),
                   mm=MultiModalPrompt(tuple(feats)))


def scheduler(*, budget_tokens=64, encoder_budget=0, encoder_cache=0, num_blocks=32, whole_images=False):
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget_tokens, max_model_len=512,
                                     max_num_encoder_input_tokens=encoder_budget, encoder_cache_size=encoder_cache,
                                     disable_chunked_mm_input=whole_images),
                     CacheConfig(block_size=16), num_blocks, check_invariants=True)


def test_cache_manager_reuses_then_evicts_oldest_unreferenced():
    m = EncoderCacheManager(10)
    a = m.allocate("a", 4, "r1")
    b = m.allocate("b", 4, "r1")
    assert sorted(a + b) == list(range(8)) and m.num_encoded == 2
    m.release_all("r1", ["a", "b"])
    m.reference("a", "r2")  # a cached image used again: not evictable
    assert m.can_allocate(6) and not m.can_allocate(7)
    c = m.allocate("c", 6, "r3")  # evicts b (unreferenced), keeps a
    assert m.has("a") and not m.has("b") and set(c) >= set(b)
    m.drop("c")
    assert not m.has("c") and len(m.free_rows) == 6 and m.num_encoded == 2


def test_encoder_budget_stops_the_chunk_before_an_image():
    s = scheduler(encoder_budget=20, encoder_cache=40)
    s.add_request(image_request("a", [3, 20, 2], hashes=["x"]))
    s.add_request(image_request("b", [2, 20, 2], hashes=["y"]))
    so, _ = run_step(s)
    # a's image takes the whole encoder budget: b stops before its image (2 text tokens).
    assert list(so.scheduled_encoder_inputs) == ["x"] and so.num_scheduled_tokens == {"a": 25, "b": 2}
    assert so.encoder_rows == {"x": so.scheduled_encoder_inputs["x"][1]}
    so, _ = run_step(s)
    assert list(so.scheduled_encoder_inputs) == ["y"] and so.num_scheduled_tokens["b"] == 22
    while s.has_requests():
        run_step(s)
    assert_scheduler_empty(s)
    assert s.encoder_cache.num_encoded == 2


def test_an_image_shared_by_two_requests_is_encoded_once():
    s = scheduler()
    s.add_request(image_request("a", [3, 20, 2], hashes=["x"]))
    s.add_request(image_request("b", [5, 20, 1], hashes=["x"]))
    so, _ = run_step(s)
    assert list(so.scheduled_encoder_inputs) == ["x"] and set(so.num_scheduled_tokens) == {"a", "b"}
    while s.has_requests():
        run_step(s)
    assert s.encoder_cache.num_encoded == 1 and s.encoder_cache.num_reused == 1
    # Kept after both finished: a later request with the image does not encode it.
    s.add_request(image_request("c", [1, 20, 1], hashes=["x"]))
    so, _ = run_step(s)
    assert not so.scheduled_encoder_inputs and so.encoder_rows["x"]


def test_chunks_through_an_image_encode_it_once():
    s = scheduler(budget_tokens=8, encoder_budget=32)
    s.add_request(image_request("a", [4, 20, 4], hashes=["x"]))
    encodes = []
    while s.has_requests():
        so, _ = run_step(s)
        encodes += list(so.scheduled_encoder_inputs)
        if "a" in so.num_scheduled_tokens and so.num_scheduled_tokens["a"] > 1:
            assert "x" in so.encoder_rows or so.scheduled_encoder_inputs == {}
    assert encodes == ["x"]


def test_block_hashes_carry_the_image_hash():
    a = image_request("a", [3, 20, 9], hashes=["x"])
    b = image_request("b", [3, 20, 9], hashes=["y"])
    c = image_request("c", [3, 20, 9], hashes=["x"])
    assert a.prompt_token_ids == b.prompt_token_ids
    assert a.block_hashes[0] != b.block_hashes[0] and a.block_hashes == c.block_hashes


def test_whole_images_never_split_across_chunks():
    """disable_chunked_mm_input (Gemma 3): a chunk that would end inside an image stops
    before it, and the image goes whole into a later chunk; a second request whose
    image does not fit the rest of the step's budget waits for the next step."""
    s = scheduler(budget_tokens=24, encoder_budget=48, encoder_cache=48, whole_images=True)
    s.add_request(image_request("a", [10, 20, 30], hashes=["x"]))
    s.add_request(image_request("b", [1, 20, 1], hashes=["y"]))
    so, _ = run_step(s)
    # a: 10 text tokens (10 + 20 would pass the budget of 24); b: 1 text token, and its
    # image (20) does not fit the 13 left.
    assert so.num_scheduled_tokens == {"a": 10, "b": 1} and not so.scheduled_encoder_inputs
    so, _ = run_step(s)
    assert so.num_scheduled_tokens == {"a": 24} and list(so.scheduled_encoder_inputs) == ["x"]
    seen = {"a": 34, "b": 1}
    while s.has_requests():
        so, _ = run_step(s)
        for req_id, n in so.num_scheduled_tokens.items():
            start = seen.get(req_id, 0)
            feats = s.requests[req_id].mm.features if req_id in s.requests else ()
            for f in feats:  # no chunk ends strictly inside an image
                assert not (f.offset < start + n < f.end), (req_id, start, n)
            seen[req_id] = start + n
    assert s.encoder_cache.num_encoded == 2


def test_whole_images_resume_a_prefix_hit_inside_an_image():
    """A prefix-cache hit that ends inside an image: b shares a's first block ([0, 16):
    10 text tokens and the image's first 6) but not its second (other text after the
    image [10, 30)); b's first chunk takes the rest of the image whole, with the budget
    it has (20: the image's size, the least the engine allows)."""
    s = scheduler(budget_tokens=20, whole_images=True)
    s.add_request(image_request("a", [10, 20, 20], hashes=["x"]))
    while s.has_requests():
        run_step(s)
    r = image_request("b", [10, 20, 20], hashes=["x"], tail_base=5000)
    s.add_request(r)
    so, _ = run_step(s)
    n = so.num_scheduled_tokens["b"]
    assert r.num_computed_tokens - n == 16 and 16 + n >= 30  # hit: block 0; the chunk reaches past the image
    assert not so.scheduled_encoder_inputs and so.encoder_rows["x"]  # a's encoder output, still cached
