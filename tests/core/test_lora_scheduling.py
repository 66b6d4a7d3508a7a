"""LoRA in the scheduler: at most max_loras distinct adapters among the running
requests (the runner's device slots), base-model requests never held back, no
starvation of a waiting adapter, and the adapter in every block hash."""
from factories import make_request, make_scheduler, run_step

from jaxserve.lora import LoRARequest

A, B, C = (LoRARequest(name, i, f"/adapters/{name}") for i, name in enumerate("abc", start=1))


def running_loras(s) -> set:
    return {r.lora_request.lora_name for r in s.running if r.lora_request is not None}


def test_cap_skips_other_adapters_and_keeps_their_order():
    s = make_scheduler(num_blocks=200, max_loras=2)
    for rid, lora in [("a0", A), ("b0", B), ("c0", C), ("base", None), ("c1", C)]:
        s.add_request(make_request(rid, 20, lora_request=lora, max_tokens=3))
    so, _ = run_step(s)
    # a and b take the two slots; c waits, and so does c1 behind it; the base request goes.
    assert set(so.num_scheduled_tokens) == {"a0", "b0", "base"}
    assert [r.request_id for r in s.waiting] == ["c0", "c1"]
    assert s.make_stats().waiting_lora_adapters == {"c": 2}
    assert s.make_stats().running_lora_adapters == {"a": 1, "b": 1}
    for _ in range(20):
        run_step(s)
        assert len(running_loras(s)) <= 2
        if not s.has_requests():
            break
    assert not s.has_requests()


def test_requests_of_running_adapters_do_not_overtake_a_waiting_one():
    """vLLM admits requests of the adapters already running past a waiting adapter's, so
    a steady stream of them starves it; here the running adapter drains first."""
    s = make_scheduler(num_blocks=400, max_loras=1)
    s.add_request(make_request("a0", 20, lora_request=A, max_tokens=4))
    run_step(s)
    s.add_request(make_request("b0", 20, lora_request=B, max_tokens=4))
    admitted_b_at = None
    for step in range(40):
        # A new request for the running adapter every step.
        s.add_request(make_request(f"a{step + 1}", 20, lora_request=A, max_tokens=4))
        so, _ = run_step(s)
        if "b0" in so.num_scheduled_tokens and admitted_b_at is None:
            admitted_b_at = step
        assert len(running_loras(s)) <= 1
    assert admitted_b_at is not None and admitted_b_at <= 5, admitted_b_at


def test_base_requests_are_not_capped():
    s = make_scheduler(num_blocks=200, max_loras=1)
    s.add_request(make_request("a0", 20, lora_request=A))
    s.add_request(make_request("b0", 20, lora_request=B))
    for i in range(5):
        s.add_request(make_request(f"base{i}", 20))
    so, _ = run_step(s)
    assert set(so.num_scheduled_tokens) == {"a0", *(f"base{i}" for i in range(5))}


def test_block_hashes_depend_on_the_adapter():
    prompt = list(range(100, 164))
    hashes = {name: make_request(name, prompt, lora_request=lora).block_hashes
              for name, lora in [("base", None), ("a", A), ("b", B)]}
    assert len(hashes["a"]) == 4
    for x, y in [("base", "a"), ("a", "b"), ("base", "b")]:
        assert not set(hashes[x]) & set(hashes[y]), (x, y)
    # The same name loaded again gets a new id: its old KV is not reused.
    again = LoRARequest("a", 7, A.lora_path)
    assert not set(make_request("a2", prompt, lora_request=again).block_hashes) & set(hashes["a"])
    assert make_request("a3", prompt, lora_request=A).block_hashes == hashes["a"]


def test_prefix_cache_hits_only_under_the_same_adapter():
    s = make_scheduler(num_blocks=200, max_loras=2)
    prompt = list(range(100, 164))
    s.add_request(make_request("a0", prompt, lora_request=A, max_tokens=1))
    for _ in range(3):
        run_step(s)
    reqs = [make_request(rid, prompt, lora_request=lora, max_tokens=1)
            for rid, lora in [("b0", B), ("base", None), ("a1", A)]]
    for r in reqs:
        s.add_request(r)
    run_step(s)
    cached = {r.request_id: r.num_cached_tokens for r in reqs}
    assert cached == {"b0": 0, "base": 0, "a1": 48}, cached
