"""IncrementalDetokenizer: token ids -> text as they arrive, with stop strings matched
on text (across token boundaries) and held back from streams until they cannot match."""
from __future__ import annotations

from tokenizers.decoders import DecodeStream

from jaxserve.sampling_params import SamplingParams


class IncrementalDetokenizer:
    def __init__(self, tokenizer, params: SamplingParams, prompt_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.backend = tokenizer.backend_tokenizer
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.detokenize = params.detokenize
        # Characters kept back from a stream: a stop string may still be forming there.
        self.stop_buffer_length = (max(len(s) for s in self.stop) - 1) if self.stop and not self.include_stop else 0
        self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self.output_text = ""
        self.num_output_tokens = 0
        # Tokens of the last update() up to the one that completed a stop string (all of
        # them when none did): a step may bring several (speculative decoding), and those
        # after the stop string are not part of the output.
        self.num_tokens_used = 0
        self._prime(prompt_token_ids)

    def _prime(self, prompt_token_ids: list[int]) -> None:
        # Feed the prompt's tail so the first output token decodes with its left
        # context (a leading space, a partial UTF-8 sequence).
        for t in prompt_token_ids[-6:]:
            self._stream.step(self.backend, t)

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Append tokens; returns the stop string matched, if any (then the text is cut).
        ``stop_terminated``: the last token is a stop token / EOS whose text must not show
        (unless include_stop_str_in_output)."""
        self.num_tokens_used = len(new_token_ids)
        if not self.detokenize:
            self.num_output_tokens += len(new_token_ids)
            return None
        skip_last = stop_terminated and not self.include_stop
        for i, t in enumerate(new_token_ids):
            self.num_output_tokens += 1
            if skip_last and i == len(new_token_ids) - 1:
                break
            prev_len = len(self.output_text)
            piece = self._stream.step(self.backend, t)
            if piece:
                self.output_text += piece
            if self.stop and self.num_output_tokens >= self.min_tokens:
                hit = self._check_stop(prev_len)
                if hit is not None:
                    self.num_tokens_used = i + 1
                    return hit
        return None

    def _check_stop(self, prev_len: int) -> str | None:
        """First stop string (by position) in the text added since prev_len."""
        best = None
        for s in self.stop:
            start = max(0, prev_len - len(s) + 1)
            idx = self.output_text.find(s, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        self.output_text = self.output_text[: idx + len(s)] if self.include_stop else self.output_text[:idx]
        return s

    def get_next_output_text(self, finished: bool, delta: bool, sent: int) -> str:
        """Text not sent yet; streams hold back the last chars that could start a stop string."""
        length = len(self.output_text) if finished else max(len(self.output_text) - self.stop_buffer_length, 0)
        if not delta:
            return self.output_text[:length]
        return self.output_text[sent:length] if length > sent else ""
