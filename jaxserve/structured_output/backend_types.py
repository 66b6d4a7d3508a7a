"""The interface every grammar engine (xgrammar, llguidance) implements.

A backend turns a request's StructuredOutputsParams into a grammar: validated
cheaply when the request arrives (no tokenizer work, so a bad schema is a 400 at
once), compiled against the tokenizer later on a worker thread. A grammar is one
request's matcher: it advances by the accepted tokens and writes the next-token
bitmask row (bit t of word t // 32 set = token t allowed).
"""
from __future__ import annotations

import abc

import numpy as np

from jaxserve.sampling_params import StructuredOutputsParams


class StructuredOutputGrammar(abc.ABC):
    """One request's matcher state."""

    @abc.abstractmethod
    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance by sampled tokens; False when one is not allowed (state unchanged
        from that token on)."""

    @abc.abstractmethod
    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` ([N, ceil(V/32)] int32)."""

    @abc.abstractmethod
    def is_terminated(self) -> bool:
        """Nothing but a stop token can follow: the constrained output is complete."""

    @abc.abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""


class StructuredOutputBackend(abc.ABC):
    name: str

    @abc.abstractmethod
    def validate(self, params: StructuredOutputsParams) -> None:
        """Raise ValueError('structured_outputs.<kind>: <the parser's message>') for a
        constraint this backend cannot compile. Cheap: no tokenizer work."""

    @abc.abstractmethod
    def compile_grammar(self, params: StructuredOutputsParams) -> StructuredOutputGrammar:
        """A fresh matcher for ``params`` (slow the first time; compiled grammars are cached)."""


# Whitespace JSON may hold between two tokens (unless the request sets its own
# pattern or none at all): pretty-printing to depth ~10 needs less, and a small model
# left with unbounded whitespace can emit newlines until max_tokens (seen with
# SmolLM2-135M, greedy, in tests/server/test_server_default_model.py).
MAX_JSON_WHITESPACE = 24


def schema_text(params: StructuredOutputsParams) -> str:
    """The JSON schema of a json constraint as text (what caches are keyed by)."""
    import json

    # Key order kept: properties are generated in the schema's order.
    return params.json if isinstance(params.json, str) else json.dumps(params.json)


def invalid(params: StructuredOutputsParams, message: str) -> ValueError:
    return ValueError(f"structured_outputs.{params.kind}: {message}")
