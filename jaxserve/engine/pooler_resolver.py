"""--runner / --convert / --pooler-config resolved for a model folder into a
PoolerConfig (None: a generative model), vLLM's rules (docs/pooling.md):

- runner "auto": pooling for the architectures that only pool (``*ForSequenceClassification``,
  ``*Model``), generate otherwise; convert "auto": classify for a sequence classifier,
  embed for anything else served by the pooling runner;
- the pooling type and normalization of an embedding model come from its
  sentence-transformers files where present (``modules.json`` -> the Pooling module's
  ``config.json``; a ``Normalize`` module), else the decoder's default: the last token,
  normalized; a classifier pools the last token (as HF's does);
- ``--pooler-config`` (a JSON object) overrides any of them.
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


def resolve_pooler_config(folder: str | Path, arch: str, runner: str = "auto", convert: str = "auto",
                          overrides: dict | None = None) -> PoolerConfig | None:
    """The PoolerConfig the engine serves ``folder`` with, None for generation (ValueError
    for a combination that cannot work). ``arch``: the architecture it is served as
    (ModelArchConfig.from_pretrained's, which reads a *ForCausalLM over *Model tensors as the *Model)."""
    from models.registry import ENCODER_ARCHITECTURES, POOLING_ARCHITECTURES

    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}")
    if convert not in CONVERTS:
        raise ValueError(f"convert must be one of {', '.join(CONVERTS)}, got {convert!r}")
    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
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
