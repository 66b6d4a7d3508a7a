"""Convert a llama-architecture GGUF file into an HF-style model folder.

The runtime must not need torch, so this reads the file with `gguf`, dequantizes with
numpy, and builds the tokenizer with the `tokenizers` library straight from the GGUF
metadata. The result is a folder that both our JAX loader and `transformers` read:

    config.json, generation_config.json, model.safetensors (float32),
    tokenizer.json, tokenizer_config.json (with the chat template)

`convert_gguf_to_hf` is the entry point; `jaxserve convert GGUF_FILE OUT_DIR` calls it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from models.atomic_folder import write_folder_atomically

__all__ = ["convert_gguf_to_hf", "CONVERTER_VERSION", "MARKER_FILE"]

# Bumped whenever the output of the conversion changes, so cached folders made by an
# older converter are recognisably stale (see models/default_model.py).
# 2: generation_config.json may carry sampling defaults (generation_defaults).
# 3: the tokenizer adds BOS / EOS when the GGUF asks for it.
CONVERTER_VERSION = 3

# Written last inside the folder; its presence means "this folder is a complete conversion".
MARKER_FILE = "jaxserve_conversion.json"

# llama.cpp token_type values (gguf.TokenType): CONTROL tokens are the special tokens
# (<|im_start|>, <|endoftext|>, ...); USER_DEFINED ones are added tokens matched whole
# in the text but not special.
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# GGUF tensor name -> HF name. Layer tensors are "blk.{i}.<suffix>".
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}

# How llama.cpp pre-tokenizes for each `tokenizer.ggml.pre` value (llama-vocab.cpp).
# "digits": every digit is its own pre-token, then the GPT-2 split (SmolLM/StarCoder
# vocabularies were trained that way and have no multi-digit tokens).
_GPT2_PRE = {"default", "gpt2", "mpt", "olmo", "jais"}
_DIGITS_GPT2_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_LLAMA3_PRE = {"llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3"}
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# ----------------------------------------------------------------------------- metadata


def _fields(reader) -> dict[str, Any]:
    """All scalar/array metadata as Python values (strings decoded, arrays as lists)."""
    out = {}
    for key, field in reader.fields.items():
        if not field.data:  # e.g. an empty array
            out[key] = []
            continue
        out[key] = field.contents()
    return out


def _config_from_metadata(md: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    arch = md.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"only llama-architecture GGUF files are supported, this one is {arch!r}")

    def get(key: str, default: Any = None) -> Any:
        value = md.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden = int(get("embedding_length"))
    n_heads = int(get("attention.head_count"))
    n_kv = int(get("attention.head_count_kv", n_heads))
    head_dim = int(md.get(f"{arch}.attention.key_length", hidden // n_heads))
    rope_dims = int(md.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ValueError(f"partial rotary embeddings ({rope_dims} of {head_dim} dims) are not supported")
    if md.get(f"{arch}.rope.scaling.type") not in (None, "none") or "rope_freqs.weight" in tensor_names:
        # Llama 3.1-style frequency scaling would need rope_scaling in config.json; not needed yet.
        raise ValueError("GGUF files with rope scaling are not supported")
    n_vocab = len(md["tokenizer.ggml.tokens"])
    vocab_size = int(md.get(f"{arch}.vocab_size", n_vocab))

    def token_id(name: str) -> int | None:
        value = md.get(f"tokenizer.ggml.{name}_token_id")
        return int(value) if value is not None else None

    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rope_theta": float(md.get(f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        # The file stores float32; round-trip through repr of a float32 gives 1e-05, not 9.99...e-06.
        "rms_norm_eps": float(np.format_float_positional(np.float32(get("attention.layer_norm_rms_epsilon")))),
        "vocab_size": vocab_size,
        "max_position_embeddings": int(get("context_length")),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": token_id("bos"),
        "eos_token_id": token_id("eos"),
        "pad_token_id": token_id("padding"),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "torch_dtype": "float32",
        "use_cache": True,
    }


# ----------------------------------------------------------------------------- weights


def _unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of a Q or K projection.

    HF's rotary embedding pairs dimension j with j + head_dim/2 ("rotate half"); llama.cpp
    pairs adjacent dimensions (2j, 2j+1). Its converter therefore reorders each head's
    output rows from [first half, second half] into interleaved pairs. Per head, GGUF row
    2j+k holds HF row k*half + j, so splitting rows as (head, j, k) and swapping j/k back
    restores HF order.
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{int(parts[1])}.{_LAYER_TENSORS[parts[2]]}"
    raise ValueError(f"unexpected tensor {gguf_name!r} in a llama GGUF file")


def _dequantize(tensor) -> np.ndarray:
    from gguf.quants import dequantize

    # GGUF shapes are listed innermost-first (ne0 = input features), so the numpy array
    # (rows = output features) already has HF's [out_features, in_features] layout.
    arr = dequantize(tensor.data, tensor.tensor_type)
    expected = tuple(int(d) for d in reversed(tensor.shape))
    return np.ascontiguousarray(arr, dtype=np.float32).reshape(expected)


def _convert_weights(reader, config: dict[str, Any], progress: bool) -> dict[str, np.ndarray]:
    from tqdm.auto import tqdm

    n_heads = config["num_attention_heads"]
    n_kv = config["num_key_value_heads"]
    out: dict[str, np.ndarray] = {}
    for tensor in tqdm(reader.tensors, desc="Converting GGUF tensors", unit="tensor", disable=not progress):
        name = _hf_name(tensor.name)
        arr = _dequantize(tensor)
        if name.endswith("self_attn.q_proj.weight"):
            arr = _unpermute_rope_rows(arr, n_heads)
        elif name.endswith("self_attn.k_proj.weight"):
            arr = _unpermute_rope_rows(arr, n_kv)
        out[name] = arr

    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(config["num_hidden_layers"]):
        expected |= {f"model.layers.{i}.{suffix}" for suffix in _LAYER_TENSORS.values()}
    if missing := sorted(expected - out.keys()):
        raise ValueError(f"GGUF file lacks tensors for: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    emb = out["model.embed_tokens.weight"]
    if emb.shape != (config["vocab_size"], config["hidden_size"]):
        raise ValueError(f"token embedding has shape {emb.shape}, config says "
                         f"({config['vocab_size']}, {config['hidden_size']})")
    return out


# ----------------------------------------------------------------------------- tokenizer


def _pre_tokenizer(pre: str | None):
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre is None or pre in _GPT2_PRE:
        return byte_level
    if pre in _DIGITS_GPT2_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _LLAMA3_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ])
    # Guessing would silently produce different token ids than the model was trained on.
    raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}")


def _build_tokenizer(md: dict[str, Any]):
    """A byte-level BPE `tokenizers.Tokenizer` equivalent to llama.cpp's for this vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    kind = md.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"only byte-level BPE (tokenizer.ggml.model = gpt2) is supported, got {kind!r}")
    tokens: list[str] = list(md["tokenizer.ggml.tokens"])
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("GGUF vocabulary has duplicate tokens")
    # Byte-level tokens never contain a real space (it is spelled "Ġ"), so the single
    # space in each merge line is the separator.
    merges = [tuple(m.split(" ")) for m in md.get("tokenizer.ggml.merges", [])]
    if any(len(m) != 2 for m in merges):
        raise ValueError("malformed merge in GGUF metadata")

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(md.get("tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    # trim_offsets=False keeps offsets covering the leading "Ġ" space, like GPT-2's tokenizer.json.
    post = [processors.ByteLevel(trim_offsets=False)]
    # llama.cpp adds BOS / EOS when the GGUF says so (Llama 3's <|begin_of_text|>); the
    # tokenizer must do it itself: tokenizer_config's add_bos_token does not reach a
    # tokenizer.json-only fast tokenizer.
    def added(which: str) -> list[tuple[str, int]]:
        token_id = md.get(f"tokenizer.ggml.{which}_token_id")
        if not md.get(f"tokenizer.ggml.add_{which}_token", False) or token_id is None:
            return []
        return [(tokens[int(token_id)], int(token_id))]

    bos, eos = added("bos"), added("eos")
    if bos or eos:
        b, e = [t for t, _ in bos], [t for t, _ in eos]
        single = " ".join(b + ["$A"] + e)
        pair = " ".join(b + ["$A"] + e + [f"{t}:1" for t in b] + ["$B:1"] + [f"{t}:1" for t in e])
        post.append(processors.TemplateProcessing(single=single, pair=pair, special_tokens=list(dict(bos + eos).items())))
    tok.post_processor = post[0] if len(post) == 1 else processors.Sequence(post)

    token_types = list(md.get("tokenizer.ggml.token_type", []))
    special = [t for t, ty in zip(tokens, token_types) if ty == _TOKEN_CONTROL]
    user = [t for t, ty in zip(tokens, token_types) if ty == _TOKEN_USER_DEFINED]
    # Added tokens keep their vocabulary ids because they are already in the vocab.
    if special:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    if user:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return tok


def _tokenizer_config(md: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    tokens = md["tokenizer.ggml.tokens"]

    def spelled(token_id: int | None) -> str | None:
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    unk = md.get("tokenizer.ggml.unknown_token_id")
    out = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": spelled(config["bos_token_id"]),
        "eos_token": spelled(config["eos_token_id"]),
        "pad_token": spelled(config["pad_token_id"]),
        "unk_token": spelled(int(unk)) if unk is not None else None,
        "add_bos_token": bool(md.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(md.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    if template := md.get("tokenizer.chat_template"):
        out["chat_template"] = template
    return out


# ----------------------------------------------------------------------------- entry point


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_folder(gguf_path: Path, folder: Path, progress: bool, generation_defaults: dict[str, Any]) -> None:
    import gguf
    from safetensors.numpy import save_file

    reader = gguf.GGUFReader(str(gguf_path))
    md = _fields(reader)
    config = _config_from_metadata(md, {t.name for t in reader.tensors})

    # Tokenizer first: it is cheap and fails fast on an unsupported vocabulary.
    _build_tokenizer(md).save(str(folder / "tokenizer.json"))
    _write_json(folder / "tokenizer_config.json", _tokenizer_config(md, config))

    tensors = _convert_weights(reader, config, progress)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    # safetensors writes through a private temp file (mode 0600); make it readable like the rest.
    os.chmod(folder / "model.safetensors", 0o644)
    del tensors

    _write_json(folder / "config.json", config)
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    if config["pad_token_id"] is not None:
        generation["pad_token_id"] = config["pad_token_id"]
    generation.update(generation_defaults)
    _write_json(folder / "generation_config.json", generation)
    _write_json(folder / MARKER_FILE, {
        "converter_version": CONVERTER_VERSION,
        "source": gguf_path.name,
        "source_size": gguf_path.stat().st_size,
    })


def convert_gguf_to_hf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *,
                       progress: bool = True, overwrite: bool = False,
                       generation_defaults: dict[str, Any] | None = None) -> Path:
    """Convert a llama GGUF file into an HF-style folder at `out_dir` and return its path.

    Weights are dequantized to float32. The folder appears atomically: everything is
    written into a temporary sibling which is renamed into place at the end, so a crash
    never leaves a half-written `out_dir`. An existing non-empty `out_dir` is an error
    unless `overwrite` is set. `generation_defaults` (e.g. {"temperature": 0.2}) go into
    generation_config.json: a GGUF file carries no sampling recommendations of its own.
    """
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    return write_folder_atomically(
        out_dir, lambda tmp: _write_folder(gguf_path, tmp, progress, generation_defaults or {}), overwrite=overwrite)
