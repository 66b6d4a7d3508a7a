"""Prometheus metrics with vLLM's names, ``vllm:`` replaced by ``jaxserve:``.

PrometheusStatLogger is fed by the engine thread (AsyncLLM stat logger protocol) and
owns its registry, so several apps in one process never clash."""
from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from jaxserve.engine.stats import EngineStats, IterationStats

# vLLM's buckets.
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0]
_TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                 80.0]
_E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0]
FINISH_REASONS = ("stop", "length", "abort")

# As vLLM does: no `*_created` series next to every counter and histogram.
prometheus_client.disable_created_metrics()


def _token_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (vLLM's build_1_2_5_buckets)."""
    out, exp = [], 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exp
            if v > max_model_len:
                return out
            out.append(v)
        exp += 1


class PrometheusStatLogger:
    def __init__(self, model_name: str, max_model_len: int) -> None:
        self.registry = r = CollectorRegistry()
        lbl = ["model_name"]
        self.gauge_running = Gauge("jaxserve:num_requests_running", "Number of requests in model execution batches.",
                                   lbl, registry=r).labels(model_name)
        self.gauge_waiting = Gauge("jaxserve:num_requests_waiting", "Number of requests waiting to be processed.",
                                   lbl, registry=r).labels(model_name)
        self.gauge_weights_version = Gauge("jaxserve:weights_version",
                                           "Version of the served weights: 0 at start, +1 per weight update.",
                                           lbl, registry=r).labels(model_name)
        self.gauge_kv_usage = Gauge("jaxserve:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                                    lbl, registry=r).labels(model_name)
        self.gauge_prefix_hit_rate = Gauge(
            "jaxserve:gpu_prefix_cache_hit_rate", "Prefix cache hit rate over the most recent requests.",
            lbl, registry=r).labels(model_name)
        self.counter_prefix_queries = Counter(
            "jaxserve:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
            lbl, registry=r).labels(model_name)
        self.counter_prefix_hits = Counter(
            "jaxserve:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
            lbl, registry=r).labels(model_name)
        self.counter_preemptions = Counter("jaxserve:num_preemptions", "Cumulative number of preemptions.",
                                           lbl, registry=r).labels(model_name)
        self.counter_prompt_tokens = Counter("jaxserve:prompt_tokens", "Number of prefill tokens processed.",
                                             lbl, registry=r).labels(model_name)
        self.counter_generation_tokens = Counter("jaxserve:generation_tokens", "Number of generation tokens processed.",
                                                 lbl, registry=r).labels(model_name)
        success = Counter("jaxserve:request_success", "Count of successfully processed requests.",
                          lbl + ["finished_reason"], registry=r)
        self.counter_request_success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        self.hist_ttft = Histogram("jaxserve:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                                   lbl, buckets=_TTFT_BUCKETS, registry=r).labels(model_name)
        self.hist_itl = Histogram("jaxserve:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                                  lbl, buckets=_TPOT_BUCKETS, registry=r).labels(model_name)
        # vLLM's older name for the inter-token latency (same observations).
        self.hist_tpot_legacy = Histogram(
            "jaxserve:time_per_output_token_seconds", "Histogram of time per output token in seconds.",
            lbl, buckets=_TPOT_BUCKETS, registry=r).labels(model_name)
        self.hist_request_tpot = Histogram(
            "jaxserve:request_time_per_output_token_seconds",
            "Histogram of time per output token per request in seconds: (e2e - ttft) / (tokens - 1).",
            lbl, buckets=_TPOT_BUCKETS, registry=r).labels(model_name)
        self.hist_e2e = Histogram("jaxserve:e2e_request_latency_seconds",
                                  "Histogram of e2e request latency in seconds.",
                                  lbl, buckets=_E2E_BUCKETS, registry=r).labels(model_name)
        tb = _token_buckets(max_model_len)
        self.hist_prompt_tokens = Histogram("jaxserve:request_prompt_tokens", "Number of prefill tokens processed.",
                                            lbl, buckets=tb, registry=r).labels(model_name)
        self.hist_generation_tokens = Histogram("jaxserve:request_generation_tokens",
                                                "Number of generation tokens processed.",
                                                lbl, buckets=tb, registry=r).labels(model_name)
        # Per data-parallel rank (label engine="0", "1", ... as vLLM's); the gauges above are the total.
        rank_lbl = ["model_name", "engine"]
        self._model_name = model_name
        self.gauge_rank_running = Gauge("jaxserve:dp_rank_num_requests_running",
                                        "Requests in model execution batches, per data-parallel rank.",
                                        rank_lbl, registry=r)
        self.gauge_rank_waiting = Gauge("jaxserve:dp_rank_num_requests_waiting",
                                        "Requests waiting, per data-parallel rank.", rank_lbl, registry=r)
        self.gauge_rank_kv_usage = Gauge("jaxserve:dp_rank_kv_cache_usage_perc",
                                         "KV-cache usage per data-parallel rank. 1 means 100 percent usage.",
                                         rank_lbl, registry=r)
        # Speculative decoding (vLLM's names); per position: drafts whose token i held.
        self.counter_spec_drafts = Counter("jaxserve:spec_decode_num_drafts", "Number of spec decoding drafts.",
                                           lbl, registry=r).labels(model_name)
        self.counter_spec_draft_tokens = Counter("jaxserve:spec_decode_num_draft_tokens", "Number of draft tokens.",
                                                 lbl, registry=r).labels(model_name)
        self.counter_spec_accepted = Counter("jaxserve:spec_decode_num_accepted_tokens",
                                             "Number of accepted tokens.", lbl, registry=r).labels(model_name)
        self.counter_spec_accepted_per_pos = Counter(
            "jaxserve:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
            lbl + ["position"], registry=r)
        # LoRA (vLLM's lora_requests_info): one sample per (max_lora, waiting, running)
        # label set, its value the time it was last seen; readers take the newest.
        self.gauge_lora_info = Gauge("jaxserve:lora_requests_info", "Running stats on lora requests.",
                                     ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=r)
        self._last_queries = self._last_hits = self._last_preemptions = 0

    def record(self, s: EngineStats, it: IterationStats | None) -> None:
        """Called by the engine thread after each loop iteration."""
        self.set_gauges(s)
        if s.prefix_cache_queries > self._last_queries:
            self.counter_prefix_queries.inc(s.prefix_cache_queries - self._last_queries)
            self._last_queries = s.prefix_cache_queries
        if s.prefix_cache_hits > self._last_hits:
            self.counter_prefix_hits.inc(s.prefix_cache_hits - self._last_hits)
            self._last_hits = s.prefix_cache_hits
        if s.num_preemptions > self._last_preemptions:
            self.counter_preemptions.inc(s.num_preemptions - self._last_preemptions)
            self._last_preemptions = s.num_preemptions
        if it is None:
            return
        if it.spec_decoding is not None and it.spec_decoding.num_drafts:
            sd = it.spec_decoding
            self.counter_spec_drafts.inc(sd.num_drafts)
            self.counter_spec_draft_tokens.inc(sd.num_draft_tokens)
            self.counter_spec_accepted.inc(sd.num_accepted_tokens)
            for pos, n in enumerate(sd.num_accepted_tokens_per_pos):
                self.counter_spec_accepted_per_pos.labels(self._model_name, str(pos)).inc(n)
        if it.num_prompt_tokens:
            self.counter_prompt_tokens.inc(it.num_prompt_tokens)
        if it.num_generation_tokens:
            self.counter_generation_tokens.inc(it.num_generation_tokens)
        for t in it.time_to_first_tokens:
            self.hist_ttft.observe(t)
        for t in it.inter_token_latencies:
            self.hist_itl.observe(t)
            self.hist_tpot_legacy.observe(t)
        for f in it.finished_requests:
            self.counter_request_success[f.finish_reason if f.finish_reason in FINISH_REASONS else "abort"].inc()
            self.hist_e2e.observe(f.e2e_latency)
            self.hist_prompt_tokens.observe(f.num_prompt_tokens)
            self.hist_generation_tokens.observe(f.num_generation_tokens)
            if f.mean_time_per_output_token is not None:
                self.hist_request_tpot.observe(f.mean_time_per_output_token)

    def set_gauges(self, s: EngineStats) -> None:
        if s.max_loras:
            self.gauge_lora_info.labels(str(s.max_loras), ",".join(s.waiting_lora_adapters),
                                        ",".join(s.running_lora_adapters)).set_to_current_time()
        self.gauge_running.set(s.num_running_reqs)
        self.gauge_waiting.set(s.num_waiting_reqs)
        self.gauge_kv_usage.set(s.kv_cache_usage)
        self.gauge_prefix_hit_rate.set(s.prefix_cache_hit_rate)
        for rank, rs in enumerate(s.ranks):
            self.gauge_rank_running.labels(self._model_name, str(rank)).set(rs.num_running_reqs)
            self.gauge_rank_waiting.labels(self._model_name, str(rank)).set(rs.num_waiting_reqs)
            self.gauge_rank_kv_usage.labels(self._model_name, str(rank)).set(rs.kv_cache_usage)
