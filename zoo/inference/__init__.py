"""Inference: the decoding loop (``generate``), compiled decoding, self-speculative decoding and the tokenizer."""
