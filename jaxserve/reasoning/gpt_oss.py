"""GPT-OSS reasoning (vLLM's ``openai_gptoss``; ``gpt_oss`` here too): harmony's
``analysis`` channel is the reasoning; the answer is the ``final`` channel, with the
``commentary`` preambles, and each function call kept in harmony's canonical form
(``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>``)
for the ``openai`` tool-call parser. The reasoning has ended (a constraint applies)
once the model has opened a ``final`` message. The special tokens must reach the
parser: ``keeps_special_tokens``.
"""
from __future__ import annotations

from collections.abc import Sequence

from jaxserve.reasoning import harmony
from jaxserve.reasoning.think_parser import ReasoningParser


class GptOssReasoningParser(ReasoningParser):
    keeps_special_tokens = True
    tags = harmony.TAGS

    def __init__(self, tokenizer) -> None:
        vocab = tokenizer.get_vocab()
        self.tokenizer = tokenizer
        ids = {tag: vocab.get(tag) for tag in (harmony.CHANNEL, harmony.MESSAGE, harmony.START)}
        missing = [tag for tag, i in ids.items() if i is None]
        if missing:
            raise ValueError(f"reasoning parser gpt_oss: the tokenizer has no {missing[0]!r} token "
                             "(it reads OpenAI's harmony format)")
        self.channel_id, self.message_id, self.start_id = ids[harmony.CHANNEL], ids[harmony.MESSAGE], ids[harmony.START]

    # ------------------------------------------------------------------ token ids (engine)
    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        """The last message header in ``token_ids`` is complete and names the final channel."""
        return self._last_final_header(token_ids) is not None

    def prompt_opens_reasoning(self, prompt_token_ids: Sequence[int]) -> bool:
        return False  # the generation prompt ends with <|start|>assistant: a header follows

    def extract_content_ids(self, token_ids: Sequence[int]) -> list[int]:
        body = self._last_final_header(token_ids)
        return [] if body is None else list(token_ids[body:])

    def _last_final_header(self, token_ids: Sequence[int]) -> int | None:
        """Where the content of the last message starts, if that message is in the final
        channel (None otherwise, or while its header is not whole)."""
        ids = list(token_ids)
        for i in range(len(ids) - 1, -1, -1):
            t = ids[i]
            if t == self.start_id or t == self.channel_id:
                return None  # a header that has not reached <|message|> yet
            if t == self.message_id:
                for j in range(i - 1, max(-1, i - 64), -1):
                    if ids[j] == self.channel_id:
                        header = self.tokenizer.decode(ids[j + 1:i])
                        return i + 1 if header.split()[:1] == ["final"] else None
                    if ids[j] == self.start_id:
                        break
                return None
        return None

    # ------------------------------------------------------------------ text (server)
    def _split(self, text: str, opened: bool = False) -> tuple[str, str]:
        reasoning, content = [], []
        messages = harmony.parse_messages(text)
        for k, msg in enumerate(messages):
            if not msg.header_done:
                continue  # its channel is not known yet
            if msg.plain:
                content.append(msg.content)
            elif msg.function is not None:
                ended = msg.terminator is not None or k < len(messages) - 1
                content.append(harmony.tool_call_block(msg.function, msg.content, ended=ended))
            elif msg.channel == "analysis":
                reasoning.append(msg.content)
            else:  # final, commentary preambles, and anything else the model addressed to the user
                content.append(msg.content)
        return "".join(reasoning), "".join(content)
