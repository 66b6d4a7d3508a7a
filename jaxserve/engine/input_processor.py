"""InputProcessor: prompts -> validated token ids; one place for every input check."""
from __future__ import annotations

import numbers

from jaxserve.core.kv_cache_utils import cdiv
from jaxserve.runner.input_batch import MAX_MASKED_STOP_IDS
from jaxserve.sampling_params import SamplingParams


class InputProcessor:
    def __init__(self, tokenizer, *, vocab_size: int, max_model_len: int, max_logprobs: int,
                 eos_token_ids: set[int], primary_eos: int | None = None,
                 kv_cache_blocks: int | None = None, blocks_held=None, block_size: int = 16,
                 structured_output_manager=None, mm_processor=None) -> None:
        self.tokenizer = tokenizer
        # A vision-language model's images -> placeholders (jaxserve/multimodal/processor.py); None: text only.
        self.mm_processor = mm_processor
        # Usable blocks of the whole KV cache. Sized from memory it holds max_model_len; a
        # small num_gpu_blocks_override may not, and a request that cannot fit even
        # alone would be preempted and recomputed forever.
        self.kv_cache_blocks = kv_cache_blocks
        # tokens -> the most blocks a request of that many KV slots holds at once (its
        # whole context in each full-attention group; the window, one step's tokens and
        # partial blocks in each sliding-window group: KVCacheLayout.blocks_held).
        self.blocks_held = blocks_held or (lambda n: cdiv(n, block_size))
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        self.eos_token_ids = eos_token_ids
        self.primary_eos = primary_eos
        self.structured_output_manager = structured_output_manager

    def tokenize(self, prompt, *, add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        """prompt: str, {"prompt": str} or {"prompt_token_ids": [...]}; returns (text, ids)."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = list(prompt["prompt_token_ids"])
                # numpy integers are fine; anything else is rejected by validate().
                return prompt.get("prompt"), [int(t) if isinstance(t, numbers.Integral) and not isinstance(t, bool)
                                              else t for t in ids]
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str or a dict, got {type(prompt).__name__}")
        return prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    def process_images(self, prompt, ids: list[int]):
        """A prompt dict's ``multi_modal_data`` images -> (ids with each image's
        placeholder expanded, MultiModalPrompt); (ids, None) without images. ValueError
        for images sent to a text model, or a bad image."""
        from jaxserve.multimodal.processor import prompt_images

        images = prompt_images(prompt)
        if not images:
            return ids, None
        if self.mm_processor is None:
            raise ValueError("multi_modal_data: this model takes text only")
        return self.mm_processor.process(ids, images)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if len(prompt_token_ids) == 0:
            raise ValueError("The decoder prompt cannot be empty")
        for t in prompt_token_ids:
            if not isinstance(t, int) or isinstance(t, bool):
                raise ValueError(f"prompt token ids must be integers, got {t!r}")
        lo, hi = min(prompt_token_ids), max(prompt_token_ids)
        if lo < 0:
            raise ValueError(f"prompt token id {lo} must be greater than or equal to 0")
        if hi >= self.vocab_size:
            raise ValueError(f"prompt token id {hi} is out of vocabulary (vocab size {self.vocab_size})")
        bad_stop = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_stop:
            raise ValueError(f"stop_token_ids: token id {bad_stop[0]} is out of vocabulary (vocab size {self.vocab_size})")
        if len(prompt_token_ids) > self.max_model_len:
            raise ValueError(
                f"The decoder prompt (length {len(prompt_token_ids)}) is longer than the maximum model "
                f"length of {self.max_model_len}. Make sure that `max_model_len` is no smaller than the "
                "number of text tokens."
            )
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(params, name)
            if v is not None and (v == -1 or v > self.max_logprobs):
                raise ValueError(
                    f"Requested {name} of {v}, which is greater than max allowed: {self.max_logprobs}"
                )
        for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ())):
            out_of_vocab = [t for t in ids if t >= self.vocab_size]
            if out_of_vocab:
                raise ValueError(f"{name}: token id {out_of_vocab[0]} is out of vocabulary (vocab size {self.vocab_size})")
        if params.structured_outputs is not None:
            if self.structured_output_manager is None:
                raise ValueError("structured_outputs: this engine has no structured output manager")
            # Parsed here (cheap), so a bad schema / regex / grammar fails the request at once.
            self.structured_output_manager.validate(params.structured_outputs)

    def resolve_params(self, prompt_len: int, params: SamplingParams) -> tuple[SamplingParams, int]:
        """EOS folded into the stop ids (for min_tokens), max_tokens resolved."""
        if not params.ignore_eos and self.primary_eos is not None:
            # Extra EOS ids (generation_config, e.g. Llama 3's <|eot_id|>) stop like stop tokens.
            extra = sorted(self.eos_token_ids - {self.primary_eos} - set(params.stop_token_ids))
            if extra:
                params = params.replace(stop_token_ids=params.stop_token_ids + extra)
        params = params.with_eos(set() if params.ignore_eos else self.eos_token_ids)
        if params.bad_words and not params._bad_words_token_ids:
            params = params.replace(_bad_words_token_ids=self.bad_words_token_ids(params.bad_words))
        n_stop = len(params.all_stop_token_ids)
        if params.min_tokens > 0 and n_stop > MAX_MASKED_STOP_IDS:
            raise ValueError(
                f"stop_token_ids: at most {MAX_MASKED_STOP_IDS} stop token ids (EOS included) can be held back "
                f"while min_tokens applies, got {n_stop}")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - prompt_len
        max_tokens = max(max_tokens, 1)
        # The last sampled token is returned, never written to the cache.
        needed = min(prompt_len + max_tokens - 1, self.max_model_len)
        blocks = self.blocks_held(needed) if self.kv_cache_blocks is not None else 0
        if self.kv_cache_blocks is not None and blocks > self.kv_cache_blocks:
            raise ValueError(
                f"max_tokens: the prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) needs {needed} KV cache "
                f"slots ({blocks} blocks), but the whole KV cache holds {self.kv_cache_blocks} "
                f"blocks of {self.block_size} tokens; lower max_tokens or enlarge the cache "
                "(num_gpu_blocks_override / kv_cache_memory)")
        return params, max_tokens

    def bad_words_token_ids(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """Each bad word as the token sequences it is written with: alone (the start of
        the text) and after a space (inside it), as vLLM bans them; duplicates dropped."""
        seqs: dict[tuple[int, ...], None] = {}
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if ids:
                    seqs[ids] = None
        return tuple(seqs)
