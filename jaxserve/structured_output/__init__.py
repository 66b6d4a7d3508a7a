"""StructuredOutputManager: grammar-constrained decoding for the engine (vLLM's v1
structured_output package, on numpy).

The path of a constrained request:
1. InputProcessor.validate -> ``validate``: the constraint is parsed (no tokenizer
   work), so a bad schema / regex / grammar is a ValueError (HTTP 400) at once.
2. EngineCore.add_request -> ``grammar_init``: the grammar is compiled on a worker
   thread; the request waits in the scheduler as WAITING_FOR_FSM until it is ready,
   so a slow schema never stalls the other requests.
3. Each schedule() -> ``grammar_bitmask``: the packed next-token mask of every
   scheduled constrained request, [n, ceil(V/32)] int32, travels in the
   SchedulerOutput; the runner scatters it into the sampler's rows (all ones for
   unconstrained rows) and the jitted sampler masks the logits before anything else.
4. update_from_output -> the grammar accepts the sampled tokens; a grammar that is
   complete finishes the request.
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from jaxserve.config import StructuredOutputsConfig
from jaxserve.request import Request, RequestStatus
from jaxserve.sampling_params import StructuredOutputsParams
from jaxserve.structured_output import backend_xgrammar
from jaxserve.structured_output.backend_types import StructuredOutputBackend
from jaxserve.structured_output.request import StructuredOutputRequest

logger = logging.getLogger("jaxserve")

# Bits of the packed mask per int32 word.
BITS = 32


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + BITS - 1) // BITS


class StructuredOutputManager:
    def __init__(self, config: StructuredOutputsConfig, tokenizer, *, vocab_size: int,
                 eos_token_ids: list[int] | set[int] | None = None, max_workers: int = 2) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.num_words = bitmask_words(vocab_size)
        self.eos_token_ids = sorted(eos_token_ids or ())
        backend = config.backend
        if backend == "auto":
            backend = "xgrammar" if backend_xgrammar.is_available() else "guidance"
        elif backend == "xgrammar" and not backend_xgrammar.is_available():
            raise ValueError("structured_outputs_backend='xgrammar' needs the xgrammar package (and torch): "
                             "pip install 'jaxserve[xgrammar]'; or use 'guidance'")
        self.backend_name = backend
        self._backends: dict[str, StructuredOutputBackend] = {}
        self.reasoner = None
        if config.reasoning_parser is not None:
            from jaxserve.reasoning import get_reasoning_parser

            self.reasoner = get_reasoning_parser(config.reasoning_parser)(tokenizer)
        # Compiles run here, off the engine loop (both libraries release the GIL).
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="jaxserve-grammar")

    def backend(self, name: str) -> StructuredOutputBackend:
        if name not in self._backends:
            if name == "xgrammar":
                self._backends[name] = backend_xgrammar.XgrammarBackend(self.tokenizer, self.vocab_size,
                                                                        self.eos_token_ids)
            else:
                from jaxserve.structured_output.backend_guidance import GuidanceBackend

                self._backends[name] = GuidanceBackend(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._backends[name]

    def backend_for(self, params: StructuredOutputsParams) -> StructuredOutputBackend:
        """The configured backend; under auto, llguidance for what xgrammar cannot parse."""
        if (self.backend_name == "xgrammar" and self.config.backend == "auto"
                and not backend_xgrammar.supports(params)):
            return self.backend("guidance")
        return self.backend(self.backend_name)

    # ------------------------------------------------------------------ requests
    def validate(self, params: StructuredOutputsParams) -> None:
        """ValueError naming the field and the parser's message for a bad constraint
        (under auto: valid if either backend takes it; else xgrammar's message)."""
        try:
            self.backend(self.backend_name).validate(params)
        except ValueError:
            if not (self.backend_name == "xgrammar" and self.config.backend == "auto"):
                raise
            try:
                self.backend("guidance").validate(params)
            except ValueError:
                pass
            else:
                return
            raise

    def grammar_init(self, request: Request) -> None:
        """Start compiling the request's grammar; it waits (WAITING_FOR_FSM) until done."""
        params = request.sampling_params.structured_outputs
        so_request = StructuredOutputRequest(params)
        if self.reasoner is not None:
            so_request.reasoning_ended = self.reasoner.is_reasoning_end(request.prompt_token_ids)
        so_request._future = self._executor.submit(self.backend_for(params).compile_grammar, params)
        request.structured_output_request = so_request
        request.status = RequestStatus.WAITING_FOR_FSM

    def should_advance(self, request: Request) -> bool:
        """Whether this step's tokens go to the grammar: yes once the reasoning (if any)
        has ended; the step whose tokens end it does not feed them (they are the end tag)."""
        so = request.structured_output_request
        if so is None or so.grammar is None:
            return False
        if so.reasoning_ended:
            return True
        if self.reasoner.is_reasoning_end(request.all_token_ids):
            so.reasoning_ended = True
        return False

    def grammar_bitmask(self, requests: list[Request]) -> np.ndarray:
        """The next-token masks of ``requests`` (constrained, reasoning over), one row
        each in order: [n, ceil(V/32)] int32."""
        bitmask = np.full((len(requests), self.num_words), -1, np.int32)
        for i, request in enumerate(requests):
            request.structured_output_request.grammar.fill_bitmask(bitmask, i)
        return bitmask

    @staticmethod
    def is_constrained(request: Request) -> bool:
        """The request's next token is masked (its grammar is ready and reasoning is over)."""
        so = request.structured_output_request
        return so is not None and so.grammar is not None and so.reasoning_ended

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
