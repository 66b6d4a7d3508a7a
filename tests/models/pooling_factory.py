"""Tiny random pooling checkpoints (docs/pooling.md): decoders saved as HF's ``*Model``
(embedding models, optionally with a sentence-transformers layout) and
``*ForSequenceClassification`` (classifiers, reward models, cross-encoders)."""
from __future__ import annotations

import json
from pathlib import Path

try:  # tests/models on sys.path (tests/e2e's conftest), or the tests package (tests/server)
    from hf_factory import _write_tokenizer
except ImportError:
    from tests.models.hf_factory import _write_tokenizer

CONFIGS = {"llama": ("LlamaConfig", dict(head_dim=16, rms_norm_eps=1e-5)), "qwen3": ("Qwen3Config", dict(head_dim=16)),
           "qwen2": ("Qwen2Config", {}), "bert": ("BertConfig", {}), "xlmr": ("XLMRobertaConfig", {})}
PREFIXES = {"llama": "Llama", "qwen3": "Qwen3", "qwen2": "Qwen2", "bert": "Bert", "xlmr": "XLMRoberta"}


def make_pooling_model(path: Path, arch: str = "qwen3", head: str = "model", *, num_labels: int = 1,
                       seed: int = 0, vocab: int = 512, layers: int = 2, max_pos: int = 512,
                       st_pooling: str | None = None, st_normalize: bool = True, **config_kw) -> Path:
    """head: "model" (the ``*Model`` decoder, no lm_head) or "classifier"
    (``*ForSequenceClassification`` with ``num_labels``). st_pooling: "mean" / "cls" /
    "lasttoken" writes a sentence-transformers modules.json with that Pooling module
    (and a Normalize module when st_normalize)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config_name, own = CONFIGS[arch]
    encoder = arch in ("bert", "xlmr")
    sizes = dict(type_vocab_size=2 if arch == "bert" else 1) if encoder else dict(num_key_value_heads=2)
    cfg = getattr(transformers, config_name)(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        max_position_embeddings=max_pos, bos_token_id=1, eos_token_id=2, pad_token_id=1 if arch == "xlmr" else 0,
        num_labels=num_labels, **sizes, **own, **config_kw)
    prefix = PREFIXES[arch]
    cls = getattr(transformers, prefix + ("Model" if head == "model" else "ForSequenceClassification"))
    model = cls(cfg)
    with torch.no_grad():  # HF's init (std 0.02) is too flat to tell mistakes apart
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
            elif name.endswith("bias"):
                p.normal_(0, 0.5)
            elif "LayerNorm" in name:  # HF starts them at 1: a mix-up of weight and bias would hide
                p.normal_(1, 0.3)
    model.float().eval().save_pretrained(path)
    _write_tokenizer(path, vocab)
    if arch == "bert" and head == "classifier":
        _bert_pair_template(path)
    if st_pooling:
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        if st_normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                            "type": "sentence_transformers.models.Normalize"})
        (path / "modules.json").write_text(json.dumps(modules))
        (path / "1_Pooling").mkdir(exist_ok=True)
        (path / "1_Pooling" / "config.json").write_text(json.dumps({
            "word_embedding_dimension": 64, "pooling_mode_cls_token": st_pooling == "cls",
            "pooling_mode_mean_tokens": st_pooling == "mean", "pooling_mode_lasttoken": st_pooling == "lasttoken"}))
    return path


def _bert_pair_template(path: Path) -> None:
    """BERT's pair layout on the word tokenizer: ``<s> a </s> b </s>`` with token types
    0 for ``<s> a </s>`` and 1 for ``b </s>`` (as [CLS] / [SEP] in BERT's own)."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> $B:1 </s>:1", special_tokens=[("<s>", 1), ("</s>", 2)])
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                            model_input_names=["input_ids", "token_type_ids", "attention_mask"]).save_pretrained(path)
