"""SamplingParams: vLLM's sampling knobs, validated on construction.

Choices where vLLM versions differ (see docs/vllm_behaviours.md §13):
- temperature must lie in [0, 2] (OpenAI's range; the newest vLLM rejects > 2);
  0 < temperature < 1e-2 is raised to 1e-2 with a warning (sampling at a lower
  temperature is numerically indistinguishable from greedy anyway).
- greedy sampling (temperature 0) with n > 1 is rejected: the n copies would be
  identical.
- top_k 0 and -1 both mean "disabled"; it is stored as 0.
"""
from __future__ import annotations

import dataclasses
import enum
import math
import warnings
from dataclasses import dataclass, field

_MIN_TEMPERATURE = 1e-2
_INT32_MAX = 2**31 - 1
_MIN_REPETITION_PENALTY, _MAX_REPETITION_PENALTY = 1e-6, 1e6
# logit_bias entries a request may carry: the sampler takes them as a fixed-width input
# ([rows, MAX_LOGIT_BIAS] ids and values), so no request compiles a program of its own.
MAX_LOGIT_BIAS = 300


@dataclass(frozen=True, kw_only=True)
class StructuredOutputsParams:
    """A constraint on the generated text (vLLM's StructuredOutputsParams): exactly one
    of json (a JSON schema, as a dict or its text), json_object (any JSON object),
    regex, choice (one of these strings) or grammar (EBNF / Lark).

    disable_any_whitespace: JSON without optional whitespace (compact output; also
    keeps a weak model from emitting whitespace forever). disable_additional_properties:
    objects whose schema does not say otherwise take no extra keys."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    KINDS = ("json", "regex", "choice", "grammar", "json_object")

    def __post_init__(self) -> None:
        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs: exactly one of json, regex, choice, grammar or json_object must be set, "
                f"got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (object or string), got "
                             f"{type(self.json).__name__}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            object.__setattr__(self, "choice", list(self.choice))

    @property
    def kind(self) -> str:
        """Which constraint: one of KINDS."""
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries everything so far
    DELTA = 1  # every output carries only what is new (streaming)
    FINAL_ONLY = 2  # one output when the request finishes (offline)


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Grammar-constrained decoding (JSON schema, regex, choice, EBNF).
    structured_outputs: StructuredOutputsParams | None = None
    # Token controls (vLLM's): logit_bias adds to the logits of token ids (clamped to
    # OpenAI's [-100, 100]); allowed_token_ids keeps only those ids; bad_words bans words (a
    # multi-token word's last token is banned where the output ends with the rest).
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # Filled in by the engine from the tokenizer / generation config: EOS plus
    # stop_token_ids; the detokenizer holds text back this many characters.
    _all_stop_token_ids: frozenset[int] = field(default=frozenset(), repr=False)
    # bad_words as token id sequences (InputProcessor, with the tokenizer).
    _bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731  (frozen dataclass)
        if self.stop is None:
            set_("stop", [])
        elif isinstance(self.stop, str):
            set_("stop", [self.stop])
        else:
            set_("stop", list(self.stop))
        set_("stop_token_ids", list(self.stop_token_ids or []))
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError("logit_bias must be a mapping of token id to bias, got "
                                 f"{type(self.logit_bias).__name__}.")
            try:  # JSON object keys are strings ("50256": -100, as OpenAI's clients send them)
                bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise ValueError("logit_bias must map integer token ids to numbers.") from None
            if not all(math.isfinite(v) for v in bias.values()):
                raise ValueError("logit_bias values must be finite numbers.")
            # Clamped to [-100, 100], as vLLM's from_optional does (OpenAI's range).
            set_("logit_bias", {k: min(100.0, max(-100.0, v)) for k, v in bias.items()} or None)
        if self.allowed_token_ids is not None:
            set_("allowed_token_ids", list(self.allowed_token_ids))
        if self.bad_words is not None:
            set_("bad_words", [self.bad_words] if isinstance(self.bad_words, str) else list(self.bad_words))
        if self.top_k == -1:
            set_("top_k", 0)
        if self.seed == -1:
            set_("seed", None)
        self._verify_args()
        if 0 < self.temperature < _MIN_TEMPERATURE:
            warnings.warn(
                f"temperature {self.temperature} is below {_MIN_TEMPERATURE}; using {_MIN_TEMPERATURE}",
                stacklevel=3,
            )
            set_("temperature", _MIN_TEMPERATURE)
        if self.temperature == 0.0:
            # Greedy: the sampler takes the argmax; top-p/k/min-p are irrelevant.
            set_("top_p", 1.0)
            set_("top_k", 0)
            set_("min_p", 0.0)
        set_("_all_stop_token_ids", frozenset(self.stop_token_ids) | self._all_stop_token_ids)

    def _verify_args(self) -> None:
        def bad(name: str, rule: str, value) -> ValueError:
            return ValueError(f"{name} must be {rule}, got {value!r}.")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "at least 1", self.n)
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "in [-2, 2]", self.presence_penalty)
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "in [-2, 2]", self.frequency_penalty)
        # The sampler divides / multiplies float32 logits by it: kept where neither overflows.
        if not (math.isfinite(self.repetition_penalty)
                and _MIN_REPETITION_PENALTY <= self.repetition_penalty <= _MAX_REPETITION_PENALTY):
            raise bad("repetition_penalty", f"greater than 0, in [{_MIN_REPETITION_PENALTY:g}, "
                      f"{_MAX_REPETITION_PENALTY:g}]", self.repetition_penalty)
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= 2.0):
            raise bad("temperature", "in [0, 2]", self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]", self.top_p)
        if not isinstance(self.top_k, int) or not 0 <= self.top_k <= _INT32_MAX:  # the sampler's top_k is int32
            raise bad("top_k", f"-1, 0 (disabled) or a positive integer up to {_INT32_MAX}", self.top_k)
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]", self.min_p)
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "an integer", self.seed)
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", "at least 1", self.max_tokens)
        if self.min_tokens < 0:
            raise bad("min_tokens", "at least 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}."
            )
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and v < 0 and v != -1:
                raise bad(name, "non-negative, or -1 for the whole vocabulary", v)
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError("stop must not contain empty strings.")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers.")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are only supported when detokenize is True.")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")
        if self.temperature == 0.0 and self.n > 1:
            raise ValueError("n must be 1 when using greedy sampling (temperature 0).")
        if self.logit_bias:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}.")
            if any(t < 0 for t in self.logit_bias):
                raise ValueError("logit_bias token ids must be non-negative integers.")
        if self.allowed_token_ids is not None and (not self.allowed_token_ids or any(
                not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.allowed_token_ids)):
            raise ValueError("allowed_token_ids must be a non-empty list of non-negative integer token ids.")
        if self.bad_words is not None and any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise ValueError("bad_words must be a list of non-empty strings.")

    @property
    def has_token_mask(self) -> bool:
        """allowed_token_ids or bad_words: the sampler's token bitmask applies to the request."""
        return self.allowed_token_ids is not None or bool(self._bad_words_token_ids)

    @property
    def all_stop_token_ids(self) -> frozenset[int]:
        return self._all_stop_token_ids

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def with_eos(self, eos_token_ids: set[int] | frozenset[int]) -> "SamplingParams":
        """A copy whose all_stop_token_ids also hold the model's EOS ids (for min_tokens)."""
        ids = frozenset(self.stop_token_ids) | frozenset(eos_token_ids)
        return dataclasses.replace(self, _all_stop_token_ids=ids)

    def replace(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)
