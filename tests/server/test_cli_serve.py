"""`serve` argument parsing and run_serve's wiring (uvicorn.run replaced by a probe)."""
from __future__ import annotations

import argparse

import pytest

from server.cli_serve import add_serve_parser, run_serve


def parse(argv):
    parser = argparse.ArgumentParser(prog="jaxserve")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_serve_arguments():
    args = parse(["serve"])
    assert args.model is None and args.port == 8000 and args.host == "127.0.0.1"
    assert args.enable_prefix_caching is True and args.func is run_serve
    # A server compiles its larger steps while it serves, unless told otherwise.
    assert args.background_warmup is True and parse(["serve", "--no-background-warmup"]).background_warmup is False
    args = parse(["serve", "/some/model", "--host", "0.0.0.0", "--port", "9001", "--max-model-len", "512",
                  "--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--served-model-name", "m",
                  "--dtype", "bfloat16", "--tensor-parallel-size", "2", "--api-key", "k", "--disable-log-requests",
                  "--block-size", "32", "--no-enable-prefix-caching", "--gpu-memory-utilization", "0.5",
                  "--num-gpu-blocks-override", "100", "--kv-cache-memory", "1000000", "--seed", "3",
                  "--attention-backend", "reference", "--max-logprobs", "5"])
    assert (args.model, args.host, args.port, args.max_model_len, args.max_num_seqs) == \
        ("/some/model", "0.0.0.0", 9001, 512, 8)
    assert (args.max_num_batched_tokens, args.served_model_name, args.dtype, args.tensor_parallel_size) == \
        (256, "m", "bfloat16", 2)
    assert args.api_key == "k" and args.disable_log_requests and args.block_size == 32
    assert args.enable_prefix_caching is False and args.gpu_memory_utilization == 0.5
    assert (args.num_gpu_blocks_override, args.kv_cache_memory, args.seed) == (100, 1_000_000, 3)
    assert args.attention_backend == "reference" and args.max_logprobs == 5
    with pytest.raises(SystemExit):
        parse(["serve", "--attention-backend", "magic"])


def test_serve_tool_and_reasoning_flags():
    args = parse(["serve"])
    assert not args.enable_auto_tool_choice and args.tool_call_parser is None and args.chat_template is None
    assert not args.enable_tokenizer_info_endpoint and args.reasoning_parser is None
    args = parse(["serve", "m", "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser",
                  "qwen3", "--chat-template", "t.jinja", "--enable-tokenizer-info-endpoint"])
    assert args.enable_auto_tool_choice and args.tool_call_parser == "hermes" and args.reasoning_parser == "qwen3"
    assert args.chat_template == "t.jinja" and args.enable_tokenizer_info_endpoint
    assert parse(["serve", "--tool-call-parser", "llama3_json"]).tool_call_parser == "llama3_json"
    with pytest.raises(SystemExit):
        parse(["serve", "--tool-call-parser", "magic"])
    # --enable-auto-tool-choice without a parser stops before the engine is built.
    with pytest.raises(SystemExit, match="--tool-call-parser"):
        run_serve(parse(["serve", "/no/such/model", "--enable-auto-tool-choice"]))


def test_run_serve_wiring(tiny_model_dir, monkeypatch):
    """run_serve builds the engine from the flags and hands uvicorn a working app."""
    from starlette.testclient import TestClient

    import server.lifecycle

    seen = {}

    def fake_serve(app, async_llm, *, host, port, **kwargs):
        seen.update(host=host, port=port, shutdown_timeout=kwargs["shutdown_timeout"])
        with TestClient(app) as c:
            seen["models"] = c.get("/v1/models", headers={"Authorization": "Bearer k"}).json()
            seen["unauthorized"] = c.get("/v1/models").status_code
            seen["completion"] = c.post("/v1/completions", headers={"Authorization": "Bearer k"},
                                        json={"prompt": "w5 w6", "max_tokens": 2, "temperature": 0}).json()
            # The API key guards the tokenizer routes too (server/limits.py; vLLM leaves them open).
            seen["tokenizer_info"] = (c.get("/tokenizer_info").status_code,
                                      c.get("/tokenizer_info", headers={"Authorization": "Bearer k"}).status_code)
            seen["tools"] = c.post("/v1/chat/completions", headers={"Authorization": "Bearer k"}, json={
                "messages": [{"role": "user", "content": "w5"}], "max_tokens": 2,
                "tools": [{"type": "function", "function": {"name": "f"}}]}).status_code
        async_llm.shutdown()
        return 0

    monkeypatch.setattr(server.lifecycle, "serve", fake_serve)
    run_serve(parse(["serve", str(tiny_model_dir), "--port", "9123", "--max-model-len", "128", "--max-num-seqs", "4",
                     "--max-num-batched-tokens", "32", "--kv-cache-memory", str(2 << 20), "--served-model-name",
                     "tiny-cli", "--api-key", "k", "--enforce-eager", "--max-logprobs", "3",
                     "--enable-tokenizer-info-endpoint", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]))
    assert seen["port"] == 9123 and seen["unauthorized"] == 401
    card = seen["models"]["data"][0]
    assert card["id"] == "tiny-cli" and card["max_model_len"] == 128
    assert seen["completion"]["usage"]["completion_tokens"] == 2
    assert seen["tokenizer_info"] == (401, 200) and seen["tools"] == 200  # tool_choice "auto" allowed by the flags
