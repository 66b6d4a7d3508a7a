"""--runner / --convert / --pooler-config resolved for a model folder into a
PoolerConfig (None: a generative model), vLLM's rules (docs/pooling.md):

- runner "auto": pooling for the architectures that only pool (``*ForSequenceClassification``,
  ``*Model``), generate otherwise; convert "auto": classify for a sequence classifier,
  embed for anything else served by the pooling runner;
- the pooling type and normalization of an embedding model come from its
  sentence-transformers files where present (``modules.json`` -> the Pooling module's
  ``config.json``; a ``Normalize`` module), else the decoder's default: the last token,
  normalized; a classifier pools the last token (as HF's does);
- ``--pooler-config`` (a JSON object) overrides any of them;
- ``--hf-overrides`` ``classifier_from_token`` serves a causal LM as a classifier from
  its lm_head rows (Qwen3-Reranker; resolve_hf_overrides).
"""
from __future__ import annotations

import json
from pathlib import Path

from jaxserve.config import CONVERTS, POOLING_TYPES, RUNNERS, PoolerConfig

# sentence-transformers' Pooling config flags -> our pooling type.
_ST_MODES = {"pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_lasttoken": "LAST"}
_OVERRIDES = ("pooling_type", "normalize", "use_activation", "dimensions")


