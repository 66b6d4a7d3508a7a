"""StructuredOutputRequest: a request's constraint and its grammar, once compiled."""
from __future__ import annotations

from concurrent.futures import Future

from jaxserve.sampling_params import StructuredOutputsParams
from jaxserve.structured_output.backend_types import StructuredOutputGrammar


class StructuredOutputRequest:
    __slots__ = ("_future", "grammar", "params", "reasoning_ended")

    def __init__(self, params: StructuredOutputsParams) -> None:
        self.params = params
        self._future: Future | None = None  # the compile job on the manager's threads
        self.grammar: StructuredOutputGrammar | None = None
        # With a reasoning parser, the constraint starts after the reasoning (vLLM).
        self.reasoning_ended = True

    def is_ready(self) -> bool:
        """The grammar is compiled (or its compile failed: ``error`` says so)."""
        if self.grammar is not None:
            return True
        if self._future is None or not self._future.done():
            return False
        if self._future.exception() is None:
            self.grammar = self._future.result()
        return True

    @property
    def error(self) -> BaseException | None:
        if self._future is None or not self._future.done():
            return None
        return self._future.exception()
