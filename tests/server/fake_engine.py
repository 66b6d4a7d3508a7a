"""A stand-in for AsyncLLM whose "model" writes scripted text: the serving code (tool
calls, reasoning, request mapping) can be tested on outputs a tiny random model never
writes, in milliseconds. The tokenizer is a word splitter with a chat template that
shows the tools and tool turns it was given."""
from __future__ import annotations

import json
from types import SimpleNamespace

from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.reasoning.harmony import TAGS as HARMONY_TAGS


class FakeTokenizer:
    """Just enough of a HF tokenizer: chat template, encode/decode, vocab."""

    chat_template = "{{ messages }}"

    def __init__(self) -> None:
        self.init_kwargs = {"model_max_length": 512, "eos_token": "</s>", "tokenizer_object": object()}
        self.vocab = {"<s>": 1, "</s>": 2, "<think>": 3, "</think>": 4, "<tool_call>": 5, "</tool_call>": 6}
        # OpenAI's harmony tokens (GPT-OSS), above the ids encode() gives words
        self.vocab |= {tag: 90 + i for i, tag in enumerate(HARMONY_TAGS)}

    def get_vocab(self):
        return dict(self.vocab)

    def apply_chat_template(self, messages, *, tokenize=False, add_generation_prompt=True,
                            continue_final_message=False, chat_template=None, tools=None, **kwargs):
        head = f"TOOLS {json.dumps(tools)} " if tools else ""
        return head + " ".join(f"{m['role']}: {m.get('content')} {json.dumps(m.get('tool_calls'))}"
                               for m in messages)

    def encode(self, text, add_special_tokens=True):
        return [7 + (hash(w) % 50) for w in text.split()] or [7]

    def decode(self, ids, **kwargs):
        return " ".join(f"t{i}" for i in ids)


class FakeEngine:
    """Yields ``script`` (a list of text deltas, the last one finishing with
    ``finish_reason``) for every request; records the SamplingParams it was given."""

    def __init__(self, script: list[str] | None = None, finish_reason: str = "stop",
                 reasoning_parser: str | None = None) -> None:
        self.script = list(script or ["hello"])
        self.finish_reason = finish_reason
        self.tokenizer = FakeTokenizer()
        self.max_model_len = 512
        self.model_config = SimpleNamespace(model="fake-model", get_diff_sampling_param=dict)
        self.config = SimpleNamespace(structured_outputs_config=SimpleNamespace(reasoning_parser=reasoning_parser))
        self.stat_loggers = []
        self.errored = False
        self.input_processor = SimpleNamespace(vocab_size=100, tokenize=self._tokenize)
        self.seen_params = []
        self.seen_request_ids = []
        self.validate_error: str | None = None  # raised (ValueError) by process_inputs when set

    def _tokenize(self, prompt, *, add_special_tokens=True):
        if isinstance(prompt, dict):
            return None, list(prompt["prompt_token_ids"])
        return prompt, self.tokenizer.encode(prompt)

    def check_capacity(self, num_seqs):
        pass

    def get_tokenizer(self):
        return self.tokenizer

    def process_inputs(self, prompt, params, **kwargs):
        if self.validate_error and params.structured_outputs is not None:
            raise ValueError(self.validate_error)
        return None, list(prompt)

    async def generate(self, prompt, params, request_id, **kwargs):
        self.seen_params.append(params)
        self.seen_request_ids.append(request_id)
        for i in range(params.n):
            for k, text in enumerate(self.script):
                last = k == len(self.script) - 1
                yield RequestOutput(
                    request_id=request_id, prompt=None, prompt_token_ids=list(prompt), prompt_logprobs=None,
                    outputs=[CompletionOutput(index=i, text=text, token_ids=[9], cumulative_logprob=None,
                                              logprobs=None, finish_reason=self.finish_reason if last else None)],
                    finished=last and i == params.n - 1, num_cached_tokens=0)
