"""Sampling defaults from a model's generation_config.json (vLLM's --generation-config)."""
import json

import pytest

from jaxserve.config import ModelConfig


def _folder(tmp_path, name, content):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps(content))
    return folder


def test_auto_reads_sampling_fields_only(tmp_path):
    model = _folder(tmp_path, "m", {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.6,
                                    "top_p": 0.95, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.1,
                                    "max_new_tokens": 512, "typical_p": 0.5, "top_a": None})
    cfg = ModelConfig(model=str(model))
    assert cfg.get_diff_sampling_param() == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
                                             "repetition_penalty": 1.1, "max_tokens": 512}


def test_vllm_mode_ignores_the_file_but_keeps_overrides(tmp_path):
    model = _folder(tmp_path, "m", {"temperature": 0.6})
    assert ModelConfig(model=str(model), generation_config="vllm").get_diff_sampling_param() == {}
    cfg = ModelConfig(model=str(model), generation_config="vllm", override_generation_config={"top_k": 5})
    assert cfg.get_diff_sampling_param() == {"top_k": 5}


def test_folder_mode_and_overrides_win(tmp_path):
    model = _folder(tmp_path, "m", {"temperature": 0.6})
    other = _folder(tmp_path, "other", {"temperature": 0.3, "top_p": 0.5})
    cfg = ModelConfig(model=str(model), generation_config=str(other),
                      override_generation_config={"top_p": 0.8, "max_new_tokens": 7})
    assert cfg.get_diff_sampling_param() == {"temperature": 0.3, "top_p": 0.8, "max_tokens": 7}


def test_no_file_or_no_sampling_fields(tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    assert ModelConfig(model=str(bare)).get_diff_sampling_param() == {}
    ids_only = _folder(tmp_path, "ids", {"bos_token_id": 1, "eos_token_id": [2, 3]})
    assert ModelConfig(model=str(ids_only)).get_diff_sampling_param() == {}


def test_bad_values_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="generation_config must be 'auto', 'vllm' or a folder"):
        ModelConfig(model=str(tmp_path), generation_config=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"override_generation_config: unknown field\(s\) \['temprature'\]"):
        ModelConfig(model=str(tmp_path), override_generation_config={"temprature": 0.5})
