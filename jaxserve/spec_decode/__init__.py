"""Speculative decoding proposers (vLLM's ``v1/spec_decode``): they guess each
request's next tokens on the host or with a draft model; the runner verifies the
guesses in the target model's step (``jaxserve/sample/rejection_sampler.py``)."""
