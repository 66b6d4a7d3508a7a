"""POST /tokenize and /detokenize (vLLM's extensions, used by `vllm bench serve`)."""
from __future__ import annotations

from server.errors import bad_request
from server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from server.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    def create_tokenize(self, request: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        self.check_model(request.model)
        if isinstance(request, TokenizeChatRequest):
            text = self.render_chat(request)
        else:
            text = request.prompt
        ids = self.tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids)

    def create_detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(request.model)
        vocab = self.engine_client.input_processor.vocab_size
        bad = [t for t in request.tokens if t < 0 or t >= vocab]
        if bad:
            raise bad_request(f"token id {bad[0]} is out of vocabulary (vocab size {vocab})", "tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens))