def sentence_transformers_pooling(folder: Path) -> dict:
    """{"pooling_type", "normalize"} from a sentence-transformers layout ({} without one)."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return {}
    modules = json.loads(modules_file.read_text())
    out = {"normalize": any(m.get("type", "").endswith("Normalize") for m in modules)}
    for m in modules:
        if m.get("type", "").endswith("Pooling"):
            cfg_file = folder / m.get("path", "") / "config.json"
            if cfg_file.is_file():
                cfg = json.loads(cfg_file.read_text())
                modes = [t for flag, t in _ST_MODES.items() if cfg.get(flag)]
                if cfg.get("pooling_mode") in ("cls", "mean", "lasttoken"):  # sentence-transformers >= 5
                    modes = [{"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}[cfg["pooling_mode"]]]
                if len(modes) != 1:
                    raise ValueError(f"{cfg_file}: pooling {modes or 'none'} is not supported "
                                     f"(one of CLS, mean, last token)")
                out["pooling_type"] = modes[0]
    return out


SCORE_FROM_TOKEN_METHODS = ("from_2_way_softmax", "no_post_processing")
_TOKEN_CLASSIFIERS = ("LlamaForSequenceClassification", "Qwen2ForSequenceClassification",
                      "Qwen3ForSequenceClassification")


def resolve_hf_overrides(folder: str | Path, tokenizer: str | None, overrides: dict | None) -> dict | None:
    """vLLM's ``hf_overrides`` as the engine applies them: ``classifier_from_token`` (a
    causal LM served as a classifier whose score head is lm_head rows) resolved to
    ``classifier_from_token_ids`` with the model's tokenizer, and vLLM's defaults filled:
    ``is_original_qwen3_reranker`` means tokens ["no", "yes"] and ``method``
    from_2_way_softmax (one label: lm_head[yes] - lm_head[no], whose sigmoid is the
    softmax probability of "yes"); any other token list defaults to no_post_processing
    (one label per token: the rows themselves). ValueError naming the key otherwise."""
    if not overrides:
        return overrides
    if not isinstance(overrides, dict):
        raise ValueError(f"hf_overrides must be a JSON object, got {type(overrides).__name__}")
    out = dict(overrides)
    if out.get("is_original_qwen3_reranker"):
        out.setdefault("classifier_from_token", ["no", "yes"])
        out.setdefault("method", "from_2_way_softmax")
    tokens = out.get("classifier_from_token")
    if tokens is None:
        return out
    from models.config import read_hf_config

    arch = (read_hf_config(folder, out).get("architectures") or [None])[0]
    if arch not in _TOKEN_CLASSIFIERS:
        raise ValueError(f"hf_overrides: classifier_from_token needs architectures one of {list(_TOKEN_CLASSIFIERS)} "
                         f"(the causal LM served as a classifier), got {arch!r}")
    if not (isinstance(tokens, list) and tokens and all(isinstance(t, str) for t in tokens)):
        raise ValueError(f"hf_overrides: classifier_from_token must be a non-empty list of token strings, got {tokens!r}")
    method = out.setdefault("method", "no_post_processing")
    if method not in SCORE_FROM_TOKEN_METHODS:
        raise ValueError(f"hf_overrides: method must be one of {list(SCORE_FROM_TOKEN_METHODS)}, got {method!r}")
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise ValueError(f"hf_overrides: method from_2_way_softmax needs two classifier_from_token entries "
                         f"([false, true]), got {len(tokens)}")
    from jaxserve.engine.llm_engine import load_tokenizer

    vocab = load_tokenizer(tokenizer or str(folder)).get_vocab()
    missing = [t for t in tokens if t not in vocab]
    if missing:
        raise ValueError(f"hf_overrides: classifier_from_token {missing} are not single tokens of the model's "
                         f"vocabulary")
    out["classifier_from_token_ids"] = [vocab[t] for t in tokens]
    return out


def resolve_pooler_config(folder: str | Path, arch: str, runner: str = "auto", convert: str = "auto",
                          overrides: dict | None = None, hf_overrides: dict | None = None) -> PoolerConfig | None:
    """The PoolerConfig the engine serves ``folder`` with, None for generation (ValueError
    for a combination that cannot work). ``arch``: the architecture it is served as
    (ModelArchConfig.from_pretrained's, which reads a *ForCausalLM over *Model tensors as the *Model).
    ``hf_overrides``: resolve_hf_overrides's, applied on top of config.json."""
    from models.config import read_hf_config
    from models.registry import ENCODER_ARCHITECTURES, POOLING_ARCHITECTURES

    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}")
    if convert not in CONVERTS:
        raise ValueError(f"convert must be one of {', '.join(CONVERTS)}, got {convert!r}")
    folder = Path(folder)
    cfg = read_hf_config(folder, hf_overrides)
    native = POOLING_ARCHITECTURES.get(arch)  # what a pooling-only architecture is for
    if runner == "auto":
        runner = "pooling" if native or convert in ("embed", "classify") or overrides else "generate"
    if runner == "generate":
        if native:
            raise ValueError(f"{arch} is a pooling model (no lm_head); serve it with runner='pooling'")
        if overrides:
            raise ValueError("pooler_config applies to runner='pooling' only")
        return None
    task = native or "embed"
    if convert not in ("auto", "none"):
        task = convert
    if task == "classify" and native != "classify":
        raise ValueError(f"convert='classify' needs a *ForSequenceClassification checkpoint (a score head); "
                         f"{arch} has none")
    if native == "classify" and task != "classify":
        raise ValueError(f"{arch} is a sequence classifier: serve it with convert='classify' (or 'auto')")
    # Decoders pool their last token (it has seen the whole prompt); encoders their first ([CLS]).
    values: dict = {"pooling_type": "CLS" if arch in ENCODER_ARCHITECTURES else "LAST"}
    if task == "embed":
        values |= sentence_transformers_pooling(folder)
    else:
        from models.adapters import num_labels

        values["num_labels"] = num_labels(cfg)
    bad = set(overrides or {}) - set(_OVERRIDES)
    if bad:
        raise ValueError(f"pooler_config: unknown key(s) {sorted(bad)}; allowed: {list(_OVERRIDES)}")
    values |= {k: v for k, v in (overrides or {}).items() if v is not None}
    if isinstance(values.get("pooling_type"), str):
        values["pooling_type"] = values["pooling_type"].upper()
    if values["pooling_type"] not in POOLING_TYPES:
        raise ValueError(f"pooler_config: pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                         f"got {values['pooling_type']!r}")
    dims = cfg.get("matryoshka_dimensions")
    if arch in ENCODER_ARCHITECTURES and task == "classify" and values["pooling_type"] != "CLS":
        raise ValueError(f"{arch}: its classification head reads the first token; pooling_type must be CLS")
    return PoolerConfig(task=task, is_matryoshka=bool(cfg.get("is_matryoshka") or dims),
                        matryoshka_dimensions=tuple(dims) if dims else None, **values)
