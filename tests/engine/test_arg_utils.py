"""EngineArgs: one home for every engine setting, its CLI flag and its default."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import pytest

from jaxserve.config import SchedulerConfig
from jaxserve.core.sched.request_queue import SchedulingPolicy
from jaxserve.engine.arg_utils import DEFAULT_MAX_MODEL_LEN, EngineArgs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))


def parse(argv: list[str]) -> argparse.Namespace:
    return EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(argv)


def test_every_field_has_a_flag_with_the_dataclass_default():
    assert EngineArgs.from_cli_args(parse([])) == EngineArgs()
    flags = {a.dest for a in EngineArgs.add_cli_args(argparse.ArgumentParser())._actions}
    assert {f.name for f in dataclasses.fields(EngineArgs)} <= flags


def test_flags_map_to_fields():
    args = EngineArgs.from_cli_args(parse([
        "/m", "--max-model-len", "512", "--no-enable-prefix-caching", "-tp", "2", "--dtype", "bfloat16",
        "--override-generation-config", '{"temperature": 0.5}', "--token-buckets", "16", "64",
        "--scheduling-policy", "priority", "--no-scan-layers", "--enforce-eager"]))
    assert args == EngineArgs(model="/m", max_model_len=512, enable_prefix_caching=False, tensor_parallel_size=2,
                              dtype="bfloat16", override_generation_config={"temperature": 0.5},
                              token_buckets=[16, 64], scheduling_policy="priority", scan_layers=False,
                              enforce_eager=True)
    assert EngineArgs.from_cli_args(parse(["--model", "/x"])).model == "/x"


@pytest.mark.parametrize("argv", [["--dtype", "float8"], ["--attention-backend", "magic"],
                                  ["--override-generation-config", "[1]"], ["--scheduling-policy", "lifo"]])
def test_bad_flags_are_refused(argv):
    with pytest.raises(SystemExit):
        parse(argv)


def test_create_engine_config(tmp_path):
    from hf_factory import make_tiny_hf_model

    path = make_tiny_hf_model(tmp_path / "m", "llama")
    limit = json.loads((path / "config.json").read_text())["max_position_embeddings"]
    config = EngineArgs(model=str(path), max_num_seqs=8, scheduling_policy="priority",
                        scan_layers=False).create_engine_config(progress=False)
    sc, mc = config.scheduler_config, config.model_config
    assert sc.max_model_len == min(limit, DEFAULT_MAX_MODEL_LEN) and sc.max_num_batched_tokens == 2048
    assert sc.max_num_seqs == 8 and sc.policy is SchedulingPolicy.PRIORITY
    assert mc.model == str(path) and mc.served_model_name == str(path) and mc.scan_layers is False
    # Without chunked prefill the step budget is the whole context.
    config = EngineArgs(model=str(path), max_model_len=64, enable_chunked_prefill=False).create_engine_config(
        progress=False)
    assert config.scheduler_config.max_num_batched_tokens == 64
    assert EngineArgs(model=str(path)).create_engine_config(
        progress=False, default_max_model_len=32).scheduler_config.max_model_len == 32
    with pytest.raises(ValueError, match=f"exceeds the model's limit of {limit}"):
        EngineArgs(model=str(path), max_model_len=limit + 1).create_engine_config(progress=False)
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineArgs(model=str(path), dtype="int4").create_engine_config(progress=False)


def test_engine_args_defaults_are_the_config_defaults(tmp_path):
    # Each default is written once, in the config dataclasses: EngineArgs() builds exactly
    # their defaults, except what it resolves from the model.
    from hf_factory import make_tiny_hf_model

    from jaxserve.config import EngineConfig, ModelConfig

    path = make_tiny_hf_model(tmp_path / "m", "llama")
    config = EngineArgs(model=str(path)).create_engine_config(progress=False)
    mc, sc = config.model_config, config.scheduler_config
    assert config == EngineConfig(model_config=ModelConfig(model=mc.model, served_model_name=mc.served_model_name),
                                  scheduler_config=SchedulerConfig(max_model_len=sc.max_model_len))
    # Where the model allows it, even that is the config's default.
    assert SchedulerConfig().max_model_len == DEFAULT_MAX_MODEL_LEN
    assert SchedulerConfig().max_num_batched_tokens == sc.max_num_batched_tokens


def test_scheduler_config_is_the_one_home_of_max_model_len():
    from jaxserve.config import ModelConfig

    assert "max_model_len" in {f.name for f in dataclasses.fields(SchedulerConfig)}
    assert "max_model_len" not in {f.name for f in dataclasses.fields(ModelConfig)}


def test_speculative_config_flag():
    from jaxserve.config import SpeculativeConfig

    args = EngineArgs.from_cli_args(parse(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']))
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    cfg = SpeculativeConfig.from_dict(args.speculative_config)
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (5, 5)  # vLLM's defaults
    assert SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2,
                                        "prompt_lookup_max": 3}).prompt_lookup_min == 3
    for bad, field in [({"method": "eagle", "num_speculative_tokens": 2}, "method"),
                       ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"method": "ngram"}, "num_speculative_tokens"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
                         "prompt_lookup_max": 2}, "prompt_lookup_min"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "typo"),
                       ({"method": "draft_model", "num_speculative_tokens": 2}, "model")]:
        with pytest.raises(ValueError, match=field):
            SpeculativeConfig.from_dict(bad)
