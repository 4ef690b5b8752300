"""Sampling (vLLM's ``sample``): a request's checked parameters (``params``), the batched sampler
with its log-probabilities (``sampler``) and the logits processors (``logits_processors``)."""
