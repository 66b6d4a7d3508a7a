"""Beam search, vLLM's (``LLM.beam_search``; ``use_beam_search`` on the server): each
step extends every live beam by one token through the engine (a one-token request
asking for the top 2 * beam_width logprobs), keeps the beam_width best candidates by
cumulative logprob, and sets aside those that end in EOS. At the end the finished and
the live beams are ranked by ``cumulative_logprob / length ** length_penalty`` (the
length counts the prompt, and not a final EOS, as vLLM's ``get_beam_search_score``).

The beams of a prompt share its prefix, so the prefix cache serves their common blocks:
a step computes each beam's last partial block and its new token only. The engine runs
the requests; this module is pure Python (BeamSearch holds the state, the callers
``LLM.beam_search`` and the server's serving code drive it).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from jaxserve.sampling_params import SamplingParams


@dataclass(frozen=True, kw_only=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # the logprobs are the model's (temperature 1); kept for vLLM's signature
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width!r}.")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens!r}.")


@dataclass
class BeamSearchSequence:
    """One beam: all its tokens (prompt included), their logprobs, its cumulative logprob."""

    tokens: list[int]
    logprobs: list[dict]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    num_prompt_tokens: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    """The best beams of one prompt, best first."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)


def beam_score(seq: BeamSearchSequence, eos_token_id: int | None, length_penalty: float) -> float:
    """vLLM's get_beam_search_score: the cumulative logprob over the length (prompt
    included, a final EOS not) to the power length_penalty."""
    n = len(seq.tokens)
    if eos_token_id is not None and seq.tokens and seq.tokens[-1] == eos_token_id:
        n -= 1
    return seq.cum_logprob / (max(n, 1) ** length_penalty)


class BeamSearch:
    """The beams of several prompts, advanced one token per ``advance``."""

    def __init__(self, prompts: list[list[int]], params: BeamSearchParams, eos_token_id: int | None) -> None:
        self.params = params
        self.eos = None if params.ignore_eos else eos_token_id
        self.live = [[BeamSearchSequence(tokens=list(p), logprobs=[], num_prompt_tokens=len(p))] for p in prompts]
        self.finished: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self.steps = 0

    @property
    def done(self) -> bool:
        return self.steps >= self.params.max_tokens or not any(self.live)

    def step_params(self) -> SamplingParams:
        """The one-token request of each live beam: the top 2 * beam_width logprobs."""
        return SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * self.params.beam_width, ignore_eos=True,
                              detokenize=False)

    def pending(self) -> list[list[int]]:
        """The token sequences to extend this step, prompt by prompt, beam by beam."""
        return [beam.tokens for beams in self.live for beam in beams]

    def advance(self, top: list[dict[int, float]], max_len: int | None = None) -> None:
        """``top``: for each pending sequence (pending()'s order) its next-token logprobs
        {token id: logprob}. ``max_len``: the model's limit (a beam reaching it ends)."""
        k, it = self.params.beam_width, iter(top)
        for i, beams in enumerate(self.live):
            candidates = []
            for beam in beams:
                for token, lp in next(it).items():
                    seq = BeamSearchSequence(tokens=beam.tokens + [token], logprobs=beam.logprobs + [{token: lp}],
                                             cum_logprob=beam.cum_logprob + lp,
                                             num_prompt_tokens=beam.num_prompt_tokens)
                    if self.eos is not None and token == self.eos:
                        seq.finish_reason = "stop"
                        self.finished[i].append(seq)
                    else:
                        candidates.append(seq)
            candidates.sort(key=lambda s: s.cum_logprob, reverse=True)
            kept = candidates[:k]
            if max_len is not None:
                for seq in [s for s in kept if len(s.tokens) >= max_len]:
                    seq.finish_reason = "length"
                    self.finished[i].append(seq)
                kept = [s for s in kept if len(s.tokens) < max_len]
            self.live[i] = kept
        self.steps += 1

    def results(self) -> list[BeamSearchOutput]:
        out = []
        for live, finished in zip(self.live, self.finished):
            for seq in live:
                seq.finish_reason = seq.finish_reason or "length"
            ranked = sorted(finished + live, key=lambda s: beam_score(s, self.eos, self.params.length_penalty),
                            reverse=True)
            out.append(BeamSearchOutput(ranked[:self.params.beam_width]))
        return out


def top_logprobs(output) -> dict[int, float]:
    """A one-token RequestOutput's next-token logprobs {token id: logprob} (its top-k)."""
    step = output.outputs[0].logprobs[0]
    return {t: lp.logprob for t, lp in step.items()}


async def beam_search_async(engine, prompts: list[list[int]], params: BeamSearchParams, *, eos_token_id: int | None,
                            max_len: int | None, request_id: str, lora_request=None,
                            priority: int = 0) -> list[BeamSearchOutput]:
    """BeamSearch driven through an AsyncLLM (the server's): each step's one-token
    requests run concurrently, one engine request per live beam."""
    import asyncio

    from jaxserve.sampling_params import RequestOutputKind

    search = BeamSearch(prompts, params, eos_token_id)
    step_params = search.step_params()

    async def extend(step: int, i: int, tokens: list[int]) -> dict[int, float]:
        last = None
        async for out in engine.generate({"prompt_token_ids": tokens}, step_params, f"{request_id}-beam{step}-{i}",
                                         priority=priority, output_kind=RequestOutputKind.FINAL_ONLY,
                                         lora_request=lora_request):
            last = out
        return top_logprobs(last)

    while not search.done:
        tops = await asyncio.gather(*(extend(search.steps, i, t) for i, t in enumerate(search.pending())))
        search.advance(list(tops), max_len=max_len)
    return search.results()
