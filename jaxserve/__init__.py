"""jaxserve: vLLM's V1 serving engine on JAX.

The engine core (jaxserve.core) is pure Python; importing this package does not
import JAX until LLM is touched.
"""
from jaxserve.outputs import (ClassificationRequestOutput, CompletionOutput, EmbeddingRequestOutput,
                              PoolingRequestOutput, RequestOutput, ScoringRequestOutput)
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestOutputKind", "StructuredOutputsParams",
           "PoolingParams", "PoolingRequestOutput", "EmbeddingRequestOutput", "ClassificationRequestOutput",
           "ScoringRequestOutput", "__version__"]


def __getattr__(name):
    if name == "LLM":
        from jaxserve.llm import LLM

        return LLM
    raise AttributeError(name)
